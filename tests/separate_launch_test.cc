// Ranks started one by one with a torchrun-style environment, as users spread them over hosts:
// a verified run, executors mixed across "hosts" (REFIT_HOST_ID), peer access across hosts and
// settings that differ refused at setup, and hostile processes beside an authenticated run.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "control/auth.h"
#include "control/mailbox.h"
#include "control/messages.h"
#include "control/ports.h"
#include "control/store.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::run_cli;
using testing::TempDir;
using Cell = testing::RunConfig;
using testing::config_yaml;

// Separate launch: every rank started on its own with a torchrun-style environment, as users
// spread ranks over hosts. Returns the exit codes (trainer 0, trainer 1, engine 0, engine 1).
// `hosts` (optional): REFIT_HOST_ID of trainer 0, trainer 1, engine 0, engine 1.
// The store port launch_separately's ranks use: one per test process, below the ephemeral range
// (control/ports.h), since ranks dial it before it listens.
int separate_launch_port() {
  static const int port = [] {
    auto p = pick_free_port();
    EXPECT_TRUE(p.ok()) << p.status().to_string();
    return p.ok() ? *p : 29633;
  }();
  return port;
}

// Trainer ranks 0 and 1 and engine ranks 0 and 1 as four processes started by a shell, as torchrun
// would; returns their exit codes. `env` (e.g. "REFIT_SECRET=... ") prefixes every rank.
std::vector<int> launch_separately(const std::string& trainer_cfg, const std::string& engine_cfg,
                                   const TempDir& dir, std::string* output,
                                   const std::vector<std::string>& hosts = {},
                                   const std::string& env = "", int steps = 2) {
  auto host = [&](std::size_t i) {
    return env + (hosts.empty() ? std::string() : "REFIT_HOST_ID=" + hosts[i] + " ");
  };
  const int port = separate_launch_port();
  const std::string exe = REFIT_CLI_PATH;
  std::ostringstream sh;
  sh << "cd " << dir.path() << " && export MASTER_ADDR=127.0.0.1 REFIT_PORT=" << port << "; "
     << host(0) << "RANK=0 WORLD_SIZE=2 " << exe << " trainer " << trainer_cfg << " --steps "
     << steps << " --verify > t0.log 2>&1 & p0=$!; " << host(1) << "RANK=1 WORLD_SIZE=2 " << exe
     << " trainer " << trainer_cfg << " --steps " << steps << " --verify > t1.log 2>&1 & p1=$!; "
     << host(2) << "ENGINE_RANK=0 " << exe << " engine " << engine_cfg << " > e0.log 2>&1 & p2=$!; "
     << host(3) << "ENGINE_RANK=1 " << exe << " engine " << engine_cfg << " > e1.log 2>&1 & p3=$!; "
     << "for p in $p0 $p1 $p2 $p3; do wait $p; echo $? >> codes; done; "
     << "cat t0.log t1.log e0.log e1.log";
  const std::string cmd =
      "timeout -k 5 120 bash -c '" + sh.str() + "' > " + dir.path() + "/all.log 2>&1";
  const int rc = std::system(cmd.c_str());
  (void)rc;
  std::ifstream all(dir.path() + "/all.log");
  std::stringstream ss;
  ss << all.rdbuf();
  *output = ss.str();
  std::vector<int> codes;
  std::ifstream in(dir.path() + "/codes");
  for (int c; in >> c;) codes.push_back(c);
  return codes;
}

TEST(SeparateLaunch, TorchrunStyleRanks) {
  TempDir dir;
  Cell c{.engine = "vllm"};
  const std::string cfg = dir.write("c.yaml", config_yaml(c));
  std::string out;
  auto codes = launch_separately(cfg, cfg, dir, &out);
  EXPECT_EQ(codes, (std::vector<int>{0, 0, 0, 0})) << out;
  EXPECT_NE(out.find("verified bit-exact"), std::string::npos) << out;
}

// Two "hosts" (REFIT_HOST_ID): trainer rank r and engine TP rank r on host r. Executor auto uses
// peer access within a host and point-to-point across: one run, both executors.
TEST(SeparateLaunch, AutoMixesPeerAndP2pAcrossHosts) {
  TempDir dir;
  Cell c{.engine = "vllm", .buffer = 8192};
  const std::string cfg = dir.write("c.yaml", config_yaml(c));
  std::string out;
  auto codes = launch_separately(cfg, cfg, dir, &out, {"host-a", "host-b", "host-a", "host-b"});
  EXPECT_EQ(codes, (std::vector<int>{0, 0, 0, 0})) << out;
  EXPECT_NE(out.find("verified bit-exact"), std::string::npos) << out;
  EXPECT_NE(out.find("pairs by executor: peer 2, p2p 2"), std::string::npos) << out;
}

