// What a process without the run secret can make the store server and a mailbox hold through their
// ZeroMQ ports before a CURVE handshake proves it (docs/security.md, "Bounds and malformed
// input"): a first frame is refused from its length field when it announces more than the socket
// reads (64 MiB on the store, kMaxMailboxMessageBytes on a mailbox), and connections that wait for
// their handshake are capped, the newest shut down, each counted once and logged once.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "control/auth.h"
#include "control/mailbox.h"
#include "control/store.h"
#include "test_util.h"

namespace refit {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr char kSecret[] = "zmq-bounds-test-secret-0123456789abcdef";

std::shared_ptr<const ControlAuth> auth() {
  auto a = ControlAuth::from_secret(kSecret);
  EXPECT_TRUE(a.ok());
  return std::make_shared<const ControlAuth>(*a);
}

std::int64_t rss_bytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}

int connect_tcp(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a), 0)
      << std::strerror(errno);
  return fd;
}

// A ZMTP 3.0 greeting of a CURVE client: what a peer sends before its first frame.
std::string curve_greeting() {
  std::string g(64, '\0');
  g[0] = static_cast<char>(0xFF);
  g[9] = 0x7F;
  g[10] = 3;
  std::memcpy(&g[12], "CURVE", 5);
  return g;
}

// Connects to `port`, sends a greeting and a first frame (a command, as a CURVE HELLO is) that
// announces `announced` bytes, then streams its bytes until the peer closes the connection, all
// are sent, or 15 s passed. Returns how many of them it got through.
std::int64_t stream_long_first_frame(int port, std::uint64_t announced) {
  const int fd = connect_tcp(port);
  std::string head = curve_greeting();
  head.push_back(0x06);  // a command frame with an 8-byte size
  for (int k = 7; k >= 0; --k) head.push_back(static_cast<char>(announced >> (8 * k)));
  EXPECT_EQ(::send(fd, head.data(), head.size(), MSG_NOSIGNAL), static_cast<ssize_t>(head.size()));
  const std::string chunk(1 << 20, 'A');
  std::int64_t sent = 0;
  const auto end = Clock::now() + 15s;
  while (sent < static_cast<std::int64_t>(announced) && Clock::now() < end) {
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, 50) != 1) continue;
    const ssize_t n = ::send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) break;
    sent += n;
  }
  ::close(fd);
  return sent;
}

// Waits (at most 20 s, calling `drive` between checks) until `done`.
bool eventually(const std::function<bool()>& done, const std::function<void()>& drive = {}) {
  for (int k = 0; k < 400; ++k) {
    if (done()) return true;
    if (drive) drive();
    std::this_thread::sleep_for(50ms);
  }
  return done();
}

int count_of(const std::string& text, const std::string& what) {
  int n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Opens `flood` connections that never say a word and keeps them open until `until` (checked
// through `drive`); returns how many the server had closed by then.
int flood_of_silent_connections(int port, int flood, const std::function<bool()>& until,
                                const std::function<void()>& drive) {
  std::vector<int> fds;
  for (int i = 0; i < flood; ++i) fds.push_back(connect_tcp(port));
  EXPECT_TRUE(eventually(until, drive));
  int closed = 0;
  for (int fd : fds) {
    // The server's greeting (10 bytes or more) arrives first; a closed connection then reads 0.
    char buf[256];
    for (int k = 0; k < 20; ++k) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 10) != 1) break;
      const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno == ECONNRESET)) {
        ++closed;
        break;
      }
      if (n < 0) break;
    }
    ::close(fd);
  }
  return closed;
}

TEST(ZmqBounds, StoreRefusesAFirstFrameOverItsLimitFromTheLengthField) {
  auto server =
      StoreServer::start(StoreServerOptions{.host = "127.0.0.1", .port = 0, .auth = auth()});
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  ::testing::internal::CaptureStderr();
  const std::int64_t before = rss_bytes();
  constexpr int kSenders = 4;
  for (int i = 0; i < kSenders; ++i) {
    const std::int64_t sent =
        stream_long_first_frame((*server)->port(), std::uint64_t{kMaxControlFrameBytes} + 1);
    EXPECT_LT(sent, std::int64_t{16} << 20) << "sender " << i << " got most of 64 MiB through";
  }
  EXPECT_TRUE(eventually([&] { return (*server)->refused() >= kSenders; })) << (*server)->refused();
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ((*server)->refused(), kSenders);
  EXPECT_NE(log.find("refused a connection: it broke the framing before its handshake completed "
                     "(a frame longer than the 67108864 bytes this socket reads"),
            std::string::npos)
      << log;
  const std::int64_t grew = rss_bytes() - before;
  EXPECT_LT(grew, std::int64_t{32} << 20) << "the process grew by " << grew << " bytes";
}

