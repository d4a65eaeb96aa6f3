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
