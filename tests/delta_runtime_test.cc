// refit.delta end to end (docs/delta.md, "Wiring"): `refit run --verify` of real processes on
// loopback, every element of every engine rank checked after each refit, for each executor and
// protocol, FSDP2 and Megatron, bf16 and FP8. Each test reads the JSON report's per-refit delta
// record: the first refit moves in full, the later ones as deltas of fewer wire bytes; a base
// either side no longer holds (a failed refit, a rollback) makes the next refit of the pair full.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "test_util.h"

namespace refit {
namespace {

using testing::count_of;
using testing::run_cli;
using testing::TempDir;
using Cell = testing::RunConfig;

struct DeltaRun {
  testing::CliResult cli;
  nlohmann::json report;  // null when none was written
};

DeltaRun run_delta(const Cell& c, const std::vector<std::string>& extra) {
  TempDir dir;
  const std::string json = dir.path() + "/report.json";
  std::vector<std::string> args = {"run", dir.write("c.yaml", testing::config_yaml(c)), "--json",
                                   json};
  args.insert(args.end(), extra.begin(), extra.end());
  DeltaRun out{.cli = run_cli(args, 240)};
  std::ifstream in(json);
  if (in) out.report = nlohmann::json::parse(in, nullptr, false);
  return out;
}

// refit.staged, with the engine ranks' debug lines: how each apply went, what was kept.
DeltaRun run_staged(Cell c, const std::vector<std::string>& extra) {
  c.staged = true;
  ::setenv("REFIT_LOG", "debug", 1);
  DeltaRun d = run_delta(c, extra);
  ::unsetenv("REFIT_LOG");
  return d;
}

// Every (trainer rank, engine rank) pair of the last refit, from the report's ranks.
int pairs_of(const nlohmann::json& report) {
  int n = 0;
  for (const auto& r : report["ranks"])
    if (r["role"] == "trainer") n += r["peer_pairs"].get<int>() + r["p2p_pairs"].get<int>();
  return n;
}

// `steps` verified refits: the first in full, every later one a delta of every pair, with less
// on the wire than the full refit and a changed fraction in (0, 0.5).
// `out` (when set) gets the run.
void expect_deltas(const Cell& c, const std::string& update = "adam:1e-5", int steps = 5,
                   DeltaRun* out = nullptr) {
  const DeltaRun d =
      run_delta(c, {"--steps", std::to_string(steps), "--verify", "--update", update});
  if (out != nullptr) *out = d;
  ASSERT_EQ(d.cli.exit_code, 0) << testing::config_yaml(c) << d.cli.output;
  EXPECT_NE(d.cli.output.find("verified bit-exact"), std::string::npos) << d.cli.output;
  ASSERT_TRUE(d.report.is_object()) << d.cli.output;
  ASSERT_TRUE(d.report.contains("delta")) << d.report.dump(2);
  const auto& s = d.report["delta"]["steps"];
  ASSERT_EQ(s.size(), static_cast<std::size_t>(steps)) << d.report.dump(2);
  const int pairs = pairs_of(d.report);
  ASSERT_GT(pairs, 0);
  EXPECT_EQ(s[0]["pairs"], 0) << s.dump(2);
  EXPECT_EQ(s[0]["wire_bytes"], s[0]["full_bytes"]) << s.dump(2);
  // Every pair's bytes: the model once, and replicated tensors once per TP rank.
  EXPECT_GE(s[0]["full_bytes"].get<std::int64_t>(),
            d.report["bytes_per_refit"].get<std::int64_t>());
  for (int i = 1; i < steps; ++i) {
    SCOPED_TRACE(i + 1);
    EXPECT_EQ(s[i]["pairs"], pairs) << s.dump(2);
    EXPECT_GT(s[i]["changed_fraction"].get<double>(), 0) << s.dump(2);
    EXPECT_LT(s[i]["changed_fraction"].get<double>(), 0.5) << s.dump(2);
    EXPECT_LT(s[i]["wire_bytes"].get<std::int64_t>(), s[i]["full_bytes"].get<std::int64_t>() / 2)
        << s.dump(2);
    EXPECT_GT(s[i]["encode_seconds"].get<double>(), 0) << s.dump(2);
  }
  // The report's top level is the last refit's; ranks count wire bytes.
  EXPECT_EQ(d.report["delta"]["wire_bytes"], s[steps - 1]["wire_bytes"]);
  std::int64_t sent = 0;
  for (const auto& r : d.report["ranks"])
    if (r["role"] == "trainer") sent += r["bytes_sent"].get<std::int64_t>();
  EXPECT_EQ(sent, d.report["delta"]["wire_bytes"].get<std::int64_t>());
}

// The cell with FP8 weights in blocks of 16 x 16 (the test models' shapes) and an update that
// moves their codes at these sizes.
void expect_fp8_deltas(Cell c) {
  c.precision = "fp8";
  c.fp8 = "{block: [16, 16]}";
  expect_deltas(c, "adam:1e-4");
}

TEST(DeltaRefits, P2pSglang) { expect_deltas({.executor = "p2p", .delta = "on"}); }
TEST(DeltaRefits, P2pVllm) { expect_deltas({.engine = "vllm", .executor = "p2p", .delta = "on"}); }
TEST(DeltaRefits, PeerSglang) {
  expect_deltas({.colocated = true, .executor = "peer", .delta = "on"});
}
TEST(DeltaRefits, PeerVllm) {
  expect_deltas({.engine = "vllm", .colocated = true, .executor = "peer", .delta = "on"});
}
TEST(DeltaRefits, P2pThreeRanksTwoEnginesSmallRounds) {
  expect_deltas(
      {.world_size = 3, .num_engines = 2, .buffer = 4096, .executor = "p2p", .delta = "on"},
      "adam:1e-6");
}
TEST(DeltaRefits, MegatronP2p) {
  expect_deltas({.executor = "p2p", .backend = "megatron", .megatron_tp = 2, .delta = "on"});
}
TEST(DeltaRefits, MegatronPeerVllm) {
  expect_deltas({.engine = "vllm",
                 .colocated = true,
                 .executor = "peer",
                 .backend = "megatron",
                 .megatron_tp = 2,
                 .delta = "on"});
}
TEST(DeltaRefits, Fp8P2pSglang) { expect_fp8_deltas({.executor = "p2p", .delta = "on"}); }
TEST(DeltaRefits, Fp8P2pVllm) {
  expect_fp8_deltas({.engine = "vllm", .executor = "p2p", .delta = "on"});
}
// FP8 over peer access: each kept pair's routes are packed every refit into segments of the
// trainer rank's own (a quantization is not a cast), and the patch writes into the engine's
// parameters only the codes and scales that changed.
TEST(DeltaRefits, Fp8PeerSglang) {
  expect_fp8_deltas({.colocated = true, .executor = "peer", .delta = "on"});
}
TEST(DeltaRefits, Fp8MegatronPeerVllm) {
  expect_fp8_deltas({.engine = "vllm",
                     .colocated = true,
                     .executor = "peer",
                     .backend = "megatron",
                     .megatron_tp = 2,
                     .delta = "on"});
}

// MoE and frontier models: stacked experts (compact routes) and MLA's kv_b_proj.
TEST(DeltaRefits, MoeP2pVllm) {
  expect_deltas({.model = "tiny-moe", .engine = "vllm", .executor = "p2p", .delta = "on"});
}
TEST(DeltaRefits, DeepSeekMlaPeerSglang) {
  expect_deltas({.model = "tiny-deepseek", .colocated = true, .executor = "peer", .delta = "on"});
}
TEST(DeltaRefits, Glm4MoeP2pSglang) {
  expect_deltas({.model = "tiny-glm4-moe", .executor = "p2p", .delta = "on"});
}
// Megatron's TP, PP and EP shards, each trainer rank keeping its own pairs' copies.
TEST(DeltaRefits, MegatronTpEpMoeP2p) {
  expect_deltas({.model = "tiny-moe",
                 .world_size = 4,
                 .executor = "p2p",
                 .backend = "megatron",
                 .megatron_tp = 2,
                 .megatron_ep = 2,
                 .delta = "on"});
}
TEST(DeltaRefits, MegatronTpPpTwoEnginesP2pVllm) {
  expect_deltas({.engine = "vllm",
                 .world_size = 4,
                 .num_engines = 2,
                 .buffer = 4096,
                 .executor = "p2p",
                 .backend = "megatron",
                 .megatron_tp = 2,
                 .megatron_pp = 2,
                 .delta = "on"});
}
TEST(DeltaRefits, Fp8MegatronP2pSglang) {
  expect_fp8_deltas({.executor = "p2p", .backend = "megatron", .megatron_tp = 2, .delta = "on"});
}

// refit.staged: the bytes of each refit, full or delta, land in the staging area while the
// engine generates, and generation pauses only for the apply. Every refit is verified on the
// engines' parameters; each one's pause is in the report and lies inside the refit. The first
// refit's apply copies the staging area; with `changes_only` (every pair point to point) each
// delta refit's apply writes only the changes into the parameters, else it copies too.
void expect_staged(Cell c, bool changes_only) {
  c.staged = true;
  DeltaRun d;
  ::setenv("REFIT_LOG", "debug", 1);  // the engine ranks say how each apply went
  expect_deltas(c, "adam:1e-5", 5, &d);
  ::unsetenv("REFIT_LOG");
  int engine_ranks = 0;
  for (const auto& r : d.report["ranks"]) engine_ranks += r["role"] == "engine";
  ASSERT_GT(engine_ranks, 0) << d.report.dump(2);
  const std::size_t n = static_cast<std::size_t>(engine_ranks);
  EXPECT_EQ(count_of(d.cli.output, "applied as its changes only"), changes_only ? 4 * n : 0)
      << d.cli.output;
  EXPECT_EQ(count_of(d.cli.output, "applied as a copy of the staging area"),
            changes_only ? n : 5 * n)
      << d.cli.output;
  ASSERT_TRUE(d.report.is_object());
  const auto& refit = d.report["refit_seconds"];
  const auto& pause = d.report["pause_seconds"];
  ASSERT_EQ(pause.size(), refit.size()) << d.report.dump(2);
  for (std::size_t i = 0; i < pause.size(); ++i) {
    EXPECT_GT(pause[i].get<double>(), 0) << d.report.dump(2);
    EXPECT_LT(pause[i].get<double>(), refit[i].get<double>()) << d.report.dump(2);
  }
  EXPECT_EQ(count_of(d.cli.output, ", generation paused"), 5U) << d.cli.output;  // step lines
  EXPECT_EQ(count_of(d.cli.output, "refit.staged: generation paused"), 1U) << d.cli.output;
}

TEST(StagedRefits, P2pSglangDelta) { expect_staged({.executor = "p2p", .delta = "on"}, true); }
TEST(StagedRefits, PeerVllmDelta) {
  expect_staged({.engine = "vllm", .colocated = true, .executor = "peer", .delta = "on"}, false);
}
TEST(StagedRefits, Fp8PeerSglangDelta) {
  expect_staged({.colocated = true,
                 .executor = "peer",
                 .delta = "on",
                 .precision = "fp8",
                 .fp8 = "{block: [16, 16]}"},
                false);
}
TEST(StagedRefits, MegatronP2pTwoEngines) {
  expect_staged(
      {.num_engines = 2, .executor = "p2p", .backend = "megatron", .megatron_tp = 2, .delta = "on"},
      true);
}

// refit.staged: an engine rank's parameters take only the changes when every byte of its refit
// arrived as a delta; where one pair moved in full (engine rank 0 forgets trainer rank 1's base
// before refit 3) that rank copies its staging area for that refit, and the other rank, whose
// pairs both moved deltas, still writes only the changes. Every refit verified.
TEST(StagedRefits, ARankWithOnePairInFullCopiesItsStagingArea) {
  const DeltaRun d = run_staged(
      {.buffer = 4096, .executor = "p2p", .delta = "on"},
      {"--steps", "4", "--verify", "--update", "adam:1e-5", "--fault", "forget-base:0:1:3"});
  ASSERT_EQ(d.cli.exit_code, 0) << d.cli.output;
  EXPECT_NE(d.cli.output.find("verified bit-exact"), std::string::npos) << d.cli.output;
  const auto line = [](int rank, int step, bool changes) {
    return fmt::format("engine 0 tp rank {}: refit.staged: refit step {} applied as {}", rank, step,
                       changes ? "its changes only" : "a copy of the staging area");
  };
  for (int step = 1; step <= 4; ++step) {
    const bool rank0_changes = step == 2 || step == 4, rank1_changes = step > 1;
    EXPECT_EQ(count_of(d.cli.output, line(0, step, rank0_changes)), 1u) << step << d.cli.output;
    EXPECT_EQ(count_of(d.cli.output, line(1, step, rank1_changes)), 1u) << step << d.cli.output;
  }
}

// Density 0: at adam:1e-12 only elements within a few 1e-10 of zero change (about 1e-5 of them);
// each delta is little more than the streams' headers and directories.
TEST(DeltaRefits, NothingChanged) {
  const DeltaRun d = run_delta({.executor = "p2p", .delta = "on"},
                               {"--steps", "3", "--verify", "--update", "adam:1e-12"});
  ASSERT_EQ(d.cli.exit_code, 0) << d.cli.output;
  const auto& s = d.report["delta"]["steps"];
  ASSERT_EQ(s.size(), 3u) << d.report.dump(2);
  for (int i = 1; i < 3; ++i) {
    EXPECT_GT(s[i]["pairs"].get<int>(), 0) << s.dump(2);
    EXPECT_LT(s[i]["changed_fraction"].get<double>(), 1e-4) << s.dump(2);
    EXPECT_LT(s[i]["wire_bytes"].get<std::int64_t>(), s[i]["full_bytes"].get<std::int64_t>() / 50)
        << s.dump(2);
  }
}

// Density 1: every element changes (--update drift); every route goes dense, so a delta moves the
// full bytes and the streams' directories, and no more.
TEST(DeltaRefits, EverythingChanged) {
  const DeltaRun d = run_delta({.executor = "p2p", .delta = "on"},
                               {"--steps", "3", "--verify", "--update", "drift"});
  ASSERT_EQ(d.cli.exit_code, 0) << d.cli.output;
  EXPECT_NE(d.cli.output.find("verified bit-exact"), std::string::npos) << d.cli.output;
  const auto& s = d.report["delta"]["steps"];
  ASSERT_EQ(s.size(), 3u) << d.report.dump(2);
  for (int i = 1; i < 3; ++i) {
    EXPECT_GT(s[i]["pairs"].get<int>(), 0) << s.dump(2);
    EXPECT_GT(s[i]["changed_fraction"].get<double>(), 0.9) << s.dump(2);
    const auto wire = s[i]["wire_bytes"].get<double>(), full = s[i]["full_bytes"].get<double>();
    EXPECT_GE(wire, full) << s.dump(2);
    EXPECT_LE(wire, full * 1.05) << s.dump(2);
  }
}

// refit.delta auto: after the first delta measured a density of ~1 (--update drift), the pairs
// are predicted faster in full, and go in full.
TEST(DeltaRefits, AutoFallsBackToFullPastBreakEven) {
  const DeltaRun d = run_delta({.executor = "p2p", .delta = "auto"},
                               {"--steps", "5", "--verify", "--update", "drift"});
  ASSERT_EQ(d.cli.exit_code, 0) << d.cli.output;
  EXPECT_NE(d.cli.output.find("verified bit-exact"), std::string::npos) << d.cli.output;
  const auto& s = d.report["delta"]["steps"];
  ASSERT_EQ(s.size(), 5u) << d.report.dump(2);
  EXPECT_EQ(s[0]["pairs"], 0) << s.dump(2);
  EXPECT_GT(s[1]["pairs"].get<int>(), 0) << s.dump(2);  // the delta that measures the density
  for (int i = 2; i < 5; ++i) EXPECT_EQ(s[i]["pairs"], 0) << s.dump(2);
  // The engine ranks offered their bases; the trainer ranks decided on full (past break-even,
  // or, where the encode alone outlasts the full refit, for good: said once per pair), and sent
  // the word that says so before each round.
  EXPECT_GT(count_of(d.cli.output, "refit.delta auto predicts them faster in full") +
                count_of(d.cli.output, "no delta can be faster"),
            0u)
      << d.cli.output;
  EXPECT_GT(count_of(d.cli.output,
                     "sent their routes in full, though this rank offered them its "
                     "base"),
            0u)
      << d.cli.output;
  // Each engine rank says so at info once, at the first of those refits; the same trainer ranks
  // sending in full again are logged at debug only.
  EXPECT_GT(count_of(d.cli.output, "refit.delta: step 3: trainer rank(s)"), 0u) << d.cli.output;
  EXPECT_EQ(count_of(d.cli.output, "refit.delta: step 4: trainer rank(s)"), 0u) << d.cli.output;
  EXPECT_EQ(count_of(d.cli.output, "refit.delta: step 5: trainer rank(s)"), 0u) << d.cli.output;
}

// A corrupted delta stream is refused before any byte of it is written, naming the route and its
// tensor; like any corruption found while bytes move, it ends the session on every rank.
TEST(DeltaRefits, CorruptedDeltaNamesTheTensor) {
  const DeltaRun d =
      run_delta({.executor = "p2p", .keep_previous = true, .delta = "on"},
                {"--steps", "4", "--verify", "--update", "adam:1e-5", "--fault", "corrupt:0:3"});
  EXPECT_EQ(d.cli.exit_code, 1) << d.cli.output;
  EXPECT_NE(d.cli.output.find("step 2/4: refit.delta: 4 pair(s) as a delta"), std::string::npos)
      << d.cli.output;
  EXPECT_NE(d.cli.output.find("fails its checksum: the stream was corrupted in flight; nothing was "
                              "applied"),
            std::string::npos)
      << d.cli.output;
  EXPECT_NE(d.cli.output.find("the delta from trainer rank"), std::string::npos) << d.cli.output;
  EXPECT_NE(d.cli.output.find("(model."), std::string::npos) << d.cli.output;
  EXPECT_EQ(d.cli.output.find("step 3/4: refit.delta"), std::string::npos) << d.cli.output;
}

// A refit that fails at its end (a corrupted full refit caught by verification): the weights
// stay invalid, or (refit.keep_previous) roll back to the version before. Either way the trainer
// ranks offer a delta against what they sent, the engine ranks refuse it, and the next refit moves
// in full, verified; deltas resume after.
// With refit.staged the copy to roll back to is taken while the bytes land, once per refit and
// engine rank.
void expect_full_after_failed_refit(bool keep_previous, bool staged = false) {
  const Cell c{.executor = "p2p", .keep_previous = keep_previous, .delta = "on"};
  const std::vector<std::string> args = {"--steps",   "4",       "--verify",   "--update",
                                         "adam:1e-5", "--fault", "corrupt:0:1"};
  const DeltaRun d = staged ? run_staged(c, args) : run_delta(c, args);
  if (staged) {
    EXPECT_EQ(count_of(d.cli.output, "refit.keep_previous: kept weight version"), 8u)
        << d.cli.output;
    EXPECT_NE(d.cli.output.find("rolled back to weight version '0'"), std::string::npos)
        << d.cli.output;
  }
  EXPECT_NE(d.cli.exit_code, 0) << d.cli.output;
  EXPECT_NE(d.cli.output.find("1 of 4 refit(s) failed (steps 1)"), std::string::npos)
      << d.cli.output;
  EXPECT_NE(d.cli.output.find("step 2/4: refit.delta: 0 pair(s) as a delta"), std::string::npos)
      << d.cli.output;
  EXPECT_NE(d.cli.output.find("step 3/4: refit.delta: 4 pair(s) as a delta"), std::string::npos)
      << d.cli.output;
  EXPECT_NE(d.cli.output.find("step 4/4: refit.delta: 4 pair(s) as a delta"), std::string::npos)
      << d.cli.output;
  // The engine ranks offer no base after the failure, and both sides say so.
  EXPECT_GT(count_of(d.cli.output,
                     "step 2: no base offered to trainer rank(s) 0, 1: this rank "
                     "holds no base from them"),
            0u)
      << d.cli.output;
  EXPECT_GT(count_of(d.cli.output, "step 2: engine rank(s) 0, 1: they offered no base"), 0u)
      << d.cli.output;
}
TEST(DeltaRefits, FailedFullRefitMakesTheNextFull) { expect_full_after_failed_refit(false); }
TEST(DeltaRefits, RolledBackRefitMakesTheNextFull) { expect_full_after_failed_refit(true); }
TEST(StagedRefits, RolledBackRefitMakesTheNextFull) { expect_full_after_failed_refit(true, true); }

// A refit that fails in flight with every rank alive (trainer rank 1 stalls past the timeout in
// refit 2): every rank forms its groups anew and forgets its bases, so refit 3 moves every pair in
// full, verified, and refit 4 is a delta again. With refit.staged the failed refit never reaches
// the parameters; refit 3 copies the staging area, and refit 4 writes only the changes again.
void expect_full_after_failure_in_flight(bool staged) {
  const Cell c{.timeout_s = 3, .executor = "p2p", .delta = "on"};
  const std::vector<std::string> args = {"--steps",   "4",       "--verify",         "--update",
                                         "adam:1e-5", "--fault", "stall-trainer:1:2"};
  const DeltaRun d = staged ? run_staged(c, args) : run_delta(c, args);
  EXPECT_NE(d.cli.exit_code, 0) << d.cli.output;
  if (staged) {
    EXPECT_EQ(count_of(d.cli.output, "refit step 2 applied as"), 0u) << d.cli.output;
    EXPECT_EQ(count_of(d.cli.output, "refit step 3 applied as a copy of the staging area"), 2u)
        << d.cli.output;
    EXPECT_EQ(count_of(d.cli.output, "refit step 4 applied as its changes only"), 2u)
        << d.cli.output;
  }
  EXPECT_NE(d.cli.output.find("1 of 4 refit(s) failed (steps 2)"), std::string::npos)
      << d.cli.output;
  EXPECT_NE(d.cli.output.find("step 1/4: refit.delta: 0 pair(s) as a delta"), std::string::npos)
      << d.cli.output;
  EXPECT_NE(d.cli.output.find("step 3/4: refit.delta: 0 pair(s) as a delta"), std::string::npos)
      << d.cli.output;
  EXPECT_NE(d.cli.output.find("step 4/4: refit.delta: 4 pair(s) as a delta"), std::string::npos)
      << d.cli.output;
  EXPECT_EQ(count_of(d.cli.output,
                     "step 3: no base offered to trainer rank(s) 0, 1: this rank "
                     "holds no base from them"),
            2u)
      << d.cli.output;
  EXPECT_EQ(count_of(d.cli.output, "step 3: engine rank(s) 0, 1: this rank keeps no base for them"),
            2u)
      << d.cli.output;
}
TEST(DeltaRefits, RefitFailedInFlightMakesTheNextFull) {
  expect_full_after_failure_in_flight(false);
}
TEST(StagedRefits, AfterARefitFailedInFlightTheNextCopies) {
  expect_full_after_failure_in_flight(true);
}

// Trainer rank 0 coordinates every engine rank (docs/protocol.md, "Scale"): the engine ranks
// offer their bases to it alone, and it relays to trainer rank 1 only the offers for its own
// pairs. Two trainer ranks feed two engine ranks in rounds of 4 KiB; before refit 3 engine rank 0
// forgets the base it holds from trainer rank 1 (as a restarted engine holds none), so exactly that
// pair moves in full there while the three others move a delta, every refit verified bit-exact;
// and the control plane carries the coordinated protocol's messages and no more.
TEST(DeltaRefits, CoordinatedOfferOnePairForgotten) {
  const int steps = 4;
  const DeltaRun d = run_delta({.buffer = 4096, .executor = "p2p", .delta = "on"},
                               {"--steps", std::to_string(steps), "--verify", "--update",
                                "adam:1e-5", "--fault", "forget-base:0:1:3"});
  ASSERT_EQ(d.cli.exit_code, 0) << d.cli.output;
  EXPECT_NE(d.cli.output.find("verified bit-exact"), std::string::npos) << d.cli.output;
  ASSERT_TRUE(d.report.is_object()) << d.cli.output;
  const auto& s = d.report["delta"]["steps"];
  ASSERT_EQ(s.size(), static_cast<std::size_t>(steps)) << d.report.dump(2);
  ASSERT_EQ(pairs_of(d.report), 4);
  EXPECT_EQ(s[0]["pairs"], 0) << s.dump(2);
  EXPECT_EQ(s[1]["pairs"], 4) << s.dump(2);
  EXPECT_EQ(s[2]["pairs"], 3) << s.dump(2);
  EXPECT_EQ(s[3]["pairs"], 4) << s.dump(2);
  EXPECT_LT(s[1]["wire_bytes"].get<std::int64_t>(), s[1]["full_bytes"].get<std::int64_t>() / 2);
  // Refit 3 moves one pair's bytes in full and deltas of the three others.
  EXPECT_GT(s[2]["wire_bytes"].get<std::int64_t>(), s[1]["wire_bytes"].get<std::int64_t>());
  EXPECT_LT(s[2]["wire_bytes"].get<std::int64_t>(), s[2]["full_bytes"].get<std::int64_t>());
  // Both sides of that pair say why, and no other pair moved in full after the first refit.
  EXPECT_EQ(count_of(d.cli.output,
                     "fault injection: forgetting what this rank holds from trainer "
                     "rank 1"),
            1u)
      << d.cli.output;
  EXPECT_EQ(count_of(d.cli.output,
                     "engine 0 tp rank 0: refit.delta: step 3: no base offered to "
                     "trainer rank(s) 1: this rank holds no base from them"),
            1u)
      << d.cli.output;
  EXPECT_EQ(count_of(d.cli.output,
                     "trainer rank 1: refit.delta: step 3: engine rank(s) 0: they offered no base"),
            1u)
      << d.cli.output;
  for (const char* step : {"step 2: ", "step 4: "}) {
    EXPECT_EQ(count_of(d.cli.output, std::string(step) + "no base offered"), 0u) << d.cli.output;
    EXPECT_EQ(count_of(d.cli.output, std::string(step) + "engine rank(s)"), 0u) << d.cli.output;
  }
  EXPECT_EQ(count_of(d.cli.output, "step 3: no base offered"), 1u) << d.cli.output;
  EXPECT_EQ(count_of(d.cli.output, "step 3: engine rank(s)"), 1u) << d.cli.output;
  // With --verify, per refit: trainer rank 0 sends E begin, proceed, commit and outcome and T - 1
  // engines-paused and refit-done; each engine rank paused, committed, verified and outcome-heard;
  // trainer rank 1 one sent: 8E + 3(T - 1) (docs/protocol.md, "Scale"). A begin or paused between
  // any other pair would add to it.
  ASSERT_TRUE(d.report.contains("control")) << d.report.dump(2);
  EXPECT_EQ(d.report["control"]["refit_mailbox_messages"], (8 * 2 + 3 * 1) * steps)
      << d.report["control"].dump();
}

// An engine rank offers its base and the trainer rank decides on full (here: it forgot what it
// kept for that engine rank before refit 3): the pair's rounds each begin with the word that says
// the segment follows in full, the engine rank scatters them as a full refit, and the other pairs
// of both ranks move deltas in the same rounds.
TEST(DeltaRefits, CoordinatedTrainerDecidesFullOnOfferedBase) {
  const int steps = 4;
  const DeltaRun d = run_delta({.buffer = 4096, .executor = "p2p", .delta = "on"},
                               {"--steps", std::to_string(steps), "--verify", "--update",
                                "adam:1e-5", "--fault", "forget-kept:1:0:3"});
  ASSERT_EQ(d.cli.exit_code, 0) << d.cli.output;
  EXPECT_NE(d.cli.output.find("verified bit-exact"), std::string::npos) << d.cli.output;
  const auto& s = d.report["delta"]["steps"];
  ASSERT_EQ(s.size(), static_cast<std::size_t>(steps)) << d.report.dump(2);
  EXPECT_EQ(s[1]["pairs"], 4) << s.dump(2);
  EXPECT_EQ(s[2]["pairs"], 3) << s.dump(2);
  EXPECT_EQ(s[3]["pairs"], 4) << s.dump(2);
  EXPECT_EQ(count_of(d.cli.output,
                     "trainer rank 1: refit.delta: step 3: engine rank(s) 0: this "
                     "rank keeps no base for them"),
            1u)
      << d.cli.output;
  EXPECT_EQ(count_of(d.cli.output,
                     "engine 0 tp rank 0: refit.delta: step 3: trainer rank(s) 1 "
                     "sent their routes in full, though this rank offered them its "
                     "base"),
            1u)
      << d.cli.output;
  EXPECT_EQ(count_of(d.cli.output, "sent their routes in full, though"), 1u) << d.cli.output;
  EXPECT_EQ(count_of(d.cli.output, "no base offered"), 2u) << d.cli.output;  // refit 1 only
}

// refit.checksum covers delta refits: every pair's checksum matched on every refit.
TEST(DeltaRefits, ChecksumsMatch) {
  const DeltaRun d = run_delta({.executor = "p2p", .checksum = true, .delta = "on"},
                               {"--steps", "4", "--update", "adam:1e-5"});
  ASSERT_EQ(d.cli.exit_code, 0) << d.cli.output;
  const auto& s = d.report["delta"]["steps"];
  ASSERT_EQ(s.size(), 4u);
  EXPECT_GT(s[3]["pairs"].get<int>(), 0) << s.dump(2);
}

}  // namespace
}  // namespace refit
