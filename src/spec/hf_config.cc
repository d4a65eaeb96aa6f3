// Parses HF config.json text into a ModelConfig (model directories and presets become specs in
// io/model_dir.cc).
#include <fmt/format.h>
#include <algorithm>
#include <nlohmann/json.hpp>

#include "refit/model_spec.h"

namespace refit {
namespace {

using nlohmann::json;

// Upper bounds far above any published model, so that size arithmetic never overflows and an
// absurd config.json is an error naming its key, not an allocation failure or a hang.
constexpr std::int64_t kMaxWidth = std::int64_t{1} << 20;         // hidden, head_dim
constexpr std::int64_t kMaxFfn = std::int64_t{1} << 22;           // (moe_)intermediate_size
constexpr std::int64_t kMaxVocab = (std::int64_t{1} << 31) - 1;   // vocab_size
constexpr std::int64_t kMaxCount = 4096;                          // layers, heads, sparse step
constexpr std::int64_t kMaxExperts = 65536;
constexpr double kMaxParameters = 1e15;

Result<std::int64_t> get_int(const json& j, const char* key, std::optional<std::int64_t> fallback,
                             std::int64_t max) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (fallback) return *fallback;
    return Status::InvalidArgument(fmt::format("config.json: missing required key \"{}\"", key));
  }
  if (!it->is_number_integer() || it->get<std::int64_t>() < 1)
    return Status::InvalidArgument(
        fmt::format("config.json: \"{}\" must be a positive integer, got {}", key, it->dump()));
  if (it->get<std::int64_t>() > max)
    return Status::InvalidArgument(fmt::format(
        "config.json: \"{}\" is {}; refit supports at most {}", key, it->dump(), max));
  return it->get<std::int64_t>();
}

Result<bool> get_bool(const json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean())
    return Status::InvalidArgument(
        fmt::format("config.json: \"{}\" must be true or false, got {}", key, it->dump()));
  return it->get<bool>();
}

double get_double(const json& j, const char* key, double fallback) {
  auto it = j.find(key);
  return (it != j.end() && it->is_number()) ? it->get<double>() : fallback;
}

// A count that may be 0 (first_k_dense_replace, num_nextn_predict_layers).
Result<std::int64_t> get_count(const json& j, const char* key, std::int64_t fallback,
                               std::int64_t max) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number_integer() || it->get<std::int64_t>() < 0 || it->get<std::int64_t>() > max)
    return Status::InvalidArgument(fmt::format(
        "config.json: \"{}\" must be an integer in [0, {}], got {}", key, max, it->dump()));
  return it->get<std::int64_t>();
}

// The MoE keys DeepSeek-V3 and GLM-4.5 share (transformers' DeepseekV3Config / Glm4MoeConfig):
// n_routed_experts routed experts of moe_intermediate_size, n_shared_experts shared ones in one
// MLP, layers [0, first_k_dense_replace) dense, every MoE router with a correction bias.
Status parse_deepseek_moe(const json& j, ModelConfig& c, std::int64_t dense_default) {
  REFIT_ASSIGN_OR_RETURN(c.intermediate_size,
                         get_int(j, "intermediate_size", std::nullopt, kMaxFfn));
  REFIT_ASSIGN_OR_RETURN(c.num_experts, get_int(j, "n_routed_experts", std::nullopt, kMaxExperts));
  REFIT_ASSIGN_OR_RETURN(c.num_experts_per_tok,
                         get_int(j, "num_experts_per_tok", std::nullopt, kMaxExperts));
  REFIT_ASSIGN_OR_RETURN(c.moe_intermediate_size,
                         get_int(j, "moe_intermediate_size", std::nullopt, kMaxFfn));
  REFIT_ASSIGN_OR_RETURN(c.n_shared_experts, get_int(j, "n_shared_experts", 1, kMaxExperts));
  if (c.moe_intermediate_size * c.n_shared_experts > kMaxFfn)
    return Status::InvalidArgument(fmt::format(
        "config.json: moe_intermediate_size ({}) * n_shared_experts ({}) is more than {}",
        c.moe_intermediate_size, c.n_shared_experts, kMaxFfn));
  c.shared_expert_intermediate_size = c.moe_intermediate_size * c.n_shared_experts;
  REFIT_ASSIGN_OR_RETURN(c.first_k_dense_replace,
                         get_count(j, "first_k_dense_replace", dense_default, kMaxCount));
  REFIT_ASSIGN_OR_RETURN(c.num_nextn_predict_layers,
                         get_count(j, "num_nextn_predict_layers", 0, kMaxCount));
  REFIT_ASSIGN_OR_RETURN(c.norm_topk_prob, get_bool(j, "norm_topk_prob", true));
  if (c.num_experts_per_tok > c.num_experts)
    return Status::InvalidArgument(
        fmt::format("config.json: need 0 < num_experts_per_tok ({}) <= n_routed_experts ({})",
                    c.num_experts_per_tok, c.num_experts));
  c.router_bias = true;
  return Status::Ok();
}

