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
//  - DeepSeek-V3 (Kimi-K2, Moonlight): multi-head latent attention — q through q_a_proj,
//    q_a_layernorm and q_b_proj (or one q_proj), the latent and the shared rope key from
//    kv_a_proj_with_mqa, kv_a_layernorm on the latent, keys and values of every head from
//    kv_b_proj, interleaved RoPE on the rope part (rope_interleave) — and DeepSeek's MoE: dense
//    layers before first_k_dense_replace, sigmoid router scores whose choice adds the float32
//    correction bias, group-limited top-k (n_group, topk_group), weights renormalised
//    (norm_topk_prob) and scaled (routed_scaling_factor), plus the ungated shared experts. The
//    engine pass runs MLA in the absorbed form both engines decode with: q_nope through W_UK_T
//    into the latent space, scores against the latent and the rope key, the attention output back
//    through W_UV (derive_mla below), as vLLM's process_weights_after_loading and SGLang's
//    post_load_weights derive them from kv_b_proj;
//  - GLM-4.5: Llama-style GQA with q/k/v bias and per-head q/k RMSNorm (use_qk_norm), RoPE on the
//    first partial_rotary_factor of each head (rotate_half), and DeepSeek-V3's MoE.
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
  // DeepSeek-V3 / GLM-4.5: RoPE pairs (2i, 2i + 1) instead of (i, i + d/2) (rope_interleave),
  // and the router: sigmoid scores, the correction bias choosing, experts in n_group groups of
  // which the topk_group best (by the sum of their two best choices) are eligible, the chosen
  // scores scaled by routed_scaling_factor.
  bool rope_interleaved = false;
  bool sigmoid_router = false;
  std::int64_t n_group = 1, topk_group = 1;
  double routed_scaling = 1.0;
};

// MLA's absorbed matrices of one layer, derived from a rank's kv_b_proj W [N (P + V), L] (N the
// rank's heads, P qk_nope_head_dim, V v_head_dim, L kv_lora_rank) as bf16 bit patterns:
// w_uk_t [N, P, L] with w_uk_t[n, p, l] = W[n (P + V) + p, l] (vLLM's W_UK_T, SGLang's w_kc), and
// w_uv [N, L, V] with w_uv[n, l, v] = W[n (P + V) + P + v, l] (vLLM's W_UV, SGLang's w_vc as
// kept after its transpose).
struct MlaAbsorbed {
  std::vector<std::uint16_t> w_uk_t, w_uv;
};
// From the rank's kv_b_proj (bf16 bit patterns, row-major) of a model with config `c` at TP size
// `tp_size`.
MlaAbsorbed derive_mla(const ModelConfig& c, std::int64_t tp_size, const std::uint16_t* kv_b);

// The forward config of `spec` from its config.json text (`config_json`; "{}" gives the
// defaults). Errors name the key.
Result<ForwardConfig> forward_config(const ModelSpec& spec, std::string_view config_json);
// The config.json text of `model` (a preset name or a model directory).
Result<std::string> model_config_json(const std::string& model);

// Single-process forward on the full HF tensors: hf[i] holds spec.tensors()[i] row-major (fp32;
// for a refit check, the values after the cast to the target precision). Causal attention over
// `tokens` at positions 0..T-1 (hf[i] of a tensor the engines keep in float32 holds that value).
// Returns the logits [T, V], row-major. The pointers must stay
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
// The same with parameters in their layout dtype (layout.params[i].dtype: bf16, or float32 for
// the parameters the engines keep in float32, docs/models.md "Engine dtypes"). For MLA models,
// `absorbed` holds each decoder layer's matrices as the engine derived them after the refit
// (indexed by layer); null derives them here from the rank's kv_b_proj.
Result<std::vector<float>> engine_forward(const ModelSpec& spec, const ForwardConfig& fc,
                                          const EngineShardLayout& layout,
                                          const std::vector<const void*>& params,
                                          const std::vector<std::int32_t>& tokens,
                                          Communicator* tp_group,
                                          const std::vector<MlaAbsorbed>* absorbed);
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