TEST(ZmqBounds, StoreCapsTheConnectionsWaitingForTheirHandshake) {
  constexpr int kCap = 4, kFlood = 12;
  auto server = StoreServer::start(StoreServerOptions{
      .host = "127.0.0.1", .port = 0, .auth = auth(), .max_pending_handshakes = kCap});
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  ::testing::internal::CaptureStderr();
  const int closed = flood_of_silent_connections(
      (*server)->port(), kFlood, [&] { return (*server)->refused() >= kFlood - kCap; }, {});
  const std::string log = ::testing::internal::GetCapturedStderr();
  // Exactly the connections over the cap were shut down, each logged once and counted once (the
  // handshake interval, 10 s, closes the others later).
  EXPECT_EQ(count_of(log, "closed a connection before its handshake"), kFlood - kCap) << log;
  EXPECT_LE(count_of(log, "refused a connection"), (*server)->refused() - (kFlood - kCap)) << log;
  EXPECT_GE(closed, kFlood - kCap);
  EXPECT_GE((*server)->pending_high_water(), kCap);
  // A member still gets in.
  auto client = connect_store("127.0.0.1", (*server)->port(), 10s, auth());
  ASSERT_TRUE(client.ok()) << client.status().to_string();
  EXPECT_TRUE((*client)->set("k", "v").ok());
}

// A flood that holds the cap's worth of connections silent does not keep a member out: the
// connection that waited longest is the one shut down, not the member's, which just arrived.
TEST(ZmqBounds, AMemberGetsInWhileAFloodHoldsItsConnectionsSilent) {
  constexpr int kCap = 4;
  auto server = StoreServer::start(StoreServerOptions{
      .host = "127.0.0.1", .port = 0, .auth = auth(), .max_pending_handshakes = kCap});
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  ::testing::internal::CaptureStderr();
  std::vector<int> flood;
  for (int i = 0; i < kCap; ++i) flood.push_back(connect_tcp((*server)->port()));
  EXPECT_TRUE(eventually([&] { return (*server)->pending_high_water() >= kCap; }));
  // Well inside the flood's 10 s: each of its connections is held until the handshake interval.
  auto client = connect_store("127.0.0.1", (*server)->port(), 3s, auth());
  const bool in = client.ok() && (*client)->set("k", "v").ok();
  const std::string log = ::testing::internal::GetCapturedStderr();
  for (int fd : flood) ::close(fd);
  EXPECT_TRUE(in) << (client.ok() ? "set failed" : client.status().to_string()) << "\n" << log;
  EXPECT_GE(count_of(log, "closed a connection before its handshake"), 1u) << log;
}

struct MailboxRig {
  MailboxRig(int max_pending = 0) {
    auto s = StoreServer::start(StoreServerOptions{.host = "127.0.0.1", .port = 0, .auth = auth()});
    EXPECT_TRUE(s.ok());
    server = std::move(s).value();
    auto c = connect_store("127.0.0.1", server->port(), 10s, auth());
    EXPECT_TRUE(c.ok());
    store = std::move(c).value();
    auto m = Mailbox::open(
        *store,
        MailboxOptions{.id = "engine/0", .auth = auth(), .max_pending_handshakes = max_pending});
    EXPECT_TRUE(m.ok()) << m.status().to_string();
    mailbox = std::move(m).value();
    auto address = store->get("mailbox/engine/0", 10s);
    EXPECT_TRUE(address.ok());
    port = std::stoi(address->substr(address->rfind(':') + 1));
  }
  // The mailbox reads its socket's events while it waits for a message.
  void drive() { (void)mailbox->receive(20ms); }
  std::unique_ptr<StoreServer> server;
  std::unique_ptr<Store> store;
  std::unique_ptr<Mailbox> mailbox;
  int port = 0;
};

TEST(ZmqBounds, MailboxRefusesAFirstFrameLongerThanAMessageFromTheLengthField) {
  MailboxRig rig;
  ::testing::internal::CaptureStderr();
  const std::int64_t before = rss_bytes();
  constexpr int kSenders = 4;
  for (int i = 0; i < kSenders; ++i) {
    const std::int64_t sent = stream_long_first_frame(rig.port, std::uint64_t{64} << 20);
    EXPECT_LT(sent, std::int64_t{16} << 20) << "sender " << i << " got most of 64 MiB through";
    rig.drive();
  }
  EXPECT_TRUE(eventually([&] { return rig.mailbox->dropped() >= kSenders; }, [&] { rig.drive(); }))
      << rig.mailbox->dropped();
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(rig.mailbox->dropped(), kSenders);
  EXPECT_NE(log.find("a frame longer than the 1048576 bytes this socket reads"), std::string::npos)
      << log;
  const std::int64_t grew = rss_bytes() - before;
  EXPECT_LT(grew, std::int64_t{32} << 20) << "the process grew by " << grew << " bytes";
}

