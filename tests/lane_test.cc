// Same-host lanes against strangers, in one process (tests/attack_test.cc attacks a real run):
// the challenge and the hello, frames sealed with the lane key, one lane per sender, and the bounds
// a lane's gate keeps before a hello proves the sender (deadline, first-frame size, pending
// connections, descriptors). Every refused connection must be counted in dropped(), and every
// string a peer supplied must reach the log escaped.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sodium.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "control/auth.h"
#include "control/lane.h"
#include "control/mailbox.h"
#include "control/mailbox_parts.h"
#include "control/messages.h"
#include "control/store.h"

namespace refit {
namespace {

using namespace std::chrono_literals;

// A frame's tag is BLAKE2b-128 keyed with the lane key over [sequence number: 8 bytes LE][type]
// [epoch: 4 bytes LE][payload] (docs/security.md, "Sealed frames"): each seal computes it from
// its keyed state, the sequence number advancing per frame, and checks what a seal with the same
// key wrote in the same order.
TEST(LaneSeal, TagsAreKeyedBlake2bOverSequenceTypeEpochAndPayload) {
  ASSERT_GE(sodium_init(), 0);
  unsigned char key[lane::kKeyBytes];
  for (std::size_t i = 0; i < sizeof key; ++i) key[i] = static_cast<unsigned char>(3 * i + 1);
  lane::FrameSeal sender(key);
  lane::FrameSeal moved(key);
  lane::FrameSeal receiver(std::move(moved));  // a moved seal tags as its source would
  const std::string payloads[] = {"", "11 7 - 0.0012 0", std::string(300, 'x')};
  for (std::uint64_t seq = 0; seq < 3; ++seq) {
    const std::string& payload = payloads[seq];
    const std::uint8_t type = static_cast<std::uint8_t>(5 + seq);
    const std::uint32_t epoch = 0x01020304u + static_cast<std::uint32_t>(seq);
    std::string input;
    for (int i = 0; i < 8; ++i) input.push_back(static_cast<char>(seq >> (8 * i)));
    input.push_back(static_cast<char>(type));
    for (int i = 0; i < 4; ++i) input.push_back(static_cast<char>(epoch >> (8 * i)));
    input += payload;
    unsigned char want[lane::kTagBytes], got[lane::kTagBytes];
    crypto_generichash(want, sizeof want, reinterpret_cast<const unsigned char*>(input.data()),
                       input.size(), key, sizeof key);
    sender.tag(type, epoch, payload, got);
    EXPECT_EQ(std::memcmp(want, got, sizeof want), 0) << "frame " << seq;
    EXPECT_TRUE(receiver.check(type, epoch, payload, got)) << "frame " << seq;
  }
  // Out of order: the receiver is at frame 3, the tag is frame 0's again.
  unsigned char first[lane::kTagBytes];
  lane::FrameSeal again(key);
  again.tag(5, 0x01020304u, payloads[0], first);
  EXPECT_FALSE(receiver.check(5, 0x01020304u, payloads[0], first));
}
using Clock = std::chrono::steady_clock;

constexpr char kSecret[] = "lane-test-secret-0123456789abcdef";
const std::string kForgedLine =
    "[refit trainer 0] step 99/20: refit 0.001 s, 999.99 GB/s, verified";

std::uint32_t get_u32(const char* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<std::uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

// An authenticated store and mailbox engine/0 (its lane with `limits`), plus a real sender.
struct LaneRig {
  explicit LaneRig(lane::Limits limits = {}, bool authenticated = true) {
    if (authenticated) {
      auto parsed = ControlAuth::from_secret(kSecret);
      EXPECT_TRUE(parsed.ok());
      auth = std::make_shared<const ControlAuth>(*parsed);
    }
    auto s = StoreServer::start("127.0.0.1", 0, auth);
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    server = std::move(s).value();
    auto c = connect_store("127.0.0.1", server->port(), 5s, auth);
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    store = std::move(c).value();
    engine = open("engine/0", limits);
    trainer = open("trainer/0", {});
    auto published = store->get("lane/engine/0", 2s);
    EXPECT_TRUE(published.ok());
    at = *lane::parse_address(*published, "lane-test-host");
  }
  std::unique_ptr<Mailbox> open(const std::string& id, lane::Limits limits) {
    auto box = Mailbox::open(
        *store, MailboxOptions{.id = id,
                               .timeout = 2s,
                               .auth = auth,
                               .settings = {.lanes = true, .host_identity = "lane-test-host"},
                               .lane_limits = limits});
    EXPECT_TRUE(box.ok()) << box.status().to_string();
    return std::move(box).value();
  }
  // Registers a member key of our own under `id` (the test holds the secret): a sender that can
  // make real hellos.
  std::vector<unsigned char> member(const std::string& id) {
    const auto [pub, sec] = curve_keypair();
    EXPECT_TRUE(store->set(auth_key_name(id), pub).ok());
    std::vector<unsigned char> sk(32);
    EXPECT_TRUE(lane::z85_key(sec, sk.data()));
    return sk;
  }
  // Receives on engine/0 until dropped() reaches `n` (the receiving thread counts lanes it closes;
  // the gate counts on its own), at most `bound`.
  void drops_reach(std::int64_t n, std::chrono::milliseconds bound = 10s) {
    const auto end = Clock::now() + bound;
    while (engine->dropped() < n && Clock::now() < end) {
      auto m = engine->receive(50ms);
      EXPECT_FALSE(m.ok()) << "a stranger's " << message_type_name(m->type) << " arrived";
    }
  }

  std::shared_ptr<const ControlAuth> auth;
  std::unique_ptr<StoreServer> server;
  std::unique_ptr<Store> store;
  std::unique_ptr<Mailbox> engine, trainer;
  lane::Address at;
};

lane::Fd raw_connect(const lane::Address& at, bool nonblocking = false) {
  sockaddr_un addr;
  const socklen_t len = lane::abstract_address(at.name, addr);
  lane::Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0), 0));
  const int rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), len);
  EXPECT_TRUE(rc == 0 || (nonblocking && errno == EAGAIN)) << std::strerror(errno);
  return fd;
}

