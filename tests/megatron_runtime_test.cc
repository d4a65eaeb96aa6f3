// Megatron cells end to end (refit run --verify --check-logits across processes) and the
// `refit shard` dump checked against layouts computed independently here.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <set>
#include <nlohmann/json.hpp>

#include "common/convert.h"
#include "io/safetensors.h"
#include "refit/model_spec.h"
#include "weights/weights.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::run_cli;
using testing::TempDir;

struct MCell {
  std::string model = "tiny-qwen3";
  std::string backend = "megatron";
  std::string engine = "sglang";
  bool colocated = false;
  int world_size = 2;
  int tp = 2, pp = 1, ep = 1;
  int num_engines = 1;
  int engine_tp = 2;
  std::string executor = "auto";
  double timeout_s = 20;
};

// The config of a Megatron cell (refit.buffer_size_bytes 16384, seed 3).
std::string yaml(const MCell& c) {
  return testing::config_yaml({.model = c.model,
                               .engine = c.engine,
                               .colocated = c.colocated,
                               .world_size = c.world_size,
                               .num_engines = c.num_engines,
                               .tp = c.engine_tp,
                               .buffer = 16384,
                               .timeout_s = c.timeout_s,
                               .executor = c.executor,
                               .seed = 3,
                               .backend = c.backend,
                               .megatron_tp = c.tp,
                               .megatron_pp = c.pp,
                               .megatron_ep = c.ep});
}

