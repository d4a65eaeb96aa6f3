// Refits that fail without ending the session, across real processes (docs/runtime.md): at their
// end (refit.checksum mismatch, failed verification, with and without refit.keep_previous), before
// any byte moved (a pause hook that fails or outlasts refit.timeout_s), and in flight with every
// rank alive (a stalled trainer or engine rank); and the rollback when the session ends mid-refit.
#include <fmt/format.h>
#include <gtest/gtest.h>

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

// refit.checksum and recovery (docs/runtime.md, "A refit that fails at its end"): a corrupted
// round or parameter is caught by the checksum at the commit, the engines do not publish, and the
// next refits of the same session (the same processes) succeed and verify.
void expect_recovers(const Cell& c, const std::string& fault, int failed_step,
                     const std::string& cause) {
  auto r = run_cell(c, {"--steps", "3", "--verify", "--fault", fault});
  SCOPED_TRACE(r.output);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find(cause), std::string::npos);
  EXPECT_NE(r.output.find(
                fmt::format("1 of 3 refit(s) failed (steps {}); the session went on", failed_step)),
            std::string::npos);
  // The other steps ran in the same session and were verified; no rank ended (engines exit 0).
  for (int step = 1; step <= 3; ++step) {
    EXPECT_EQ(r.output.find(fmt::format("step {}/3: refit failed", step)) != std::string::npos,
              step == failed_step)
        << "step " << step;
    EXPECT_EQ(count_of(r.output, fmt::format("step {}/3: refit ", step)), 1u) << "step " << step;
  }
  EXPECT_EQ(count_of(r.output, ", verified\n"), 2u);
  EXPECT_EQ(count_of(r.output, "exited with code 0"), static_cast<size_t>(c.num_engines * c.tp));
  if (c.keep_previous) {
    EXPECT_EQ(count_of(r.output, "(refit.keep_previous) and resumed generation"),
              static_cast<size_t>(c.num_engines * c.tp));
    EXPECT_EQ(count_of(r.output, "weights kept after the failed refit (version"),
              static_cast<size_t>(c.num_engines * c.tp));
  } else {
    // Every engine rank discards the refit, also those whose own bytes were intact: the ranks of
    // one engine never hold two versions.
    EXPECT_EQ(count_of(r.output, "the weights are invalid and generation stays paused"),
              static_cast<size_t>(c.num_engines * c.tp));
  }
}