TEST(SeparateLaunch, PeerAcrossHostsIsRefused) {
  TempDir dir;
  Cell c{.timeout_s = 5, .executor = "peer"};
  const std::string cfg = dir.write("c.yaml", config_yaml(c));
  std::string out;
  auto codes = launch_separately(cfg, cfg, dir, &out, {"host-a", "host-b", "host-a", "host-b"});
  ASSERT_EQ(codes.size(), 4u) << out;
  for (int code : codes) EXPECT_NE(code, 0) << out;
  EXPECT_NE(out.find("are on different hosts, so peer access is impossible"), std::string::npos)
      << out;
  EXPECT_EQ(out.find("step 1/2"), std::string::npos) << "refused at setup, before any refit:\n"
                                                     << out;
}

// Ranks launched with configs that differ in a setting every rank must share are refused at
// setup (runtime/agreement.h), naming the key and both values — under either protocol, before
// any group forms or refit starts, and on every rank.
void expect_settings_refused(const Cell& trainer, const Cell& engine,
                             const std::vector<std::string>& words) {
  TempDir dir;
  const std::string trainer_cfg = dir.write("t.yaml", config_yaml(trainer));
  const std::string engine_cfg = dir.write("e.yaml", config_yaml(engine));
  std::string out;
  auto codes = launch_separately(trainer_cfg, engine_cfg, dir, &out);
  ASSERT_EQ(codes.size(), 4u) << out;
  for (int code : codes) EXPECT_NE(code, 0) << out;
  EXPECT_NE(std::find(codes.begin(), codes.end(), 2), codes.end()) << "a setup error exits 2\n"
                                                                   << out;
  for (const std::string& w : words) EXPECT_NE(out.find(w), std::string::npos) << w << "\n" << out;
  EXPECT_EQ(out.find("step 1/2"), std::string::npos) << "no refit may start:\n" << out;
}
TEST(SeparateLaunch, SglangBufferSizeMismatchIsRefusedNamingTheKey) {
  expect_settings_refused({.buffer = 4096, .timeout_s = 10, .executor = "p2p"},
                          {.buffer = 1 << 15, .timeout_s = 10, .executor = "p2p"},
                          {"disagree on refit.buffer_size_bytes: trainer rank 0 has 4096, engine 0 "
                           "tp rank ",
                           " has 32768"});
}
TEST(SeparateLaunch, VllmEngineCountMismatchIsRefusedNamingTheKey) {
  expect_settings_refused({.engine = "vllm", .timeout_s = 10},
                          {.engine = "vllm", .num_engines = 2, .timeout_s = 10},
                          {"disagree on generation.num_engines: trainer rank 0 has 1", " has 2"});
}
TEST(SeparateLaunch, TransferModeMismatchIsRefusedNamingTheKey) {
  expect_settings_refused({.timeout_s = 10, .executor = "gather"},
                          {.timeout_s = 10, .executor = "p2p"},
                          {"disagree on refit.executor: trainer rank 0 has gather", " has p2p"});
}

// Hostile neighbours during an authenticated run (REFIT_SECRET on every rank):
//  - a process without the secret cannot reach the store: its handshake is refused, so it can
//    neither read the mailbox addresses nor write a failure into the store;
//  - a process with the wrong secret is told so;
//  - messages sent straight to the ranks' mailboxes (their addresses read here as an insider
//    would) are dropped and logged: garbage over a plain socket never completes the handshake,
//    and forged begin / commit / paused / committed / verified messages over a CURVE socket that
//    knows the server key but not the real senders' keys are dropped as "sent with another
//    sender's key" or as malformed.
// The run completes and verifies. It must outlast the attack (the store's handshakes, then the
// forged messages round after round until the ranks' logs show them dropped, at most 60 rounds);
// a refit of this model takes about a millisecond, so an attempt whose run ended first is made
// again with ten times the refits (at most three attempts).
struct AttackOutcome {
  bool outlasted = false;  // the run was still going when the attack was done
  int rounds = 0;
  bool plain_refused = false, wrong_refused = false;
  std::string wrong_error;
  std::vector<int> codes;
  std::string out;
};

const std::vector<std::string>& attack_drops() {
  static const std::vector<std::string> drops = {
      "dropped a begin message claiming to come from 'trainer/0'",
      "dropped a paused message claiming to come from 'engine/0'",
      "it was sent with another sender's key", "dropped a malformed message"};
  return drops;
}

