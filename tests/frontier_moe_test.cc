// DeepSeek-V3 (MLA) and GLM-4.5 end to end, across real processes: every cell kind (FSDP2 ->
// both engine protocols, colocated or not, TP 1/2/4) bit-exact with --verify on the three tiny
// shapes (q_lora_rank set and null, several shared experts, several dense first layers, MTP
// layers); the float32 router correction bias in --dump and under refit.checksum; FP8 blocks under
// DeepSeek's names; what is refused at setup (the Megatron bridge, executor gather); an FP8
// checkpoint read as the trainer's weights.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "common/convert.h"
#include "engine/engine_layout.h"
#include "io/safetensors.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "spec/fp8.h"
#include "test_util.h"
#include "weights/setup.h"

namespace refit {
namespace {

using testing::run_cli;
using testing::TempDir;

struct Cell {
  const char* model;
  const char* engine;
  bool colocated;
  int tp;
};

std::string cell_config(const Cell& c, const std::string& extra = "") {
  // Non-colocated: FSDP2 world 3 (uneven dim-0 chunks) into two engines; colocated: one trainer
  // rank per engine rank, one engine.
  const int world = c.colocated ? c.tp : 3;
  const int engines = c.colocated ? 1 : 2;
  return fmt::format(
      "model: {}\npolicy: {{world_size: {}}}\ngeneration: {{backend: {}, colocated: {}, "
      "num_engines: {}, tp_size: {}}}\nrefit: {{buffer_size_bytes: 4096, timeout_s: 30{}}}\n",
      c.model, world, c.engine, c.colocated ? "true" : "false", engines, c.tp, extra);
}

// Every (protocol, colocated, TP) kind, each on one of the three shapes.
TEST(FrontierMoeRuntime, EveryCellKindIsBitExact) {
  TempDir dir;
  const std::vector<Cell> cells = {
      {"tiny-deepseek", "vllm", false, 1},        {"tiny-deepseek-lite", "vllm", false, 2},
      {"tiny-glm4-moe", "vllm", false, 4},        {"tiny-deepseek-lite", "vllm", true, 1},
      {"tiny-glm4-moe", "vllm", true, 2},         {"tiny-deepseek", "vllm", true, 4},
      {"tiny-glm4-moe", "sglang", false, 1},      {"tiny-deepseek", "sglang", false, 2},
      {"tiny-deepseek-lite", "sglang", false, 4}, {"tiny-deepseek", "sglang", true, 1},
      {"tiny-deepseek-lite", "sglang", true, 2},  {"tiny-glm4-moe", "sglang", true, 4},
  };
  for (const Cell& c : cells) {
    SCOPED_TRACE(fmt::format("{} {} colocated {} tp {}", c.model, c.engine, c.colocated, c.tp));
    const std::string cfg = dir.write("c.yaml", cell_config(c));
    auto r = run_cli({"run", cfg, "--steps", "2", "--verify"}, 180);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("verified bit-exact on every engine rank"), std::string::npos)
        << r.output;
  }
}

// The router correction bias is float32 in every engine rank's dump and in the expected tensors,
// under refit.checksum too (its elements are checksummed as float32 on both sides); GLM-4.5's
// router weight is float32 in vLLM's layout and bf16 in SGLang's.
TEST(FrontierMoeRuntime, CorrectionBiasIsFloat32InTheDump) {
  TempDir dir;
  for (const Cell& c :
       {Cell{"tiny-deepseek", "sglang", false, 2}, Cell{"tiny-glm4-moe", "vllm", false, 2},
        Cell{"tiny-glm4-moe", "sglang", false, 2}}) {
    SCOPED_TRACE(fmt::format("{} {}", c.model, c.engine));
    const std::string cfg = dir.write("c.yaml", cell_config(c, ", checksum: true"));
    const std::string out = dir.path() + "/dump-" + c.model + "-" + c.engine;
    auto r = run_cli({"run", cfg, "--steps", "2", "--verify", "--dump", out}, 180);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("refit.checksum: step 1 arrived intact"), std::string::npos)
        << r.output;
    auto expected = SafetensorsFile::open(out + "/expected.safetensors");
    auto engine = SafetensorsFile::open(out + "/engine-3.safetensors");
    ASSERT_TRUE(expected.ok() && engine.ok());
    const std::string bias = "model.layers.2.mlp.gate.e_score_correction_bias";
    const std::string router = "model.layers.2.mlp.gate.weight";
    for (const auto* f : {expected->get(), engine->get()}) {
      const TensorInfo* b = f->find(bias);
      ASSERT_NE(b, nullptr);
      EXPECT_EQ(b->dtype, DType::kFloat32);
      EXPECT_EQ(b->shape, (std::vector<std::int64_t>{8}));
    }
    const bool glm_vllm =
        std::string(c.model) == "tiny-glm4-moe" && std::string(c.engine) == "vllm";
    EXPECT_EQ((*engine)->find(router)->dtype, glm_vllm ? DType::kFloat32 : DType::kBFloat16);
    EXPECT_EQ((*engine)->find("model.layers.2.mlp.experts.w13_weight")->dtype, DType::kBFloat16);
    // The float32 bias holds the trainer's float32 values exactly, on every engine rank.
    auto trainer = SafetensorsFile::open(out + "/trainer.safetensors");
    ASSERT_TRUE(trainer.ok());
    const TensorInfo* t = (*trainer)->find(bias);
    const TensorInfo* e = (*engine)->find(bias);
    ASSERT_TRUE(t && e);
    EXPECT_EQ(std::memcmp((*trainer)->data(*t), (*engine)->data(*e), 8 * 4), 0);
  }
}

