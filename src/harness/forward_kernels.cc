// CPU kernels of the logit check; see harness/forward_kernels.h.
#include "harness/forward_kernels.h"

#include <algorithm>
#include <numeric>

namespace refit::fwd {

const float* WeightView::row(std::int64_t row, std::vector<float>& scratch) const {
  if (f32_) return f32_ + row * cols_;
  scratch.resize(static_cast<std::size_t>(cols_));
  const std::uint16_t* src = bf16_ + row * cols_;
  for (std::int64_t j = 0; j < cols_; ++j)
    scratch[static_cast<std::size_t>(j)] = bf16_bits_to_float(src[j]);
  return scratch.data();
}

void linear(const float* x, std::int64_t T, const WeightView& w, const WeightView& bias, float* y,
            std::int64_t y_stride) {
  const std::int64_t K = w.cols(), N = w.rows();
  if (y_stride == 0) y_stride = N;
  std::vector<float> scratch;
  // Weight rows outside, tokens inside: each weight element is decoded once.
  for (std::int64_t n = 0; n < N; ++n) {
    const float* wr = w.row(n, scratch);
    const double b = bias.empty() ? 0.0 : bias.at(0, n);
    for (std::int64_t t = 0; t < T; ++t) {
      const float* xr = x + t * K;
      double acc = 0.0;
      for (std::int64_t k = 0; k < K; ++k) acc += static_cast<double>(xr[k]) * wr[k];
      y[t * y_stride + n] = static_cast<float>(acc + b);
    }
  }
}

void rms_norm(const float* x, std::int64_t x_stride, std::int64_t n_rows, std::int64_t dim,
              const WeightView& w, double eps, float* out, std::int64_t out_stride) {
  for (std::int64_t t = 0; t < n_rows; ++t) {
    const float* xr = x + t * x_stride;
    float* o = out + t * out_stride;
    double sq = 0.0;
    for (std::int64_t j = 0; j < dim; ++j) sq += static_cast<double>(xr[j]) * xr[j];
    const float inv = static_cast<float>(1.0 / std::sqrt(sq / static_cast<double>(dim) + eps));
    for (std::int64_t j = 0; j < dim; ++j) o[j] = xr[j] * inv * w.at(0, j);
  }
}

void apply_rope(float* head, std::int64_t d, std::int64_t pos, double theta) {
  const std::int64_t half = d / 2;
  for (std::int64_t i = 0; i < half; ++i) {
    const double inv_freq = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(d));
    const double angle = static_cast<double>(pos) * inv_freq;
    const auto c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
    const float a = head[i], b = head[i + half];
    head[i] = a * c - b * s;
    head[i + half] = b * c + a * s;
  }
}

void prepare_heads(float* base, std::int64_t stride, std::int64_t T, std::int64_t n_heads,
                   std::int64_t d, const WeightView& norm, double eps, double theta) {
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t h = 0; h < n_heads; ++h) {
      float* head = base + t * stride + h * d;
      if (!norm.empty()) rms_norm(head, d, 1, d, norm, eps, head, d);
      apply_rope(head, d, t, theta);
    }
}

void causal_attention(const float* q, std::int64_t q_stride, const float* k, const float* v,
                      std::int64_t kv_stride, std::int64_t T, std::int64_t n_q, std::int64_t d,
                      const std::vector<std::int64_t>& kv_of_head, float* out) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> p(static_cast<std::size_t>(T));
  for (std::int64_t h = 0; h < n_q; ++h) {
    const std::int64_t kv = kv_of_head[static_cast<std::size_t>(h)];
    for (std::int64_t t = 0; t < T; ++t) {
      const float* qh = q + t * q_stride + h * d;
      double max_score = -1e300;
      for (std::int64_t s = 0; s <= t; ++s) {
        const float* kh = k + s * kv_stride + kv * d;
        double dot = 0.0;
        for (std::int64_t j = 0; j < d; ++j) dot += static_cast<double>(qh[j]) * kh[j];
        p[static_cast<std::size_t>(s)] = dot * scale;
        max_score = std::max(max_score, dot * scale);
      }
      double sum = 0.0;
      for (std::int64_t s = 0; s <= t; ++s) {
        auto& ps = p[static_cast<std::size_t>(s)];
        ps = std::exp(ps - max_score);
        sum += ps;
      }
      float* o = out + t * n_q * d + h * d;
      for (std::int64_t j = 0; j < d; ++j) {
        double acc = 0.0;
        for (std::int64_t s = 0; s <= t; ++s)
          acc += p[static_cast<std::size_t>(s)] * v[s * kv_stride + kv * d + j];
        o[j] = static_cast<float>(acc / sum);
      }
    }
  }
}

std::vector<std::pair<std::int64_t, float>> route_token(const float* logits, std::int64_t E,
                                                        std::int64_t k, bool normalize) {
  std::vector<double> prob(static_cast<std::size_t>(E));
  const double max_logit = *std::max_element(logits, logits + E);
  double sum = 0.0;
  for (std::int64_t e = 0; e < E; ++e) {
    prob[static_cast<std::size_t>(e)] = std::exp(static_cast<double>(logits[e]) - max_logit);
    sum += prob[static_cast<std::size_t>(e)];
  }
  std::vector<std::int64_t> order(static_cast<std::size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return prob[static_cast<std::size_t>(a)] > prob[static_cast<std::size_t>(b)];
  });
  k = std::min(k, E);
  double top_sum = 0.0;
  for (std::int64_t i = 0; i < k; ++i) top_sum += prob[static_cast<std::size_t>(order[i])] / sum;
  std::vector<std::pair<std::int64_t, float>> out;
  out.reserve(static_cast<std::size_t>(k));
  for (std::int64_t i = 0; i < k; ++i) {
    const double w = prob[static_cast<std::size_t>(order[i])] / sum;
    out.emplace_back(order[i], static_cast<float>(normalize ? w / top_sum : w));
  }
  return out;
}

}  // namespace refit::fwd