void expect_cell(const MCell& c) {
  TempDir dir;
  auto r = run_cli(
      {"run", dir.write("c.yaml", yaml(c)), "--steps", "3", "--verify", "--check-logits"}, 120);
  EXPECT_EQ(r.exit_code, 0) << yaml(c) << r.output;
  EXPECT_NE(r.output.find("verified bit-exact"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("engine logits match"), std::string::npos) << r.output;
}

// Megatron TP 2 -> engine TP 2: each trainer rank feeds one engine rank. Engine rank 1 refuses
// step 2 (its pause hook fails): trainer rank 0, which does not feed it, hears its answer too and
// aborts, and steps 1 and 3 verify.
TEST(MegatronRecovery, RefusedRefitIsAbortedByTrainerRanksThatDoNotFeedTheRefusingRank) {
  TempDir dir;
  auto r = run_cli({"run", dir.write("c.yaml", yaml({.engine = "vllm"})), "--steps", "3",
                    "--verify", "--fault", "fail-pause:1:2"},
                   120);
  SCOPED_TRACE(r.output);
  EXPECT_EQ(r.exit_code, 1);
  for (int rank : {0, 1})
    EXPECT_NE(r.output.find(fmt::format("trainer rank {}: refit step 2 aborted before any byte "
                                        "moved: engine 0 tp rank 1: the pause hook failed",
                                        rank)),
              std::string::npos)
        << "trainer rank " << rank;
  EXPECT_NE(r.output.find("1 of 3 refit(s) failed (steps 2); the session went on"),
            std::string::npos);
  EXPECT_NE(r.output.find("step 3/3: refit "), std::string::npos);
}

// Megatron TP 2 -> engine TP 2 over point-to-point: trainer rank 1 stalls in step 2 (alive), so
// engine rank 1's receive times out. Trainer rank 0 and engine rank 0, which never wait for
// trainer rank 1's bytes, fail the refit in flight too; every rank forms its groups anew, and
// step 3 of the same session verifies (docs/runtime.md, "A refit that fails in flight").
TEST(MegatronRecovery, StalledTrainerRankFailsTheRefitInFlightOnEveryRank) {
  TempDir dir;
  auto r = run_cli({"run", dir.write("c.yaml", yaml({.executor = "p2p", .timeout_s = 3})),
                    "--steps", "3", "--verify", "--fault", "stall-trainer:1:2"},
                   120);
  SCOPED_TRACE(r.output);
  EXPECT_EQ(r.exit_code, 1);
  for (const char* rank : {"trainer rank 0", "trainer rank 1", "engine 0 tp rank 0",
                           "engine 0 tp rank 1"})
    EXPECT_NE(r.output.find(fmt::format("{}: refit step 2 failed in flight with every rank alive",
                                        rank)),
              std::string::npos)
        << rank;
  EXPECT_NE(r.output.find("1 of 3 refit(s) failed (steps 2); the session went on"),
            std::string::npos);
  EXPECT_NE(r.output.find("step 3/3: refit "), std::string::npos);
  EXPECT_EQ(r.output.find("step 3/3: refit failed"), std::string::npos);
}

// The four Megatron cells.
TEST(MegatronCells, SglangBroadcast) { expect_cell({}); }
TEST(MegatronCells, VllmBroadcast) { expect_cell({.engine = "vllm"}); }
TEST(MegatronCells, SglangIpc) {
  expect_cell({.colocated = true, .num_engines = 2, .engine_tp = 1});
}
TEST(MegatronCells, VllmIpc) { expect_cell({.engine = "vllm", .colocated = true}); }

TEST(MegatronShapes, Tp1Dp2) { expect_cell({.tp = 1}); }
TEST(MegatronShapes, Tp2Pp2) { expect_cell({.world_size = 4, .tp = 2, .pp = 2}); }
TEST(MegatronShapes, Tp2Dp2) { expect_cell({.world_size = 4, .tp = 2}); }
TEST(MegatronShapes, Gqa7Tp2Pp2TiedVocabNotDivisible) {
  // tiny-qwen2: 14 heads / 2 kv heads, vocabulary 515 (not a multiple of 128*tp), tied.
  expect_cell({.model = "tiny-qwen2", .world_size = 4, .tp = 2, .pp = 2});
}
TEST(MegatronShapes, Gqa1Tp4) {
  expect_cell({.model = "tiny-llama", .world_size = 4, .tp = 4, .engine_tp = 4});
}
TEST(MegatronShapes, MoeEp2Dp2) {
  expect_cell({.model = "tiny-moe", .engine = "vllm", .world_size = 4, .tp = 2, .ep = 2});
}
// Megatron over the transfer plan's point-to-point executor (Gloo send/recv), and the full-bucket
// gather executor (the bridge's all-gather, then broadcast).
TEST(MegatronP2p, Tp2Pp2ToTwoEnginesTp2) {
  expect_cell({.model = "tiny-qwen2",
               .world_size = 4,
               .tp = 2,
               .pp = 2,
               .num_engines = 2,
               .executor = "p2p"});
}
TEST(MegatronP2p, MoeTp2Ep2ToTp4) {
  expect_cell({.model = "tiny-moe",
               .engine = "vllm",
               .world_size = 4,
               .tp = 2,
               .ep = 2,
               .engine_tp = 4,
               .executor = "p2p"});
}
// The point-to-point group connects only the pairs that exchange bytes, on their first use: each
// rank's Gloo connections are its plan view's pairs (here 1 to 3 of the 7 other ranks), made in
// one batch at the first refit, as many in all as the report's point-to-point pairs, and the
// refits verify.
TEST(MegatronP2p, TheGroupConnectsOnlyThePairsThatExchangeBytes) {
  TempDir dir;
  const std::string json = dir.path() + "/r.json";
  ::setenv("REFIT_LOG", "debug", 1);
  auto r = run_cli({"run",
                    dir.write("c.yaml", yaml({.world_size = 4,
                                              .tp = 2,
                                              .pp = 2,
                                              .num_engines = 2,
                                              .executor = "p2p"})),
                    "--steps", "2", "--verify", "--json", json},
                   120);
  ::unsetenv("REFIT_LOG");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verified bit-exact"), std::string::npos) << r.output;
  std::set<int> ranks;
  int connections = 0;
  const std::string line = "gloo[p2p] rank ";
  for (std::size_t at = r.output.find(line); at != std::string::npos;
       at = r.output.find(line, at + 1)) {
    const int rank = std::atoi(r.output.c_str() + at + line.size());
    const std::size_t c = r.output.find(": connected ", at);
    ASSERT_NE(c, std::string::npos) << r.output;
    const int pairs = std::atoi(r.output.c_str() + c + std::strlen(": connected "));
    EXPECT_GE(pairs, 1);
    EXPECT_LT(pairs, 7) << "a full mesh";
    EXPECT_TRUE(ranks.insert(rank).second) << "rank " << rank << " connected in two batches";
    connections += pairs;
  }
  EXPECT_EQ(ranks.size(), 8u) << r.output;
  std::ifstream in(json);
  const auto report = nlohmann::json::parse(in, nullptr, false);
  ASSERT_TRUE(report.is_object());
  int pairs = 0;
  for (const auto& e : report["ranks"])
    if (e["role"] == "trainer") pairs += e["p2p_pairs"].get<int>();
  EXPECT_GT(pairs, 0);
  EXPECT_EQ(connections, 2 * pairs) << r.output;
}
TEST(MegatronGather, Tp2Pp2Broadcast) {
  expect_cell({.world_size = 4, .tp = 2, .pp = 2, .executor = "gather"});
}

TEST(MegatronShapes, MoeEp2Pp2Tp1Ipc) {
  expect_cell({.model = "tiny-moe",
               .colocated = true,
               .world_size = 4,
               .tp = 1,
               .pp = 2,
               .ep = 2,
               .num_engines = 2,
               .engine_tp = 2});
}

TEST(LogitCheck, Fsdp2Cells) {
  expect_cell({.backend = "fsdp2", .world_size = 3});
  expect_cell({.model = "tiny-moe",
               .backend = "fsdp2",
               .engine = "vllm",
               .colocated = true,
               .world_size = 2});
}

// --- refit shard against independently computed layouts -----------------------------------

std::vector<float> hf_values(const ModelSpec& spec, const std::string& name, std::uint64_t seed) {
  const auto idx = *spec.find(name);
  WeightSource w(spec, seed, nullptr);
  std::vector<float> v(static_cast<std::size_t>(spec.tensors()[idx].numel()));
  w.values(static_cast<std::uint32_t>(idx), 0, static_cast<std::int64_t>(v.size()), 0, v.data());
  return v;
}

std::vector<float> read_f32(const SafetensorsFile& f, const std::string& name,
                            std::vector<std::int64_t>* shape) {
  const TensorInfo* info = f.find(name);
  EXPECT_NE(info, nullptr) << name;
  if (info == nullptr) return {};
  *shape = info->shape;
  std::vector<float> v(static_cast<std::size_t>(info->numel()));
  std::memcpy(v.data(), f.data(*info), v.size() * 4);
  return v;
}

TEST(Shard, Fsdp2RankHoldsItsRows) {
  TempDir dir;
  auto cfg = dir.write("c.yaml", yaml({.backend = "fsdp2", .world_size = 3}));
  const std::string out = dir.path() + "/rank2.safetensors";
  auto r = run_cli({"shard", cfg, "--rank", "2", "--out", out});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto file = SafetensorsFile::open(out);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  auto spec = *load_model_spec("tiny-qwen3");
  // k_proj is [32, 64]: torch.chunk over 3 ranks gives 11, 11, 10 rows.
  std::vector<std::int64_t> shape;
  auto got = read_f32(**file, "model.layers.1.self_attn.k_proj.weight", &shape);
  EXPECT_EQ(shape, (std::vector<std::int64_t>{10, 64}));
  auto full = hf_values(spec, "model.layers.1.self_attn.k_proj.weight", 3);
  ASSERT_EQ(got.size(), 640u);
  EXPECT_EQ(std::memcmp(got.data(), full.data() + 22 * 64, 640 * 4), 0);
}

TEST(Shard, MegatronFusedQkvOfTpRank1) {
  TempDir dir;
  auto cfg = dir.write("c.yaml", yaml({.world_size = 2, .tp = 2}));
  const std::string out = dir.path() + "/rank1.safetensors";
  auto r = run_cli({"shard", cfg, "--rank", "1", "--out", out});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto file = SafetensorsFile::open(out);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  auto spec = *load_model_spec("tiny-qwen3");
  // tiny-qwen3: nq 4, nkv 2, d 16, H 64. TP rank 1 holds query group 1: q heads 2,3; kv head 1.
  std::vector<std::int64_t> shape;
  auto got = read_f32(**file, "decoder.layers.0.self_attention.linear_qkv.weight", &shape);
  EXPECT_EQ(shape, (std::vector<std::int64_t>{(2 + 1 + 1) * 16, 64}));
  auto q = hf_values(spec, "model.layers.0.self_attn.q_proj.weight", 3);
  auto k = hf_values(spec, "model.layers.0.self_attn.k_proj.weight", 3);
  auto v = hf_values(spec, "model.layers.0.self_attn.v_proj.weight", 3);
  std::vector<float> want;
  want.insert(want.end(), q.begin() + 32 * 64, q.begin() + 64 * 64);  // q rows of heads 2, 3
  want.insert(want.end(), k.begin() + 16 * 64, k.begin() + 32 * 64);  // k rows of kv head 1
  want.insert(want.end(), v.begin() + 16 * 64, v.begin() + 32 * 64);  // v rows of kv head 1
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0);
  // linear_proj is row-parallel: columns [32, 64) of o_proj.
  auto proj = read_f32(**file, "decoder.layers.0.self_attention.linear_proj.weight", &shape);
  EXPECT_EQ(shape, (std::vector<std::int64_t>{64, 32}));
  auto o = hf_values(spec, "model.layers.0.self_attn.o_proj.weight", 3);
  for (int row = 0; row < 64; ++row)
    ASSERT_EQ(std::memcmp(proj.data() + row * 32, o.data() + row * 64 + 32, 32 * 4), 0) << row;
  // Vocabulary padded to 128*tp = 256 -> 1024 rows, 512 per rank; rank 1 holds rows 512..1023,
  // of which 512..999 are real.
  auto emb = read_f32(**file, "embedding.word_embeddings.weight", &shape);
  EXPECT_EQ(shape, (std::vector<std::int64_t>{512, 64}));
  auto e = hf_values(spec, "model.embed_tokens.weight", 3);
  EXPECT_EQ(std::memcmp(emb.data(), e.data() + 512 * 64, 488 * 64 * 4), 0);
  for (std::size_t i = 488 * 64; i < emb.size(); ++i) ASSERT_EQ(emb[i], 0.0f) << i;
}

TEST(Shard, RankOutsideTheGroupIsASetupError) {
  TempDir dir;
  auto r = run_cli({"shard", dir.write("c.yaml", yaml({})), "--rank", "5", "--out",
                    dir.path() + "/x.safetensors"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--rank 5"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace refit
