// Builds the HF parameter table of a ModelConfig (docs/design.md §6.1), in HF's state_dict order.
#include "refit/model_spec.h"

#include <fmt/format.h>
#include <algorithm>

namespace refit {

std::string_view architecture_name(Architecture arch) {
  switch (arch) {
    case Architecture::kLlama:
      return "LlamaForCausalLM";
    case Architecture::kQwen2:
      return "Qwen2ForCausalLM";
    case Architecture::kQwen3:
      return "Qwen3ForCausalLM";
    case Architecture::kMistral:
      return "MistralForCausalLM";
    case Architecture::kQwen3Moe:
      return "Qwen3MoeForCausalLM";
    case Architecture::kGemma2:
      return "Gemma2ForCausalLM";
    case Architecture::kGemma3:
      return "Gemma3ForCausalLM";
    case Architecture::kPhi3:
      return "Phi3ForCausalLM";
    case Architecture::kQwen2Moe:
      return "Qwen2MoeForCausalLM";
    case Architecture::kDeepseekV3:
      return "DeepseekV3ForCausalLM";
    case Architecture::kGlm4Moe:
      return "Glm4MoeForCausalLM";
    case Architecture::kOther:
      return "other";
  }
  return "?";
}

bool llama_family(Architecture arch) {
  switch (arch) {
    case Architecture::kLlama:
    case Architecture::kQwen2:
    case Architecture::kQwen3:
    case Architecture::kMistral:
    case Architecture::kQwen3Moe:
      return true;
    case Architecture::kGemma2:
    case Architecture::kGemma3:
    case Architecture::kPhi3:
    case Architecture::kQwen2Moe:
    case Architecture::kDeepseekV3:
    case Architecture::kGlm4Moe:
    case Architecture::kOther:
      return false;
  }
  return false;
}

bool ModelConfig::is_moe_layer(std::int64_t layer) const {
  if (num_experts <= 0) return false;
  if (layer < first_k_dense_replace) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end())
    return false;
  return decoder_sparse_step > 0 && (layer + 1) % decoder_sparse_step == 0;
}

