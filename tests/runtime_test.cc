// End-to-end refits across real processes on loopback: `refit run --verify` for every FSDP2 cell,
// uneven shards, several engines and TP sizes, small buffers, faults and killed ranks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "control/auth.h"
#include "control/mailbox.h"
#include "control/messages.h"
#include "control/store.h"
#include "refit/version.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::run_cli;
using testing::TempDir;

struct Cell {
  std::string model = "tiny-qwen3";
  std::string engine = "sglang";
  bool colocated = false;
  int world_size = 2;
  int num_engines = 1;
  int tp = 2;
  std::string dtype = "float32";
  long long buffer = 1 << 16;
  int num_buffers = 2;
  double timeout_s = 20;
  std::string executor = "auto";
  bool checksum = false;
  bool keep_previous = false;
};

std::string config_yaml(const Cell& c) {
  std::ostringstream y;
  y << "model: " << c.model << "\n"
    << "device: cpu\nseed: 7\n"
    << "policy:\n  backend: fsdp2\n  world_size: " << c.world_size << "\n  dtype: " << c.dtype
    << "\n"
    << "generation:\n  backend: " << c.engine
    << "\n  colocated: " << (c.colocated ? "true" : "false") << "\n  num_engines: " << c.num_engines
    << "\n  tp_size: " << c.tp << "\n"
    << "refit:\n  target_precision: bf16\n  buffer_size_bytes: " << c.buffer
    << "\n  num_buffers: " << c.num_buffers << "\n  timeout_s: " << c.timeout_s
    << "\n  executor: " << c.executor << "\n  checksum: " << (c.checksum ? "true" : "false")
    << "\n  keep_previous: " << (c.keep_previous ? "true" : "false") << "\n";
  return y.str();
}

testing::CliResult run_cell(const Cell& c,
                            std::vector<std::string> extra = {"--steps", "2", "--verify"}) {
  TempDir dir;
  std::vector<std::string> args = {"run", dir.write("config.yaml", config_yaml(c))};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_cli(args, 120);
}

void expect_verified(const Cell& c) {
  auto r = run_cell(c);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verified bit-exact"), std::string::npos) << r.output;
}

// Like expect_verified, and the pairs were served by the executors named ("peer 4, p2p 0").
void expect_pairs(const Cell& c, const std::string& pairs) {
  auto r = run_cell(c);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verified bit-exact"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("pairs by executor: " + pairs), std::string::npos) << r.output;
}

// The four FSDP2 cells of the support matrix.
TEST(RuntimeCells, Fsdp2SglangBroadcast) { expect_verified({}); }
TEST(RuntimeCells, Fsdp2VllmBroadcast) { expect_verified({.engine = "vllm"}); }
TEST(RuntimeCells, Fsdp2SglangIpc) { expect_verified({.colocated = true, .tp = 2}); }
TEST(RuntimeCells, Fsdp2VllmIpc) { expect_verified({.engine = "vllm", .colocated = true}); }

TEST(RuntimeShapes, OneTrainerRank) { expect_verified({.world_size = 1, .tp = 1}); }

