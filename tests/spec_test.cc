#include <gtest/gtest.h>

#include "refit/model_spec.h"
#include "test_util.h"

namespace refit {
namespace {

struct Published {
  const char* preset;
  std::int64_t total;
  std::size_t tensors;
};

class PresetTotals : public ::testing::TestWithParam<Published> {};

TEST_P(PresetTotals, MatchPublishedParameterCount) {
  auto spec = load_model_spec(GetParam().preset);
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  EXPECT_EQ(spec->total_parameters(), GetParam().total);
  EXPECT_EQ(spec->tensors().size(), GetParam().tensors);
}

INSTANTIATE_TEST_SUITE_P(Presets, PresetTotals,
                         ::testing::Values(Published{"qwen2.5-0.5b", 494'032'768, 290},
                                           Published{"qwen2.5-7b", 7'615'616'512, 339},
                                           // Model card: 0.6B, 0.44B non-embedding (tied).
                                           Published{"qwen3-0.6b", 596'049'920, 310},
                                           Published{"qwen3-8b", 8'190'735'360, 399},
                                           Published{"llama-3.1-8b", 8'030'261'248, 291},
                                           Published{"llama-3.2-1b", 1'235'814'400, 146},
                                           Published{"mistral-7b", 7'241'732'096, 291},
                                           Published{"qwen3-30b-a3b", 30'532'122'624, 18'867},
                                           Published{"gemma-2-2b", 2'614'341'888, 288},
                                           Published{"gemma-3-1b", 999'885'952, 340},
                                           Published{"phi-3-mini", 3'821'079'552, 195},
                                           Published{"qwen1.5-moe-a2.7b", 14'315'784'192, 4'659}),
                         [](const auto& info) {
                           std::string n = info.param.preset;
                           for (auto& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

TEST(Spec, Qwen2HasBiasAndDerivedHeadDim) {
  auto spec = load_model_spec("qwen2.5-0.5b");
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(spec->config().head_dim, 64);
  auto k = spec->find("model.layers.3.self_attn.k_proj.bias");
  ASSERT_TRUE(k.has_value());
  EXPECT_EQ(spec->tensors()[*k].shape, (std::vector<std::int64_t>{128}));
  EXPECT_FALSE(spec->find("lm_head.weight").has_value()) << "tied embeddings";
}

TEST(Spec, Qwen3HasGivenHeadDimAndQkNorms) {
  auto spec = load_model_spec("qwen3-8b");
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(spec->config().head_dim, 128);
  auto q = spec->find("model.layers.0.self_attn.q_proj.weight");
  ASSERT_TRUE(q);
  EXPECT_EQ(spec->tensors()[*q].shape, (std::vector<std::int64_t>{4096, 4096}));
  EXPECT_TRUE(spec->find("model.layers.35.self_attn.k_norm.weight"));
  EXPECT_FALSE(spec->find("model.layers.0.self_attn.q_proj.bias"));
  EXPECT_TRUE(spec->find("lm_head.weight"));
}

TEST(Spec, MoeExpertsAndRouter) {
  auto spec = load_model_spec("qwen3-30b-a3b");
  ASSERT_TRUE(spec.ok());
  auto r = spec->find("model.layers.47.mlp.gate.weight");
  ASSERT_TRUE(r);
  EXPECT_EQ(spec->tensors()[*r].shape, (std::vector<std::int64_t>{128, 2048}));
  auto e = spec->find("model.layers.47.mlp.experts.127.down_proj.weight");
  ASSERT_TRUE(e);
  EXPECT_EQ(spec->tensors()[*e].shape, (std::vector<std::int64_t>{2048, 768}));
  EXPECT_EQ(spec->tensors()[*e].expert, 127);
  EXPECT_FALSE(spec->find("model.layers.0.mlp.gate_proj.weight"));
}

TEST(Spec, MlpOnlyLayersAreDense) {
  auto c = parse_hf_config(R"({"architectures":["Qwen3MoeForCausalLM"],"hidden_size":8,
    "intermediate_size":16,"num_hidden_layers":3,"num_attention_heads":2,"num_key_value_heads":1,
    "head_dim":4,"vocab_size":10,"num_experts":2,"num_experts_per_tok":1,
    "moe_intermediate_size":4,"mlp_only_layers":[1]})");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  ModelSpec spec(*c);
  EXPECT_TRUE(spec.find("model.layers.0.mlp.experts.1.up_proj.weight"));
  EXPECT_TRUE(spec.find("model.layers.1.mlp.up_proj.weight"));
  EXPECT_FALSE(spec.find("model.layers.1.mlp.gate.weight"));
}

// Any other architecture parses (its table comes from the checkpoint's headers: any_model_test).
TEST(Spec, UnknownArchitectureIsKeptByName) {
  auto c = parse_hf_config(R"({"architectures":["GPT2LMHeadModel"],"hidden_size":8})");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->arch, Architecture::kOther);
  EXPECT_EQ(c->architecture, "GPT2LMHeadModel");
  EXPECT_EQ(c->hidden_size, 8);
  auto bad = parse_hf_config(R"({"architectures":["GPT2LMHeadModel"],"hidden_size":-8})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("hidden_size"), std::string::npos);
}

// transformers 5 saves Qwen3MoeConfig.num_experts as num_local_experts (seen in run 29).
TEST(Spec, NumLocalExpertsStandsInForNumExperts) {
  auto c = parse_hf_config(
      R"({"architectures":["Qwen3MoeForCausalLM"],"hidden_size":32,"intermediate_size":64,
          "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,
          "vocab_size":100,"num_local_experts":6,"num_experts_per_tok":2,
          "moe_intermediate_size":16})");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->num_experts, 6);
}

TEST(Spec, MissingKeyIsNamed) {
  auto c = parse_hf_config(R"({"architectures":["LlamaForCausalLM"],"hidden_size":8})");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("num_hidden_layers"), std::string::npos);
}

// Sizes no model has are refused naming the key (or the sizes behind an absurd total), before any
// tensor is built: no overflow (a 2^62 vocabulary once gave 86,400 parameters), no hang (10^9
// layers), no allocation failure later.
TEST(Spec, AbsurdSizesAreRefusedNamingTheKey) {
  const std::string base =
      R"("hidden_size":64,"intermediate_size":160,"num_hidden_layers":2,"num_attention_heads":4,)"
      R"("num_key_value_heads":2,"head_dim":16,"vocab_size":512)";
  auto parse = [&](const std::string& arch, const std::string& extra) {
    std::string text = R"({"architectures":[")" + arch + R"("],)" + base + extra + "}";
    // Later keys win in nlohmann's parser: `extra` overrides the base value.
    return parse_hf_config(text);
  };
  ASSERT_TRUE(parse("Qwen3ForCausalLM", "").ok());
  struct Case {
    std::string arch, extra, words;
  };
  const std::vector<Case> cases = {
      {"Qwen3ForCausalLM", R"(,"hidden_size":1099511627776)", "\"hidden_size\" is 1099511627776; refit supports at most 1048576"},
      {"Qwen3ForCausalLM", R"(,"vocab_size":4611686018427387904)", "\"vocab_size\" is 4611686018427387904"},
      {"Qwen3ForCausalLM", R"(,"num_hidden_layers":1000000000)", "\"num_hidden_layers\" is 1000000000"},
      {"Qwen3ForCausalLM", R"(,"intermediate_size":1125899906842624)", "\"intermediate_size\""},
      {"Qwen3ForCausalLM", R"(,"head_dim":1099511627776)", "\"head_dim\""},
      {"Qwen3ForCausalLM", R"(,"hidden_size":524288,"vocab_size":1073741824)",
       "would make about 1.13e+15 parameters"},
      {"Qwen3MoeForCausalLM",
       R"(,"num_hidden_layers":4096,"num_experts":65536,"num_experts_per_tok":2,"moe_intermediate_size":64)",
       "would make about 805371907 tensors"},
  };
  for (const Case& c : cases) {
    auto r = parse(c.arch, c.extra);
    ASSERT_FALSE(r.ok()) << c.extra;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.extra;
    EXPECT_NE(r.status().message().find(c.words), std::string::npos) << r.status().message();
  }
}

TEST(Spec, ModelDirectory) {
  testing::TempDir dir;
  dir.write("config.json", *preset_config_json("tiny-qwen3"));
  auto spec = load_model_spec(dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  EXPECT_EQ(spec->total_parameters(), load_model_spec("tiny-qwen3")->total_parameters());
  auto missing = load_model_spec(dir.path() + "/nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nope"), std::string::npos);
}

TEST(Spec, CliJsonListsEveryTensor) {
  auto r = testing::run_cli({"spec", "qwen3-30b-a3b", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("\"total_parameters\": 30532122624"), std::string::npos);
  EXPECT_NE(r.output.find("\"num_tensors\": 18867"), std::string::npos);
}

}  // namespace
}  // namespace refit