// The gate's challenge on `fd` (its 32 bytes), read within 2 s; empty when none came.
std::string read_challenge(int fd) {
  std::string got;
  const auto end = Clock::now() + 2s;
  while (got.size() < 41 && Clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) != 1) continue;
    char buf[41];
    const ssize_t n = ::recv(fd, buf, 41 - got.size(), MSG_DONTWAIT);
    if (n <= 0) break;
    got.append(buf, static_cast<std::size_t>(n));
  }
  if (got.size() != 41 || get_u32(got.data()) != 37 ||
      static_cast<std::uint8_t>(got[4]) != lane::kChallengeFrame)
    return {};
  return got.substr(9);
}

// Whether the peer closed `fd` within `bound` (reads and discards what arrives meanwhile).
bool closed_within(int fd, std::chrono::milliseconds bound) {
  const auto end = Clock::now() + bound;
  while (Clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) != 1) continue;
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return true;
  }
  return false;
}

std::string hello_payload(const std::string& from, const std::string& proof) {
  std::string h;
  h.push_back(static_cast<char>(from.size()));
  return h + from + proof;
}

// A whole hello frame as a sender writes it.
std::string hello_frame(const std::string& from, const std::string& proof) {
  const std::string payload = hello_payload(from, proof);
  std::string f;
  const auto len = static_cast<std::uint32_t>(5 + payload.size());
  for (int i = 0; i < 4; ++i) f.push_back(static_cast<char>(len >> (8 * i)));
  f.push_back(static_cast<char>(lane::kHelloFrame));
  f.append(4, '\0');
  return f + payload;
}

bool write_all(int fd, const std::string& bytes) {
  return ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

std::int64_t rss_bytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}

