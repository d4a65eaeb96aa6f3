// Logit check of a refit: the same decoder forward pass computed twice, once by one process from
// the full Hugging Face tensors and once by the TP ranks of an engine from their own shards (in the
// vLLM / SGLang layout of engine/engine_layout.h). Equal logits prove the engine layout *means*
// the right thing (fused qkv order, kv-head replication, gate/up order, column slices,
// vocabulary-parallel tables), not only that bytes arrived.
//
// Model math follows HF Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE: RMSNorm, q/k/v (+bias),
// per-head q/k RMSNorm (Qwen3), non-interleaved ("rotate_half") RoPE over the full head_dim,
// grouped-query causal attention, SiLU-gated MLP or top-k routed experts, final norm, lm_head
// (embed_tokens when tied). Not modelled: rope_scaling (e.g. Llama 3.1's) and sliding windows.
// Windows never matter for the few tokens of a check; without rope_scaling the logits differ from
// HF's for such models, but both passes share the math, so the layout comparison stays exact.
//
// Everything runs on the CPU in fp32 storage with double accumulation in dot products; O(T *
// parameters) work for T tokens. Functions are thread-compatible: distinct calls may run on
// distinct threads (the engine pass drives its Communicator from the calling thread only).
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "engine/engine_layout.h"
#include "refit/model_spec.h"
#include "refit/status.h"

namespace refit {

// Single-process forward on the full HF tensors: hf[i] holds spec.tensors()[i] row-major (fp32;
// for a refit check, the values after the cast to the target precision). Causal attention over
// `tokens` at positions 0..T-1. Returns the logits [T, V], row-major. The pointers must stay
// valid for the call; nothing is retained. The forward passes here cover the Llama family
// (llama_family in refit/model_spec.h); --check-logits refuses the others at setup (Gemma's offset
// norms and soft-capping, Phi-3, Qwen2-MoE's shared expert, tables read from headers).
Result<std::vector<float>> reference_forward(const ModelSpec& spec,
                                             const std::vector<const float*>& hf,
                                             const std::vector<std::int32_t>& tokens);

// The same forward computed by engine TP rank `layout.tp_rank` from its own parameters:
// params[i] holds layout.params[i] as bf16 bit patterns, row-major. Partial results (vocabulary
// -parallel embedding, o_proj / down_proj / expert partial sums, lm_head slices) are combined
// over `tp_group` with Communicator::all_gather_v only, summed locally in rank order so that every
// rank computes bit-identical activations. `tp_group` has layout.tp_size members with rank ==
// tp_rank, or is null when tp_size == 1. Every rank must call this with the same tokens. Returns
// the full logits [T, V] (vocabulary padding dropped) on every rank.
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

}  // namespace refit