// DeepseekV3ForCausalLM: multi-head latent attention (transformers' DeepseekV3Attention; vLLM's
// and SGLang's deepseek_v2.py). The engines build every MLA projection without bias and keep the
// correction bias only with topk_method noaux_tc, where transformers always has it: configs
// that would make the two tables differ are refused, naming the key.
Status parse_deepseek_v3(const json& j, ModelConfig& c) {
  REFIT_ASSIGN_OR_RETURN(c.hidden_size, get_int(j, "hidden_size", std::nullopt, kMaxWidth));
  REFIT_ASSIGN_OR_RETURN(c.num_layers, get_int(j, "num_hidden_layers", std::nullopt, kMaxCount));
  REFIT_ASSIGN_OR_RETURN(c.num_heads, get_int(j, "num_attention_heads", std::nullopt, kMaxCount));
  REFIT_ASSIGN_OR_RETURN(c.vocab_size, get_int(j, "vocab_size", std::nullopt, kMaxVocab));
  c.mla = true;
  if (auto it = j.find("q_lora_rank"); it == j.end() || it->is_null()) {
    c.q_lora_rank = 0;  // DeepSeek-V2-Lite style: one q_proj
  } else {
    REFIT_ASSIGN_OR_RETURN(c.q_lora_rank, get_int(j, "q_lora_rank", std::nullopt, kMaxWidth));
  }
  REFIT_ASSIGN_OR_RETURN(c.kv_lora_rank, get_int(j, "kv_lora_rank", std::nullopt, kMaxWidth));
  REFIT_ASSIGN_OR_RETURN(c.qk_nope_head_dim,
                         get_int(j, "qk_nope_head_dim", std::nullopt, kMaxWidth));
  REFIT_ASSIGN_OR_RETURN(c.qk_rope_head_dim,
                         get_int(j, "qk_rope_head_dim", std::nullopt, kMaxWidth));
  REFIT_ASSIGN_OR_RETURN(c.v_head_dim, get_int(j, "v_head_dim", std::nullopt, kMaxWidth));
  // MLA has no kv heads to split: every head's keys and values come from the one latent.
  c.num_kv_heads = c.num_heads;
  c.head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim;
  REFIT_RETURN_IF_ERROR(parse_deepseek_moe(j, c, /*dense_default=*/3));
  REFIT_ASSIGN_OR_RETURN(c.tie_word_embeddings, get_bool(j, "tie_word_embeddings", false));
  if (c.tie_word_embeddings)
    return Status::Unsupported(
        "config.json: DeepseekV3ForCausalLM with tie_word_embeddings true; vLLM and SGLang keep "
        "lm_head as a parameter of its own and never tie it; allowed: false");
  REFIT_ASSIGN_OR_RETURN(const bool bias, get_bool(j, "attention_bias", false));
  if (bias)
    return Status::Unsupported(
        "config.json: DeepseekV3ForCausalLM with attention_bias true; vLLM and SGLang build "
        "every MLA projection without bias; allowed: false");
  if (auto it = j.find("moe_layer_freq");
      it != j.end() && !it->is_null() && !(it->is_number_integer() && it->get<std::int64_t>() == 1))
    return Status::Unsupported(fmt::format(
        "config.json: DeepseekV3ForCausalLM with moe_layer_freq {}; transformers makes every "
        "layer from first_k_dense_replace on MoE, the engines only every moe_layer_freq-th; "
        "allowed: 1",
        it->dump()));
  const auto topk = j.find("topk_method");
  if (topk == j.end() || !topk->is_string() || topk->get<std::string>() != "noaux_tc")
    return Status::Unsupported(fmt::format(
        "config.json: DeepseekV3ForCausalLM needs \"topk_method\": \"noaux_tc\"; vLLM and "
        "SGLang keep mlp.gate.e_score_correction_bias only then, transformers always; got {}",
        topk == j.end() ? std::string("none") : topk->dump()));
  c.rms_norm_eps = get_double(j, "rms_norm_eps", 1e-6);
  c.rope_theta = get_double(j, "rope_theta", 10000.0);
  return Status::Ok();
}

