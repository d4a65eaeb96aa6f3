// End-to-end refits across real processes on loopback: `refit run --verify` for every FSDP2 cell of
// the support matrix, uneven shards, several engines and TP sizes, small buffers, and each
// executor (peer, p2p, gather) named by the pairs it served.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
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

// The full-bucket design, kept as the explicit `refit.executor: gather`: all-gather over the
// trainer group, then broadcast from trainer rank 0 or the colocated rank's ipc slots.
TEST(RuntimeGather, Fsdp2SglangBroadcast) { expect_verified({.executor = "gather"}); }
TEST(RuntimeGather, Fsdp2VllmBroadcastTwoEngines) {
  expect_verified({.engine = "vllm", .num_engines = 2, .executor = "gather"});
}
TEST(RuntimeGather, Fsdp2SglangIpcSmallBuffers) {
  expect_verified({.colocated = true, .buffer = 4096, .executor = "gather"});
}
// With verification the trainer ranks of ipc slots agree on each outcome through the store, a
// key per rank and refit; each rank erases its key of two outcomes before (steps 3 and 4 here),
// so a long run does not grow the store.
TEST(RuntimeGather, TrainerRanksEraseTheirOutcomeKeysOfEarlierRefits) {
  setenv("REFIT_LOG", "debug", 1);
  auto r = run_cell({.colocated = true, .buffer = 4096, .executor = "gather"},
                    {"--steps", "4", "--verify"});
  unsetenv("REFIT_LOG");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, ", verified\n"), 4u) << r.output;
  EXPECT_EQ(count_of(r.output, "erased its outcome key 'outcome/0/"), 4u) << r.output;
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

// Compact routes (one route for a run of experts or layers that sit one step apart on both sides):
// verified bit-exact over peer access and point-to-point, with rounds that cut runs of experts,
// and with the HF-name layout, whose experts are separate parameters. The trainer's log line
// says how many blocks its routes stand for: more than the routes themselves.
void expect_compact_run(const testing::CliResult& r, const std::string& pairs) {
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verified bit-exact"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("pairs by executor: " + pairs), std::string::npos) << r.output;
  const auto at = r.output.find("this rank sends ");
  ASSERT_NE(at, std::string::npos) << r.output;
  long long routes = 0, blocks = 0;
  ASSERT_EQ(std::sscanf(r.output.c_str() + at, "this rank sends %lld routes (%lld blocks)", &routes,
                        &blocks),
            2)
      << r.output.substr(at, 120);
  EXPECT_GT(blocks, 2 * routes) << r.output.substr(at, 120);
}
void expect_compact(const Cell& c, const std::string& pairs) {
  expect_compact_run(run_cell(c), pairs);
}
TEST(RuntimeCompactRoutes, MoeP2pRoundsCutRunsOfExperts) {
  expect_compact({.model = "tiny-moe",
                  .world_size = 3,
                  .num_engines = 2,
                  .tp = 2,
                  .buffer = 4096,
                  .executor = "p2p"},
                 "peer 0, p2p 12");
}
TEST(RuntimeCompactRoutes, MoePeerVllm) {
  expect_compact({.model = "tiny-moe", .engine = "vllm", .world_size = 3, .tp = 2},
                 "peer 6, p2p 0");
}
TEST(RuntimeCompactRoutes, MoeHfLayoutP2p) {
  expect_compact({.model = "tiny-moe",
                  .world_size = 2,
                  .tp = 2,
                  .buffer = 4096,
                  .executor = "p2p",
                  .layout = "hf"},
                 "peer 0, p2p 4");
}
TEST(RuntimeCompactRoutes, MoeHfLayoutPeerChecksummed) {
  expect_compact({.model = "tiny-moe", .world_size = 2, .tp = 2, .checksum = true, .layout = "hf"},
                 "peer 4, p2p 0");
}

// The same in the DeepSeek-V3 / GLM-4.5 shapes (multi-head latent attention, shared experts, dense
// first layers, the float32 router bias): each executor and layout, and FP8 blocks.
TEST(RuntimeCompactRoutes, FrontierMoePresetsOverEveryExecutorAndLayout) {
  struct Case {
    Cell cell;
    const char* pairs;
  };
  const std::vector<Case> cases = {
      {{.model = "tiny-deepseek",
        .world_size = 3,
        .num_engines = 2,
        .tp = 2,
        .buffer = 4096,
        .executor = "p2p"},
       "peer 0, p2p 12"},
      {{.model = "tiny-deepseek-lite",
        .engine = "vllm",
        .world_size = 3,
        .tp = 2,
        .executor = "peer"},
       "peer 6, p2p 0"},
      {{.model = "tiny-glm4-moe",
        .engine = "vllm",
        .world_size = 3,
        .num_engines = 2,
        .tp = 2,
        .buffer = 4096,
        .executor = "p2p"},
       "peer 0, p2p 12"},
      {{.model = "tiny-glm4-moe", .world_size = 2, .tp = 2, .checksum = true, .layout = "hf"},
       "peer 4, p2p 0"},
      {{.model = "tiny-deepseek-lite",
        .world_size = 2,
        .tp = 2,
        .buffer = 4096,
        .executor = "p2p",
        .layout = "hf"},
       "peer 0, p2p 4"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(config_yaml(c.cell));
    expect_compact(c.cell, c.pairs);
  }
}
TEST(RuntimeCompactRoutes, FrontierMoeFp8BlocksOverP2p) {
  TempDir dir;
  for (const char* engine : {"vllm", "sglang"}) {
    SCOPED_TRACE(engine);
    const std::string path = dir.write(
        "fp8.yaml",
        std::string("model: tiny-deepseek\npolicy: {world_size: 3}\ngeneration: {backend: ") +
            engine +
            ", num_engines: 2, tp_size: 2}\nrefit: {target_precision: fp8, fp8: {block: [8, 8]}, "
            "buffer_size_bytes: 4096, executor: p2p, timeout_s: 30}\n");
    auto r = run_cli({"run", path, "--steps", "2", "--verify"}, 180);
    EXPECT_NE(r.output.find("against the FP8 reference quantizer"), std::string::npos) << r.output;
    expect_compact_run(r, "peer 0, p2p 12");
  }
}
// Megatron's TP, PP and EP shards into engine TP: runs of experts end at an EP boundary.
TEST(RuntimeCompactRoutes, MegatronTpPpEpOverP2p) {
  const std::vector<Cell> cells = {
      {.model = "tiny-moe",
       .world_size = 4,
       .tp = 2,
       .buffer = 4096,
       .executor = "p2p",
       .backend = "megatron",
       .megatron_tp = 2,
       .megatron_ep = 2},
      {.model = "tiny-moe",
       .engine = "vllm",
       .world_size = 4,
       .num_engines = 2,
       .tp = 2,
       .buffer = 4096,
       .executor = "p2p",
       .backend = "megatron",
       .megatron_tp = 2,
       .megatron_pp = 2},
  };
  for (const Cell& c : cells) {
    SCOPED_TRACE(config_yaml(c));
    expect_compact(c, "peer 0, p2p ");
  }
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

}  // namespace
}  // namespace refit