int open_fds() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// Strangers at an authenticated lane: a hello that names a sender without holding the key it
// registered, a frame before any hello, and a process of another user (refused by the receiver's
// check of the peer's uid). None of them delivers a message; each is counted in dropped(). The
// real sender's messages still arrive, over the lane.
TEST(MailboxLane, StrangersAreRefused) {
  LaneRig rig;
  const std::string begin = encode(BeginMessage{.step = 7, .version = "evil-v7"});
  std::int64_t expected = 0;
  {  // A hello claiming trainer/0, proved with a stranger's key: the gate never accepts it, so
     // the connect fails before a frame could be written into the closed lane.
    unsigned char pk[32], sk[32];
    crypto_box_keypair(pk, sk);
    auto lane = lane::connect(rig.at, "trainer/0", "engine/0", sk, 2s);
    ASSERT_FALSE(lane.ok());
    EXPECT_NE(lane.status().message().find("the receiver refused the hello"), std::string::npos)
        << lane.status().to_string();
    rig.drops_reach(++expected);
    EXPECT_EQ(rig.engine->dropped(), expected);
  }
  {  // No hello: a begin first.
    lane::Fd fd = raw_connect(rig.at);
    ASSERT_FALSE(read_challenge(fd.get()).empty());
    ASSERT_TRUE(lane::write_raw_frame(fd.get(), static_cast<std::uint8_t>(MessageType::kBegin), 0,
                                      begin, 1s)
                    .ok());
    EXPECT_TRUE(closed_within(fd.get(), 5s));
    rig.drops_reach(++expected);
    EXPECT_EQ(rig.engine->dropped(), expected);
  }
  if (::getuid() == 0) {  // Another user (root can become one): it connects, and is refused.
    sockaddr_un addr;
    const socklen_t len = lane::abstract_address(rig.at.name, addr);
    const pid_t pid = ::fork();
    if (pid == 0) {  // only async-signal-safe calls from here
      if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
      const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
      if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0) ::_exit(4);
      char b;
      ::_exit(::read(fd, &b, 1) == 0 ? 0 : 5);  // closed without a challenge
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0);
    rig.drops_reach(++expected);
    EXPECT_EQ(rig.engine->dropped(), expected);
  }
  ASSERT_TRUE(rig.trainer->send("engine/0", MessageType::kBegin, "real").ok());
  auto m = rig.engine->receive(2s);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->from, "trainer/0");
  EXPECT_EQ(m->payload, "real");
  EXPECT_EQ(rig.engine->lane_messages(), 1);
  EXPECT_EQ(rig.engine->dropped(), expected);
}

