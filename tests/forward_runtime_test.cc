// --check-logits across real processes for every architecture with a fused layout: each engine
// rank runs the forward from its own TP shards, combined over its TP ranks, against the
// single-process reference (harness/forward.h), with the facts config.json gives (soft-capping,
// sliding windows, RoPE bases); and a layout the engine's forward reads wrongly is caught.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>

#include "engine/engine_layout.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::run_cli;
using testing::TempDir;

// Occurrences of `needle` in `hay`.
int count(const std::string& hay, const std::string& needle) {
  int n = 0;
  for (auto at = hay.find(needle); at != std::string::npos; at = hay.find(needle, at + 1)) ++n;
  return n;
}

// A model directory holding `preset`'s config.json with `extra` keys merged in (no safetensors:
// the weights are generated).
std::string model_dir(const TempDir& dir, const std::string& preset, const std::string& extra) {
  auto json = preset_config_json(preset);
  EXPECT_TRUE(json.ok()) << preset;
  std::string text = json.ok() ? *json : "{}";
  const auto close = text.rfind('}');
  text = text.substr(0, close) + ", " + extra + "}";
  dir.write(preset + "/config.json", text);
  return dir.path() + "/" + preset;
}

struct LogitCell {
  std::string model;
  std::string generation;
  int world = 2;
  std::string refit = "";  // more refit keys, ", key: value"
};

// Returns the run's output.
std::string expect_logits_checked(const LogitCell& c, int engine_ranks) {
  TempDir dir;
  const std::string cfg =
      dir.write("c.yaml", fmt::format("model: {}\npolicy: {{world_size: {}}}\ngeneration: {{{}}}\n"
                                      "refit: {{timeout_s: 60{}}}\n",
                                      c.model, c.world, c.generation, c.refit));
  auto r = run_cli({"run", cfg, "--steps", "2", "--verify", "--check-logits"}, 240);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("engine logits match the reference forward"), std::string::npos)
      << r.output;
  // Every engine rank checked both steps.
  EXPECT_EQ(count(r.output, "match the reference forward of"), 2 * engine_ranks) << r.output;
  return r.output;
}

TEST(ForwardRuntime, CheckLogitsOfGemmaWithWindowsAndSoftCapping) {
  TempDir dir;
  // Windows of 3 over the 8 checked tokens and strong soft-capping: both change the logits.
  const std::string g2 = model_dir(dir, "tiny-gemma2",
                                   R"("sliding_window": 3, "attn_logit_softcapping": 1.5, )"
                                   R"("final_logit_softcapping": 2.5)");
  const std::string g3 = model_dir(dir, "tiny-gemma3",
                                   R"("sliding_window": 3, "layer_types": ["sliding_attention", )"
                                   R"("full_attention"], "rope_local_base_freq": 100.0)");
  expect_logits_checked({g2, "backend: vllm, tp_size: 2", 3}, 2);
  expect_logits_checked({g3, "backend: sglang, tp_size: 2"}, 2);  // whole embedding per rank
  expect_logits_checked({g3, "backend: vllm, tp_size: 4"}, 4);    // one kv head replicated
}

TEST(ForwardRuntime, CheckLogitsOfPhi3AndQwen2Moe) {
  expect_logits_checked({"tiny-phi3", "backend: sglang, tp_size: 2"}, 2);
  expect_logits_checked({"tiny-qwen2-moe", "backend: vllm, num_engines: 2, tp_size: 2", 3}, 4);
}