TEST(RuntimeChecksum, PassingRunsSayTheChecksumsMatched) {
  for (const Cell& c : {Cell{.checksum = true}, Cell{.executor = "p2p", .checksum = true},
                        Cell{.engine = "vllm", .colocated = true, .checksum = true},
                        Cell{.model = "tiny-qwen2",
                        .world_size = 3,
                        .num_engines = 2,
                        .buffer = 4096,
                        .checksum = true}}) {
    auto r = run_cell(c, {"--steps", "2", "--verify"});
    SCOPED_TRACE(r.output);
    EXPECT_EQ(r.exit_code, 0);
    EXPECT_EQ(count_of(r.output, "refit.checksum: step 1 arrived intact"),
              static_cast<size_t>(c.num_engines * c.tp));
  }
}
TEST(RuntimeChecksum, RejectedWithGather) {
  auto r = run_cell({.executor = "gather", .checksum = true}, {"--steps", "1"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("refit.checksum"), std::string::npos) << r.output;
}
TEST(RuntimeRecovery, ChecksumMismatchPeerThenRecovers) {
  // Without --verify the checksum alone catches it.
  auto r = run_cell({.checksum = true}, {"--steps", "3", "--fault", "corrupt:1"});
  SCOPED_TRACE(r.output);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("checksum mismatch in refit step 1"), std::string::npos);
  EXPECT_NE(r.output.find("step 3/3: refit "), std::string::npos);
  EXPECT_NE(r.output.find("written in place"), std::string::npos) << "peer path not taken";
}
TEST(RuntimeRecovery, ChecksumMismatchP2pThenRecovers) {
  expect_recovers({.executor = "p2p", .checksum = true}, "corrupt:1", 1,
                  "checksum mismatch in refit step 1");
}
// Trainer rank 0 compares each engine rank's sums of its feeders' checksums with the sums the
// feeders sent, added up on the way by the trainer relays (5 trainer ranks: groups {0, 1, 2} and
// {3, 4}, trainer rank 3 relaying); no per-pair checksum travels, and the weighted sums still name
// the pair (common/pair_sums.h).
TEST(RuntimeRecovery, ChecksumMismatchThroughTrainerRelaysNamesThePair) {
  expect_recovers({.world_size = 5, .num_engines = 2, .checksum = true}, "corrupt:1", 1,
                  "checksum mismatch in refit step 1: the bytes trainer rank 2 sent did not "
                  "arrive as sent");
}
TEST(RuntimeRecovery, FailedVerificationThenRecovers) {
  // The verification hook's failure is the refit's, not the session's.
  expect_recovers({.engine = "vllm"}, "corrupt:2:2", 2, "verify: engine 0 tp rank");
}
TEST(RuntimeRecovery, KeepPreviousRollsBackBitExact) {
  // Step 2 fails: every engine rank restores step 1's bytes and label (verified bit-exact).
  expect_recovers({.checksum = true, .keep_previous = true}, "corrupt:1:2", 2,
                  "checksum mismatch in refit step 2");
  expect_recovers(
      {.engine = "vllm", .colocated = true, .world_size = 1, .tp = 1, .keep_previous = true},
      "corrupt:0:2", 2, "verify: engine 0 tp rank 0");
  // Only engine rank 0's bytes are corrupted: rank 1 verified step 2 and must still roll back
  // (with the others), to step 1's bytes.
  expect_recovers({.engine = "vllm",
                   .colocated = true,
                   .buffer = 4096,
                   .checksum = true,
                   .keep_previous = true},
                  "corrupt:0:2", 2, "checksum mismatch in refit step 2");
}

// A refit an engine rank refuses (its pause hook fails, or outlasts refit.timeout_s) is aborted by
// every trainer rank before any byte moves: every engine rank keeps the previous version (valid,
// verified bit-exact against it), the ranks whose pause succeeded resume generation, and the
// session's next refits publish and verify.
void expect_aborted_then_recovers(const Cell& c, const std::string& fault, int failed_step,
                                  const std::string& cause) {
  auto r = run_cell(c, {"--steps", "3", "--verify", "--fault", fault});
  SCOPED_TRACE(r.output);
  const auto ranks = static_cast<size_t>(c.num_engines * c.tp);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find(cause), std::string::npos);
  EXPECT_NE(r.output.find(
                fmt::format("1 of 3 refit(s) failed (steps {}); the session went on", failed_step)),
            std::string::npos);
  EXPECT_EQ(count_of(r.output, ", verified\n"), 2u);
  EXPECT_EQ(count_of(r.output, "exited with code 0"), ranks);
  EXPECT_EQ(
      count_of(r.output, fmt::format("refit step {} aborted before any byte moved", failed_step)),
      static_cast<size_t>(c.world_size));
  EXPECT_EQ(count_of(r.output, fmt::format("refit step {} was aborted before any byte landed; "
                                           "weight version '",
                                           failed_step)),
            ranks);
  EXPECT_EQ(count_of(r.output, "weights kept after the failed refit (version"), ranks);
  // Nothing landed: no rank went invalid or rolled back.
  EXPECT_EQ(count_of(r.output, "the weights are invalid"), 0u);
}

TEST(RuntimeRecovery, FailedPauseHookAbortsBeforeAnyByteThenRecovers) {
  const std::string cause =
      "the pause hook failed, so refit step 2 was aborted before any "
      "parameter changed: fault injection";
  // Point-to-point; the refusing rank is the second of one engine.
  expect_aborted_then_recovers({}, "fail-pause:1:2", 2, "engine 0 tp rank 1 reported: " + cause);
  // Peer access (written in place): feeders that commit early cannot overtake the abort.
  expect_aborted_then_recovers({.colocated = true}, "fail-pause:0:2", 2,
                               "engine 0 tp rank 0 reported: " + cause);
  // Three trainer ranks feeding two engines: every trainer rank agrees through the store.
  expect_aborted_then_recovers(
      {.model = "tiny-qwen2", .world_size = 3, .num_engines = 2, .buffer = 4096}, "fail-pause:3:2",
      2, "engine 1 tp rank 1 reported: " + cause);
}