std::int64_t TensorSpec::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::int64_t TensorSpec::row_elems() const {
  std::int64_t n = 1;
  for (std::size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

std::shared_ptr<const ModelSpec::Table> ModelSpec::make_table(std::vector<TensorSpec> tensors) {
  auto table = std::make_shared<Table>();
  table->tensors = std::move(tensors);
  table->index.reserve(table->tensors.size());
  for (std::size_t i = 0; i < table->tensors.size(); ++i)
    table->index.emplace(table->tensors[i].name, i);
  return table;
}

ModelSpec::ModelSpec() : table_(make_table({})) {}

ModelSpec::ModelSpec(ModelSpec&& other) noexcept
    : config_(std::move(other.config_)), table_(other.table_), source_(std::move(other.source_)) {}

ModelSpec& ModelSpec::operator=(ModelSpec&& other) noexcept {
  config_ = std::move(other.config_);
  table_ = other.table_;
  source_ = std::move(other.source_);
  return *this;
}

ModelSpec::ModelSpec(ModelConfig config, std::string source)
    : config_(std::move(config)), source_(std::move(source)) {
  std::vector<TensorSpec> tensors;
  const auto& c = config_;
  const std::int64_t H = c.hidden_size, d = c.head_dim;
  const std::int64_t q_rows = c.num_heads * d, kv_rows = c.num_kv_heads * d;
  auto add = [&](std::string name, std::vector<std::int64_t> shape, ParamRole role,
                 std::int64_t layer = -1, std::int64_t expert = -1) {
    tensors.push_back(TensorSpec{std::move(name), std::move(shape), role, layer, expert});
  };

  add("model.embed_tokens.weight", {c.vocab_size, H}, ParamRole::kEmbedding);
  for (std::int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    if (c.mla) {
      // transformers' DeepseekV3Attention, in registration order.
      const std::int64_t qk_head = c.qk_nope_head_dim + c.qk_rope_head_dim;
      if (c.q_lora_rank > 0) {
        add(p + "self_attn.q_a_proj.weight", {c.q_lora_rank, H}, ParamRole::kQAProj, i);
        add(p + "self_attn.q_a_layernorm.weight", {c.q_lora_rank}, ParamRole::kQALayerNorm, i);
        add(p + "self_attn.q_b_proj.weight", {c.num_heads * qk_head, c.q_lora_rank},
            ParamRole::kQBProj, i);
      } else {
        add(p + "self_attn.q_proj.weight", {c.num_heads * qk_head, H}, ParamRole::kQProj, i);
      }
      add(p + "self_attn.kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, H},
          ParamRole::kKvAProj, i);
      add(p + "self_attn.kv_a_layernorm.weight", {c.kv_lora_rank}, ParamRole::kKvALayerNorm, i);
      add(p + "self_attn.kv_b_proj.weight",
          {c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}, ParamRole::kKvBProj,
          i);
      add(p + "self_attn.o_proj.weight", {H, c.num_heads * c.v_head_dim}, ParamRole::kOProj, i);
    } else if (c.fused_in_checkpoint) {
      add(p + "self_attn.qkv_proj.weight", {q_rows + 2 * kv_rows, H}, ParamRole::kQkvProj, i);
    } else {
      add(p + "self_attn.q_proj.weight", {q_rows, H}, ParamRole::kQProj, i);
      if (c.attention_bias) add(p + "self_attn.q_proj.bias", {q_rows}, ParamRole::kQBias, i);
      add(p + "self_attn.k_proj.weight", {kv_rows, H}, ParamRole::kKProj, i);
      if (c.attention_bias) add(p + "self_attn.k_proj.bias", {kv_rows}, ParamRole::kKBias, i);
      add(p + "self_attn.v_proj.weight", {kv_rows, H}, ParamRole::kVProj, i);
      if (c.attention_bias) add(p + "self_attn.v_proj.bias", {kv_rows}, ParamRole::kVBias, i);
    }
    if (!c.mla) add(p + "self_attn.o_proj.weight", {H, q_rows}, ParamRole::kOProj, i);
    if (c.qk_norm) {
      add(p + "self_attn.q_norm.weight", {d}, ParamRole::kQNorm, i);
      add(p + "self_attn.k_norm.weight", {d}, ParamRole::kKNorm, i);
    }
    const bool deepseek_moe =
        c.arch == Architecture::kDeepseekV3 || c.arch == Architecture::kGlm4Moe;
    if (c.is_moe_layer(i) && deepseek_moe) {
      // DeepSeek-V3 / GLM-4.5 (transformers' DeepseekV3MoE): experts, the router with its
      // correction bias (a persistent buffer), then one MLP for every shared expert.
      const std::int64_t I = c.moe_intermediate_size, S = c.shared_expert_intermediate_size;
      for (std::int64_t e = 0; e < c.num_experts; ++e) {
        const std::string q = fmt::format("{}mlp.experts.{}.", p, e);
        add(q + "gate_proj.weight", {I, H}, ParamRole::kExpertGate, i, e);
        add(q + "up_proj.weight", {I, H}, ParamRole::kExpertUp, i, e);
        add(q + "down_proj.weight", {H, I}, ParamRole::kExpertDown, i, e);
      }
      add(p + "mlp.gate.weight", {c.num_experts, H}, ParamRole::kRouter, i);
      if (c.router_bias)
        add(p + "mlp.gate.e_score_correction_bias", {c.num_experts}, ParamRole::kRouterBias, i);
      if (S > 0) {
        add(p + "mlp.shared_experts.gate_proj.weight", {S, H}, ParamRole::kSharedGate, i);
        add(p + "mlp.shared_experts.up_proj.weight", {S, H}, ParamRole::kSharedUp, i);
        add(p + "mlp.shared_experts.down_proj.weight", {H, S}, ParamRole::kSharedDown, i);
      }
    } else if (c.is_moe_layer(i)) {
      const std::int64_t I = c.moe_intermediate_size;
      add(p + "mlp.gate.weight", {c.num_experts, H}, ParamRole::kRouter, i);
      for (std::int64_t e = 0; e < c.num_experts; ++e) {
        const std::string q = fmt::format("{}mlp.experts.{}.", p, e);
        add(q + "gate_proj.weight", {I, H}, ParamRole::kExpertGate, i, e);
        add(q + "up_proj.weight", {I, H}, ParamRole::kExpertUp, i, e);
        add(q + "down_proj.weight", {H, I}, ParamRole::kExpertDown, i, e);
      }
      if (c.shared_expert_intermediate_size > 0) {
        const std::int64_t S = c.shared_expert_intermediate_size;
        add(p + "mlp.shared_expert.gate_proj.weight", {S, H}, ParamRole::kSharedGate, i);
        add(p + "mlp.shared_expert.up_proj.weight", {S, H}, ParamRole::kSharedUp, i);
        add(p + "mlp.shared_expert.down_proj.weight", {H, S}, ParamRole::kSharedDown, i);
        add(p + "mlp.shared_expert_gate.weight", {1, H}, ParamRole::kSharedExpertGate, i);
      }
    } else if (c.fused_in_checkpoint) {
      const std::int64_t I = c.intermediate_size;
      add(p + "mlp.gate_up_proj.weight", {2 * I, H}, ParamRole::kGateUpProj, i);
      add(p + "mlp.down_proj.weight", {H, I}, ParamRole::kDownProj, i);
    } else {
      const std::int64_t I = c.intermediate_size;
      add(p + "mlp.gate_proj.weight", {I, H}, ParamRole::kGateProj, i);
      add(p + "mlp.up_proj.weight", {I, H}, ParamRole::kUpProj, i);
      add(p + "mlp.down_proj.weight", {H, I}, ParamRole::kDownProj, i);
    }
    add(p + "input_layernorm.weight", {H}, ParamRole::kInputNorm, i);
    add(p + "post_attention_layernorm.weight", {H}, ParamRole::kPostAttnNorm, i);
    if (c.feedforward_norms) {
      add(p + "pre_feedforward_layernorm.weight", {H}, ParamRole::kPreFfnNorm, i);
      add(p + "post_feedforward_layernorm.weight", {H}, ParamRole::kPostFfnNorm, i);
    }
  }
  add("model.norm.weight", {H}, ParamRole::kFinalNorm);
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, H}, ParamRole::kLmHead);
  table_ = make_table(std::move(tensors));
}