// Colocated with one trainer rank: the trainer writes the engine's parameters in place (peer
// access), or — with executor gather — goes through the shared-memory buffers.
TEST(RuntimeZeroCopy, DirectWritesIntoTheEngine) {
  for (const char* model : {"tiny-qwen3", "tiny-qwen2", "tiny-moe"})
    expect_pairs({.model = model, .colocated = true, .world_size = 1, .tp = 1}, "peer 1, p2p 0");
}
TEST(RuntimeZeroCopy, BuffersWithTheGatherExecutor) {
  auto r = run_cell({.engine = "vllm",
                     .colocated = true,
                     .world_size = 1,
                     .tp = 1,
                     .buffer = 4096,
                     .executor = "gather"},
                    {"--steps", "2", "--verify"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("executor gather, ipc"), std::string::npos) << r.output;
}
TEST(RuntimeZeroCopy, CorruptionIsCaught) {
  auto r = run_cell({.colocated = true, .world_size = 1, .tp = 1},
                    {"--steps", "1", "--verify", "--fault", "corrupt:3"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verify:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("written in place"), std::string::npos) << "zero-copy path not taken\n"
                                                                  << r.output;
}
TEST(RuntimeShapes, ThreeTrainerRanksUnevenChunks) {
  // tiny-qwen2: 14 heads / 2 kv heads, d=4: k_proj has 8 rows -> chunks 3,3,2; norms of 56.
  expect_verified({.model = "tiny-qwen2", .world_size = 3, .tp = 2});
}
TEST(RuntimeShapes, EmptyChunks) {
  // tiny-qwen3 q_norm has 16 rows: with 7 ranks chunk = 3 -> rank 5 holds 1 row, rank 6 none.
  expect_verified({.world_size = 7, .tp = 1, .timeout_s = 30});
}
TEST(RuntimeShapes, TwoEnginesBroadcast) { expect_verified({.num_engines = 2, .tp = 2}); }
TEST(RuntimeShapes, TwoEnginesVllmIpc) {
  expect_verified(
      {.engine = "vllm", .colocated = true, .world_size = 2, .num_engines = 2, .tp = 1});
}
TEST(RuntimeShapes, Tp4ReplicatesKvHeads) { expect_verified({.tp = 4}); }
TEST(RuntimeShapes, BufferSmallerThanLargestTensor) {
  // embed_tokens is 1000 x 64 bf16 = 128 KB; 4 KiB buckets split it over 32 buckets.
  expect_verified({.buffer = 4096});
}
TEST(RuntimeShapes, SingleBuffer) { expect_verified({.num_buffers = 1}); }
TEST(RuntimeShapes, TiedEmbeddings) { expect_verified({.model = "tiny-qwen2", .tp = 1}); }
TEST(RuntimeShapes, BFloat16Trainer) { expect_verified({.dtype = "bfloat16"}); }
TEST(RuntimeShapes, TinyMoe) { expect_verified({.model = "tiny-moe", .tp = 2}); }
TEST(RuntimeShapes, TinyMoeVllmIpc) {
  expect_verified({.model = "tiny-moe", .engine = "vllm", .colocated = true});
}

TEST(RuntimeReport, JsonHasTheContractKeys) {
  TempDir dir;
  const std::string json = dir.path() + "/report.json";
  auto r =
      run_cli({"run", dir.write("c.yaml", config_yaml({})), "--steps", "3", "--json", json}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(json);
  std::stringstream ss;
  ss << in.rdbuf();
  for (const char* key :
       {"\"ok\": true", "\"steps\": 3", "\"verified\": false", "\"bytes_per_refit\"",
        "\"buckets_per_refit\"", "\"refit_seconds\"", "\"gbps\"", "\"phases\"", "\"unshard\"",
        "\"cast_pack\"", "\"transfer\"", "\"apply\"", "\"config\""})
    EXPECT_NE(ss.str().find(key), std::string::npos) << key << "\n" << ss.str();
}

// A failed run writes its report too (docs/runtime.md, "Report"): ok false, the error and the
// process blamed, none of the measurements — and no earlier run's report survives.
TEST(RuntimeReport, FailedRunReportBlamesTheKilledRank) {
  TempDir dir;
  const std::string json = dir.write("report.json", R"({"schema_version": 3, "ok": true})");
  auto r = run_cli({"run", dir.write("c.yaml", config_yaml({.timeout_s = 5})), "--steps", "2",
                    "--fault", "kill-engine:1:0", "--json", json},
                   120);
  ASSERT_EQ(r.exit_code, 1) << r.output;
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j.at("schema_version").get<int>(), 6);
  EXPECT_FALSE(j.at("ok").get<bool>()) << j.dump(2);
  const auto& e = j.at("error");
  EXPECT_EQ(e.at("role"), "engine") << j.dump(2);
  EXPECT_EQ(e.at("rank").get<int>(), 1) << j.dump(2);
  EXPECT_EQ(e.at("process"), "engine 0 tp rank 1") << j.dump(2);
  EXPECT_NE(e.at("message").get<std::string>().find("killed by signal 9"), std::string::npos)
      << j.dump(2);
  EXPECT_FALSE(j.contains("refit_seconds")) << j.dump(2);
  EXPECT_EQ(j.at("config").at("model"), "tiny-qwen3");
}

TEST(RuntimeReport, UnwritablePathExits2BeforeAnyRankStarts) {
  TempDir dir;
  const std::string cfg = dir.write("c.yaml", config_yaml({}));
  for (const std::string& path : {dir.path() + "/missing/report.json", dir.path()}) {
    auto r = run_cli({"run", cfg, "--json", path}, 60);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("--json " + path), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("refit(s) completed"), std::string::npos) << r.output;
  }
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

// refit.checksum and recovery (docs/runtime.md, "A refit that fails at its end"): a corrupted
// round or parameter is caught by the checksum at the commit, the engines do not publish, and the
// next refits of the same session (the same processes) succeed and verify.
size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// An engine rank sends its exported parameters (a region's handle and every offset, or a handle
// per parameter) in its first pause answer to each feeder only: later begins say which export the
// feeder holds, and the answer leaves it out. World 2 -> TP 2 colocated: 4 peer pairs, so steps 2
// and 3 leave the export out 8 times, and every step verifies.
TEST(RuntimeZeroCopy, EnginesSendTheirExportOnce) {
  setenv("REFIT_LOG", "debug", 1);
  auto r = run_cell({.engine = "vllm", .colocated = true, .world_size = 2, .tp = 2},
                    {"--steps", "3", "--verify"});
  unsetenv("REFIT_LOG");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "/3: refit "), 3u) << r.output;
  EXPECT_EQ(count_of(r.output, ", verified\n"), 3u) << r.output;
  EXPECT_NE(r.output.find("pairs by executor: peer 4, p2p 0"), std::string::npos) << r.output;
  EXPECT_EQ(count_of(r.output, "left out its export"), 8u) << r.output;
}

