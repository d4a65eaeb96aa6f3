// refit/model_spec.h — the Hugging Face parameter table of a model (docs/design.md §6.1).
//
// A ModelSpec is an immutable value: the parsed config.json (ModelConfig) and the exact,
// ordered list of HF parameters (TensorSpec). Every participant of a refit derives the same
// spec from the same config, so the order of `tensors` is part of the refit plan.
//
// Where the table comes from (docs/models.md):
//  - an architecture refit knows (Architecture other than kOther): derived from config.json, in
//    HF's state_dict order, with the roles the fused engine layout and the Megatron bridge need;
//    safetensors in the model directory are checked against it;
//  - any other architecture (kOther): read from the safetensors headers of the model directory
//    (every tensor's name and shape, in natural name order), every role kOther. Only layouts that
//    need no architecture facts serve it: an FSDP2 trainer and the engine layout `hf`.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "refit/status.h"

namespace refit {

enum class Architecture {
  kLlama,       // LlamaForCausalLM
  kQwen2,       // Qwen2ForCausalLM (q/k/v bias)
  kQwen3,       // Qwen3ForCausalLM (q/k norms)
  kMistral,     // MistralForCausalLM
  kQwen3Moe,    // Qwen3MoeForCausalLM (q/k norms, routed experts)
  kGemma2,      // Gemma2ForCausalLM (pre/post feed-forward norms, tied embeddings)
  kGemma3,      // Gemma3ForCausalLM, text only (Gemma 2's norms plus q/k norms)
  kPhi3,        // Phi3ForCausalLM (q/k/v and gate/up already fused in the checkpoint)
  kQwen2Moe,    // Qwen2MoeForCausalLM (q/k/v bias, routed experts plus a gated shared expert)
  kDeepseekV3,  // DeepseekV3ForCausalLM (DeepSeek-V3/R1, Kimi-K2, Moonlight): MLA, dense first
                // layers, routed and shared experts, a float32 router correction bias
  kGlm4Moe,     // Glm4MoeForCausalLM (GLM-4.5/4.6): q/k/v bias, optional q/k norms, dense first
                // layers, routed and shared experts, a float32 router correction bias
  kOther,       // any other class: the tensor table comes from the checkpoint's headers
};

// The Llama family (Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE): the architectures whose Megatron
// names refit's bridge knows (docs/megatron.md) and that its reference forward covers
// (src/harness/forward.h). The others have a table and, but for kOther, a fused layout only.
bool llama_family(Architecture arch);

// HF architecture string ("Qwen3ForCausalLM") of an Architecture; "other" for kOther (its real
// name is ModelConfig::architecture).
std::string_view architecture_name(Architecture arch);

// config.json "quantization_config" of a quantized checkpoint (read for FP8 refits, docs/fp8.md).
struct QuantizationConfig {
  bool present = false;
  std::string quant_method;                     // e.g. "fp8"
  std::vector<std::int64_t> weight_block_size;  // [rows, cols]; empty: one scale per tensor
  std::vector<std::string> ignored;             // modules_to_not_convert / ignored_layers
};

struct ModelConfig {
  Architecture arch = Architecture::kLlama;
  std::string architecture = "LlamaForCausalLM";  // config.json "architectures"[0], as written
  // With kOther only architecture, tie_word_embeddings and (when config.json has them)
  // hidden_size, num_layers and vocab_size are read; the other sizes stay 0.
  std::int64_t hidden_size = 0;        // H
  std::int64_t num_layers = 0;         // num_hidden_layers
  std::int64_t num_heads = 0;          // nq = num_attention_heads
  std::int64_t num_kv_heads = 0;       // nkv = num_key_value_heads (defaults to nq)
  std::int64_t head_dim = 0;           // d: given, else H / nq
  std::int64_t intermediate_size = 0;  // I of dense MLPs
  std::int64_t vocab_size = 0;         // V
  bool tie_word_embeddings = false;    // no lm_head.weight when true
  bool attention_bias = false;         // q/k/v_proj.bias (Qwen2 always; Llama if set)
  bool qk_norm = false;                // self_attn.{q,k}_norm.weight (Qwen3, Qwen3-MoE)
  // MoE models only (num_experts == 0 for dense models).
  std::int64_t num_experts = 0;          // E
  std::int64_t num_experts_per_tok = 0;  // top-k of the router
  std::int64_t moe_intermediate_size = 0;
  std::int64_t decoder_sparse_step = 1;       // layer i is MoE when (i+1) % step == 0 ...
  std::vector<std::int64_t> mlp_only_layers;  // ... and i is not listed here
  bool norm_topk_prob = true;
  // The shared expert's I (0: no shared expert). Qwen2-MoE: shared_expert_intermediate_size, one
  // gated mlp.shared_expert; DeepSeek-V3 / GLM-4.5: moe_intermediate_size * n_shared_experts, one
  // ungated mlp.shared_experts MLP holding all of them.
  std::int64_t shared_expert_intermediate_size = 0;
  std::int64_t n_shared_experts = 0;  // DeepSeek-V3 / GLM-4.5 (the count behind the size above)
  // DeepSeek-V3 / GLM-4.5: layers [0, first_k_dense_replace) are dense, every later one MoE.
  std::int64_t first_k_dense_replace = 0;
  // mlp.gate.e_score_correction_bias [E] in every MoE layer (DeepSeek-V3 with topk_method
  // noaux_tc, GLM-4.5); the engines keep it in float32 (docs/models.md).
  bool router_bias = false;
  // Multi-head latent attention (DeepSeek-V3). q_lora_rank 0: config.json's null, one q_proj
  // [nq * (nope + rope), H] instead of q_a_proj / q_a_layernorm / q_b_proj.
  bool mla = false;
  std::int64_t q_lora_rank = 0;
  std::int64_t kv_lora_rank = 0;
  std::int64_t qk_nope_head_dim = 0;
  std::int64_t qk_rope_head_dim = 0;
  std::int64_t v_head_dim = 0;
  // Multi-token-prediction layers after the decoder layers (DeepSeek-V3, GLM-4.5
  // num_nextn_predict_layers): read, never part of the table (docs/models.md, "MTP layers").
  std::int64_t num_nextn_predict_layers = 0;
  // Gemma 2 / 3: pre_/post_feedforward_layernorm in every layer.
  bool feedforward_norms = false;
  // Phi-3: the checkpoint holds self_attn.qkv_proj and mlp.gate_up_proj already fused.
  bool fused_in_checkpoint = false;
  // Used by the reference forward pass only.
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;

