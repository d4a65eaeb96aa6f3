// Any model (docs/models.md, docs/engines.md): tensor tables read from a checkpoint's safetensors
// headers for architectures refit has no facts about, the engine layout `hf` (every engine rank
// receives every tensor whole under its HF name), and the setup-time refusals of what needs the
// facts (the fused layout, the Megatron bridge, --check-logits). The models are written here, as
// safetensors with odd shapes, and refitted across real processes bit-exact.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/convert.h"
#include "engine/engine_layout.h"
#include "io/safetensors.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::run_cli;
using testing::TempDir;

struct Table {
  std::string arch;
  bool tie = false;
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> tensors;
};

// A GPT-NeoX-like table: fused qkv with bias, an MLP of odd width, layers 0, 2 and 10 (so that
// natural order differs from byte order), a 0-d and a 3-D tensor, an untied output head.
Table neox_like() {
  Table t{.arch = "GPTNeoXForCausalLM"};
  t.tensors = {{"gpt_neox.embed_in.weight", {37, 24}}, {"gpt_neox.final_layer_norm.weight", {24}},
               {"gpt_neox.final_layer_norm.bias", {24}}, {"gpt_neox.scalar_gain", {}},
               {"gpt_neox.mixer", {3, 5, 7}},         {"embed_out.weight", {37, 24}}};
  for (int layer : {0, 2, 10}) {
    const std::string p = fmt::format("gpt_neox.layers.{}.", layer);
    t.tensors.push_back({p + "attention.query_key_value.weight", {72, 24}});
    t.tensors.push_back({p + "attention.query_key_value.bias", {72}});
    t.tensors.push_back({p + "attention.dense.weight", {24, 24}});
    t.tensors.push_back({p + "mlp.dense_h_to_4h.weight", {53, 24}});
    t.tensors.push_back({p + "mlp.dense_4h_to_h.weight", {24, 53}});
    t.tensors.push_back({p + "input_layernorm.weight", {24}});
  }
  return t;
}

// A Phi-like table (PhiForCausalLM, not Phi-3): separate q/k/v with biases, fc1/fc2, a stored
// lm_head.weight that tie_word_embeddings makes the embedding again.
Table phi_like() {
  Table t{.arch = "PhiForCausalLM", .tie = true};
  t.tensors = {{"model.embed_tokens.weight", {41, 20}},
               {"model.final_layernorm.weight", {20}},
               {"model.final_layernorm.bias", {20}},
               {"lm_head.weight", {41, 20}}};
  for (int layer = 0; layer < 3; ++layer) {
    const std::string p = fmt::format("model.layers.{}.", layer);
    for (const char* x : {"q_proj", "k_proj", "v_proj"}) {
      t.tensors.push_back({p + "self_attn." + x + ".weight", {20, 20}});
      t.tensors.push_back({p + "self_attn." + x + ".bias", {20}});
    }
    t.tensors.push_back({p + "self_attn.dense.weight", {20, 20}});
    t.tensors.push_back({p + "mlp.fc1.weight", {77, 20}});
    t.tensors.push_back({p + "mlp.fc1.bias", {77}});
    t.tensors.push_back({p + "mlp.fc2.weight", {20, 77}});
  }
  return t;
}

// Writes `t` as a model directory under `dir`: config.json and `shards` safetensors files, the
// even-numbered tensors in bf16 and the others in fp32, with values no two tensors share.
std::string write_model(const TempDir& dir, const std::string& name, const Table& t,
                        int shards) {
  const std::string model = dir.path() + "/" + name;
  dir.write(name + "/config.json",
            fmt::format(R"({{"architectures": ["{}"], "tie_word_embeddings": {}, "hidden_size": 24}})",
                        t.arch, t.tie ? "true" : "false"));
  std::vector<std::vector<std::byte>> data;
  std::vector<TensorView> views;
  for (std::size_t i = 0; i < t.tensors.size(); ++i) {
    const auto& [tname, shape] = t.tensors[i];
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    std::vector<float> v(static_cast<std::size_t>(n));
    for (std::int64_t k = 0; k < n; ++k)
      v[static_cast<std::size_t>(k)] =
          static_cast<float>(std::sin(0.37 * static_cast<double>(k) + static_cast<double>(i)));
    const DType dt = i % 2 == 0 ? DType::kBFloat16 : DType::kFloat32;
    data.emplace_back(static_cast<std::size_t>(n) * dtype_size(dt));
    convert(v.data(), DType::kFloat32, data.back().data(), dt, static_cast<std::size_t>(n));
    views.push_back(TensorView{tname, dt, shape, data.back().data()});
  }
  const Status st = write_checkpoint(model, views, shards);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return model;
}

