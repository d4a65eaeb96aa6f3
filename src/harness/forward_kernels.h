// Internal to the logit check (harness/forward.h): the CPU kernels both forward passes share.
// Activations are fp32 row-major [T, n]; weights are read through WeightView, so the reference
// pass (fp32 HF tensors) and the engine pass (bf16 shards) run the same arithmetic. Dot products
// accumulate in double: the passes sum partial products in different groupings (TP partials), and
// double keeps that reordering far below the check's tolerance.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "harness/forward.h"
#include "refit/model_spec.h"
#include "refit/status.h"

namespace refit::fwd {

inline float bf16_bits_to_float(std::uint16_t bits) {
  const std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// A read-only row-major [rows, cols] matrix of fp32 values or bf16 bit patterns. Does not own the
// data. A 1-D tensor of n elements is the view [1, n].
class WeightView {
 public:
  WeightView() = default;
  static WeightView f32(const float* data, std::int64_t rows, std::int64_t cols) {
    WeightView w;
    w.f32_ = data;
    w.rows_ = rows;
    w.cols_ = cols;
    return w;
  }
  static WeightView bf16(const std::uint16_t* data, std::int64_t rows, std::int64_t cols) {
    WeightView w;
    w.bf16_ = data;
    w.rows_ = rows;
    w.cols_ = cols;
    return w;
  }

  bool empty() const { return f32_ == nullptr && bf16_ == nullptr; }
  std::int64_t rows() const { return rows_; }
  std::int64_t cols() const { return cols_; }
  // Rows [first, first + n) as a view of their own.
  WeightView row_block(std::int64_t first, std::int64_t n) const {
    WeightView w = *this;
    if (f32_) w.f32_ = f32_ + first * cols_;
    if (bf16_) w.bf16_ = bf16_ + first * cols_;
    w.rows_ = n;
    return w;
  }
  // Element (row, col) as fp32.
  float at(std::int64_t row, std::int64_t col) const {
    const std::int64_t i = row * cols_ + col;
    return f32_ ? f32_[i] : bf16_bits_to_float(bf16_[i]);
  }
  // Row `row` as fp32: points into the data (fp32) or into `scratch` (bf16, decoded there).
  const float* row(std::int64_t row, std::vector<float>& scratch) const;

 private:
  const float* f32_ = nullptr;
  const std::uint16_t* bf16_ = nullptr;
  std::int64_t rows_ = 0, cols_ = 0;
};

// y[t, n] = sum_k x[t, k] * w[n, k] (+ bias[0, n]) for t < T, n < w.rows(); x has row stride
// w.cols(), y has row stride `y_stride` (w.rows() when 0). `bias` may be empty.
void linear(const float* x, std::int64_t T, const WeightView& w, const WeightView& bias, float* y,
            std::int64_t y_stride = 0);

// out[t, :] = x[t, :] * rsqrt(mean(x[t, :]^2) + eps) * w[0, :] for `n_rows` rows of `dim`
// elements, with row strides `x_stride` / `out_stride`; with `offset` (Gemma) the factor is
// 1 + w instead of w. In place when out == x.
void rms_norm(const float* x, std::int64_t x_stride, std::int64_t n_rows, std::int64_t dim,
              const WeightView& w, double eps, float* out, std::int64_t out_stride,
              bool offset = false);

// Rotary position embedding of one head, HF "rotate_half" convention: the first `rotary_dim`
// elements (even) rotate in pairs (i, i + rotary_dim/2) by angle pos * theta^(-2i/rotary_dim) /
// factor (linear position scaling; factor 1 without); the rest pass unchanged.
struct Rope {
  double theta = 10000.0;
  double factor = 1.0;
  std::int64_t rotary_dim = 0;  // 0: the whole head
};
void apply_rope(float* head, std::int64_t d, std::int64_t pos, const Rope& rope);
// The same with the pairs interleaved (2i, 2i + 1), as DeepSeek's checkpoints order their rope
// dimensions (transformers converts them to the rotate_half order first, which gives the same
// dot products between q and k).
void apply_rope_interleaved(float* head, std::int64_t d, std::int64_t pos, const Rope& rope);

// Per-head preparation of q or k inside a [T, *] buffer: for each row t and each of `n_heads`
// heads of `d` elements starting at base + t * stride + h * d: optional RMSNorm over the head
// (`norm` non-empty; `offset` as rms_norm's), then RoPE at position t.
void prepare_heads(float* base, std::int64_t stride, std::int64_t T, std::int64_t n_heads,
                   std::int64_t d, const WeightView& norm, double eps, const Rope& rope,
                   bool offset = false);

// How attention scores are formed: score = softcap * tanh(scale * q.k / softcap) when softcap
// > 0, else scale * q.k; position t attends to s in (t - window, t] (window 0: every s <= t).
struct AttentionMath {
  double scale = 1.0;
  double softcap = 0.0;
  std::int64_t window = 0;
};

// Causal softmax attention. Query head h (of `n_q` local heads) reads qk_dim elements at
// q + t * q_stride + h * q_head_stride and attends to kv head kv_of_head[h]: keys of qk_dim
// elements at k + s * k_stride + kv * k_head_stride, values of v_dim elements at v + s * v_stride
// + kv * v_head_stride. Writes out[t, h * v_dim + j] (row stride n_q * v_dim).
struct AttentionShape {
  std::int64_t T = 0, n_q = 0, qk_dim = 0, v_dim = 0;
  std::int64_t q_stride = 0, q_head_stride = 0;
  std::int64_t k_stride = 0, k_head_stride = 0;
  std::int64_t v_stride = 0, v_head_stride = 0;
};
void causal_attention(const float* q, const float* k, const float* v, const AttentionShape& shape,
                      const std::vector<std::int64_t>& kv_of_head, const AttentionMath& math,
                      float* out);
// The common case: q, k and v heads of d elements, k and v sharing a row stride.
void causal_attention(const float* q, std::int64_t q_stride, const float* k, const float* v,
                      std::int64_t kv_stride, std::int64_t T, std::int64_t n_q, std::int64_t d,
                      const std::vector<std::int64_t>& kv_of_head, const AttentionMath& math,
                      float* out);

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
// transformers' gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in double.
float gelu_tanh(float x);
inline float sigmoid(float x) {
  return static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(x))));
}
// tanh soft-capping: cap * tanh(x / cap); x unchanged when cap <= 0.
inline float softcap(float x, double cap) {
  return cap > 0 ? static_cast<float>(cap * std::tanh(static_cast<double>(x) / cap)) : x;
}