ModelSpec::ModelSpec(ModelConfig config, std::vector<TensorSpec> tensors, std::string source)
    : config_(std::move(config)),
      table_(make_table(std::move(tensors))),
      source_(std::move(source)) {}

bool natural_name_less(std::string_view a, std::string_view b) {
  auto digit = [](char ch) { return ch >= '0' && ch <= '9'; };
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (digit(a[i]) && digit(b[j])) {
      std::size_t ie = i, je = j;
      while (ie < a.size() && digit(a[ie])) ++ie;
      while (je < b.size() && digit(b[je])) ++je;
      // Compare the numbers without parsing them (any length): strip leading zeros, then the
      // longer one is larger, then digit by digit.
      std::size_t iz = i, jz = j;
      while (iz + 1 < ie && a[iz] == '0') ++iz;
      while (jz + 1 < je && b[jz] == '0') ++jz;
      const std::string_view na = a.substr(iz, ie - iz), nb = b.substr(jz, je - jz);
      if (na.size() != nb.size()) return na.size() < nb.size();
      if (na != nb) return na < nb;
      if (ie - i != je - j) return ie - i < je - j;  // "01" after "1": a total order
      i = ie;
      j = je;
      continue;
    }
    if (a[i] != b[j]) return static_cast<unsigned char>(a[i]) < static_cast<unsigned char>(b[j]);
    ++i;
    ++j;
  }
  return a.size() - i < b.size() - j;
}

std::int64_t layer_of_name(std::string_view name) {
  constexpr std::string_view kKey = "layers.";
  for (std::size_t at = name.find(kKey); at != std::string_view::npos;
       at = name.find(kKey, at + 1)) {
    if (at > 0 && name[at - 1] != '.') continue;
    std::size_t k = at + kKey.size();
    std::int64_t n = 0;
    std::size_t digits = 0;
    while (k < name.size() && name[k] >= '0' && name[k] <= '9' && digits < 9) {
      n = n * 10 + (name[k] - '0');
      ++k;
      ++digits;
    }
    if (digits > 0 && k < name.size() && name[k] == '.') return n;
  }
  return -1;
}

std::int64_t ModelSpec::total_parameters() const {
  std::int64_t n = 0;
  for (const auto& t : tensors()) n += t.numel();
  return n;
}

std::optional<std::size_t> ModelSpec::find(std::string_view name) const {
  auto it = table_->index.find(std::string(name));
  if (it == table_->index.end()) return std::nullopt;
  return it->second;
}

}  // namespace refit