TEST(AnyModel, TableComesFromTheHeadersInNaturalOrder) {
  TempDir dir;
  const Table t = neox_like();
  const std::string model = write_model(dir, "neox", t, 2);
  auto spec = load_model_spec(model);
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  EXPECT_FALSE(spec->known_architecture());
  EXPECT_EQ(spec->config().architecture, "GPTNeoXForCausalLM");
  ASSERT_EQ(spec->tensors().size(), t.tensors.size());
  for (const auto& [name, shape] : t.tensors) {
    auto at = spec->find(name);
    ASSERT_TRUE(at) << name;
    EXPECT_EQ(spec->tensors()[*at].shape, shape) << name;
    EXPECT_EQ(spec->tensors()[*at].role, ParamRole::kOther) << name;
  }
  // Natural order: layer 2 before layer 10, and a tensor knows its layer.
  const auto l2 = *spec->find("gpt_neox.layers.2.input_layernorm.weight");
  const auto l10 = *spec->find("gpt_neox.layers.10.attention.dense.weight");
  EXPECT_LT(l2, l10);
  EXPECT_EQ(spec->tensors()[l10].layer, 10);
  EXPECT_EQ(spec->tensors()[*spec->find("embed_out.weight")].layer, -1);
  for (std::size_t i = 1; i < spec->tensors().size(); ++i)
    EXPECT_TRUE(natural_name_less(spec->tensors()[i - 1].name, spec->tensors()[i].name));
}

TEST(AnyModel, NaturalOrderComparesNumbersAsNumbers) {
  EXPECT_TRUE(natural_name_less("layers.2.w", "layers.10.w"));
  EXPECT_FALSE(natural_name_less("layers.10.w", "layers.2.w"));
  EXPECT_TRUE(natural_name_less("a.9", "a.10"));
  EXPECT_TRUE(natural_name_less("a.1", "a.01"));  // a total order: equal numbers, fewer digits first
  EXPECT_FALSE(natural_name_less("a.1", "a.1"));
  EXPECT_TRUE(natural_name_less("a", "a.0"));
  EXPECT_EQ(layer_of_name("model.layers.17.mlp.w"), 17);
  EXPECT_EQ(layer_of_name("gpt_neox.layers.3.x"), 3);
  EXPECT_EQ(layer_of_name("model.sublayers.3.x"), -1);
  EXPECT_EQ(layer_of_name("model.layers.x"), -1);
}

TEST(AnyModel, TiedOutputHeadIsSentOnce) {
  TempDir dir;
  const std::string model = write_model(dir, "phi", phi_like(), 1);
  auto spec = load_model_spec(model);
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  EXPECT_TRUE(spec->config().tie_word_embeddings);
  EXPECT_FALSE(spec->find("lm_head.weight"));
  EXPECT_TRUE(spec->find("model.embed_tokens.weight"));
  EXPECT_EQ(spec->tensors().size(), phi_like().tensors.size() - 1);
}

// An architecture refit has no facts about, even a relative of one it knows (DeepSeek-V2's class
// next to DeepseekV3ForCausalLM), goes through its headers and the hf layout; fused is refused,
// naming the way that works.
TEST(AnyModel, UnknownDeepseekClassGoesThroughItsHeaders) {
  TempDir dir;
  Table t{.arch = "DeepseekV2ForCausalLM"};
  t.tensors = {{"model.embed_tokens.weight", {50, 16}},
               {"model.layers.0.self_attn.kv_b_proj.weight", {24, 8}},
               {"model.layers.0.mlp.gate.weight", {4, 16}},
               {"lm_head.weight", {50, 16}}};
  const std::string model = write_model(dir, "ds", t, 1);
  const std::string fused = dir.write("f.yaml", "model: " + model + "\ngeneration: {tp_size: 2}\n");
  auto r = run_cli({"check", fused}, 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("generation.layout: fused needs an architecture refit knows"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("is DeepseekV2ForCausalLM"), std::string::npos) << r.output;
  const std::string hf =
      dir.write("h.yaml", "model: " + model + "\ngeneration: {tp_size: 2, layout: hf}\n");
  auto ok = run_cli({"run", hf, "--steps", "1", "--verify"}, 120);
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("verified bit-exact"), std::string::npos) << ok.output;
}

TEST(AnyModel, AnUnknownArchitectureWithoutSafetensorsIsRefusedByName) {
  TempDir dir;
  dir.write("m/config.json", R"({"architectures": ["MadeUpForCausalLM"]})");
  auto spec = load_model_spec(dir.path() + "/m");
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(spec.status().message().find("\"MadeUpForCausalLM\""), std::string::npos);
  EXPECT_NE(spec.status().message().find("holds no safetensors"), std::string::npos);
}