AttackOutcome attack_a_run(int steps) {
  AttackOutcome o;
  TempDir dir;
  Cell c{.engine = "vllm", .timeout_s = 20};
  const std::string cfg = dir.write("c.yaml", config_yaml(c));
  const std::string secret = "attack-test-secret-0123456789abcdef";
  std::atomic<bool> run_ended{false};
  std::thread run([&] {
    o.codes = launch_separately(cfg, cfg, dir, &o.out, {}, "REFIT_SECRET=" + secret + " ", steps);
    run_ended = true;
  });
  const int port = separate_launch_port();
  auto auth = ControlAuth::from_secret(secret);
  auto insider = connect_store("127.0.0.1", port, std::chrono::seconds(30),
                               std::make_shared<const ControlAuth>(*auth));
  std::optional<std::string> engine_box, trainer_box;
  if (insider.ok()) {
    auto e = (*insider)->get("mailbox/engine/0", std::chrono::seconds(30));
    auto t = (*insider)->get("mailbox/trainer/0", std::chrono::seconds(30));
    if (e.ok() && t.ok()) engine_box = *e, trainer_box = *t;
  }
  if (!engine_box) {
    run.join();
    o.out += "\ninsider: " + insider.status().to_string();
    return o;
  }

  // Without the secret, and with another one.
  o.plain_refused =
      !connect_store("127.0.0.1", port, std::chrono::milliseconds(1500), nullptr).ok();
  auto other = ControlAuth::from_secret("another-secret-0123456789abcdef");
  auto wrong = connect_store("127.0.0.1", port, std::chrono::milliseconds(3000),
                             std::make_shared<const ControlAuth>(*other));
  o.wrong_refused = !wrong.ok();
  o.wrong_error = wrong.status().to_string();

  zmq::context_t ctx;
  auto push = [&](const std::string& address, bool curve) {
    zmq::socket_t s(ctx, zmq::socket_type::push);
    s.set(zmq::sockopt::linger, 0);
    s.set(zmq::sockopt::sndtimeo, 2000);
    if (curve) {
      const auto [pub, sec] = curve_keypair();  // a stranger's key
      s.set(zmq::sockopt::curve_serverkey, auth->server_public());
      s.set(zmq::sockopt::curve_publickey, pub);
      s.set(zmq::sockopt::curve_secretkey, sec);
    }
    s.connect(address);
    return s;
  };
  auto send = [](zmq::socket_t& s, MessageType t, const std::string& from, const std::string& p) {
    const std::array<std::uint8_t, 5> head{static_cast<std::uint8_t>(t), 0, 0, 0, 0};  // epoch 0
    std::array<zmq::const_buffer, 3> parts{zmq::const_buffer(head.data(), head.size()),
                                           zmq::buffer(from), zmq::buffer(p)};
    (void)zmq::send_multipart(s, parts, zmq::send_flags::dontwait);
  };
  // Whether the four ranks' logs so far (t0.log, t1.log, e0.log and e1.log in `dir`) show every
  // drop.
  auto all_dropped = [&] {
    std::string text;
    for (const char* name : {"t0.log", "t1.log", "e0.log", "e1.log"}) {
      std::ifstream in(dir.path() + "/" + name);
      std::stringstream ss;
      ss << in.rdbuf();
      text += ss.str();
    }
    return std::all_of(attack_drops().begin(), attack_drops().end(),
                       [&](const std::string& d) { return text.find(d) != std::string::npos; });
  };
  zmq::socket_t plain_push = push(*engine_box, false);
  send(plain_push, MessageType::kBegin, "trainer/0",
       encode(BeginMessage{.step = 1, .version = "evil-v99"}));
  zmq::socket_t to_engine = push(*engine_box, true);
  zmq::socket_t to_trainer = push(*trainer_box, true);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // CURVE handshakes
  const std::string garbage(64 << 10, '\xA5');
  bool dropped = false;
  for (; o.rounds < 60 && !run_ended && !(dropped = all_dropped()); ++o.rounds) {
    send(to_engine, MessageType::kBegin, "trainer/0",
         encode(BeginMessage{.step = 99, .version = "evil-v99"}));
    send(to_engine, MessageType::kCommit, "trainer/0", encode(CommitMessage{.step = 99}));
    send(to_trainer, MessageType::kPaused, "engine/0", garbage);
    send(to_trainer, MessageType::kCommitted, "engine/0", encode(CommittedMessage{}));
    send(to_trainer, MessageType::kVerified, "engine/1", "{\"verified\": true}");
    zmq::message_t one(garbage.data(), 100);
    (void)to_engine.send(one, zmq::send_flags::dontwait);  // one frame: malformed
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  o.outlasted = dropped && !run_ended;
  run.join();
  return o;
}

TEST(Attack, ForeignProcessesCannotReachOrForgeTheControlPlane) {
  AttackOutcome o;
  int steps = 300;
  for (int attempt = 0; attempt < 3 && !o.outlasted; ++attempt, steps *= 10)
    o = attack_a_run(steps);
  ASSERT_TRUE(o.outlasted) << "the last run (" << steps / 10 << " refits) ended before the attack "
                           << "was done (" << o.rounds << " round(s) of forged messages)\n"
                           << o.out;
  EXPECT_TRUE(o.plain_refused);
  ASSERT_TRUE(o.wrong_refused);
  EXPECT_NE(o.wrong_error.find("refused this process's handshake"), std::string::npos)
      << o.wrong_error;
  EXPECT_EQ(o.codes, (std::vector<int>{0, 0, 0, 0})) << o.out;
  EXPECT_NE(o.out.find("verified bit-exact"), std::string::npos) << o.out;
  EXPECT_EQ(o.out.find("evil-v99"), std::string::npos) << o.out;
  for (const std::string& d : attack_drops())
    EXPECT_NE(o.out.find(d), std::string::npos) << d << "\n" << o.out;
}

}  // namespace
}  // namespace refit
