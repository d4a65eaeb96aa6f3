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
                                           // Model card: 235B total, 234B non-embedding.
                                           Published{"qwen3-235b-a22b", 235'093'634'560, 36'945},
                                           Published{"gemma-2-2b", 2'614'341'888, 288},
                                           Published{"gemma-3-1b", 999'885'952, 340},
                                           Published{"phi-3-mini", 3'821'079'552, 195},
                                           Published{"qwen1.5-moe-a2.7b", 14'315'784'192, 4'659},
                                           // Model card: 671B total (685B with the MTP layer,
                                           // which is not part of the table).
                                           Published{"deepseek-v3", 671'026'419'200, 45'395},
                                           // Model card: 1T total (1.04T elsewhere).
                                           Published{"kimi-k2", 1'026'408'232'448, 69'975},
                                           // Model card: 106B total (110B with the MTP layer).
                                           Published{"glm-4.5-air", 106'852'251'264, 17'925}),
                         [](const auto& info) {
                           std::string n = info.param.preset;
                           for (auto& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

// The activated parameters of the published model cards: every tensor but the routed experts,
// plus num_experts_per_tok of them per MoE layer (GLM counts them without the embeddings).
TEST(Spec, FrontierMoeActivatedParametersMatchTheModelCards) {
  struct Card {
    const char* preset;
    std::int64_t billions;
    bool without_embeddings;
  };
  for (const Card& card : {Card{"deepseek-v3", 37, false}, Card{"kimi-k2", 32, false},
                           Card{"glm-4.5-air", 12, true}}) {
    SCOPED_TRACE(card.preset);
    auto spec = load_model_spec(card.preset);
    ASSERT_TRUE(spec.ok()) << spec.status().to_string();
    const ModelConfig& c = spec->config();
    std::int64_t active = 0;
    for (const TensorSpec& t : spec->tensors()) {
      const bool routed = t.role == ParamRole::kExpertGate || t.role == ParamRole::kExpertUp ||
                          t.role == ParamRole::kExpertDown;
      const bool embedding = t.role == ParamRole::kEmbedding || t.role == ParamRole::kLmHead;
      if (card.without_embeddings && embedding) continue;
      if (!routed || t.expert < c.num_experts_per_tok) active += t.numel();
    }
    EXPECT_EQ(active / 1'000'000'000, card.billions) << active;
  }
}

// DeepSeek-V3's table, as transformers' DeepseekV3ForCausalLM names it: MLA, three dense layers,
// then MoE layers with a float32 correction bias and one shared-experts MLP; no MTP layer.
TEST(Spec, DeepseekV3TableIsTransformersStateDict) {
  auto spec = load_model_spec("deepseek-v3");
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  auto shape = [&](const std::string& name) {
    const auto at = spec->find(name);
    EXPECT_TRUE(at) << name;
    return at ? spec->tensors()[*at].shape : std::vector<std::int64_t>{};
  };
  using S = std::vector<std::int64_t>;
  const std::string a = "model.layers.0.self_attn.";
  EXPECT_EQ(shape(a + "q_a_proj.weight"), (S{1536, 7168}));
  EXPECT_EQ(shape(a + "q_a_layernorm.weight"), (S{1536}));
  EXPECT_EQ(shape(a + "q_b_proj.weight"), (S{128 * 192, 1536}));
  EXPECT_EQ(shape(a + "kv_a_proj_with_mqa.weight"), (S{576, 7168}));
  EXPECT_EQ(shape(a + "kv_a_layernorm.weight"), (S{512}));
  EXPECT_EQ(shape(a + "kv_b_proj.weight"), (S{128 * 256, 512}));
  EXPECT_EQ(shape(a + "o_proj.weight"), (S{7168, 128 * 128}));
  EXPECT_FALSE(spec->find(a + "q_proj.weight"));
  EXPECT_EQ(shape("model.layers.2.mlp.gate_proj.weight"), (S{18432, 7168}));
  EXPECT_FALSE(spec->find("model.layers.2.mlp.gate.weight"));
  EXPECT_EQ(shape("model.layers.3.mlp.gate.weight"), (S{256, 7168}));
  EXPECT_EQ(shape("model.layers.3.mlp.gate.e_score_correction_bias"), (S{256}));
  EXPECT_EQ(shape("model.layers.60.mlp.experts.255.down_proj.weight"), (S{7168, 2048}));
  EXPECT_EQ(shape("model.layers.60.mlp.shared_experts.up_proj.weight"), (S{2048, 7168}));
  EXPECT_FALSE(spec->find("model.layers.61.eh_proj.weight"));  // the MTP layer
  EXPECT_EQ(spec->config().num_nextn_predict_layers, 1);
  // HF order within an MoE layer: experts, the router and its bias, the shared experts.
  EXPECT_LT(*spec->find("model.layers.3.mlp.experts.255.down_proj.weight"),
            *spec->find("model.layers.3.mlp.gate.weight"));
  EXPECT_EQ(*spec->find("model.layers.3.mlp.gate.weight") + 1,
            *spec->find("model.layers.3.mlp.gate.e_score_correction_bias"));
  EXPECT_LT(*spec->find("model.layers.3.mlp.gate.e_score_correction_bias"),
            *spec->find("model.layers.3.mlp.shared_experts.gate_proj.weight"));
}

// q_lora_rank null (DeepSeek-V2-Lite, Moonlight): one q_proj, no q_a / q_b; several shared experts
// in one MLP of moe_intermediate_size * n_shared_experts; first_k_dense_replace dense layers.
TEST(Spec, DeepseekTinyTablesCoverEveryVariant) {
  auto lite = load_model_spec("tiny-deepseek-lite");
  ASSERT_TRUE(lite.ok()) << lite.status().to_string();
  using S = std::vector<std::int64_t>;
  EXPECT_EQ(lite->tensors()[*lite->find("model.layers.0.self_attn.q_proj.weight")].shape,
            (S{4 * 12, 40}));
  EXPECT_FALSE(lite->find("model.layers.0.self_attn.q_a_proj.weight"));
  EXPECT_FALSE(lite->find("model.layers.0.self_attn.q_a_layernorm.weight"));
  EXPECT_TRUE(lite->find("model.layers.0.mlp.down_proj.weight"));
  EXPECT_TRUE(lite->find("model.layers.1.mlp.gate.e_score_correction_bias"));
  auto ds = load_model_spec("tiny-deepseek");
  ASSERT_TRUE(ds.ok()) << ds.status().to_string();
  EXPECT_EQ(ds->config().first_k_dense_replace, 2);
  EXPECT_TRUE(ds->find("model.layers.1.mlp.up_proj.weight"));
  EXPECT_FALSE(ds->find("model.layers.1.mlp.gate.weight"));
  EXPECT_EQ(ds->tensors()[*ds->find("model.layers.2.mlp.shared_experts.gate_proj.weight")].shape,
            (S{2 * 16, 48}));                                           // two shared experts of 16
  EXPECT_FALSE(ds->find("model.layers.4.self_attn.kv_b_proj.weight"));  // MTP: not in the table
  auto glm = load_model_spec("tiny-glm4-moe");
  ASSERT_TRUE(glm.ok()) << glm.status().to_string();
  EXPECT_TRUE(glm->find("model.layers.0.self_attn.q_proj.bias"));
  EXPECT_TRUE(glm->find("model.layers.0.self_attn.k_norm.weight"));
  EXPECT_FALSE(glm->find("model.layers.0.self_attn.o_proj.bias"));
  EXPECT_TRUE(glm->find("model.layers.0.mlp.gate_proj.weight"));
  EXPECT_TRUE(glm->find("model.layers.1.mlp.gate.e_score_correction_bias"));
  EXPECT_TRUE(glm->find("model.layers.2.mlp.shared_experts.down_proj.weight"));
  EXPECT_FALSE(glm->find("model.layers.3.mlp.gate.weight"));  // MTP: not in the table
}

// What the engines and transformers would disagree on is refused at parse time, naming the key.
TEST(Spec, DeepseekConfigsTheEnginesDoNotServeAreRefused) {
  const std::string base =
      R"("architectures":["DeepseekV3ForCausalLM"],"hidden_size":16,"intermediate_size":32,)"
      R"("moe_intermediate_size":8,"num_hidden_layers":2,"num_attention_heads":2,)"
      R"("q_lora_rank":8,"kv_lora_rank":8,"qk_nope_head_dim":4,"qk_rope_head_dim":4,)"
      R"("v_head_dim":4,"n_routed_experts":4,"num_experts_per_tok":2,"first_k_dense_replace":1,)"
      R"("vocab_size":64)";
  ASSERT_TRUE(parse_hf_config("{" + base + R"(,"topk_method":"noaux_tc"})").ok());
  struct Case {
    std::string extra, words;
  };
  for (const Case& c :
       {Case{"", R"(needs "topk_method": "noaux_tc")"},
        Case{R"(,"topk_method":"greedy")", R"(got "greedy")"},
        Case{R"(,"topk_method":"noaux_tc","attention_bias":true)", "attention_bias"},
        Case{R"(,"topk_method":"noaux_tc","moe_layer_freq":2)", "moe_layer_freq 2"},
        Case{R"(,"topk_method":"noaux_tc","tie_word_embeddings":true)", "tie_word_embeddings"},
        Case{R"(,"topk_method":"noaux_tc","kv_lora_rank":null)",
             R"(missing required key "kv_lora_rank")"},
        Case{R"(,"topk_method":"noaux_tc","first_k_dense_replace":-1)",
             R"("first_k_dense_replace" must be an integer)"}}) {
    auto r = parse_hf_config("{" + base + c.extra + "}");
    ASSERT_FALSE(r.ok()) << c.extra;
    EXPECT_NE(r.status().message().find(c.words), std::string::npos) << r.status().message();
  }
}

// Qwen/Qwen3-235B-A22B's model card: 235B parameters, 234B of them non-embedding, 22B activated
// (8 of 128 experts per token), 94 layers, 64 query and 4 key/value heads, 128 experts.
TEST(Spec, Qwen3_235bMatchesItsModelCard) {
  auto spec = load_model_spec("qwen3-235b-a22b");
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  const ModelConfig& c = spec->config();
  EXPECT_EQ(c.num_layers, 94);
  EXPECT_EQ(c.num_heads, 64);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  std::int64_t embedding = 0, experts = 0;
  for (const TensorSpec& t : spec->tensors()) {
    if (t.role == ParamRole::kEmbedding || t.role == ParamRole::kLmHead) embedding += t.numel();
    if (t.expert >= 0) experts += t.numel();
  }
  const double total = static_cast<double>(spec->total_parameters());
  const double active = total - static_cast<double>(experts) * (1.0 - 8.0 / 128.0);
  EXPECT_NEAR(total / 1e9, 235, 0.5);
  EXPECT_NEAR((total - static_cast<double>(embedding)) / 1e9, 234, 0.5);
  EXPECT_NEAR(active / 1e9, 22, 0.5);
}

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

// A spec is immutable: its copies share one tensor table and name index (a frontier MoE's table
// is tens of thousands of tensors, and the wire model and every rank's plan inputs hold copies),
// and a moved-from spec keeps answering.
TEST(Spec, CopiesShareTheTensorTable) {
  auto loaded = load_model_spec("qwen3-30b-a3b");
  ASSERT_TRUE(loaded.ok());
  const ModelSpec spec = *loaded;
  ModelSpec copy = spec;
  EXPECT_EQ(&copy.tensors(), &spec.tensors()) << "a copy must share the table, not copy it";
  EXPECT_EQ(copy.tensors().size(), spec.tensors().size());
  EXPECT_EQ(copy.find("model.layers.47.mlp.experts.127.down_proj.weight"),
            spec.find("model.layers.47.mlp.experts.127.down_proj.weight"));
  ModelSpec moved = std::move(copy);
  EXPECT_EQ(&moved.tensors(), &spec.tensors());
  EXPECT_EQ(copy.tensors().size(), spec.tensors().size());  // NOLINT(bugprone-use-after-move)
  EXPECT_TRUE(copy.find("model.embed_tokens.weight"));      // NOLINT(bugprone-use-after-move)
  ModelSpec empty;
  EXPECT_TRUE(empty.tensors().empty());
  EXPECT_FALSE(empty.find("model.embed_tokens.weight"));
  empty = spec;
  EXPECT_EQ(&empty.tensors(), &spec.tensors());
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