// gate[i] := act(gate[i]) * up[i] for i < n.
void gated(float* gate, const float* up, std::int64_t n, Activation act);

// The RoPE and the attention math of decoder layer `layer`.
Rope layer_rope(const ForwardConfig& fc, std::int64_t layer);
AttentionMath layer_attention(const ForwardConfig& fc, const ModelConfig& c, std::int64_t layer);
// Checks that `fc` fits the model: one entry per layer, rotary part within the head.
Status check_forward_config(const ModelConfig& c, const ForwardConfig& fc, const char* who);

// Router decision for one token: softmax over `E` logits, the top `k` (ties: lower expert index
// first), renormalised to sum 1 when `normalize`. Returns (expert, weight) pairs, best first.
std::vector<std::pair<std::int64_t, float>> route_token(const float* logits, std::int64_t E,
                                                        std::int64_t k, bool normalize);

// DeepSeek-V3 / GLM-4.5 router decision for one token (transformers' DeepseekV3TopkRouter and
// route_tokens_to_experts): scores sigmoid(logits); choices scores + bias (the float32 correction
// bias); the E experts in fc.n_group groups, each ranked by the sum of its two best choices (its
// one, for groups of one), the best fc.topk_group kept and the other choices taken as 0; the top
// `k` choices (ties: lower index first), weighted by their scores, renormalised (plus 1e-20) when
// `normalize`, times fc.routed_scaling.
std::vector<std::pair<std::int64_t, float>> route_token_sigmoid(const float* logits,
                                                                const float* bias, std::int64_t E,
                                                                std::int64_t k, bool normalize,
                                                                const ForwardConfig& fc);
// RoPE of one head as fc says: interleaved pairs (DeepSeek) or rotate_half.
inline void rope_head(float* head, std::int64_t d, std::int64_t pos, const Rope& rope,
                      const ForwardConfig& fc) {
  if (fc.rope_interleaved)
    apply_rope_interleaved(head, d, pos, rope);
  else
    apply_rope(head, d, pos, rope);
}

// Checks what both passes assume of the config (positive sizes, nq a multiple of nkv, even
// head_dim, a valid top-k) and that every token is inside the vocabulary. Messages start with
// `who`.
Status check_forward_inputs(const ModelConfig& c, const std::vector<std::int32_t>& tokens,
                            const char* who);

}  // namespace refit::fwd