// FP8 as DeepSeek ships it: every quantized linear of both engines' layouts with its block scale
// under the engine's name (vLLM's fused_qkv_a_proj, SGLang's fused_qkv_a_proj_with_mqa), the bias
// float32, bit-exact against the reference quantizer.
TEST(FrontierMoeRuntime, Fp8BlocksUnderDeepseekNames) {
  TempDir dir;
  for (const char* engine : {"vllm", "sglang"}) {
    SCOPED_TRACE(engine);
    const std::string text = fmt::format(
        "model: tiny-deepseek\npolicy: {{world_size: 3}}\ngeneration: {{backend: {}, "
        "num_engines: 2, tp_size: 2}}\nrefit: {{target_precision: fp8, fp8: {{block: [8, 8]}}, "
        "buffer_size_bytes: 4096, timeout_s: 30}}\n",
        engine);
    const std::string path = dir.write("fp8.yaml", text);
    const std::string out = dir.path() + "/dump-fp8-" + engine;
    auto r = run_cli({"run", path, "--steps", "2", "--verify", "--dump", out}, 180);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("verified bit-exact against the FP8 reference quantizer"),
              std::string::npos)
        << r.output;
    auto dump = SafetensorsFile::open(out + "/engine-1.safetensors");
    ASSERT_TRUE(dump.ok()) << dump.status().to_string();
    const std::string a = "model.layers.3.self_attn.", m = "model.layers.3.mlp.";
    const std::string fused =
        std::string(engine) == "sglang" ? "fused_qkv_a_proj_with_mqa" : "fused_qkv_a_proj";
    struct Want {
      std::string name;
      DType dtype;
      std::vector<std::int64_t> shape;
    };
    const std::vector<Want> wants = {
        {a + fused + ".weight", DType::kFloat8E4M3, {52, 48}},
        {a + fused + ".weight_scale_inv", DType::kFloat32, {7, 6}},  // 3 blocks of q_a, 4 of kv_a
        {a + "q_b_proj.weight_scale_inv", DType::kFloat32, {10, 3}},
        {a + "kv_b_proj.weight_scale_inv", DType::kFloat32, {11, 3}},
        {a + "o_proj.weight_scale_inv", DType::kFloat32, {6, 5}},
        {m + "experts.w13_weight_scale_inv", DType::kFloat32, {8, 2, 6}},
        {m + "experts.w2_weight_scale_inv", DType::kFloat32, {8, 6, 1}},
        {m + "shared_experts.gate_up_proj.weight_scale_inv", DType::kFloat32, {4, 6}},
        {"model.layers.0.mlp.gate_up_proj.weight_scale_inv", DType::kFloat32, {6, 6}},
        {m + "gate.weight", DType::kBFloat16, {8, 48}},
        {m + "gate.e_score_correction_bias", DType::kFloat32, {8}},
        {a + "kv_a_layernorm.weight", DType::kBFloat16, {20}},
    };
    for (const Want& w : wants) {
      const TensorInfo* t = (*dump)->find(w.name);
      ASSERT_NE(t, nullptr) << w.name;
      EXPECT_EQ(t->dtype, w.dtype) << w.name;
      EXPECT_EQ(t->shape, w.shape) << w.name;
    }
    EXPECT_EQ((*dump)->find(m + "gate.weight_scale_inv"), nullptr);
  }
}