  // The checkpoint's quantization_config, when config.json has one.
  QuantizationConfig quantization;

  bool is_moe_layer(std::int64_t layer) const;
};

// What a parameter is, independent of its name; layouts switch on this.
enum class ParamRole {
  kEmbedding,     // model.embed_tokens.weight [V, H]
  kLmHead,        // lm_head.weight [V, H]
  kFinalNorm,     // model.norm.weight [H]
  kInputNorm,     // input_layernorm.weight [H]
  kPostAttnNorm,  // post_attention_layernorm.weight [H]
  kQProj,
  kKProj,
  kVProj,  // [nq*d, H] / [nkv*d, H]
  kQBias,
  kKBias,
  kVBias,  // [nq*d] / [nkv*d]
  kOProj,  // [H, nq*d]
  kQNorm,
  kKNorm,  // [d]
  kGateProj,
  kUpProj,    // dense MLP [I, H]
  kDownProj,  // dense MLP [H, I]
  kRouter,    // mlp.gate.weight [E, H]
  kExpertGate,
  kExpertUp,     // [I_moe, H]
  kExpertDown,   // [H, I_moe]
  kPreFfnNorm,   // pre_feedforward_layernorm.weight [H] (Gemma)
  kPostFfnNorm,  // post_feedforward_layernorm.weight [H] (Gemma)
  kQkvProj,      // self_attn.qkv_proj.weight [(nq + 2 nkv) d, H] = [q; k; v] (Phi-3)
  kGateUpProj,   // mlp.gate_up_proj.weight [2 I, H] = [gate; up] (Phi-3)
  kSharedGate,
  kSharedUp,          // mlp.shared_expert.{gate,up}_proj.weight [I_sh, H] (Qwen2-MoE)
  kSharedDown,        // mlp.shared_expert.down_proj.weight [H, I_sh]
  kSharedExpertGate,  // mlp.shared_expert_gate.weight [1, H]
  kRouterBias,        // mlp.gate.e_score_correction_bias [E] (DeepSeek-V3, GLM-4.5; float32)
  // Multi-head latent attention (DeepSeek-V3); its q_proj (q_lora_rank null) is kQProj
  // [nq * (nope + rope), H] and its o_proj kOProj [H, nq * v].
  kQAProj,        // self_attn.q_a_proj.weight [q_lora_rank, H]
  kQALayerNorm,   // self_attn.q_a_layernorm.weight [q_lora_rank]
  kQBProj,        // self_attn.q_b_proj.weight [nq * (nope + rope), q_lora_rank]
  kKvAProj,       // self_attn.kv_a_proj_with_mqa.weight [kv_lora_rank + rope, H]
  kKvALayerNorm,  // self_attn.kv_a_layernorm.weight [kv_lora_rank]
  kKvBProj,       // self_attn.kv_b_proj.weight [nq * (nope + v), kv_lora_rank]
  kOther,         // a tensor of a table read from safetensors headers (no architecture facts)
};

struct TensorSpec {
  std::string name;                 // HF name
  std::vector<std::int64_t> shape;  // row-major
  ParamRole role = ParamRole::kEmbedding;
  std::int64_t layer = -1;   // decoder layer, -1 outside layers
  std::int64_t expert = -1;  // expert index for kExpert*, else -1