// The other trainer ranks return a refused refit only once trainer rank 0 heard every engine
// rank's abort-heard (its refit-done): were one late, the refit would fail in flight on every
// trainer rank alike, not end as aborted on some and in flight on trainer rank 0.
TEST(RuntimeRecovery, OtherTrainerRanksReturnAnAbortOnceEveryEngineRankHeardIt) {
  setenv("REFIT_LOG", "debug", 1);
  auto r = run_cell({.model = "tiny-qwen2", .world_size = 3, .num_engines = 2, .buffer = 4096},
                    {"--steps", "3", "--verify", "--fault", "fail-pause:3:2"});
  unsetenv("REFIT_LOG");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(count_of(r.output, ", verified\n"), 2u) << r.output;
  EXPECT_EQ(count_of(r.output, "every engine rank heard the abort of refit step 2"), 2u)
      << r.output;
}

TEST(RuntimeRecovery, PauseHookOutlastingTheTimeoutAbortsThenRecovers) {
  // The hook takes 4.5 s against a timeout of 3 s: the engine rank refuses the refit (the same to
  // every feeder, which wait longer), resumes, and the next step runs in the same session.
  expect_aborted_then_recovers({.timeout_s = 3}, "slow-pause:0:1", 1,
                               "engine 0 tp rank 0 reported: the pause hook took 4.");
  expect_aborted_then_recovers({.timeout_s = 3}, "slow-pause:1:2", 2,
                               "longer than refit.timeout_s (3 s), so refit step 2 was aborted "
                               "before any parameter changed");
}