// Refused before any rank starts, naming what is missing: Megatron's MLA and shared-expert shards
// (refit's bridge does not model them), and gather buckets, which hold one dtype.
TEST(FrontierMoeSetup, WhatTheseModelsCannotUseIsRefusedAtSetup) {
  TempDir dir;
  struct Case {
    std::string yaml, words;
  };
  const std::vector<Case> cases = {
      {"model: tiny-deepseek\npolicy: {backend: megatron, world_size: 2, megatron: {tp: 2}}\n",
       "Megatron-Core's multi-latent attention and shared-expert shards are not modelled"},
      {"model: tiny-glm4-moe\npolicy: {backend: megatron, world_size: 2, megatron: {tp: 2}}\n",
       "Megatron-Core's shared-expert shards are not modelled"},
      {"model: tiny-deepseek\nrefit: {executor: gather}\n",
       "keep model.layers.2.mlp.gate.e_score_correction_bias in float32"},
      {"model: tiny-deepseek\ngeneration: {layout: hf}\nrefit: {executor: gather}\n",
       "keep model.layers.2.mlp.gate.e_score_correction_bias in float32"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.yaml);
    auto r = run_cli({"check", dir.write("c.yaml", c.yaml)}, 60);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(c.words), std::string::npos) << r.output;
  }
  // The hf layout serves them on the transfer plan, the bias float32 there too.
  auto hf = run_cli(
      {"run", dir.write("h.yaml", "model: tiny-deepseek\ngeneration: {tp_size: 2, layout: hf}\n"),
       "--verify"},
      120);
  EXPECT_EQ(hf.exit_code, 0) << hf.output;
}

// A checkpoint with its MTP layer (model.layers.{num_hidden_layers}.*) is accepted: the layer is
// not part of the table, and setup says so.
TEST(FrontierMoeSetup, CheckpointMtpLayerIsLeftOutSayingSo) {
  TempDir dir;
  dir.write("m/config.json", *preset_config_json("tiny-deepseek"));
  auto spec = load_model_spec(dir.path() + "/m");
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  std::vector<std::vector<float>> data;
  std::vector<TensorView> views;
  for (const TensorSpec& t : spec->tensors()) {
    data.emplace_back(static_cast<std::size_t>(t.numel()), 0.25f);
    views.push_back({t.name, DType::kFloat32, t.shape, data.back().data()});
  }
  data.emplace_back(48 * 96, 0.5f);  // the MTP layer's eh_proj [H, 2H], and one of its norms
  views.push_back({"model.layers.4.eh_proj.weight", DType::kFloat32, {48, 96}, data.back().data()});
  data.emplace_back(48, 1.0f);
  views.push_back({"model.layers.4.enorm.weight", DType::kFloat32, {48}, data.back().data()});
  ASSERT_TRUE(write_checkpoint(dir.path() + "/m", views).ok());
  auto r = run_cli({"check", dir.write("c.yaml", "model: " + dir.path() + "/m\n")}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("the checkpoint's 2 tensor(s) of its 1 MTP layer(s) (model.layers.4.*) "
                          "are not part of the refit"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("every safetensors header checked against the table"), std::string::npos)
      << r.output;
}

// The model directory's quantization_config decides what stays bf16, by module name: kv_b_proj
// (every layer) and layer 0's dense MLP here, through modules_to_not_convert and vLLM's
// ignored_layers alike. Leaving out only one half of the fused a-projection is refused, naming it.
TEST(FrontierMoeSetup, QuantizationConfigKeepsDeepseekModulesInBf16) {
  TempDir dir;
  auto with = [&](const std::string& name, const std::string& quant) {
    std::string config = *preset_config_json("tiny-deepseek");
    config.insert(config.rfind('}'), ", \"quantization_config\": " + quant);
    dir.write(name + "/config.json", config);
    return dir.path() + "/" + name;
  };
  for (const char* key : {"modules_to_not_convert", "ignored_layers"}) {
    SCOPED_TRACE(key);
    const std::string model =
        with(key, fmt::format(R"({{"quant_method": "fp8", "weight_block_size": [8, 8], "{}": )"
                              R"(["kv_b_proj", "model.layers.0.mlp"]}})",
                              key));
    auto spec = load_model_spec(model);
    ASSERT_TRUE(spec.ok()) << spec.status().to_string();
    Config cfg;
    cfg.model = model;
    cfg.generation.backend = EngineProtocol::kSglang;
    cfg.refit.target_precision = DType::kFloat8E4M3;
    ASSERT_TRUE(validate_config(cfg, *spec).ok());
    auto wire = wire_model(cfg, *spec);
    ASSERT_TRUE(wire.ok());
    auto L = engine_wire_layout(cfg, *spec, *wire, 1);
    ASSERT_TRUE(L.ok()) << L.status().to_string();
    std::map<std::string, DType> dtype;
    for (const EngineParam& p : L->params) dtype[p.name] = p.dtype;
    const std::string a = "model.layers.2.self_attn.";
    EXPECT_EQ(dtype.at(a + "kv_b_proj.weight"), DType::kBFloat16);
    EXPECT_FALSE(dtype.count(a + "kv_b_proj.weight_scale_inv"));
    EXPECT_EQ(dtype.at("model.layers.0.mlp.gate_up_proj.weight"), DType::kBFloat16);
    EXPECT_EQ(dtype.at("model.layers.1.mlp.gate_up_proj.weight"), DType::kFloat8E4M3);
    EXPECT_EQ(dtype.at(a + "fused_qkv_a_proj_with_mqa.weight"), DType::kFloat8E4M3);
    EXPECT_EQ(dtype.at(a + "q_b_proj.weight_scale_inv"), DType::kFloat32);
    EXPECT_EQ(dtype.at("model.layers.2.mlp.gate.e_score_correction_bias"), DType::kFloat32);
  }
  const std::string split = with("split", R"({"quant_method": "fp8", "weight_block_size": [8, 8],
                  "modules_to_not_convert": ["kv_a_proj_with_mqa"]})");
  auto r = run_cli({"check", dir.write("s.yaml", "model: " + split +
                                                     "\ngeneration: {tp_size: "
                                                     "2}\nrefit: {target_precision: fp8}\n")},
                   60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("parameter model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight "
                          "fuses model.layers.0.self_attn.q_a_proj.weight (float8_e4m3) and "
                          "model.layers.0.self_attn.kv_a_proj_with_mqa.weight (bfloat16)"),
            std::string::npos)
      << r.output;
}