// A sender writes only to a lane whose listener is a process of its own user: a name a rank freed
// as it exited may be bound by anyone in the network namespace.
TEST(MailboxLane, AListenerOfAnotherUserIsNotWrittenTo) {
  if (::getuid() != 0) GTEST_SKIP() << "needs root to become another user";
  const std::string name = fmt::format("refit-test-squatter-{}", ::getpid());
  sockaddr_un addr;
  const socklen_t len = lane::abstract_address(name, addr);
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {  // only async-signal-safe calls from here
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    if (::bind(fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0 || ::listen(fd, 4) != 0)
      ::_exit(4);
    const char one = 1;
    if (::write(ready[1], &one, 1) != 1) ::_exit(5);
    const int c = ::accept(fd, nullptr, nullptr);
    char b;
    ::_exit(c >= 0 && ::read(c, &b, 1) == 0 ? 0 : 6);  // the sender left without a byte
  }
  ::close(ready[1]);
  char b = 0;
  ASSERT_EQ(::read(ready[0], &b, 1), 1) << "the other user's listener did not start";
  ::close(ready[0]);
  const std::string key(32, '\0');
  auto lane = lane::connect(lane::Address{.name = name, .key = key}, "trainer/0", "engine/0",
                            nullptr, 2s);
  ASSERT_FALSE(lane.ok());
  EXPECT_NE(lane.status().message().find("its listener is not a process of this user (uid 65534"),
            std::string::npos)
      << lane.status().to_string();
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// A listener of the same user that did not publish the lane (it bound a name the lane's mailbox
// freed, and copied its published key) cannot open the hello, so it cannot answer with the accept
// the lane key makes: the sender writes it nothing after the hello.
TEST(MailboxLane, AListenerWithoutTheLaneKeyIsNotWrittenTo) {
  LaneRig rig;
  const std::vector<unsigned char> sk = rig.member("trainer/7");
  const std::string name = fmt::format("refit-test-impostor-{}", ::getpid());
  sockaddr_un addr;
  const socklen_t len = lane::abstract_address(name, addr);
  lane::Fd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<const sockaddr*>(&addr), len), 0);
  ASSERT_EQ(::listen(listener.get(), 4), 0);
  std::size_t after_hello = 0;
  bool answered = false;
  std::thread impostor([&] {
    lane::Fd c(::accept(listener.get(), nullptr, nullptr));
    if (!c) return;
    if (!lane::write_raw_frame(c.get(), lane::kChallengeFrame, 0, std::string(32, 'c'), 1s).ok())
      return;
    // The hello: its length field, then the rest.
    std::string got;
    const auto end = Clock::now() + 3s;
    char buf[4096];
    while (Clock::now() < end && (got.size() < 4 || got.size() < 4 + get_u32(got.data()))) {
      pollfd p{c.get(), POLLIN, 0};
      if (::poll(&p, 1, 50) != 1) continue;
      const ssize_t n = ::recv(c.get(), buf, sizeof buf, 0);
      if (n <= 0) return;
      got.append(buf, static_cast<std::size_t>(n));
    }
    if (got.size() < 4) return;
    const std::size_t hello = 4 + get_u32(got.data());
    answered = lane::write_raw_frame(c.get(), lane::kAcceptFrame, 0, std::string(16, '\0'), 1s).ok();
    // Whatever the sender writes after its hello, until it closes.
    after_hello = got.size() - std::min(got.size(), hello);
    while (Clock::now() < end + 2s) {
      pollfd p{c.get(), POLLIN, 0};
      if (::poll(&p, 1, 50) != 1) continue;
      const ssize_t n = ::recv(c.get(), buf, sizeof buf, 0);
      if (n <= 0) break;
      after_hello += static_cast<std::size_t>(n);
    }
  });
  bool connected = false;
  std::string error;
  {
    auto lane = lane::connect(lane::Address{.name = name, .key = rig.at.key}, "trainer/7",
                              "engine/0", sk.data(), 2s);
    connected = lane.ok();
    if (connected)
      (void)lane::write_frame(*lane, static_cast<std::uint8_t>(MessageType::kBegin), 0, "secret",
                              1s);
    else
      error = lane.status().message();
  }  // the sender's end closes: the impostor's reads end
  impostor.join();
  EXPECT_TRUE(answered);
  EXPECT_FALSE(connected);
  EXPECT_NE(error.find("the receiver's accept does not carry the lane key"), std::string::npos)
      << error;
  EXPECT_EQ(after_hello, 0u);
}

