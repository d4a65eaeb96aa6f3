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
// elements, with row strides `x_stride` / `out_stride`. In place when out == x.
void rms_norm(const float* x, std::int64_t x_stride, std::int64_t n_rows, std::int64_t dim,
              const WeightView& w, double eps, float* out, std::int64_t out_stride);

// Rotates one head vector of `d` elements (d even) at position `pos`, HF "rotate_half"
// convention: pairs (i, i + d/2) with inverse frequency theta^(-2i/d).
void apply_rope(float* head, std::int64_t d, std::int64_t pos, double theta);

// Per-head preparation of q or k inside a [T, *] buffer: for each row t and each of `n_heads`
// heads of `d` elements starting at base + t * stride + h * d: optional RMSNorm over the head
// (`norm` non-empty), then RoPE at position t.
void prepare_heads(float* base, std::int64_t stride, std::int64_t T, std::int64_t n_heads,
                   std::int64_t d, const WeightView& norm, double eps, double theta);

// Causal softmax attention with scale 1/sqrt(d). Query head h (of `n_q` local heads) reads
// q + t * q_stride + h * d and attends to kv head kv_of_head[h] at k / v + s * kv_stride +
// kv_of_head[h] * d for s <= t. Writes out[t, h * d + j] (row stride n_q * d).
void causal_attention(const float* q, std::int64_t q_stride, const float* k, const float* v,
                      std::int64_t kv_stride, std::int64_t T, std::int64_t n_q, std::int64_t d,
                      const std::vector<std::int64_t>& kv_of_head, float* out);

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// Router decision for one token: softmax over `E` logits, the top `k` (ties: lower expert index
// first), renormalised to sum 1 when `normalize`. Returns (expert, weight) pairs, best first.
std::vector<std::pair<std::int64_t, float>> route_token(const float* logits, std::int64_t E,
                                                        std::int64_t k, bool normalize);

// Checks what both passes assume of the config (positive sizes, nq a multiple of nkv, even
// head_dim, a valid top-k) and that every token is inside the vocabulary. Messages start with
// `who`.
Status check_forward_inputs(const ModelConfig& c, const std::vector<std::int32_t>& tokens,
                            const char* who);

}  // namespace refit::fwd
