// Built-in presets: the published config.json of real models (architecture-relevant keys, values
// as released), plus tiny models for tests. A preset is parsed exactly like a model directory.
#include <fmt/format.h>
#include <algorithm>
#include <map>

#include "refit/model_spec.h"

namespace refit {
namespace {

const std::map<std::string, const char*, std::less<>>& presets() {
  static const std::map<std::string, const char*, std::less<>> table = {
      // Qwen/Qwen2.5-0.5B — 494,032,768 parameters.
      {"qwen2.5-0.5b", R"({
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
  "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
  "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
  "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "hidden_act": "silu"})"},
      // Qwen/Qwen2.5-7B — 7,615,616,512 parameters.
      {"qwen2.5-7b", R"({
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
  "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
  "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
  "max_position_embeddings": 131072, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "hidden_act": "silu"})"},
      // Qwen/Qwen3-0.6B — 751,632,384 parameters.
      {"qwen3-0.6b", R"({
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
  "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
  "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
  "attention_bias": false, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000, "tie_word_embeddings": true, "torch_dtype": "bfloat16"})"},
      // Qwen/Qwen3-8B — 8,190,735,360 parameters.
      {"qwen3-8b", R"({
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
  "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
  "attention_bias": false, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})"},
      // meta-llama/Llama-3.1-8B — 8,030,261,248 parameters.
      {"llama-3.1-8b", R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
  "attention_bias": false, "mlp_bias": false, "max_position_embeddings": 131072,
  "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16"})"},
      // meta-llama/Llama-3.2-1B — 1,235,814,400 parameters.
      {"llama-3.2-1b", R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
  "attention_bias": false, "mlp_bias": false, "max_position_embeddings": 131072,
  "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": true,
  "torch_dtype": "bfloat16"})"},
      // mistralai/Mistral-7B-v0.1 — 7,241,732,096 parameters.
      {"mistral-7b", R"({
  "architectures": ["MistralForCausalLM"], "model_type": "mistral",
  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
  "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
  "sliding_window": 4096, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})"},
      // Qwen/Qwen3-30B-A3B — 30,532,122,624 parameters in 18,867 tensors.
      {"qwen3-30b-a3b", R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
  "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
  "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
  "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": true,
  "attention_bias": false, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})"},
      // Qwen/Qwen3-235B-A22B — 235,093,634,560 parameters in 36,945 tensors (published: 235B
      // total, 234B non-embedding, 22B activated).
      {"qwen3-235b-a22b", R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
  "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 94,
  "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
  "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536,
  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": true,
  "attention_bias": false, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})"},
      // google/gemma-2-2b — 2,614,341,888 parameters (tied; head_dim 256, so nq*d != H).
      {"gemma-2-2b", R"({
  "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
  "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
  "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 256000,
  "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
  "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-06,
  "rope_theta": 10000.0, "tie_word_embeddings": true, "torch_dtype": "float32"})"},
      // google/gemma-3-1b-pt (text) — 999,885,952 parameters (tied; one kv head).
      {"gemma-3-1b", R"({
  "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
  "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
  "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
  "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
  "rope_local_base_freq": 10000, "rope_theta": 1000000, "hidden_activation": "gelu_pytorch_tanh",
  "rms_norm_eps": 1e-06, "tie_word_embeddings": true, "torch_dtype": "bfloat16"})"},
      // microsoft/Phi-3-mini-4k-instruct — 3,821,079,552 parameters (qkv and gate_up fused).
      {"phi-3-mini", R"({
  "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
  "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 2047,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16"})"},
      // Qwen/Qwen1.5-MoE-A2.7B — 14,315,784,192 parameters (60 experts, a gated shared expert).
      {"qwen1.5-moe-a2.7b", R"({
  "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
  "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
  "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936,
  "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
  "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "norm_topk_prob": false,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16"})"},
      // deepseek-ai/DeepSeek-V3 — 671,026,419,200 parameters without its MTP layer (model card:
      // 671B total, 37B activated; 685B with the MTP module). Ships in FP8 (block 128 x 128);
      // refit.target_precision: fp8 gives the same scheme.
      {"deepseek-v3", R"({
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
  "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
  "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
  "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
  "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
  "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
  "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": true,
  "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1, "vocab_size": 129280,
  "attention_bias": false, "rms_norm_eps": 1e-06, "rope_theta": 10000,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "hidden_act": "silu"})"},
      // moonshotai/Kimi-K2-Instruct — 1,026,408,232,448 parameters (model card: 1T total, 32B
      // activated; 64 heads, 384 experts, one dense layer). Ships in FP8 (block 128 x 128).
      {"kimi-k2", R"({
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
  "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
  "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
  "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
  "v_head_dim": 128, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
  "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
  "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": true,
  "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0, "vocab_size": 163840,
  "attention_bias": false, "rms_norm_eps": 1e-06, "rope_theta": 50000.0,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "hidden_act": "silu"})"},
      // zai-org/GLM-4.5-Air — 106,852,251,264 parameters without its MTP layer (model card: 106B
      // total, 12B active; 96 heads of 128, q/k/v bias, partial rotary 0.5, one dense layer).
      {"glm-4.5-air", R"({
  "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
  "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
  "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
  "attention_bias": true, "use_qk_norm": false, "partial_rotary_factor": 0.5,
  "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
  "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": true,
  "routed_scaling_factor": 1.0, "num_nextn_predict_layers": 1, "vocab_size": 151552,
  "rms_norm_eps": 1e-05, "rope_theta": 1000000, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "hidden_act": "silu"})"},
      // Tiny models for tests. Vocabulary sizes are deliberately not multiples of 64 or 128.
      // Dense Qwen3 with GQA 2 and q/k norms, untied.
      {"tiny-qwen3", R"({
  "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
  "vocab_size": 1000, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
  "tie_word_embeddings": false})"},
      // Dense Qwen2 with q/k/v bias, GQA 7 (14 heads / 2 kv heads), tied embeddings.
      {"tiny-qwen2", R"({
  "architectures": ["Qwen2ForCausalLM"], "hidden_size": 56, "intermediate_size": 80,
  "num_hidden_layers": 2, "num_attention_heads": 14, "num_key_value_heads": 2,
  "vocab_size": 515, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
  "tie_word_embeddings": true})"},
      // Dense Llama, multi-head attention (GQA 1), untied.
      {"tiny-llama", R"({
  "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
  "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
  "vocab_size": 777, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
  "tie_word_embeddings": false})"},
      // Qwen3-MoE with 8 experts, top-2, untied.
      {"tiny-moe", R"({
  "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
  "vocab_size": 300, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": true,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": false})"},
      // Gemma 2: head_dim * heads != hidden_size, feed-forward norms, tied.
      {"tiny-gemma2", R"({
  "architectures": ["Gemma2ForCausalLM"], "hidden_size": 48, "intermediate_size": 80,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
  "vocab_size": 333, "query_pre_attn_scalar": 16, "rms_norm_eps": 1e-06})"},
      // Gemma 3 text: one kv head (replicated on every TP rank), q/k norms.
      {"tiny-gemma3", R"({
  "architectures": ["Gemma3ForCausalLM"], "hidden_size": 40, "intermediate_size": 72,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 12,
  "vocab_size": 401, "query_pre_attn_scalar": 12, "rms_norm_eps": 1e-06})"},
      // Phi-3: q/k/v and gate/up fused in the checkpoint, GQA 2, untied.
      {"tiny-phi3", R"({
  "architectures": ["Phi3ForCausalLM"], "hidden_size": 48, "intermediate_size": 88,
  "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
  "vocab_size": 259, "rms_norm_eps": 1e-05, "tie_word_embeddings": false})"},
      // Qwen2-MoE: q/k/v bias, 6 experts top-2, a gated shared expert, layer 1 dense.
      {"tiny-qwen2-moe", R"({
  "architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 32, "intermediate_size": 56,
  "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
  "vocab_size": 211, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 20,
  "shared_expert_intermediate_size": 36, "decoder_sparse_step": 1, "mlp_only_layers": [1],
  "norm_topk_prob": false, "rms_norm_eps": 1e-06, "tie_word_embeddings": false})"},
      // DeepSeek-V3 shapes: MLA with q_lora_rank, two dense layers, then MoE layers with 8
      // experts (top-2 of the 2 best of 4 groups) and two shared experts; an MTP layer (not part
      // of the table). Every TP size up to 8 shards it.
      {"tiny-deepseek", R"({
  "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 48, "intermediate_size": 48,
  "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 8,
  "num_key_value_heads": 8, "q_lora_rank": 24, "kv_lora_rank": 20, "qk_nope_head_dim": 12,
  "qk_rope_head_dim": 8, "v_head_dim": 10, "n_routed_experts": 8, "n_shared_experts": 2,
  "num_experts_per_tok": 2, "first_k_dense_replace": 2, "moe_layer_freq": 1,
  "topk_method": "noaux_tc", "n_group": 4, "topk_group": 2, "num_nextn_predict_layers": 1,
  "vocab_size": 299, "rms_norm_eps": 1e-06, "tie_word_embeddings": false})"},
      // DeepSeek-V2-Lite / Moonlight style: MLA with q_lora_rank null (one q_proj), one dense
      // layer, 5 experts (top-2) and one shared expert.
      {"tiny-deepseek-lite", R"({
  "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 40, "intermediate_size": 36,
  "moe_intermediate_size": 8, "num_hidden_layers": 3, "num_attention_heads": 4,
  "num_key_value_heads": 4, "q_lora_rank": null, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
  "qk_rope_head_dim": 4, "v_head_dim": 6, "n_routed_experts": 5, "n_shared_experts": 1,
  "num_experts_per_tok": 2, "first_k_dense_replace": 1, "topk_method": "noaux_tc",
  "n_group": 1, "topk_group": 1, "vocab_size": 257, "rms_norm_eps": 1e-06, "tie_word_embeddings": false})"},
      // GLM-4.5 shapes: GQA 4 with q/k/v bias and q/k norms (nq * d != H; kv heads replicated
      // at TP 4 and 8), one dense layer, 8 experts (top-2) and a shared expert; an MTP layer
      // (not part of the table).
      {"tiny-glm4-moe", R"({
  "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 40, "intermediate_size": 56,
  "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 8,
  "num_key_value_heads": 2, "head_dim": 12, "attention_bias": true, "use_qk_norm": true,
  "partial_rotary_factor": 0.5, "n_routed_experts": 8, "n_shared_experts": 1,
  "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
  "vocab_size": 311, "rms_norm_eps": 1e-05, "tie_word_embeddings": false})"},
  };
  return table;
}

}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, text] : presets()) names.push_back(name);
  return names;
}

Result<std::string> preset_config_json(std::string_view name) {
  auto it = presets().find(name);
  if (it == presets().end()) return Status::NotFound(fmt::format("no preset \"{}\"", name));
  return std::string(it->second);
}

}  // namespace refit
