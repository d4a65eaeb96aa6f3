// --check-logits across real processes for every architecture with a fused layout: each engine
// rank runs the forward from its own TP shards, combined over its TP ranks, against the
// single-process reference (harness/forward.h), with the facts config.json gives (soft-capping,
// sliding windows, RoPE bases); and a layout the engine's forward reads wrongly is caught.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>

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
};

void expect_logits_checked(const LogitCell& c, int engine_ranks) {
  TempDir dir;
  const std::string cfg =
      dir.write("c.yaml", fmt::format("model: {}\npolicy: {{world_size: {}}}\ngeneration: {{{}}}\n"
                                      "refit: {{timeout_s: 60}}\n",
                                      c.model, c.world, c.generation));
  auto r = run_cli({"run", cfg, "--steps", "2", "--verify", "--check-logits"}, 240);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("engine logits match the reference forward"), std::string::npos)
      << r.output;
  // Every engine rank checked both steps.
  EXPECT_EQ(count(r.output, "match the reference forward of"), 2 * engine_ranks) << r.output;
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

}  // namespace
}  // namespace refit
