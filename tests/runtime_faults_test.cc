// Faults across real processes: corrupted buckets, rounds and parameters caught and named; killed
// and stopped ranks of every role noticed and named by every other rank (the fault matrix); and
// what `refit run` leaves behind (nothing: processes, shared-memory segments, its directory) when
// a rank dies, on SIGTERM, and past its overall deadline.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace refit {
namespace {

using testing::count_of;
using testing::run_cli;
using testing::TempDir;
using Cell = testing::RunConfig;
using testing::config_yaml;

testing::CliResult run_cell(const Cell& c,
                            std::vector<std::string> extra = {"--steps", "2", "--verify"}) {
  return testing::run_config(c, extra);
}

TEST(RuntimeFaults, CorruptBucketFailsAndNamesTheTensor) {
  auto r = run_cell({}, {"--steps", "1", "--verify", "--fault", "corrupt:1"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verify:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("tensor model."), std::string::npos) << r.output;
}

TEST(RuntimeFaults, CorruptBucketIpc) {
  auto r = run_cell({.colocated = true}, {"--steps", "1", "--verify", "--fault", "corrupt:0"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verify:"), std::string::npos) << r.output;
}
TEST(RuntimeZeroCopy, CorruptionIsCaught) {
  auto r = run_cell({.colocated = true, .world_size = 1, .tp = 1},
                    {"--steps", "1", "--verify", "--fault", "corrupt:3"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verify:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("written in place"), std::string::npos) << "zero-copy path not taken\n"
                                                                  << r.output;
}

TEST(RuntimeGather, CorruptBucketFailsAndNamesTheTensor) {
  auto r = run_cell({.executor = "gather"}, {"--steps", "1", "--verify", "--fault", "corrupt:1"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tensor model."), std::string::npos) << r.output;
}

void expect_dies_cleanly(const Cell& c, const std::string& fault, const std::string& culprit) {
  auto start = std::chrono::steady_clock::now();
  auto r = run_cell(c, {"--steps", "2", "--fault", fault});
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // run_cli returns only after every process that shares its output pipe exited (exit 124 if
  // any was still running after its own timeout).
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "processes left running:\n" << r.output;
  EXPECT_LT(secs, c.timeout_s + 15) << r.output;
  EXPECT_NE(r.output.find(culprit + " was killed by signal 9"), std::string::npos) << r.output;
  // The survivors name it as a process that is gone, at once, not from its silence: from the
  // launcher's record of the signal, or from its closed connection, whichever reached the store
  // first (the first failure is recorded once).
  const bool by_launcher =
      r.output.find(culprit + ": aborted: the process was killed by signal 9") != std::string::npos;
  const bool by_connection =
      r.output.find(culprit + ": aborted: exited: its connection to the control plane closed "
                              "without leaving") != std::string::npos;
  EXPECT_TRUE(by_launcher || by_connection) << r.output;
  EXPECT_EQ(r.output.find("no heartbeat for"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("exited with code 0"), std::string::npos)
      << "every rank must exit non-zero:\n"
      << r.output;
}

TEST(RuntimeFaults, KilledEngineRank) {
  expect_dies_cleanly({.timeout_s = 5}, "kill-engine:1:2", "engine 0 tp rank 1");
}
TEST(RuntimeFaults, KilledTrainerRank) {
  expect_dies_cleanly({.timeout_s = 5}, "kill-trainer:1:2", "trainer rank 1");
}
// The relays (docs/protocol.md, "Relays") die like any rank: the ranks they relay for learn it
// from the heartbeat watch and name the relay, not a silence.
TEST(RuntimeFaults, KilledEngineRelay) {
  expect_dies_cleanly({.timeout_s = 5}, "kill-engine:0:2", "engine 0 tp rank 0");
}
TEST(RuntimeFaults, KilledTrainerRelay) {
  // 4 trainer ranks form groups {0, 1} and {2, 3}: trainer rank 2 relays for trainer rank 3.
  expect_dies_cleanly({.world_size = 4, .num_engines = 2, .timeout_s = 5}, "kill-trainer:2:2",
                      "trainer rank 2");
}
TEST(RuntimeFaults, KilledEngineRankIpc) {
  expect_dies_cleanly({.colocated = true, .timeout_s = 5}, "kill-engine:0:1", "engine 0 tp rank 0");
}

// A rank that dies without a word is noticed through the control plane's liveness checks long
// before the (here deliberately long) timeout.
TEST(RuntimeFaults, KilledTrainerRankIpcIsNoticedWellBeforeTheTimeout) {
  auto start = std::chrono::steady_clock::now();
  auto r = run_cell({.colocated = true, .timeout_s = 60},
                    {"--steps", "2", "--fault", "kill-trainer:0:1"});
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(secs, 20) << r.output;
  EXPECT_NE(r.output.find("trainer rank 0 was killed by signal 9"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("exited with code 0"), std::string::npos) << r.output;
}

// A stopped (SIGSTOP) rank keeps its sockets open, so nothing but its silence gives it away: its
// heartbeat stands still, every other rank ends naming it (runtime/failure.h), and the launcher
// kills it once every other rank has exited. The timeout is long on purpose: the message says
// the heartbeat check, not the timeout, ended the run.
void expect_stopped_rank_named(const Cell& c, const std::string& fault, const std::string& culprit,
                               const std::string& how) {
  auto r = run_cell(c, {"--steps", "2", "--fault", fault});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "processes left running:\n" << r.output;
  EXPECT_NE(r.output.find("fault injection: stopping myself"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(culprit + how), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("killed, stopped (SIGSTOP) after every other rank exited: " + culprit),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("did not complete within"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("exited with code 0"), std::string::npos) << r.output;
}
TEST(RuntimeFaults, StoppedTrainerRankIsNamedByItsHeartbeat) {
  expect_stopped_rank_named({.timeout_s = 120}, "stop-trainer:1:0", "trainer rank 1",
                            ": aborted: stopped: no heartbeat for");
}
TEST(RuntimeFaults, StoppedEngineRankIsNamedByItsHeartbeat) {
  expect_stopped_rank_named({.buffer = 4096, .timeout_s = 120, .executor = "p2p"},
                            "stop-engine:1:1", "engine 0 tp rank 1",
                            ": aborted: stopped: no heartbeat for");
}
TEST(RuntimeFaults, StoppedStoreHostIsNamed) {
  expect_stopped_rank_named({.timeout_s = 120}, "stop-trainer:0:0", "trainer rank 0",
                            ": the store it hosts did not answer for 5.0 s");
}

// Faults on the transfer plan: a corrupted round is caught and named; a killed rank ends the run.
TEST(RuntimeP2p, CorruptRoundFailsAndNamesTheTensor) {
  auto r = run_cell({.buffer = 4096, .executor = "p2p"},
                    {"--steps", "1", "--verify", "--fault", "corrupt:2"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("corrupting round 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("verify:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("tensor model."), std::string::npos) << r.output;
}
TEST(RuntimeP2p, KilledEngineRank) {
  expect_dies_cleanly({.buffer = 4096, .executor = "p2p"}, "kill-engine:1:3", "engine 0 tp rank 1");
}
TEST(RuntimeP2p, KilledTrainerRank) {
  expect_dies_cleanly({.buffer = 4096, .executor = "p2p"}, "kill-trainer:1:2", "trainer rank 1");
}
TEST(RuntimePeer, KilledEngineRank) {
  expect_dies_cleanly({.executor = "peer"}, "kill-engine:0:0", "engine 0 tp rank 0");
}
TEST(RuntimePeer, KilledTrainerRank) {
  expect_dies_cleanly({.executor = "peer"}, "kill-trainer:1:0", "trainer rank 1");
}

// `refit run` has an overall deadline: a run that outlasts it (here 100000 refits in 8 s) is
// ended, every rank killed and reaped, and the reason given.
TEST(RuntimeCleanup, TheLauncherHasAnOverallDeadline) {
  auto r = run_cell({.timeout_s = 20}, {"--steps", "100000", "--deadline", "8"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("the run passed its overall deadline of 8 s (refit run --deadline); "
                          "killed: trainer rank 0, trainer rank 1, engine 0 tp rank 0, engine 0 "
                          "tp rank 1"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("step 1/100000"), std::string::npos) << r.output;
}

// What a run leaves in /dev/shm (segments named after REFIT_RUN_ID), and the processes that still
// carry that run id in their environment.
std::vector<std::string> segments_of(const std::string& run_id) {
  std::vector<std::string> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/dev/shm", ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("refit-" + run_id + "-", 0) == 0) out.push_back(name);
  }
  return out;
}
int processes_of(const std::string& run_id) {
  int n = 0;
  std::error_code ec;
  const std::string needle = "REFIT_RUN_ID=" + run_id + '\0';
  for (std::filesystem::directory_iterator it("/proc", ec), end; !ec && it != end;
       it.increment(ec)) {
    std::ifstream env(it->path() / "environ", std::ios::binary);
    std::stringstream ss;
    ss << env.rdbuf();
    if ((ss.str() + '\0').find(needle) != std::string::npos) ++n;
  }
  return n;
}

// The fault matrix: SIGKILL and SIGSTOP of every role — trainer rank 0 (the store's host),
// another trainer rank, an engine rank — at setup, mid-transfer (round 1 of 4 KiB rounds) and at
// the commit. Every process exits within the documented bound (5.5 s of silence, then teardown;
// the timeout is a minute, so it is not what ended the run), the launcher names the rank, nothing
// of the run is left (processes, segments, its directory), and no surviving engine rank ends with
// a new version: the previous one ("0") or none (invalid). Checksums are on, so an engine rank
// publishes only on the trainer ranks' agreed outcome.
struct MatrixCase {
  std::string fault;    // kill-trainer:0:setup ...
  std::string culprit;  // "trainer rank 0"
};
std::vector<MatrixCase> fault_matrix() {
  std::vector<MatrixCase> cases;
  const std::pair<std::string, std::string> roles[] = {{"trainer:0", "trainer rank 0"},
                                                       {"trainer:1", "trainer rank 1"},
                                                       {"engine:1", "engine 0 tp rank 1"}};
  for (const char* how : {"kill", "stop"})
    for (const auto& [role, culprit] : roles)
      for (const char* at : {"setup", "1", "commit"})
        cases.push_back({fmt::format("{}-{}:{}", how, role, at), culprit});
  return cases;
}
void PrintTo(const MatrixCase& m, std::ostream* os) { *os << m.fault; }
class FaultMatrix : public ::testing::TestWithParam<MatrixCase> {};
TEST_P(FaultMatrix, EveryRankExitsNamingItAndNothingIsLeft) {
  const MatrixCase& m = GetParam();
  const bool stop = m.fault.rfind("stop", 0) == 0;
  TempDir tmp;
  const std::string id = fmt::format("matrix-{}", getpid());
  setenv("REFIT_RUN_ID", id.c_str(), 1);
  setenv("TMPDIR", tmp.path().c_str(), 1);
  const auto start = std::chrono::steady_clock::now();
  auto r = run_cell({.buffer = 4096, .timeout_s = 60, .executor = "p2p", .checksum = true},
                    {"--steps", "2", "--fault", m.fault});
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  unsetenv("REFIT_RUN_ID");
  unsetenv("TMPDIR");
  SCOPED_TRACE(m.fault + "\n" + r.output);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.exit_code, 124) << "processes left running";
  EXPECT_LT(secs, 30);
  const std::string at = m.fault.substr(m.fault.rfind(':') + 1);
  EXPECT_NE(
      r.output.find(fmt::format("fault injection: {} myself at {}", stop ? "stopping" : "killing",
                                at == "1"        ? "round 1"
                                : at == "commit" ? "the commit"
                                                 : at)),
      std::string::npos)
      << "the fault did not fire where it names";
  const std::string named =
      stop ? "killed, stopped (SIGSTOP) after every other rank exited: " + m.culprit
           : m.culprit + " was killed by signal 9";
  EXPECT_NE(r.output.find(named), std::string::npos) << "the launcher did not name the rank";
  EXPECT_EQ(r.output.find("exited with code 0"), std::string::npos) << "every rank must fail";
  EXPECT_TRUE(segments_of(id).empty());
  EXPECT_EQ(processes_of(id), 0) << "a rank outlived the launcher";
  EXPECT_TRUE(std::filesystem::is_empty(tmp.path())) << "the run's directory was left behind";
  // Survivors' weights: the previous version or none, never step 1's label.
  const std::string ended = "the session ended with weight version '";
  for (size_t p = r.output.find(ended); p != std::string::npos; p = r.output.find(ended, p + 1)) {
    const std::string version =
        r.output.substr(p + ended.size(), r.output.find('\'', p + ended.size()) - p - ended.size());
    EXPECT_TRUE(version == "0" || version.empty())
        << "an engine rank ended with version " << version;
  }
  if (at == "commit" && m.culprit != "engine 0 tp rank 1") {
    EXPECT_EQ(count_of(r.output, ended + "' (invalid: generation stays paused)"), 2u)
        << "both engine ranks had bytes of step 1 and must end invalid";
  }
}
INSTANTIATE_TEST_SUITE_P(RuntimeFaults, FaultMatrix, ::testing::ValuesIn(fault_matrix()),
                         [](const ::testing::TestParamInfo<MatrixCase>& info) {
                           std::string name = info.param.fault;
                           for (char& c : name)
                             if (c == ':' || c == '-') c = '_';
                           return name;
                         });

// A rank killed before it unlinked its segment (the engine's exported parameters on the
// zero-copy path) leaks nothing: `refit run` removes what the run left and says so.
TEST(RuntimeCleanup, KilledRankLeavesNoSegments) {
  const std::string id = fmt::format("leak-{}", getpid());
  setenv("REFIT_RUN_ID", id.c_str(), 1);
  auto r = run_cell({.colocated = true, .world_size = 1, .tp = 1, .timeout_s = 10},
                    {"--steps", "2", "--fault", "kill-engine:0:0"});
  unsetenv("REFIT_RUN_ID");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("fault injection: killing myself"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("shared-memory segment(s) /dev/shm/refit-" + id), std::string::npos)
      << "nothing was left to remove, so the test did not exercise the sweep\n"
      << r.output;
  EXPECT_TRUE(segments_of(id).empty()) << segments_of(id).front();
}

// SIGTERM (or SIGINT) to `refit run`: every rank stops, the run's segments and its temporary
// directory go, and the launcher dies of the signal.
TEST(RuntimeCleanup, SigtermStopsEveryRankAndRemovesSegments) {
  TempDir dir;
  const std::string id = fmt::format("term-{}", getpid());
  const std::string cfg = dir.write(
      "c.yaml", config_yaml({.colocated = true, .world_size = 1, .tp = 1, .timeout_s = 30}));
  // `timeout` sends SIGTERM after 5 s, mid-run (100000 refits take far longer).
  const std::string cmd = fmt::format(
      "REFIT_RUN_ID={} timeout -s TERM 5 {} run {} --steps 100000 > {}/run.log 2>&1; echo $? > "
      "{}/rc",
      id, REFIT_CLI_PATH, cfg, dir.path(), dir.path());
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  std::ifstream rc(dir.path() + "/rc"), log(dir.path() + "/run.log");
  int code = 0;
  rc >> code;
  std::stringstream out;
  out << log.rdbuf();
  EXPECT_EQ(code, 124) << "timeout(1) reports that its SIGTERM ended the run\n" << out.str();
  EXPECT_NE(out.str().find("interrupted by signal 15"), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("step 1/100000"), std::string::npos) << "the run never started\n"
                                                                << out.str();
  EXPECT_TRUE(segments_of(id).empty()) << segments_of(id).front();
  EXPECT_EQ(processes_of(id), 0) << "a rank outlived the launcher";
}

}  // namespace
}  // namespace refit