TEST(RuntimeRecovery, FailedPauseHookWithGatherIsRejected) {
  auto r = run_cell({.executor = "gather"}, {"--steps", "1", "--fault", "fail-pause:0"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("a refused refit needs the transfer plan"), std::string::npos)
      << r.output;
}

// A refit that fails in flight with every rank alive (docs/runtime.md, "A refit that fails in
// flight"): a trainer or engine rank stalls for 2.5 x refit.timeout_s (its heartbeat goes on) in
// step 2. A rank that times out records the refit's failure; every rank sees it, fails the refit
// with that cause, forms its groups anew (epoch 1), and step 3 of the same session verifies.
struct InFlight {
  Cell cell;
  std::string fault;
  bool verify = true;
  // What every engine rank logs about its weights after the failure (`engine_says_on` of them,
  // -1: every one).
  std::string engine_says;
  int engine_says_on = -1;
};

void expect_fails_in_flight_then_recovers(const InFlight& t) {
  std::vector<std::string> args{"--steps", "3", "--fault", t.fault};
  if (t.verify) args.push_back("--verify");
  auto r = run_cell(t.cell, args);
  SCOPED_TRACE(r.output);
  const auto engines = static_cast<size_t>(t.cell.num_engines * t.cell.tp);
  const auto trainers = static_cast<size_t>(t.cell.world_size);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(count_of(r.output, "fault injection: the stall ended"), 1u);
  EXPECT_NE(r.output.find("1 of 3 refit(s) failed (steps 2); the session went on"),
            std::string::npos);
  EXPECT_NE(r.output.find("refit step 2 (version 'step-2') failed in flight: "), std::string::npos);
  EXPECT_EQ(count_of(r.output, "step 3/3: refit "), 1u);
  EXPECT_EQ(count_of(r.output, "step 3/3: refit failed"), 0u);
  if (t.verify) {
    EXPECT_EQ(count_of(r.output, ", verified\n"), 2u);
  }
  // Every trainer rank failed the refit in flight; every engine rank too, or caught up after it
  // had published its complete part.
  EXPECT_EQ(count_of(r.output, "failed in flight with every rank alive"),
            trainers + engines - count_of(r.output, "failed in flight on another rank after"));
  EXPECT_EQ(count_of(r.output, "forming the groups anew"), trainers + engines);
  EXPECT_EQ(count_of(r.output, t.engine_says),
            t.engine_says_on < 0 ? engines : static_cast<size_t>(t.engine_says_on));
  EXPECT_EQ(count_of(r.output, "exited with code 0"), engines);
}

TEST(RuntimeRecovery, StalledTrainerRankFailsTheRefitInFlightThenRecovers) {
  const std::string invalid = "the weights are invalid and generation stays paused";
  // Point-to-point (Gloo): the engines' receives time out.
  expect_fails_in_flight_then_recovers({.cell = {.timeout_s = 3, .executor = "p2p"},
                                        .fault = "stall-trainer:1:2",
                                        .engine_says = invalid});
  // Peer access: the engines' wait for the stalled rank's commit times out. No rollback: the
  // stalled rank may still write in place.
  expect_fails_in_flight_then_recovers(
      {.cell = {.timeout_s = 3, .keep_previous = true},
       .fault = "stall-trainer:0:2",
       .engine_says = "no rollback after a refit that failed in flight while feeders wrote in "
                      "place"});
  // Three trainer ranks feeding two engines of TP 2, small rounds.
  expect_fails_in_flight_then_recovers({.cell = {.model = "tiny-qwen2",
                                                 .world_size = 3,
                                                 .num_engines = 2,
                                                 .buffer = 4096,
                                                 .timeout_s = 3,
                                                 .executor = "p2p"},
                                        .fault = "stall-trainer:2:2",
                                        .engine_says = invalid});
}

TEST(RuntimeRecovery, StalledEngineRankFailsTheRefitInFlightThenRecovers) {
  // Without an agreed outcome (no checksum, no verification) the engine ranks publish their
  // complete bytes; the trainer ranks' wait for the stalled rank's commit acknowledgement times
  // out, and the stalled rank catches up between refits. Its relay (TP rank 0,
  // docs/protocol.md "Relays") published too but was still waiting to relay that
  // acknowledgement: it fails the refit in flight with its weights complete.
  {
    const std::string published =
        "failed in flight on another rank after this rank published weight version 'step-2'";
    expect_fails_in_flight_then_recovers({.cell = {.timeout_s = 3, .executor = "p2p"},
                                          .fault = "stall-engine:1:2",
                                          .verify = false,
                                          .engine_says = published,
                                          .engine_says_on = 1});
  }
  // With checksums the engine ranks wait for the outcome: none publishes, each rolls back.
  expect_fails_in_flight_then_recovers(
      {.cell = {.timeout_s = 3, .executor = "p2p", .checksum = true, .keep_previous = true},
       .fault = "stall-engine:0:2",
       .engine_says = "(refit.keep_previous) and resumed generation"});
}

// The session ends during a refit (a killed trainer rank): with refit.keep_previous the surviving
// engine ranks restore the kept version before they exit — a serving process that outlives the
// session serves it — unless a feeder wrote in place in that refit.
TEST(RuntimeRecovery, KeepPreviousRollsBackWhenTheSessionEndsMidRefit) {
  {
    auto r = run_cell({.timeout_s = 5, .executor = "p2p", .keep_previous = true},
                      {"--steps", "2", "--fault", "kill-trainer:1:1"});
    SCOPED_TRACE(r.output);
    EXPECT_NE(r.exit_code, 0);
    EXPECT_EQ(count_of(r.output,
                       "refit step 1 failed; rolled back to weight version '0' "
                       "(refit.keep_previous)"),
              2u);
    EXPECT_EQ(count_of(r.output, "the session ended with weight version '0'\n"), 2u);
  }
  {
    auto r = run_cell({.timeout_s = 5, .keep_previous = true},
                      {"--steps", "2", "--fault", "kill-trainer:1:1"});
    SCOPED_TRACE(r.output);
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("killing myself while writing the engines' parameters"),
              std::string::npos)
        << "peer path not taken";
    EXPECT_EQ(count_of(r.output, "no rollback at the end of the session: feeders wrote in place"),
              2u);
    EXPECT_EQ(count_of(r.output, "rolled back"), 0u);
  }
}

}  // namespace
}  // namespace refit