// "quantization_config": quant_method, weight_block_size [rows, cols] and the modules left
// unquantized (transformers' modules_to_not_convert, vLLM's ignored_layers; both are read).
Result<QuantizationConfig> parse_quantization(const json& j) {
  QuantizationConfig q;
  const auto it = j.find("quantization_config");
  if (it == j.end() || it->is_null()) return q;
  if (!it->is_object())
    return Status::InvalidArgument("config.json: \"quantization_config\" must be an object");
  q.present = true;
  if (auto m = it->find("quant_method"); m != it->end() && m->is_string())
    q.quant_method = m->get<std::string>();
  if (auto b = it->find("weight_block_size"); b != it->end() && !b->is_null()) {
    if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number_integer() ||
        !(*b)[1].is_number_integer() || (*b)[0].get<std::int64_t>() <= 0 ||
        (*b)[1].get<std::int64_t>() <= 0 || (*b)[0].get<std::int64_t>() > kMaxWidth ||
        (*b)[1].get<std::int64_t>() > kMaxWidth)
      return Status::InvalidArgument(fmt::format(
          "config.json: quantization_config.weight_block_size must be two positive integers "
          "[rows, cols], got {}",
          b->dump()));
    q.weight_block_size = {(*b)[0].get<std::int64_t>(), (*b)[1].get<std::int64_t>()};
  }
  for (const char* key : {"modules_to_not_convert", "ignored_layers"}) {
    const auto l = it->find(key);
    if (l == it->end() || l->is_null()) continue;
    if (!l->is_array())
      return Status::InvalidArgument(
          fmt::format("config.json: quantization_config.{} must be a list of module names", key));
    for (const auto& v : *l) {
      if (!v.is_string())
        return Status::InvalidArgument(fmt::format(
            "config.json: quantization_config.{} must be a list of module names, got {}", key,
            v.dump()));
      q.ignored.push_back(v.get<std::string>());
    }
  }
  return q;
}

// What the table of `c` would hold, estimated in floating point (no overflow): refused when it
// could never be a model, before any tensor is built.
Result<ModelConfig> check_size(const ModelConfig& c) {
  const double h = static_cast<double>(c.hidden_size), d = static_cast<double>(c.head_dim);
  const double experts = static_cast<double>(c.num_experts);
  const double ffn = c.num_experts > 0
                         ? experts * 3.0 * h * static_cast<double>(c.moe_intermediate_size) +
                               3.0 * h * static_cast<double>(c.shared_expert_intermediate_size)
                         : 3.0 * h * static_cast<double>(c.intermediate_size);
  const double nq = static_cast<double>(c.num_heads);
  const double q_in = c.q_lora_rank > 0 ? static_cast<double>(c.q_lora_rank) : h;
  const double attention =
      c.mla ? h * static_cast<double>(c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim) +
                  q_in * nq * static_cast<double>(c.qk_nope_head_dim + c.qk_rope_head_dim) +
                  static_cast<double>(c.kv_lora_rank) * nq *
                      static_cast<double>(c.qk_nope_head_dim + c.v_head_dim) +
                  nq * static_cast<double>(c.v_head_dim) * h
            : h * d * static_cast<double>(2 * c.num_heads + 2 * c.num_kv_heads);
  const double layers = static_cast<double>(c.num_layers);
  const double parameters =
      static_cast<double>(c.vocab_size) * h * (c.tie_word_embeddings ? 1.0 : 2.0) +
      layers * (attention + ffn);
  const double tensors = 3.0 + layers * (16.0 + 3.0 * experts);
  if (tensors > static_cast<double>(kMaxModelTensors))
    return Status::InvalidArgument(fmt::format(
        "config.json: num_hidden_layers ({}) and num_experts ({}) would make about {:.0f} tensors; "
        "refit supports at most {}",
        c.num_layers, c.num_experts, tensors, kMaxModelTensors));
  if (parameters > kMaxParameters)
    return Status::InvalidArgument(fmt::format(
        "config.json: hidden_size ({}), intermediate sizes, vocab_size ({}) and num_hidden_layers "
        "({}) would make about {:.3g} parameters; refit supports at most {:.0g}",
        c.hidden_size, c.vocab_size, c.num_layers, parameters, kMaxParameters));
  return c;
}

}  // namespace

