// A real run under attack by a process of the same user that does not hold the run secret
// (docs/security.md, "Threat model"). The run: trainer ranks 0 and 1 and engine ranks 0 and 1 of
// qwen2.5-0.5b's shapes, started as four processes with a run secret, 8 refits with --verify. The
// attacker is this test binary started again (AttackerWithoutTheSecret.*): it finds engine rank
// 0's same-host lane the way any process of the user can (/proc), and tries a replayed hello, a
// sender id holding a forged log line, a hello without the sender's key, another uid, a half-sent
// hello, 64 MiB first frames and a flood of connections; and, on the store's port, ZeroMQ clients
// without the run's keys. The run must still verify, engine rank 0 must count every connection
// it refused, and no forged line may reach the log.
#include <gtest/gtest.h>
#include <poll.h>
#include <sodium.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
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
#include "control/ports.h"
#include "control/store.h"
#include "control/zmq_monitor.h"
#include "test_util.h"

namespace refit {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::TempDir;

const std::string kForgedLine =
    "[refit trainer 0] step 99/20: refit 0.001 s, 999.99 GB/s, verified";
constexpr int kFlood = 100;
constexpr int kLongFrames = 4;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::uint32_t get_u32(const char* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<std::uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

std::string hello_frame(const std::string& from, const std::string& proof) {
  std::string payload(1, static_cast<char>(from.size()));
  payload += from + proof;
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

lane::Fd connect_lane(const std::string& name, bool nonblocking = false) {
  sockaddr_un addr;
  const socklen_t len = lane::abstract_address(name, addr);
  lane::Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0), 0));
  const int rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), len);
  EXPECT_TRUE(rc == 0 || (nonblocking && errno == EAGAIN)) << std::strerror(errno);
  return fd;
}

// Up to `n` bytes from `fd`, within 5 s (fewer when it closes).
std::string read_bytes(int fd, std::size_t n) {
  std::string got;
  const auto end = Clock::now() + 5s;
  while (got.size() < n && Clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) != 1) continue;
    char buf[64];
    const ssize_t r = ::recv(fd, buf, std::min(sizeof buf, n - got.size()), MSG_DONTWAIT);
    if (r <= 0) break;
    got.append(buf, static_cast<std::size_t>(r));
  }
  return got;
}

std::string read_challenge(int fd) {
  const std::string got = read_bytes(fd, 41);
  if (got.size() != 41 || get_u32(got.data()) != 37) return {};
  return got.substr(9);
}

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

std::string hex(const std::string& s) {
  std::string out(2 * s.size() + 1, '\0');
  sodium_bin2hex(out.data(), out.size(), reinterpret_cast<const unsigned char*>(s.data()),
                 s.size());
  out.pop_back();
  return out;
}

std::string unhex(const std::string& h) {
  std::string out(h.size() / 2, '\0');
  std::size_t n = 0;
  sodium_hex2bin(reinterpret_cast<unsigned char*>(out.data()), out.size(), h.data(), h.size(),
                 nullptr, &n, nullptr);
  out.resize(n);
  return out;
}

// The pid of the process whose environment holds every one of `vars` ("NAME=value"), or 0.
pid_t find_process(const std::vector<std::string>& vars) {
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string env = slurp(e.path().string() + "/environ");
    bool all = !env.empty();
    for (const std::string& v : vars)
      all = all && (env.rfind(v + '\0', 0) == 0 || env.find('\0' + v + '\0') != std::string::npos);
    if (all) return static_cast<pid_t>(std::stol(name));
  }
  return 0;
}

// The abstract name of the same-host lane process `pid` listens on: its listening Unix socket
// named @refit-lane-… (/proc/net/unix), matched by inode with the process's descriptors.
std::string lane_of(pid_t pid) {
  std::vector<std::string> inodes;
  std::error_code ec;
  for (const auto& e :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    const std::string target = std::filesystem::read_symlink(e.path(), ec).string();
    if (target.rfind("socket:[", 0) == 0) inodes.push_back(target.substr(8, target.size() - 9));
  }
  std::istringstream unix_sockets(slurp("/proc/net/unix"));
  for (std::string line; std::getline(unix_sockets, line);) {
    std::istringstream f(line);
    std::string num, refs, proto, flags, type, state, inode, path;
    f >> num >> refs >> proto >> flags >> type >> state >> inode >> path;
    if (flags != "00010000" || path.rfind("@refit-lane-", 0) != 0) continue;
    for (const std::string& i : inodes)
      if (i == inode) return path.substr(1);
  }
  return {};
}

std::int64_t rss_of(pid_t pid) {
  std::istringstream in(slurp("/proc/" + std::to_string(pid) + "/status"));
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}