// Every TP rank holds every tensor whole, under its HF name, in the spec's order; with a known
// architecture the same holds, and TP sizes the fused layout refuses are fine.
TEST(AnyModel, HfLayoutGivesEveryRankEveryTensorWhole) {
  TempDir dir;
  auto neox = load_model_spec(write_model(dir, "neox", neox_like(), 1));
  ASSERT_TRUE(neox.ok());
  auto qwen = load_model_spec("tiny-qwen3");
  ASSERT_TRUE(qwen.ok());
  for (const ModelSpec* spec : {&*neox, &*qwen}) {
    for (int tp : {1, 3}) {
      for (int r = 0; r < tp; ++r) {
        auto L = engine_layout(*spec, tp, r, EngineLayout::kHf, EngineProtocol::kVllm);
        ASSERT_TRUE(L.ok()) << L.status().to_string();
        ASSERT_EQ(L->params.size(), spec->tensors().size());
        EXPECT_EQ(L->total_numel(), spec->total_parameters());
        for (std::size_t i = 0; i < L->params.size(); ++i) {
          const EngineParam& p = L->params[i];
          EXPECT_EQ(p.name, spec->tensors()[i].name);
          EXPECT_EQ(p.shape, spec->tensors()[i].shape);
          ASSERT_EQ(p.pieces.size(), 1u) << p.name;
          const MatrixShape m = matrix_shape(p.shape);
          EXPECT_EQ(p.pieces[0].hf_tensor, i);
          EXPECT_EQ(p.pieces[0].rows, m.rows);
          EXPECT_EQ(p.pieces[0].cols, m.cols);
        }
      }
    }
  }
  EXPECT_FALSE(engine_layout(*neox, 2, 0, EngineLayout::kFused, EngineProtocol::kVllm).ok());
  EXPECT_FALSE(check_engine_tp(*qwen, 3).ok());  // the fused layout could not shard it
}

// What needs architecture facts is refused at setup (exit 2), naming the architecture and the
// way out.
TEST(AnyModel, FusedMegatronAndLogitChecksAreRefusedNamingTheArchitecture) {
  TempDir dir;
  const std::string model = write_model(dir, "neox", neox_like(), 1);
  struct Case {
    std::string yaml;
    std::vector<std::string> extra;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"generation: {tp_size: 2}\n",
       {},
       {"generation.layout: fused needs an architecture refit knows", "GPTNeoXForCausalLM",
        "allowed: hf"}},
      {"policy: {backend: megatron, world_size: 2, megatron: {tp: 2}}\n"
       "generation: {tp_size: 2, layout: hf}\n",
       {},
       {"policy.backend: megatron needs an architecture refit's Megatron bridge knows", "GPTNeoXForCausalLM",
        "allowed: fsdp2"}},
      {"generation: {tp_size: 2, layout: hf}\n",
       {"--check-logits"},
       {"--check-logits: refit has no reference forward for GPTNeoXForCausalLM"}},
  };
  for (const Case& c : cases) {
    const std::string cfg = dir.write("c.yaml", "model: " + model + "\n" + c.yaml);
    std::vector<std::string> args = {c.extra.empty() ? "check" : "run", cfg};
    args.insert(args.end(), c.extra.begin(), c.extra.end());
    auto r = run_cli(args, 60);
    EXPECT_EQ(r.exit_code, 2) << c.yaml << r.output;
    for (const auto& e : c.expect) EXPECT_NE(r.output.find(e), std::string::npos) << e << "\n" << r.output;
    // Refused before any rank started.
    EXPECT_EQ(r.output.find("trainer rank"), std::string::npos) << r.output;
  }
}

struct HfCell {
  std::string model;
  std::string backend = "fsdp2";
  std::string megatron = "{tp: 1, pp: 1, ep: 1}";
  int world_size = 3;
  int num_engines = 2;
  int tp = 2;
  bool colocated = false;
  std::string executor = "auto";
  std::string engine = "sglang";
};

testing::CliResult run_hf_cell(const TempDir& dir, const HfCell& c,
                               const std::vector<std::string>& extra) {
  const std::string cfg = dir.write(
      "cell.yaml",
      fmt::format("model: {}\nseed: 3\npolicy: {{backend: {}, world_size: {}, megatron: {}}}\n"
                  "generation: {{backend: {}, colocated: {}, num_engines: {}, tp_size: {}, "
                  "layout: hf}}\n"
                  "refit: {{buffer_size_bytes: 1024, timeout_s: 30, executor: {}}}\n",
                  c.model, c.backend, c.world_size, c.megatron, c.engine,
                  c.colocated ? "true" : "false", c.num_engines, c.tp, c.executor));
  std::vector<std::string> args = {"run", cfg, "--steps", "2", "--verify"};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_cli(args, 180);
}

