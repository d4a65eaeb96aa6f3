// Logit check of a refit: the same decoder forward pass computed twice, once by one process from
// the full Hugging Face tensors and once by the TP ranks of an engine from their own shards (in the
// vLLM / SGLang layout of engine/engine_layout.h). Equal logits prove the engine layout *means*
// the right thing (fused qkv order, kv-head replication, gate/up order, column slices,
// vocabulary-parallel tables), not only that bytes arrived.
//
// Model math follows transformers' modeling files of every architecture with a fused layout
// (docs/models.md, "Forward"):
//  - Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE: RMSNorm, q/k/v (+bias), per-head q/k RMSNorm
//    (Qwen3), "rotate_half" RoPE, grouped-query causal attention (Mistral's sliding window),
//    SiLU-gated MLP or top-k routed experts, final norm, lm_head (embed_tokens when tied);
//  - Gemma 2 / 3: embeddings times sqrt(hidden_size), RMSNorm by (1 + w), the attention and MLP
//    outputs normalized before their residual adds, the pre-MLP norm pre_feedforward_layernorm,
//    GELU (tanh), scores scaled by query_pre_attn_scalar^-1/2, soft-capped attention and final
//    logits, sliding windows on the layers that have them, Gemma 3's per-layer-type RoPE bases;
//  - Phi-3: q/k/v and gate/up as row ranges of the checkpoint's fused tensors, sliding window,
//    partial rotary;
//  - Qwen2-MoE: Qwen2's attention, softmax top-k experts plus a shared expert scaled by
//    sigmoid(shared_expert_gate), dense layers where mlp_only_layers says.
// Not modelled: rope_scaling other than linear (e.g. Llama 3.1's, Phi-3's longrope); without it
// the logits differ from transformers' for such models, but both passes share the math, so the
// layout comparison stays exact.
//
// Everything runs on the CPU in fp32 storage with double accumulation in dot products; O(T *
// parameters) work for T tokens. Functions are thread-compatible: distinct calls may run on
// distinct threads (the engine pass drives its Communicator from the calling thread only).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "comm/communicator.h"
#include "engine/engine_layout.h"
#include "refit/model_spec.h"
#include "refit/status.h"

namespace refit {

// What the forward passes need beyond the tensor table: read from the model's config.json with
// transformers' defaults for each architecture (harness/forward_config.cc).
enum class Activation { kSilu, kGeluTanh };
struct ForwardConfig {
  double attn_scale = 0.0;     // multiplier of q.k; 0: 1/sqrt(head_dim)
  double attn_softcap = 0.0;   // attention logits soft-capped at this (0: none)
  double final_softcap = 0.0;  // output logits soft-capped at this (0: none)
  // Per decoder layer: the sliding window (0: full causal attention), RoPE base and linear
  // position factor.
  std::vector<std::int64_t> window;
  std::vector<double> rope_theta, rope_factor;
  std::int64_t rotary_dim = 0;  // leading elements of a head that RoPE rotates (0: all)
  bool offset_norms = false;    // RMSNorm multiplies by (1 + w) (Gemma)
  bool sandwich_norms = false;  // attention / MLP outputs normalized before the residual (Gemma)
  double embed_scale = 1.0;     // embeddings multiplied by this (Gemma: sqrt(hidden_size))
  Activation activation = Activation::kSilu;
};

// The forward config of `spec` from its config.json text (`config_json`; "{}" gives the
// defaults). Errors name the key.
Result<ForwardConfig> forward_config(const ModelSpec& spec, std::string_view config_json);
// The config.json text of `model` (a preset name or a model directory).
Result<std::string> model_config_json(const std::string& model);

// Single-process forward on the full HF tensors: hf[i] holds spec.tensors()[i] row-major (fp32;
// for a refit check, the values after the cast to the target precision). Causal attention over
// `tokens` at positions 0..T-1. Returns the logits [T, V], row-major. The pointers must stay
// valid for the call; nothing is retained. Every architecture with a fused layout has a forward
// (has_reference_forward); --check-logits refuses the others at setup (tables read from headers).
Result<std::vector<float>> reference_forward(const ModelSpec& spec, const ForwardConfig& fc,
                                             const std::vector<const float*>& hf,
                                             const std::vector<std::int32_t>& tokens);
// With the defaults of forward_config(spec, "{}").
Result<std::vector<float>> reference_forward(const ModelSpec& spec,
                                             const std::vector<const float*>& hf,
                                             const std::vector<std::int32_t>& tokens);

// Whether the forward passes here model `arch`.
bool has_reference_forward(Architecture arch);

// The same forward computed by engine TP rank `layout.tp_rank` from its own parameters:
// params[i] holds layout.params[i] as bf16 bit patterns, row-major. Partial results (vocabulary
// -parallel embedding, o_proj / down_proj / expert partial sums, lm_head slices) are combined
// over `tp_group` with Communicator::all_gather_v only, summed locally in rank order so that every
// rank computes bit-identical activations. `tp_group` has layout.tp_size members with rank ==
// tp_rank, or is null when tp_size == 1. Every rank must call this with the same tokens. Returns
// the full logits [T, V] (vocabulary padding dropped) on every rank.
Result<std::vector<float>> engine_forward(const ModelSpec& spec, const ForwardConfig& fc,
                                          const EngineShardLayout& layout,
                                          const std::vector<const std::uint16_t*>& params,
                                          const std::vector<std::int32_t>& tokens,
                                          Communicator* tp_group);
// With the defaults of forward_config(spec, "{}").
Result<std::vector<float>> engine_forward(const ModelSpec& spec, const EngineShardLayout& layout,
                                          const std::vector<const std::uint16_t*>& params,
                                          const std::vector<std::int32_t>& tokens,
                                          Communicator* tp_group);

// A fixed, deterministic token sequence of length n (n <= 0: empty) within the model's
// vocabulary. It starts with the last and the first token id, so that the first and the last
// vocabulary-parallel shard are read, and spreads the rest over the vocabulary.
std::vector<std::int32_t> logit_check_tokens(const ModelSpec& spec, int n);

// Compares logits [T, vocab]: error = max|got - want| / (max|want| + 1e-6). Ok when error <=
// rel_tol; otherwise Corruption naming the position and vocabulary index of the worst element,
// both values, the error and the tolerance. Non-finite values in `got` always fail. Mismatched
// sizes are InvalidArgument.
Status compare_logits(const std::vector<float>& got, const std::vector<float>& want,
                      std::int64_t vocab, double rel_tol);
// The error compare_logits compares with its tolerance (infinite for a non-finite value in `got`,
// NaN for mismatched sizes).
double logit_error(const std::vector<float>& got, const std::vector<float>& want);

}  // namespace refit