// The attacker: skipped unless the test below starts it.
TEST(AttackerWithoutTheSecret, AttacksAnEngineLane) {
  const char* port = std::getenv("REFIT_TEST_ATTACK_PORT");
  if (port == nullptr) GTEST_SKIP() << "started by Attack.AStrangerCannotPassTheLanesOfARun";
  ASSERT_EQ(std::getenv("REFIT_SECRET"), nullptr);
  ASSERT_EQ(std::getenv("REFIT_SECRET_FILE"), nullptr);
  const std::string captured = unhex(std::getenv("REFIT_TEST_CAPTURED_HELLO"));
  const pid_t engine = find_process({"ENGINE_RANK=0", std::string("REFIT_PORT=") + port});
  ASSERT_GT(engine, 0) << "engine rank 0 of the run is not running";
  const std::string name = lane_of(engine);
  ASSERT_FALSE(name.empty()) << "engine rank 0 (pid " << engine << ") has no lane";

  // A half-sent hello, left waiting while the other attacks run: closed at the gate's deadline
  // (2 s).
  lane::Fd half = connect_lane(name);
  ASSERT_EQ(read_challenge(half.get()).size(), 32u);
  ASSERT_TRUE(write_all(half.get(), std::string("\x40\x00\x00", 3)));
  {  // A hello captured from another connection, replayed.
    lane::Fd fd = connect_lane(name);
    ASSERT_EQ(read_challenge(fd.get()).size(), 32u);
    ASSERT_TRUE(write_all(fd.get(), captured));
    EXPECT_TRUE(closed_within(fd.get(), 5s)) << "the replayed hello was taken";
  }
  {  // A sender id that holds a forged log line.
    lane::Fd fd = connect_lane(name);
    ASSERT_EQ(read_challenge(fd.get()).size(), 32u);
    ASSERT_TRUE(write_all(fd.get(), hello_frame("x\n" + kForgedLine, std::string(120, 'p'))));
    EXPECT_TRUE(closed_within(fd.get(), 5s));
  }
  {  // A hello claiming trainer/0 with a proof of the right size that nobody's key made, then a
     // begin.
    lane::Fd fd = connect_lane(name);
    ASSERT_EQ(read_challenge(fd.get()).size(), 32u);
    std::string proof(24 + 16 + 12 + 1 + 8 + 1 + 9 + 32 + 32, '\0');
    randombytes_buf(proof.data(), proof.size());
    ASSERT_TRUE(write_all(fd.get(), hello_frame("trainer/0", proof)));
    (void)lane::write_raw_frame(fd.get(), 2, 0, "{\"step\": 666}", 1s);
    EXPECT_TRUE(closed_within(fd.get(), 5s));
  }
  if (::getuid() == 0) {  // Another uid.
    sockaddr_un addr;
    const socklen_t len = lane::abstract_address(name, addr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
      const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
      if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0) ::_exit(4);
      char b;
      ::_exit(::read(fd, &b, 1) == 0 ? 0 : 5);  // closed without a challenge
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
  {  // First frames announcing 64 MiB: refused from the length field; the engine does not grow.
    const std::int64_t before = rss_of(engine);
    const std::string chunk(1 << 20, 'A');
    for (int i = 0; i < kLongFrames; ++i) {
      lane::Fd fd = connect_lane(name);
      ASSERT_EQ(read_challenge(fd.get()).size(), 32u);
      std::string head;
      for (int k = 0; k < 4; ++k) head.push_back(static_cast<char>((64u << 20) >> (8 * k)));
      head.push_back(static_cast<char>(lane::kHelloFrame));
      ASSERT_TRUE(write_all(fd.get(), head));
      std::int64_t sent = 0;
      const auto end = Clock::now() + 15s;
      while (sent < (std::int64_t{64} << 20) && Clock::now() < end) {
        pollfd p{fd.get(), POLLOUT, 0};
        if (::poll(&p, 1, 50) != 1) continue;
        const ssize_t n = ::send(fd.get(), chunk.data(), chunk.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (n <= 0) break;
        sent += n;
      }
      EXPECT_LT(sent, std::int64_t{16} << 20) << "long frame " << i;
    }
    const std::int64_t grew = rss_of(engine) - before;
    EXPECT_LT(grew, std::int64_t{64} << 20) << "engine rank 0 grew by " << grew << " bytes";
  }
  // (Before the flood: the gate logs at most 10 lines per 10 s, and the flood's would hide it.)
  EXPECT_TRUE(closed_within(half.get(), 15s)) << "a half-sent hello stayed open";
  {  // A flood of connections that never say hello: at most 64 wait at the gate at once.
    std::vector<lane::Fd> flood;
    for (int i = 0; i < kFlood; ++i) flood.push_back(connect_lane(name, /*nonblocking=*/true));
    const auto challenged = [&] {
      int n = 0;
      for (const lane::Fd& fd : flood) {
        pollfd p{fd.get(), POLLIN, 0};
        if (::poll(&p, 1, 0) == 1) ++n;
      }
      return n;
    };
    for (int k = 0; k < 100 && challenged() == 0; ++k) std::this_thread::sleep_for(20ms);
    std::this_thread::sleep_for(300ms);
    const int taken = challenged();
    EXPECT_GE(taken, 1);
    EXPECT_LE(taken, 64);
  }
  {  // ZeroMQ on the store's port without the run's keys: NULL, and CURVE with a made-up server
     // key. Neither gets an answer, and each keeps its connection until the store ends it: the
     // store must judge the handshake itself, not see the stranger leave first (on a loaded
     // machine that can take longer than the wait for an answer).
    zmq::context_t ctx;
    for (int curve = 0; curve < 2; ++curve) {
      zmq::socket_t s(ctx, zmq::socket_type::dealer);
      s.set(zmq::sockopt::linger, 0);
      s.set(zmq::sockopt::reconnect_ivl, -1);  // one connection each
      if (curve == 1) {
        const auto [pub, sec] = curve_keypair();
        const auto [server, unused] = curve_keypair();
        s.set(zmq::sockopt::curve_serverkey, server);
        s.set(zmq::sockopt::curve_publickey, pub);
        s.set(zmq::sockopt::curve_secretkey, sec);
      }
      auto monitor = watch_connections(ctx, s);
      ASSERT_TRUE(monitor.ok()) << monitor.status().to_string();
      s.connect(std::string("tcp://127.0.0.1:") + port);
      const std::string id(8, '\1');
      const std::uint8_t op = 2;  // set
      std::array<zmq::const_buffer, 4> parts{zmq::buffer(id), zmq::const_buffer(&op, 1),
                                             zmq::str_buffer("error/first"),
                                             zmq::str_buffer("forged")};
      (void)zmq::send_multipart(s, parts, zmq::send_flags::dontwait);
      zmq_pollitem_t item{s.handle(), 0, ZMQ_POLLIN, 0};
      EXPECT_EQ(zmq_poll(&item, 1, 500), 0) << "the store answered a stranger";
      bool ended = false;
      for (int k = 0; k < 1200 && !ended; ++k) {
        for (const ConnectionEvent& e : read_connection_events(*monitor))
          ended = ended || e.event == ZMQ_EVENT_DISCONNECTED || e.refused();
        if (!ended) std::this_thread::sleep_for(50ms);
      }
      EXPECT_TRUE(ended) << "the store kept a stranger's connection open for a minute";
    }
  }

  EXPECT_EQ(::kill(engine, 0), 0) << "the run ended before the attack did (raise --steps)";
}

// The run the attacker attacks, and what it must show afterwards.
TEST(Attack, AStrangerCannotPassTheLanesOfARun) {
  TempDir dir;
  auto picked = pick_free_port();
  ASSERT_TRUE(picked.ok()) << picked.status().to_string();
  const int port = *picked;
  const std::string secret = "attack-test-secret-0123456789abcdef";
  const std::string cfg = dir.write(
      "c.yaml",
      "model: qwen2.5-0.5b\ndevice: cpu\npolicy: {backend: fsdp2, world_size: 2, dtype: float32}\n"
      "generation: {backend: sglang, num_engines: 1, tp_size: 2}\nrefit: {timeout_s: 60}\n");
  const std::string exe = REFIT_CLI_PATH;
  std::ostringstream sh;
  sh << "cd " << dir.path() << " && export MASTER_ADDR=127.0.0.1 REFIT_PORT=" << port
     << " REFIT_SECRET=" << secret << "; "
     << "RANK=0 WORLD_SIZE=2 " << exe << " trainer " << cfg
     << " --steps 8 --verify > t0.log 2>&1 & "
     << "p0=$!; RANK=1 WORLD_SIZE=2 " << exe << " trainer " << cfg
     << " --steps 8 --verify > t1.log 2>&1 & p1=$!; ENGINE_RANK=0 " << exe << " engine " << cfg
     << " > e0.log 2>&1 & p2=$!; ENGINE_RANK=1 " << exe << " engine " << cfg
     << " > e1.log 2>&1 & p3=$!; for p in $p0 $p1 $p2 $p3; do wait $p; echo $? >> codes; done";
  std::thread run([&] {
    const std::string cmd = "timeout -k 5 540 bash -c '" + sh.str() + "'";
    (void)std::system(cmd.c_str());
  });

  // An insider (it holds the secret) makes a real hello to engine rank 0, answering a real
  // challenge, as if one had been captured; the attacker gets its bytes and no secret.
  auto parsed = ControlAuth::from_secret(secret);
  ASSERT_TRUE(parsed.ok());
  auto insider =
      connect_store("127.0.0.1", port, 60s, std::make_shared<const ControlAuth>(*parsed));
  ASSERT_TRUE(insider.ok()) << insider.status().to_string();
  auto published = (*insider)->get("lane/engine/0", 60s);
  ASSERT_TRUE(published.ok()) << published.status().to_string();
  const std::string identity = published->substr(0, published->find('\n'));
  const std::optional<lane::Address> at = lane::parse_address(*published, identity);
  ASSERT_TRUE(at.has_value());
  const auto [pub, sec] = curve_keypair();
  ASSERT_TRUE((*insider)->set(auth_key_name("intruder/0"), pub).ok());
  unsigned char sk[32], key[32];
  ASSERT_TRUE(lane::z85_key(sec, sk));
  std::string captured;
  {
    lane::Fd fd = connect_lane(at->name);
    const std::string challenge = read_challenge(fd.get());
    ASSERT_EQ(challenge.size(), 32u);
    captured = hello_frame("intruder/0",
                           lane::make_proof("intruder/0", "engine/0", challenge, at->key, sk, key));
    ASSERT_TRUE(write_all(fd.get(), captured));
    // The gate's accept, keyed with the lane key the hello carried (a sender writes nothing
    // before it).
    const std::string accept = read_bytes(fd.get(), 4 + 5 + lane::kTagBytes);
    ASSERT_EQ(accept.size(), 4 + 5 + lane::kTagBytes);
    EXPECT_EQ(static_cast<std::uint8_t>(accept[4]), lane::kAcceptFrame);
    unsigned char tag[lane::kTagBytes];
    lane::accept_tag(key, challenge, tag);
    EXPECT_EQ(accept.substr(9), std::string(reinterpret_cast<const char*>(tag), sizeof tag));
  }
  insider->reset();

  const int attacker = testing::run_test_child("AttackerWithoutTheSecret.AttacksAnEngineLane",
                                               {"REFIT_TEST_ATTACK_PORT=" + std::to_string(port),
                                                "REFIT_TEST_CAPTURED_HELLO=" + hex(captured)},
                                               std::chrono::seconds(240));
  run.join();
  EXPECT_EQ(attacker, 0) << "the attacker's own checks failed (its output is above)";

  std::vector<int> codes;
  std::ifstream in(dir.path() + "/codes");
  for (int c; in >> c;) codes.push_back(c);
  const std::string out = slurp(dir.path() + "/t0.log") + slurp(dir.path() + "/t1.log") +
                          slurp(dir.path() + "/e0.log") + slurp(dir.path() + "/e1.log");
  EXPECT_EQ(codes, (std::vector<int>{0, 0, 0, 0})) << out;
  EXPECT_NE(out.find("verified bit-exact"), std::string::npos) << out;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);)
    EXPECT_NE(line.rfind("[refit trainer 0] step 99", 0), 0u) << "a forged line:\n" << out;
  const std::string e0 = slurp(dir.path() + "/e0.log");
  for (const std::string& want :
       {std::string("answers another connection's challenge (a replayed hello)"),
        std::string("its hello claims to come from 'x\\x0a[refit trainer 0] step 99/20"),
        std::string("its hello claims to come from 'trainer/0' without the key that sender "
                    "registered"),
        std::string("no complete hello within 2000 ms of its connection"),
        std::string("its first frame announces 67108864 bytes; a hello has at most 1024")})
    EXPECT_NE(e0.find(want), std::string::npos) << want << "\n" << e0;
  // Every connection the attacker made to engine rank 0's lane, counted once: the replay, the
  // forged id, the forged proof, another uid (as root), the half hello, the long frames, the flood.
  const int expected = 3 + (::getuid() == 0 ? 1 : 0) + 1 + kLongFrames + kFlood;
  EXPECT_NE(e0.find("mailbox 'engine/0': dropped " + std::to_string(expected) +
                    " message(s) and connection(s) in all"),
            std::string::npos)
      << e0;
  EXPECT_NE(out.find("store server tcp://127.0.0.1:" + std::to_string(port) +
                     ": refused a connection: the handshake failed"),
            std::string::npos)
      << out;
}

}  // namespace
}  // namespace refit