// A checkpoint that ships FP8 (F8_E4M3 weights with float32 weight_scale_inv, DeepSeek-V3's
// format) gives the trainer its dequantized weights: float32(code) * the block's scale. A weight
// without its scale is refused at setup, naming it.
TEST(FrontierMoeSetup, Fp8CheckpointIsDequantizedAsTheTrainersWeights) {
  TempDir dir;
  std::string config = *preset_config_json("tiny-deepseek");
  config.insert(config.rfind('}'), R"(, "quantization_config": {"quant_method": "fp8",
      "weight_block_size": [8, 8]})");
  dir.write("m/config.json", config);
  auto spec = load_model_spec(dir.path() + "/m");
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  // Every tensor f32 (value = its element index / 64), but o_proj of layer 1: fp8 codes with
  // per-block scales 1, 2, 3, ...
  std::vector<std::vector<std::uint8_t>> bytes;
  std::vector<TensorView> views;
  const std::string o = "model.layers.1.self_attn.o_proj.weight";
  const TensorSpec& ot = spec->tensors()[*spec->find(o)];
  const std::int64_t rows = ot.shape[0], cols = ot.shape[1];
  const std::int64_t grid_rows = (rows + 7) / 8, grid_cols = (cols + 7) / 8;
  std::vector<float> scales(static_cast<std::size_t>(grid_rows * grid_cols));
  for (std::size_t k = 0; k < scales.size(); ++k) scales[k] = static_cast<float>(k + 1);
  for (const TensorSpec& t : spec->tensors()) {
    auto& b = bytes.emplace_back();
    if (t.name == o) {
      b.resize(static_cast<std::size_t>(t.numel()));
      for (std::size_t k = 0; k < b.size(); ++k) b[k] = static_cast<std::uint8_t>(0x38 + k % 8);
      views.push_back({t.name, DType::kFloat8E4M3, t.shape, b.data()});
      continue;
    }
    b.resize(static_cast<std::size_t>(t.numel()) * 4);
    auto* f = reinterpret_cast<float*>(b.data());
    for (std::int64_t k = 0; k < t.numel(); ++k) f[k] = static_cast<float>(k) / 64;
    views.push_back({t.name, DType::kFloat32, t.shape, b.data()});
  }
  views.push_back({o + "_scale_inv", DType::kFloat32, {grid_rows, grid_cols}, scales.data()});
  ASSERT_TRUE(write_checkpoint(dir.path() + "/m", views).ok());

  Config cfg;
  cfg.model = dir.path() + "/m";
  cfg.generation.tp_size = 1;  // every TP-1 slice is whole 8 x 8 blocks
  cfg.refit.target_precision = DType::kFloat8E4M3;
  auto model = load_rank_model(cfg);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  const auto oi = static_cast<std::uint32_t>(*(*model)->spec.find(o));
  std::vector<float> got(static_cast<std::size_t>(rows * cols));
  (*model)->weights->values(oi, 0, rows * cols, 0, got.data());
  const auto* codes = bytes[oi].data();
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      const float want = fp8e4m3_to_f32(codes[r * cols + c]) *
                         scales[static_cast<std::size_t>(r / 8 * grid_cols + c / 8)];
      ASSERT_EQ(got[static_cast<std::size_t>(r * cols + c)], want) << r << ", " << c;
    }
  // Without its scale the weight cannot be read.
  views.pop_back();
  ASSERT_TRUE(write_checkpoint(dir.path() + "/m", views).ok());
  auto refused = load_rank_model(cfg);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find(o + " is F8_E4M3 but the checkpoint holds neither"),
            std::string::npos)
      << refused.status().message();
}

}  // namespace
}  // namespace refit