// A hello is good for the one connection whose challenge it answers, frames after it must carry
// the lane key's tags, and a sender has one live lane.
TEST(MailboxLane, ReplayedHelloIsRefusedAndFramesAreSealed) {
  LaneRig rig;
  const std::vector<unsigned char> sk = rig.member("trainer/7");
  // A real lane of trainer/7, written by hand so that its hello can be kept.
  lane::Fd a = raw_connect(rig.at);
  const std::string ca = read_challenge(a.get());
  ASSERT_EQ(ca.size(), 32u);
  unsigned char key[32];
  const std::string hello = hello_frame(
      "trainer/7", lane::make_proof("trainer/7", "engine/0", ca, rig.at.key, sk.data(), key));
  ASSERT_TRUE(write_all(a.get(), hello));
  lane::Outgoing first{std::move(a), lane::FrameSeal(key)};
  ASSERT_TRUE(
      lane::write_frame(first, static_cast<std::uint8_t>(MessageType::kBegin), 0, "one", 1s).ok());
  auto m = rig.engine->receive(3s);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->from, "trainer/7");
  EXPECT_EQ(m->payload, "one");

  ::testing::internal::CaptureStderr();
  {  // The same hello on a new connection answers the old challenge: refused as a replay.
    lane::Fd b = raw_connect(rig.at);
    ASSERT_EQ(read_challenge(b.get()).size(), 32u);
    ASSERT_TRUE(write_all(b.get(), hello));
    EXPECT_TRUE(closed_within(b.get(), 5s));
    rig.drops_reach(1);
  }
  {  // A valid hello of another member, then a frame without the lane key's tag.
    const std::vector<unsigned char> sk8 = rig.member("trainer/8");
    lane::Fd c = raw_connect(rig.at);
    const std::string cc = read_challenge(c.get());
    unsigned char k[32];
    ASSERT_TRUE(
        write_all(c.get(), hello_frame("trainer/8", lane::make_proof("trainer/8", "engine/0", cc,
                                                                     rig.at.key, sk8.data(), k))));
    ASSERT_TRUE(lane::write_raw_frame(c.get(), static_cast<std::uint8_t>(MessageType::kCommit), 0,
                                      std::string(16, 'x') + "forged", 1s)
                    .ok());
    rig.drops_reach(2);  // the receiving thread reads the lane, and closes it
    EXPECT_TRUE(closed_within(c.get(), 5s));
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("answers another connection's challenge (a replayed hello)"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("a frame whose tag does not match the lane's key"), std::string::npos) << log;
  EXPECT_EQ(rig.engine->dropped(), 2);

  // A second lane of trainer/7 replaces the first, which is closed once drained.
  auto second = lane::connect(rig.at, "trainer/7", "engine/0", sk.data(), 2s);
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  ASSERT_TRUE(
      lane::write_frame(first, static_cast<std::uint8_t>(MessageType::kBegin), 0, "two", 1s).ok());
  ASSERT_TRUE(
      lane::write_frame(*second, static_cast<std::uint8_t>(MessageType::kBegin), 0, "three", 1s)
          .ok());
  for (const char* want : {"two", "three"}) {
    auto got = rig.engine->receive(3s);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_EQ(got->payload, want);
  }
  EXPECT_TRUE(closed_within(first.fd.get(), 5s));
  EXPECT_EQ(rig.engine->lane_messages(), 3);
  EXPECT_EQ(rig.engine->dropped(), 2);
}

// Ids and addresses that peers supply reach the log escaped: a sender id holding a newline and a
// forged log line leaves no line of its own, through the lane's gate (a hello naming it), through
// a lane without a run secret (a frame that ends it), and through ZeroMQ (a message claiming it).
TEST(MailboxLane, PeerSuppliedIdsLeaveNoLineOfTheirOwn) {
  const std::string evil = "x\n" + kForgedLine;
  ::testing::internal::CaptureStderr();
  {
    LaneRig rig;
    lane::Fd fd = raw_connect(rig.at);
    ASSERT_EQ(read_challenge(fd.get()).size(), 32u);
    ASSERT_TRUE(write_all(fd.get(), hello_frame(evil, std::string(100, 'p'))));
    EXPECT_TRUE(closed_within(fd.get(), 5s));
    rig.drops_reach(1);
    // ZeroMQ: a stranger's CURVE key with the server's key, claiming the evil id.
    auto address = rig.store->get("mailbox/engine/0", 1s);
    ASSERT_TRUE(address.ok());
    zmq::context_t ctx;
    zmq::socket_t push(ctx, zmq::socket_type::push);
    push.set(zmq::sockopt::linger, 0);
    const auto [pub, sec] = curve_keypair();
    push.set(zmq::sockopt::curve_serverkey, rig.auth->server_public());
    push.set(zmq::sockopt::curve_publickey, pub);
    push.set(zmq::sockopt::curve_secretkey, sec);
    push.connect(*address);
    const std::array<std::uint8_t, 5> head{static_cast<std::uint8_t>(MessageType::kBegin), 0, 0, 0,
                                           0};
    const std::string payload = "p";  // outlives the send (a buffer of a temporary would not)
    std::array<zmq::const_buffer, 3> parts{zmq::const_buffer(head.data(), head.size()),
                                           zmq::buffer(evil), zmq::buffer(payload)};
    ASSERT_TRUE(zmq::send_multipart(push, parts));
    rig.drops_reach(2);
  }
  {  // Without a run secret the hello is taken; a frame of unknown type then ends the lane.
    LaneRig rig({}, /*authenticated=*/false);
    lane::Fd fd = raw_connect(rig.at);
    ASSERT_EQ(read_challenge(fd.get()).size(), 32u);
    ASSERT_TRUE(write_all(fd.get(), hello_frame(evil, "")));
    ASSERT_TRUE(lane::write_raw_frame(fd.get(), 99, 0, "z", 1s).ok());
    rig.drops_reach(1);
    EXPECT_TRUE(closed_within(fd.get(), 5s));
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  std::istringstream lines(log);
  int escaped = 0;
  for (std::string line; std::getline(lines, line);) {
    EXPECT_NE(line.rfind("[refit trainer 0] step 99", 0), 0u) << "a forged line:\n" << log;
    if (line.find("x\\x0a[refit trainer 0] step 99/20") != std::string::npos) ++escaped;
  }
  EXPECT_EQ(escaped, 3) << log;
}

// A connection that sends part of its hello is closed at the gate's deadline, counted and logged.
TEST(MailboxLane, HalfSentHelloIsClosedAtTheDeadline) {
  LaneRig rig({.hello_deadline = 300ms});
  ::testing::internal::CaptureStderr();
  lane::Fd fd = raw_connect(rig.at);
  ASSERT_EQ(read_challenge(fd.get()).size(), 32u);
  ASSERT_TRUE(write_all(fd.get(), std::string("\x40\x00\x00", 3)));
  EXPECT_TRUE(closed_within(fd.get(), 10s));
  rig.drops_reach(1);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("no complete hello within 300 ms of its connection"), std::string::npos)
      << log;
  EXPECT_EQ(rig.engine->dropped(), 1);
}