void expect_hf_cell(const TempDir& dir, const HfCell& c, const std::string& pairs,
                    const std::vector<std::string>& extra = {}) {
  SCOPED_TRACE(fmt::format("{} {} world {} -> {} x TP {} {} executor {}", c.model, c.backend,
                           c.world_size, c.num_engines, c.tp,
                           c.colocated ? "colocated" : "non-colocated", c.executor));
  auto r = run_hf_cell(dir, c, extra);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verified bit-exact on every engine rank"), std::string::npos)
      << r.output;
  // Every engine rank took the weights through the load_weights hook, checked and verified.
  std::size_t hooked = 0;
  for (auto at = r.output.find("by name in"); at != std::string::npos;
       at = r.output.find("by name in", at + 1))
    ++hooked;
  EXPECT_EQ(hooked, static_cast<std::size_t>(c.num_engines * c.tp)) << r.output;
  // --check-logits ran the reference forward on every rank's whole tensors.
  if (std::find(extra.begin(), extra.end(), "--check-logits") != extra.end()) {
    EXPECT_NE(r.output.find("engine logits match the reference forward"), std::string::npos)
        << r.output;
  }
  if (!pairs.empty()) {
    EXPECT_NE(r.output.find("pairs by executor: " + pairs), std::string::npos) << r.output;
  }
}

// The issue's CI cell: FSDP2 world 3 (uneven dim-0 chunks, buffers smaller than most tensors) →
// two engines of TP 2 in the hf layout, bit-exact; every engine rank holds the whole model.
TEST(AnyModelRuntime, NeoxLikeFsdp2World3ToTwoHfEngines) {
  TempDir dir;
  const std::string model = write_model(dir, "neox", neox_like(), 2);
  expect_hf_cell(dir, {.model = model, .executor = "p2p"}, "peer 0, p2p 12");
  // `refit check` shows the layout and its cost: each engine rank receives the whole model.
  const std::string cfg = dir.write(
      "c.yaml", "model: " + model +
                    "\npolicy: {world_size: 3}\ngeneration: {num_engines: 2, tp_size: 2, "
                    "layout: hf}\n");
  auto r = run_cli({"check", cfg}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("engine layout: hf"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("engine rank 3 receives"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(1.000 of the model)"), std::string::npos) << r.output;
}

TEST(AnyModelRuntime, PhiLikeColocatedAndGatherInHfLayout) {
  TempDir dir;
  const std::string model = write_model(dir, "phi", phi_like(), 1);
  // Colocated world 2 → TP 2: trainer ranks write into the engines' parameters in place.
  expect_hf_cell(dir, {.model = model, .world_size = 2, .num_engines = 1, .colocated = true},
                 "peer 4, p2p 0");
  // Full buckets: all-gather, then a broadcast to every engine rank.
  expect_hf_cell(dir, {.model = model, .world_size = 2, .executor = "gather", .engine = "vllm"},
                 "");
}

// A refit whose bytes arrive corrupted on one engine rank (refit.checksum) is rolled back
// (refit.keep_previous): every engine rank hands the restored bytes to its load_weights hook again,
// and the next refit verifies — the weights the hook took included.
TEST(AnyModelRuntime, RollbackHandsTheRestoredWeightsToLoadWeights) {
  TempDir dir;
  const std::string model = write_model(dir, "neox", neox_like(), 1);
  const std::string cfg = dir.write(
      "c.yaml", "model: " + model +
                    "\npolicy: {world_size: 2}\ngeneration: {num_engines: 1, tp_size: 2, "
                    "layout: hf}\nrefit: {buffer_size_bytes: 4096, timeout_s: 30, executor: p2p, "
                    "checksum: true, keep_previous: true}\n");
  auto r = run_cli({"run", cfg, "--steps", "3", "--verify", "--fault", "corrupt:1:2"}, 180);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("checksum mismatch in refit step 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("call(s) (after the rollback)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 3/3: refit "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("by name in"), std::string::npos) << r.output;
}

// A known architecture in the hf layout, from a Megatron trainer (TP 2): the bridge maps its
// shards to HF tensors, every engine rank receives them whole, and the logits of the reference
// forward on each rank's tensors equal those on the trainer's weights.
TEST(AnyModelRuntime, MegatronToHfLayoutWithLogits) {
  TempDir dir;
  expect_hf_cell(dir,
                 {.model = "tiny-qwen3", .backend = "megatron", .megatron = "{tp: 2, pp: 1, ep: 1}",
                  .world_size = 2},
                 "", {"--check-logits"});
}

}  // namespace
}  // namespace refit