Result<ModelConfig> parse_hf_config(std::string_view json_text) {
  json j = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return Status::InvalidArgument("config.json: not a JSON object");

  ModelConfig c;
  auto arch_it = j.find("architectures");
  if (arch_it == j.end() || !arch_it->is_array() || arch_it->empty() || !(*arch_it)[0].is_string())
    return Status::InvalidArgument(
        "config.json: \"architectures\" must be a list naming the model class");
  const std::string arch = (*arch_it)[0].get<std::string>();
  if (arch == "LlamaForCausalLM")
    c.arch = Architecture::kLlama;
  else if (arch == "Qwen2ForCausalLM")
    c.arch = Architecture::kQwen2;
  else if (arch == "Qwen3ForCausalLM")
    c.arch = Architecture::kQwen3;
  else if (arch == "MistralForCausalLM")
    c.arch = Architecture::kMistral;
  else if (arch == "Qwen3MoeForCausalLM")
    c.arch = Architecture::kQwen3Moe;
  else if (arch == "Gemma2ForCausalLM")
    c.arch = Architecture::kGemma2;
  else if (arch == "Gemma3ForCausalLM")
    c.arch = Architecture::kGemma3;
  else if (arch == "Phi3ForCausalLM")
    c.arch = Architecture::kPhi3;
  else if (arch == "Qwen2MoeForCausalLM")
    c.arch = Architecture::kQwen2Moe;
  else if (arch == "DeepseekV3ForCausalLM")
    c.arch = Architecture::kDeepseekV3;
  else if (arch == "Glm4MoeForCausalLM")
    c.arch = Architecture::kGlm4Moe;
  else
    c.arch = Architecture::kOther;
  c.architecture = arch;
  REFIT_ASSIGN_OR_RETURN(c.quantization, parse_quantization(j));
  if (c.arch == Architecture::kOther) {
    // No architecture facts: the table comes from the checkpoint's headers. Sizes are read when
    // present (for `refit spec` and the logs); a present but invalid one is still an error.
    REFIT_ASSIGN_OR_RETURN(c.tie_word_embeddings, get_bool(j, "tie_word_embeddings", false));
    REFIT_ASSIGN_OR_RETURN(c.hidden_size, get_int(j, "hidden_size", 0, kMaxWidth));
    REFIT_ASSIGN_OR_RETURN(c.num_layers, get_int(j, "num_hidden_layers", 0, kMaxCount));
    REFIT_ASSIGN_OR_RETURN(c.vocab_size, get_int(j, "vocab_size", 0, kMaxVocab));
    return c;
  }

  if (c.arch == Architecture::kDeepseekV3) {
    REFIT_RETURN_IF_ERROR(parse_deepseek_v3(j, c));
    return check_size(c);
  }
  REFIT_ASSIGN_OR_RETURN(c.hidden_size, get_int(j, "hidden_size", std::nullopt, kMaxWidth));
  REFIT_ASSIGN_OR_RETURN(c.num_layers, get_int(j, "num_hidden_layers", std::nullopt, kMaxCount));
  REFIT_ASSIGN_OR_RETURN(c.num_heads, get_int(j, "num_attention_heads", std::nullopt, kMaxCount));
  REFIT_ASSIGN_OR_RETURN(c.num_kv_heads, get_int(j, "num_key_value_heads", c.num_heads, kMaxCount));
  REFIT_ASSIGN_OR_RETURN(c.intermediate_size, get_int(j, "intermediate_size", std::nullopt, kMaxFfn));
  REFIT_ASSIGN_OR_RETURN(c.vocab_size, get_int(j, "vocab_size", std::nullopt, kMaxVocab));
  if (c.hidden_size == 0 || c.num_heads == 0 || c.num_kv_heads == 0 || c.vocab_size == 0)
    return Status::InvalidArgument(
        "config.json: hidden_size, num_attention_heads, num_key_value_heads and vocab_size must "
        "be positive");
  if (c.num_heads % c.num_kv_heads != 0)
    return Status::InvalidArgument(fmt::format(
        "config.json: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
        c.num_heads, c.num_kv_heads));
  if (c.hidden_size % c.num_heads != 0 && !j.contains("head_dim"))
    return Status::InvalidArgument(
        fmt::format("config.json: no head_dim given and hidden_size ({}) is not a multiple of "
                    "num_attention_heads ({})",
                    c.hidden_size, c.num_heads));
  REFIT_ASSIGN_OR_RETURN(c.head_dim, get_int(j, "head_dim", c.hidden_size / c.num_heads, kMaxWidth));
  const bool gemma = c.arch == Architecture::kGemma2 || c.arch == Architecture::kGemma3;
  const bool moe = c.arch == Architecture::kQwen3Moe || c.arch == Architecture::kQwen2Moe;
  // Gemma ties its output head to the embedding (vLLM and SGLang require it).
  REFIT_ASSIGN_OR_RETURN(c.tie_word_embeddings, get_bool(j, "tie_word_embeddings", gemma));
  if (gemma && !c.tie_word_embeddings)
    return Status::Unsupported(fmt::format(
        "config.json: {} with tie_word_embeddings false; Gemma models tie their output head to "
        "the embedding (vLLM and SGLang require it)",
        arch));
  // Qwen2's and Qwen2-MoE's attention always has q/k/v bias; the others only when the config
  // says so (Phi-3 never).
  const bool always_bias = c.arch == Architecture::kQwen2 || c.arch == Architecture::kQwen2Moe;
  REFIT_ASSIGN_OR_RETURN(c.attention_bias, get_bool(j, "attention_bias", always_bias));
  if (always_bias) c.attention_bias = true;
  if (c.arch == Architecture::kPhi3 && c.attention_bias)
    return Status::Unsupported("config.json: Phi3ForCausalLM with attention_bias; Phi-3's fused "
                               "qkv_proj has no bias");
  c.qk_norm = c.arch == Architecture::kQwen3 || c.arch == Architecture::kQwen3Moe ||
              c.arch == Architecture::kGemma3;
  if (c.arch == Architecture::kGlm4Moe) {
    // GLM-4.5: q/k/v bias as attention_bias says, q/k norms as use_qk_norm says, partial rotary
    // (no tensor of its own), the DeepSeek-V3 MoE block.
    REFIT_ASSIGN_OR_RETURN(c.qk_norm, get_bool(j, "use_qk_norm", false));
    REFIT_RETURN_IF_ERROR(parse_deepseek_moe(j, c, /*dense_default=*/1));
    if (c.tie_word_embeddings)
      return Status::Unsupported(
          "config.json: Glm4MoeForCausalLM with tie_word_embeddings true; vLLM and SGLang keep "
          "lm_head as a parameter of its own and never tie it; allowed: false");
  }
  c.feedforward_norms = gemma;
  c.fused_in_checkpoint = c.arch == Architecture::kPhi3;
  c.rms_norm_eps = get_double(j, "rms_norm_eps", 1e-6);
  c.rope_theta = get_double(j, "rope_theta", 10000.0);

  if (moe) {
    // Checkpoints write num_experts; transformers 5 saves Qwen3MoeConfig's as num_local_experts
    // (notes/gpu-runs.md run 29), which is read when num_experts is absent.
    const char* experts_key =
        !j.contains("num_experts") && j.contains("num_local_experts") ? "num_local_experts"
                                                                      : "num_experts";
    REFIT_ASSIGN_OR_RETURN(c.num_experts, get_int(j, experts_key, std::nullopt, kMaxExperts));
    if (c.arch == Architecture::kQwen2Moe) {
      REFIT_ASSIGN_OR_RETURN(c.shared_expert_intermediate_size,
                             get_int(j, "shared_expert_intermediate_size", 0, kMaxFfn));
    }
    REFIT_ASSIGN_OR_RETURN(c.num_experts_per_tok, get_int(j, "num_experts_per_tok", std::nullopt, kMaxExperts));
    REFIT_ASSIGN_OR_RETURN(c.moe_intermediate_size,
                           get_int(j, "moe_intermediate_size", std::nullopt, kMaxFfn));
    REFIT_ASSIGN_OR_RETURN(c.decoder_sparse_step, get_int(j, "decoder_sparse_step", 1, kMaxCount));
    REFIT_ASSIGN_OR_RETURN(c.norm_topk_prob, get_bool(j, "norm_topk_prob", false));
    if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
      if (!it->is_array())
        return Status::InvalidArgument(
            "config.json: \"mlp_only_layers\" must be a list of integers");
      for (const auto& v : *it) {
        if (!v.is_number_integer())
          return Status::InvalidArgument(
              "config.json: \"mlp_only_layers\" must be a list of integers");
        c.mlp_only_layers.push_back(v.get<std::int64_t>());
      }
    }
    if (c.num_experts == 0 || c.num_experts_per_tok == 0 || c.num_experts_per_tok > c.num_experts)
      return Status::InvalidArgument(
          fmt::format("config.json: need 0 < num_experts_per_tok ({}) <= num_experts ({})",
                      c.num_experts_per_tok, c.num_experts));
  }
  return check_size(c);
}

}  // namespace refit