// A first frame announcing 64 MiB is refused from its length field: each of eight such senders
// gets its connection closed after a few socket buffers of its bytes, and the receiving process
// does not grow by them.
TEST(MailboxLane, LongFirstFrameIsRefusedBeforeItsBytesArrive) {
  LaneRig rig;
  const std::int64_t before = rss_bytes();
  const std::string chunk(1 << 20, 'A');
  constexpr int kSenders = 8;
  for (int i = 0; i < kSenders; ++i) {
    lane::Fd fd = raw_connect(rig.at);
    ASSERT_EQ(read_challenge(fd.get()).size(), 32u);
    std::string head;
    const std::uint32_t len = 64u << 20;
    for (int k = 0; k < 4; ++k) head.push_back(static_cast<char>(len >> (8 * k)));
    head.push_back(static_cast<char>(lane::kHelloFrame));
    ASSERT_TRUE(write_all(fd.get(), head));
    std::int64_t sent = 0;
    const auto end = Clock::now() + 10s;
    while (sent < (std::int64_t{64} << 20) && Clock::now() < end) {
      pollfd p{fd.get(), POLLOUT, 0};
      if (::poll(&p, 1, 50) != 1) continue;
      const ssize_t n = ::send(fd.get(), chunk.data(), chunk.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (n <= 0) break;
      sent += n;
    }
    EXPECT_LT(sent, std::int64_t{16} << 20) << "sender " << i << " got most of 64 MiB through";
  }
  rig.drops_reach(kSenders);
  EXPECT_EQ(rig.engine->dropped(), kSenders);
  const std::int64_t grew = rss_bytes() - before;
  EXPECT_LT(grew, std::int64_t{64} << 20) << "the process grew by " << grew << " bytes";
}

// A flood of connections that never say hello: the gate holds at most max_pending of them at once
// (only those get a challenge; the others wait in the listen queue), and counts every one.
TEST(MailboxLane, PendingConnectionsAreCappedAndCounted) {
  LaneRig rig({.hello_deadline = 3s, .max_pending = 4});
  constexpr int kFlood = 40;
  std::vector<lane::Fd> flood;
  for (int i = 0; i < kFlood; ++i) flood.push_back(raw_connect(rig.at, /*nonblocking=*/true));
  // Within the first deadline only four are taken and challenged.
  const auto challenged = [&] {
    int n = 0;
    for (const lane::Fd& fd : flood) {
      pollfd p{fd.get(), POLLIN, 0};
      if (::poll(&p, 1, 0) == 1) ++n;
    }
    return n;
  };
  for (int k = 0; k < 100 && challenged() == 0; ++k) std::this_thread::sleep_for(20ms);
  std::this_thread::sleep_for(200ms);
  const int taken = challenged();
  EXPECT_GE(taken, 1);
  EXPECT_LE(taken, 4);
  flood.clear();  // the flood gives up: each is taken later, found closed, and counted
  rig.drops_reach(kFlood, 30s);
  EXPECT_EQ(rig.engine->dropped(), kFlood);
  // The real sender still gets through, over the lane.
  ASSERT_TRUE(rig.trainer->send("engine/0", MessageType::kBegin, "real").ok());
  auto m = rig.engine->receive(3s);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->payload, "real");
  EXPECT_EQ(rig.engine->lane_messages(), 1);
}