TEST(ZmqBounds, MailboxCapsTheConnectionsWaitingForTheirHandshake) {
  constexpr int kCap = 4, kFlood = 12;
  MailboxRig rig(kCap);
  ::testing::internal::CaptureStderr();
  const int closed = flood_of_silent_connections(
      rig.port, kFlood, [&] { return rig.mailbox->dropped() >= kFlood - kCap; },
      [&] { rig.drive(); });
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count_of(log, "closed a connection before its handshake"), kFlood - kCap) << log;
  EXPECT_LE(count_of(log, "refused a ZeroMQ connection"), rig.mailbox->dropped() - (kFlood - kCap))
      << log;
  EXPECT_GE(closed, kFlood - kCap);
}

// The cap holds while the rank is busy elsewhere (a training step between refits): nothing
// calls receive() during the flood.
TEST(ZmqBounds, MailboxCapsWaitingConnectionsWhileItsRankDoesNotReceive) {
  constexpr int kCap = 4, kFlood = 12;
  MailboxRig rig(kCap);
  ::testing::internal::CaptureStderr();
  const int closed = flood_of_silent_connections(
      rig.port, kFlood, [&] { return rig.mailbox->dropped() >= kFlood - kCap; }, [] {});
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count_of(log, "closed a connection before its handshake"), kFlood - kCap) << log;
  EXPECT_GE(closed, kFlood - kCap);
}

// A message longer than kMaxMailboxMessageBytes is refused when it is sent, naming its size.
TEST(ZmqBounds, AMessageOverTheLimitIsRefusedAtItsSender) {
  MailboxRig rig;
  const std::string big(static_cast<std::size_t>(kMaxMailboxMessageBytes) + 1, 'x');
  const Status st = rig.mailbox->send("engine/0", MessageType::kBegin, big);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find(std::to_string(big.size()) + " bytes"), std::string::npos)
      << st.to_string();
}

// The store's host out of file descriptors: started by the test below, with a soft RLIMIT_NOFILE
// a few descriptors above what it holds, while that test opens connections to it.
TEST(ZmqBoundsChild, StoreOutOfDescriptors) {
  const char* port_file = std::getenv("REFIT_TEST_PORT_FILE");
  if (port_file == nullptr) GTEST_SKIP() << "started by ZmqBounds.StoreOutOfDescriptorsIsAnError";
  auto server =
      StoreServer::start(StoreServerOptions{.host = "127.0.0.1", .port = 0, .auth = auth()});
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  int open_now = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    (void)e;
    ++open_now;
  }
  rlimit r{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &r), 0);
  r.rlim_cur = static_cast<rlim_t>(open_now + 8);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &r), 0);
  std::ofstream(port_file) << (*server)->port() << "\n";
  ASSERT_TRUE(eventually([&] { return !(*server)->failure().ok(); }))
      << "no error within 20 s; refused " << (*server)->refused();
  const std::string want = "this process's RLIMIT_NOFILE is " + std::to_string(open_now + 8);
  EXPECT_NE((*server)->failure().message().find(want), std::string::npos)
      << (*server)->failure().to_string();
  EXPECT_EQ((*server)->failure().code(), StatusCode::kIOError);
  // ZeroMQ retried the accept while the connection waited; the run of failures counts once.
  EXPECT_EQ((*server)->refused(), 1);
}

// Out of descriptors, the store server's failure() is an error that names RLIMIT_NOFILE (trainer
// rank 0 fails with it), and ZeroMQ's retries of the failed accept count once.
TEST(ZmqBounds, StoreOutOfDescriptorsIsAnError) {
#if defined(__SANITIZE_ADDRESS__)
  // UndefinedBehaviorSanitizer's vptr check probes memory through a pipe, which a process out of
  // descriptors cannot open: it then reports every virtual call as one on an invalid object.
  GTEST_SKIP() << "not under the sanitizers: their runtime needs descriptors of its own";
#endif
  testing::TempDir dir;
  const std::string port_file = dir.path() + "/port";
  std::atomic<bool> done{false};
  std::thread clients([&] {
    int port = 0;
    for (int k = 0; k < 600 && port == 0 && !done.load(); ++k) {
      std::ifstream in(port_file);
      if (!(in >> port)) {
        port = 0;
        std::this_thread::sleep_for(50ms);
      }
    }
    if (port == 0) return;
    std::this_thread::sleep_for(100ms);
    std::vector<int> fds;
    for (int i = 0; i < 32 && !done.load(); ++i) fds.push_back(connect_tcp(port));
    for (int k = 0; k < 600 && !done.load(); ++k) std::this_thread::sleep_for(50ms);
    for (int fd : fds) ::close(fd);
  });
  const int rc = testing::run_test_child("ZmqBoundsChild.StoreOutOfDescriptors",
                                         {"REFIT_TEST_PORT_FILE=" + port_file}, 60s);
  done.store(true);
  clients.join();
  EXPECT_EQ(rc, 0) << "the store's own checks failed (its output is above)";
}

}  // namespace
}  // namespace refit