// DeepSeek-V3 (q_lora_rank set and null) and GLM-4.5, TP 1, 2 and 4, both protocols, colocated and
// not: after each refit every engine rank's weights_changed hook names all of its parameters and
// derives MLA's absorbed matrices again from kv_b_proj; the absorbed forward from those matches the
// reference (a stale derivation would not: ForwardEngine.StaleMlaMatricesFailTheCheck).
TEST(ForwardRuntime, CheckLogitsOfDeepseekAndGlmWithDerivedMla) {
  struct Cell {
    const char* model;
    EngineProtocol backend;
    int tp;
  };
  const Cell cells[] = {
      {"tiny-deepseek", EngineProtocol::kVllm, 1},
      {"tiny-deepseek", EngineProtocol::kSglang, 4},
      {"tiny-deepseek-lite", EngineProtocol::kVllm, 2},
      {"tiny-deepseek-lite", EngineProtocol::kSglang, 1},
      {"tiny-glm4-moe", EngineProtocol::kVllm, 4},
      {"tiny-glm4-moe", EngineProtocol::kSglang, 2},
  };
  for (const Cell& c : cells) {
    const bool sglang = c.backend == EngineProtocol::kSglang;
    SCOPED_TRACE(fmt::format("{} {} tp {}", c.model, sglang ? "sglang" : "vllm", c.tp));
    auto spec = load_model_spec(c.model);
    ASSERT_TRUE(spec.ok()) << spec.status().to_string();
    auto layout = engine_layout(*spec, c.tp, 0, EngineLayout::kFused, c.backend);
    ASSERT_TRUE(layout.ok()) << layout.status().to_string();
    const std::string out = expect_logits_checked(
        {c.model, fmt::format("backend: {}, tp_size: {}", sglang ? "sglang" : "vllm", c.tp)}, c.tp);
    if (!spec->config().mla) continue;
    // Once per refit and engine rank, naming every parameter of the rank.
    const std::string derived = fmt::format(
        "weights_changed hook: {} parameters; {} derived again from kv_b_proj for {} layers",
        layout->params.size(), sglang ? "w_kc / w_vc" : "W_UK_T / W_UV", spec->config().num_layers);
    EXPECT_EQ(count(out, derived), 2 * c.tp) << derived << "\n" << out;
  }
  // FP8 blocks: the matrices come from the dequantized kv_b_proj, as the engines derive them.
  const std::string fp8 = expect_logits_checked(
      {"tiny-deepseek", "backend: vllm, tp_size: 2", 2,
       ", target_precision: fp8, fp8: {block: [8, 8]}"},
      2);
  EXPECT_EQ(count(fp8, "W_UK_T / W_UV derived again from kv_b_proj for 4 layers"), 4) << fp8;
  // Colocated: each engine rank beside a trainer rank, its bytes written in place (peer access).
  const std::string colocated = expect_logits_checked(
      {"tiny-deepseek", "backend: sglang, tp_size: 2, colocated: true", 2}, 2);
  EXPECT_EQ(count(colocated, "w_kc / w_vc derived again from kv_b_proj for 4 layers"), 4)
      << colocated;
  expect_logits_checked({"tiny-glm4-moe", "backend: vllm, tp_size: 2, colocated: true", 2}, 2);
}

// A refit whose bytes arrive corrupted on one engine rank (refit.checksum) is rolled back
// (refit.keep_previous): the weights_changed hook runs again after the rollback, so the MLA
// matrices are derived from the restored kv_b_proj — once per refit and rank, plus once per rank
// for the rollback.
TEST(ForwardRuntime, RollbackDerivesMlaMatricesAgain) {
  TempDir dir;
  const std::string cfg = dir.write(
      "c.yaml",
      "model: tiny-deepseek\npolicy: {world_size: 2}\ngeneration: {backend: sglang, tp_size: 2}\n"
      "refit: {buffer_size_bytes: 4096, timeout_s: 30, executor: p2p, checksum: true, "
      "keep_previous: true}\n");
  auto r = run_cli({"run", cfg, "--steps", "3", "--verify", "--fault", "corrupt:1:2"}, 180);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("checksum mismatch in refit step 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 3/3: refit "), std::string::npos) << r.output;
  EXPECT_EQ(count(r.output, "w_kc / w_vc derived again from kv_b_proj for 4 layers"), 3 * 2 + 2)
      << r.output;
}

}  // namespace
}  // namespace refit