// A hello naming a sender the mailbox does not know costs it a store lookup, which anyone of the
// same user can cause: past a small budget per second such hellos are refused without one, and a
// real sender whose key the mailbox already read still gets through.
TEST(MailboxLane, HellosFromUnknownSendersCostABoundedNumberOfStoreLookups) {
  LaneRig rig;
  // The real sender's key, read once before the flood.
  ASSERT_TRUE(rig.trainer->send("engine/0", MessageType::kBegin, "before").ok());
  auto first = rig.engine->receive(3s);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  constexpr int kGhosts = 64;
  const std::int64_t requests_before = rig.store->requests();
  const auto start = Clock::now();
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < kGhosts; ++i) {
    lane::Fd fd = raw_connect(rig.at);
    ASSERT_EQ(read_challenge(fd.get()).size(), 32u);
    std::string proof(24 + 16 + 120, '\0');
    randombytes_buf(proof.data(), proof.size());
    ASSERT_TRUE(write_all(fd.get(), hello_frame(fmt::format("ghost/{}", i), proof)));
    EXPECT_TRUE(closed_within(fd.get(), 5s)) << "ghost " << i;
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  rig.drops_reach(kGhosts);
  const std::string log = ::testing::internal::GetCapturedStderr();
  const std::int64_t lookups = rig.store->requests() - requests_before;
  // At most the budget per started second of the flood (before: one per hello).
  const double bound = mailbox_parts::SenderKeys::kMissBudget * (seconds + 1);
  EXPECT_LE(static_cast<double>(lookups), bound) << seconds << " s";
  EXPECT_LT(bound, kGhosts) << "the flood took " << seconds << " s: too slow to tell";
  EXPECT_NE(log.find("its hello claims to come from 'ghost/0', which registered no key"),
            std::string::npos)
      << log;
  EXPECT_EQ(rig.engine->dropped(), kGhosts);
  // The real sender's lane is untouched.
  ASSERT_TRUE(rig.trainer->send("engine/0", MessageType::kBegin, "after").ok());
  auto m = rig.engine->receive(3s);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->payload, "after");
  EXPECT_EQ(rig.engine->lane_messages(), 2);
}

// Out of descriptors, the gate names the limit and the connection waits in the listen queue; once
// descriptors are free again it is taken (and, closed meanwhile, counted).
TEST(MailboxLane, RunningOutOfDescriptorsNamesTheLimit) {
  LaneRig rig;
  lane::Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  ::testing::internal::CaptureStderr();
  rlimit low = old;
  // Every descriptor this process may have is open (open_fds() counts its own directory's).
  low.rlim_cur = static_cast<rlim_t>(open_fds() - 1);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  sockaddr_un addr;
  const socklen_t len = lane::abstract_address(rig.at.name, addr);
  const int rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), len);
  std::this_thread::sleep_for(500ms);  // the gate tries, runs out, backs off
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &old), 0);
  ASSERT_EQ(rc, 0) << std::strerror(errno);
  fd = lane::Fd();
  rig.drops_reach(1);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("cannot take a same-host lane connection: too many open files: this "
                     "process's RLIMIT_NOFILE is " +
                     std::to_string(low.rlim_cur)),
            std::string::npos)
      << log;
  EXPECT_EQ(rig.engine->dropped(), 1);
}

}  // namespace
}  // namespace refit