void expect_recovers(const Cell& c, const std::string& fault, int failed_step,
                     const std::string& cause) {
  auto r = run_cell(c, {"--steps", "3", "--verify", "--fault", fault});
  SCOPED_TRACE(r.output);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find(cause), std::string::npos);
  EXPECT_NE(r.output.find(fmt::format("1 of 3 refit(s) failed (steps {}); the session went on",
                                      failed_step)),
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
  for (const Cell& c : {Cell{.checksum = true},
                        Cell{.executor = "p2p", .checksum = true},
                        Cell{.engine = "vllm", .colocated = true, .checksum = true},
                        Cell{.model = "tiny-qwen2", .world_size = 3, .num_engines = 2,
                             .buffer = 4096, .checksum = true}}) {
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
TEST(RuntimeRecovery, FailedVerificationThenRecovers) {
  // The verification hook's failure is the refit's, not the session's.
  expect_recovers({.engine = "vllm"}, "corrupt:2:2", 2, "verify: engine 0 tp rank");
}
TEST(RuntimeRecovery, KeepPreviousRollsBackBitExact) {
  // Step 2 fails: every engine rank restores step 1's bytes and label (verified bit-exact).
  expect_recovers({.checksum = true, .keep_previous = true}, "corrupt:1:2", 2,
                  "checksum mismatch in refit step 2");
  expect_recovers({.engine = "vllm", .colocated = true, .world_size = 1, .tp = 1,
                   .keep_previous = true},
                  "corrupt:0:2", 2, "verify: engine 0 tp rank 0");
  // Only engine rank 0's bytes are corrupted: rank 1 verified step 2 and must still roll back
  // (with the others), to step 1's bytes.
  expect_recovers({.engine = "vllm", .colocated = true, .buffer = 4096, .checksum = true,
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
  EXPECT_NE(r.output.find(fmt::format("1 of 3 refit(s) failed (steps {}); the session went on",
                                      failed_step)),
            std::string::npos);
  EXPECT_EQ(count_of(r.output, ", verified\n"), 2u);
  EXPECT_EQ(count_of(r.output, "exited with code 0"), ranks);
  EXPECT_EQ(count_of(r.output, fmt::format("refit step {} aborted before any byte moved",
                                           failed_step)),
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
  const std::string cause = "the pause hook failed, so refit step 2 was aborted before any "
                            "parameter changed: fault injection";
  // Point-to-point; the refusing rank is the second of one engine.
  expect_aborted_then_recovers({}, "fail-pause:1:2", 2, "engine 0 tp rank 1 reported: " + cause);
  // Peer access (written in place): feeders that commit early cannot overtake the abort.
  expect_aborted_then_recovers({.colocated = true}, "fail-pause:0:2", 2,
                               "engine 0 tp rank 0 reported: " + cause);
  // Three trainer ranks feeding two engines: every trainer rank agrees through the store.
  expect_aborted_then_recovers({.model = "tiny-qwen2", .world_size = 3, .num_engines = 2,
                                .buffer = 4096},
                               "fail-pause:3:2", 2, "engine 1 tp rank 1 reported: " + cause);
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
  // What every engine rank logs about its weights after the failure.
  std::string engine_says;
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
  EXPECT_EQ(count_of(r.output, t.engine_says), engines);
  EXPECT_EQ(count_of(r.output, "exited with code 0"), engines);
}

TEST(RuntimeRecovery, StalledTrainerRankFailsTheRefitInFlightThenRecovers) {
  const std::string invalid = "the weights are invalid and generation stays paused";
  // Point-to-point (Gloo): the engines' receives time out.
  expect_fails_in_flight_then_recovers(
      {.cell = {.timeout_s = 3, .executor = "p2p"}, .fault = "stall-trainer:1:2",
       .engine_says = invalid});
  // Peer access: the engines' wait for the stalled rank's commit times out. No rollback: the
  // stalled rank may still write in place.
  expect_fails_in_flight_then_recovers(
      {.cell = {.timeout_s = 3, .keep_previous = true}, .fault = "stall-trainer:0:2",
       .engine_says = "no rollback after a refit that failed in flight while feeders wrote in "
                      "place"});
  // Three trainer ranks feeding two engines of TP 2, small rounds.
  expect_fails_in_flight_then_recovers(
      {.cell = {.model = "tiny-qwen2", .world_size = 3, .num_engines = 2, .buffer = 4096,
                .timeout_s = 3, .executor = "p2p"},
       .fault = "stall-trainer:2:2",
       .engine_says = invalid});
}

TEST(RuntimeRecovery, StalledEngineRankFailsTheRefitInFlightThenRecovers) {
  // Without an agreed outcome (no checksum, no verification) the engine ranks publish their
  // complete bytes; the trainer ranks' wait for the stalled rank's commit acknowledgement times
  // out, and the engine ranks catch up between refits.
  expect_fails_in_flight_then_recovers(
      {.cell = {.timeout_s = 3, .executor = "p2p"}, .fault = "stall-engine:1:2", .verify = false,
       .engine_says = "failed in flight on another rank after this rank published weight version "
                      "'step-2'"});
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
    EXPECT_EQ(count_of(r.output, "refit step 1 failed; rolled back to weight version '0' "
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

TEST(RuntimeSetup, VllmPlanHashMismatchIsRefused) {
  auto r =
      run_cell({.engine = "vllm", .timeout_s = 5}, {"--steps", "1", "--fault", "plan-mismatch"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("manifest mismatch"), std::string::npos) << r.output;
}

// Two ranks of different refit versions: the engine announces "<version>+mismatch" in its hello
// and the trainer refuses it at setup, naming both sides and both versions.
TEST(RuntimeSetup, VersionMismatchIsRefusedNamingBothSides) {
  auto r = run_cell({.timeout_s = 5}, {"--steps", "1", "--fault", "version-mismatch"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("version mismatch"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(fmt::format("runs refit {}+mismatch (wire protocol {})", version(),
                                      wire_version())),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find(fmt::format("trainer rank 0 runs refit {} (wire protocol {})",
                                      version(), wire_version())),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("step 1/1"), std::string::npos) << r.output;  // no refit ran
}

TEST(RuntimeSetup, InvalidConfigExits2BeforeStarting) {
  auto r = run_cell({.colocated = true, .world_size = 3, .tp = 2}, {"--steps", "1"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("world_size"), std::string::npos) << r.output;
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
  EXPECT_NE(r.output.find(fmt::format("fault injection: {} myself at {}", stop ? "stopping" : "killing",
                                      at == "1" ? "round 1" : at == "commit" ? "the commit" : at)),
            std::string::npos)
      << "the fault did not fire where it names";
  const std::string named = stop ? "killed, stopped (SIGSTOP) after every other rank exited: " +
                                       m.culprit
                                 : m.culprit + " was killed by signal 9";
  EXPECT_NE(r.output.find(named), std::string::npos) << "the launcher did not name the rank";
  EXPECT_EQ(r.output.find("exited with code 0"), std::string::npos) << "every rank must fail";
  EXPECT_TRUE(segments_of(id).empty());
  EXPECT_EQ(processes_of(id), 0) << "a rank outlived the launcher";
  EXPECT_TRUE(std::filesystem::is_empty(tmp.path())) << "the run's directory was left behind";
  // Survivors' weights: the previous version or none, never step 1's label.
  const std::string ended = "the session ended with weight version '";
  for (size_t p = r.output.find(ended); p != std::string::npos; p = r.output.find(ended, p + 1)) {
    const std::string version = r.output.substr(p + ended.size(), r.output.find('\'', p + ended.size()) - p - ended.size());
    EXPECT_TRUE(version == "0" || version.empty()) << "an engine rank ended with version " << version;
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
      << "nothing was left to remove, so the test did not exercise the sweep\n" << r.output;
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
      "REFIT_RUN_ID={} timeout -s TERM 5 {} run {} --steps 100000 > {}/run.log 2>&1; echo $? > {}/rc",
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

// A fault the run could never reach is refused before any rank starts (it would silently do
// nothing), naming the limit: ranks that do not exist, rounds or buckets past the plan.
TEST(RuntimeSetup, FaultsOutsideThePlanExit2) {
  struct Case {
    Cell cell;
    const char* fault;
    const char* words;
  };
  const Case cases[] = {
      {{.world_size = 2}, "kill-trainer:2:0", "there is no trainer rank 2 (policy.world_size is 2)"},
      {{.tp = 2}, "kill-engine:2:0", "there is no engine rank 2"},
      {{.executor = "gather"}, "corrupt:999", "bucket 999 is past the plan"},
      {{.buffer = 4096, .executor = "p2p"}, "kill-engine:0:99999", "round 99999 is past the plan"},
  };
  for (const Case& c : cases) {
    auto r = run_cell(c.cell, {"--steps", "1", "--fault", c.fault});
    EXPECT_EQ(r.exit_code, 2) << c.fault << "\n" << r.output;
    EXPECT_NE(r.output.find(c.words), std::string::npos) << c.fault << "\n" << r.output;
    EXPECT_EQ(r.output.find("step 1/1"), std::string::npos) << "a rank ran: " << r.output;
  }
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

// Separate launch: every rank started on its own with a torchrun-style environment, as users
// spread ranks over hosts. Returns the exit codes (trainer 0, trainer 1, engine 0, engine 1).
// `hosts` (optional): REFIT_HOST_ID of trainer 0, trainer 1, engine 0, engine 1.
// The store port launch_separately's ranks use.
int separate_launch_port() { return 20000 + static_cast<int>(getpid() % 20000); }

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
  sh << "cd " << dir.path() << " && export MASTER_ADDR=127.0.0.1 MASTER_PORT=" << port << "; "
     << host(0) << "RANK=0 WORLD_SIZE=2 " << exe << " trainer " << trainer_cfg << " --steps "
     << steps << " --verify > t0.log 2>&1 & p0=$!; " << host(1) << "RANK=1 WORLD_SIZE=2 " << exe
     << " trainer " << trainer_cfg << " --steps " << steps
     << " --verify > t1.log 2>&1 & p1=$!; "
     << host(2) << "ENGINE_RANK=0 " << exe << " engine " << engine_cfg
     << " > e0.log 2>&1 & p2=$!; "
     << host(3) << "ENGINE_RANK=1 " << exe << " engine " << engine_cfg
     << " > e1.log 2>&1 & p3=$!; "
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

}  // namespace
}  // namespace refit

namespace refit {
namespace {

// The full-bucket design, kept as the explicit `refit.executor: gather`: all-gather over the
// trainer group, then broadcast from trainer rank 0 or the colocated rank's ipc slots.
TEST(RuntimeGather, Fsdp2SglangBroadcast) { expect_verified({.executor = "gather"}); }
TEST(RuntimeGather, Fsdp2VllmBroadcastTwoEngines) {
  expect_verified({.engine = "vllm", .num_engines = 2, .executor = "gather"});
}
TEST(RuntimeGather, Fsdp2SglangIpcSmallBuffers) {
  expect_verified({.colocated = true, .buffer = 4096, .executor = "gather"});
}
TEST(RuntimeGather, CorruptBucketFailsAndNamesTheTensor) {
  auto r = run_cell({.executor = "gather"}, {"--steps", "1", "--verify", "--fault", "corrupt:1"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tensor model."), std::string::npos) << r.output;
}

// The transfer plan over point-to-point (Gloo send/recv), across world sizes, TP sizes and
// replicas, with buffers smaller than a tensor (routes split, many rounds).
TEST(RuntimeP2p, ThreeRanksTwoEnginesTp2TinyBuffers) {
  expect_pairs({.world_size = 3, .num_engines = 2, .tp = 2, .buffer = 4096, .executor = "p2p"},
               "peer 0, p2p 12");
}
TEST(RuntimeP2p, OneRankTp1) {
  expect_pairs({.world_size = 1, .tp = 1, .executor = "p2p"}, "peer 0, p2p 1");
}
TEST(RuntimeP2p, Tp4VllmSingleBuffer) {
  expect_pairs({.engine = "vllm", .tp = 4, .num_buffers = 1, .executor = "p2p"}, "peer 0, p2p 8");
}
TEST(RuntimeP2p, ColocatedMoeBf16) {
  expect_pairs({.model = "tiny-moe", .colocated = true, .dtype = "bfloat16", .executor = "p2p"},
               "peer 0, p2p 4");
}
TEST(RuntimeP2p, EmptyChunksSevenRanks) {
  // tiny-qwen3 q_norm has 16 rows: with 7 ranks rank 6 holds none of it.
  auto r = run_cell({.world_size = 7, .tp = 1, .timeout_s = 30, .executor = "p2p"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verified bit-exact"), std::string::npos) << r.output;
}

// Peer access: trainer ranks write every engine rank's exported parameters in place.
TEST(RuntimePeer, ThreeRanksTp2) {
  expect_pairs({.model = "tiny-qwen2", .world_size = 3, .tp = 2, .executor = "peer"},
               "peer 6, p2p 0");
}
TEST(RuntimePeer, TwoEnginesTp4) {
  expect_pairs({.engine = "vllm", .num_engines = 2, .tp = 4}, "peer 16, p2p 0");
}
TEST(RuntimePeer, ColocatedTp2Moe) {
  expect_pairs({.model = "tiny-moe", .engine = "vllm", .colocated = true}, "peer 4, p2p 0");
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

// The report's per-rank traffic: each engine rank of TP T receives its own shard (about 1/T of
// the model), every replica the whole model once; trainer ranks send what engines receive.
TEST(RuntimeReport, RanksArrayShowsShardSizedReceives) {
  for (const char* executor : {"peer", "p2p"}) {
    TempDir dir;
    const std::string json = dir.path() + "/report.json";
    Cell c{.world_size = 3, .num_engines = 2, .tp = 2, .executor = executor};
    auto r = run_cli({"run", dir.write("c.yaml", config_yaml(c)), "--steps", "1", "--json", json},
                     120);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::ifstream in(json);
    const auto j = nlohmann::json::parse(in);
    EXPECT_EQ(j.at("schema_version").get<int>(), 6);
    EXPECT_TRUE(j.at("ok").get<bool>());
    EXPECT_FALSE(j.contains("error"));
    EXPECT_EQ(j.at("executor").get<std::string>(), executor);
    const double model = j.at("bytes_per_refit").get<double>();
    long long sent = 0, received = 0;
    int trainers = 0, engines = 0, pairs_t = 0, pairs_e = 0;
    for (const auto& rank : j.at("ranks")) {
      const bool trainer = rank.at("role") == "trainer";
      sent += rank.at("bytes_sent").get<long long>();
      received += rank.at("bytes_received").get<long long>();
      const int pairs = rank.at("peer_pairs").get<int>() + rank.at("p2p_pairs").get<int>();
      if (trainer) {
        ++trainers;
        pairs_t += pairs;
      } else {
        ++engines;
        pairs_e += pairs;
        const double b = rank.at("bytes_received").get<double>();
        // TP rank 1 holds fewer real vocabulary rows (1000 padded to 1024, split 512 / 488).
        EXPECT_GT(b, model / 2 * 0.97) << executor << " engine rank " << rank.at("rank");
        EXPECT_LT(b, model / 2 * 1.05) << executor << " engine rank " << rank.at("rank");
      }
    }
    EXPECT_EQ(trainers, 3);
    EXPECT_EQ(engines, 4);
    EXPECT_EQ(sent, received) << executor;
    EXPECT_EQ(pairs_t, pairs_e) << executor;
    EXPECT_NEAR(static_cast<double>(received), 2 * model, 0.05 * model) << executor;
  }
}

}  // namespace
// Hostile neighbours during an authenticated run (REFIT_SECRET on every rank):
//  - a process without the secret cannot reach the store: its handshake is refused, so it can
//    neither read the mailbox addresses nor write a failure into the store;
//  - a process with the wrong secret is told so;
//  - messages sent straight to the ranks' mailboxes (their addresses read here as an insider
//    would) are dropped and logged: garbage over a plain socket never completes the handshake,
//    and forged begin / commit / paused / committed / verified messages over a CURVE socket that
//    knows the server key but not the real senders' keys are dropped as "sent with another
//    sender's key" or as malformed.
// The run completes and verifies.
TEST(Attack, ForeignProcessesCannotReachOrForgeTheControlPlane) {
  TempDir dir;
  Cell c{.engine = "vllm", .timeout_s = 20};
  const std::string cfg = dir.write("c.yaml", config_yaml(c));
  const std::string secret = "attack-test-secret-0123456789abcdef";
  std::string out;
  std::vector<int> codes;
  std::thread run([&] {
    codes = launch_separately(cfg, cfg, dir, &out, {}, "REFIT_SECRET=" + secret + " ", 6);
  });
  const int port = separate_launch_port();
  auto auth = ControlAuth::from_secret(secret);
  ASSERT_TRUE(auth.ok());
  auto insider = connect_store("127.0.0.1", port, std::chrono::seconds(30),
                               std::make_shared<const ControlAuth>(*auth));
  ASSERT_TRUE(insider.ok()) << insider.status().to_string();

  // Without the secret, and with another one.
  auto plain = connect_store("127.0.0.1", port, std::chrono::milliseconds(1500), nullptr);
  EXPECT_FALSE(plain.ok());
  auto other = ControlAuth::from_secret("another-secret-0123456789abcdef");
  auto wrong = connect_store("127.0.0.1", port, std::chrono::milliseconds(3000),
                             std::make_shared<const ControlAuth>(*other));
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("refused this process's handshake"), std::string::npos)
      << wrong.status().to_string();

  auto engine_box = (*insider)->get("mailbox/engine/0", std::chrono::seconds(30));
  auto trainer_box = (*insider)->get("mailbox/trainer/0", std::chrono::seconds(30));
  ASSERT_TRUE(engine_box.ok() && trainer_box.ok());
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
  zmq::socket_t plain_push = push(*engine_box, false);
  send(plain_push, MessageType::kBegin, "trainer/0",
       encode(BeginMessage{.step = 1, .version = "evil-v99"}));
  zmq::socket_t to_engine = push(*engine_box, true);
  zmq::socket_t to_trainer = push(*trainer_box, true);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // CURVE handshakes
  const std::string garbage(64 << 10, '\xA5');
  for (int i = 0; i < 3; ++i) {
    send(to_engine, MessageType::kBegin, "trainer/0",
         encode(BeginMessage{.step = 99, .version = "evil-v99"}));
    send(to_engine, MessageType::kCommit, "trainer/0", encode(CommitMessage{.step = 99}));
    send(to_trainer, MessageType::kPaused, "engine/0", garbage);
    send(to_trainer, MessageType::kCommitted, "engine/0", encode(CommittedMessage{}));
    send(to_trainer, MessageType::kVerified, "engine/1", "{\"verified\": true}");
    zmq::message_t one(garbage.data(), 100);
    (void)to_engine.send(one, zmq::send_flags::dontwait);  // one frame: malformed
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  run.join();
  EXPECT_EQ(codes, (std::vector<int>{0, 0, 0, 0})) << out;
  EXPECT_NE(out.find("verified bit-exact"), std::string::npos) << out;
  EXPECT_EQ(out.find("evil-v99"), std::string::npos) << out;
  EXPECT_NE(out.find("dropped a begin message claiming to come from 'trainer/0'"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("dropped a paused message claiming to come from 'engine/0'"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("it was sent with another sender's key"), std::string::npos) << out;
  EXPECT_NE(out.find("dropped a malformed message"), std::string::npos) << out;
}

}  // namespace refit