  std::int64_t numel() const;
  std::int64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  // Elements per dim-0 row (1 for 1-D tensors).
  std::int64_t row_elems() const;
};

class ModelSpec {
 public:
  ModelSpec();
  // Builds the HF parameter list of `config` in HF's state_dict order.
  explicit ModelSpec(ModelConfig config, std::string source = {});
  // An explicit table (names must be unique; the caller checked them): read from safetensors
  // headers or from a module's state dict.
  ModelSpec(ModelConfig config, std::vector<TensorSpec> tensors, std::string source);
  // Copies share the tensor table and its name index (a spec is immutable), so a copy costs its
  // config, not its tensors: the wire model, the plan's inputs and every rank's setup hold copies
  // of specs of tens of thousands of tensors. A moved-from spec keeps sharing its table.
  ModelSpec(const ModelSpec&) = default;
  ModelSpec& operator=(const ModelSpec&) = default;
  ModelSpec(ModelSpec&& other) noexcept;
  ModelSpec& operator=(ModelSpec&& other) noexcept;

  const ModelConfig& config() const { return config_; }
  const std::vector<TensorSpec>& tensors() const { return table_->tensors; }
  // Where the spec came from: a preset name or a model directory.
  const std::string& source() const { return source_; }
  std::int64_t total_parameters() const;
  // Whether refit has the architecture's facts (roles, fused layout, Megatron names, forward).
  bool known_architecture() const { return config_.arch != Architecture::kOther; }
  // Index into tensors(), or nullopt.
  std::optional<std::size_t> find(std::string_view name) const;

 private:
  struct Table {
    std::vector<TensorSpec> tensors;
    std::unordered_map<std::string, std::size_t> index;  // name -> position in tensors
  };
  static std::shared_ptr<const Table> make_table(std::vector<TensorSpec> tensors);

  ModelConfig config_;
  std::shared_ptr<const Table> table_;  // never null
  std::string source_;
};

// The most tensors a model's table may hold (a config.json, a checkpoint or an explicit table):
// far above any published model, so that an absurd input is an error naming it, not a hang.
inline constexpr std::int64_t kMaxModelTensors = 4'000'000;

// Parses the text of an HF config.json. An unknown "architectures" entry is an error naming it.
Result<ModelConfig> parse_hf_config(std::string_view json_text);

// Names of the built-in presets, sorted.
std::vector<std::string> preset_names();
// The config.json text of a built-in preset, or NotFound.
Result<std::string> preset_config_json(std::string_view name);

// A preset name, or a directory holding config.json. Errors name the preset or path. For an
// architecture refit does not know, the directory must hold the model's safetensors: the table
// is read from their headers (tensor_table_from_headers).
Result<ModelSpec> load_model_spec(std::string_view model);

// The natural order of tensor names: runs of digits compare as numbers, so
// "model.layers.2.x" < "model.layers.10.x". Header-derived tables use it.
bool natural_name_less(std::string_view a, std::string_view b);
// The decoder layer a name belongs to ("<...>.layers.<N>.<...>"), or -1.
std::int64_t layer_of_name(std::string_view name);

}  // namespace refit
