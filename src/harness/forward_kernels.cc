// CPU kernels of the logit check; see harness/forward_kernels.h.
#include "harness/forward_kernels.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
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
              const WeightView& w, double eps, float* out, std::int64_t out_stride, bool offset) {
  for (std::int64_t t = 0; t < n_rows; ++t) {
    const float* xr = x + t * x_stride;
    float* o = out + t * out_stride;
    double sq = 0.0;
    for (std::int64_t j = 0; j < dim; ++j) sq += static_cast<double>(xr[j]) * xr[j];
    const float inv = static_cast<float>(1.0 / std::sqrt(sq / static_cast<double>(dim) + eps));
    for (std::int64_t j = 0; j < dim; ++j)
      o[j] = xr[j] * inv * (offset ? 1.0f + w.at(0, j) : w.at(0, j));
  }
}

namespace {
// The rotation of pair (a, b) for frequency index i of a rotary part of `rd` elements.
void rotate(float& a, float& b, std::int64_t i, std::int64_t rd, std::int64_t pos,
            const Rope& rope) {
  const double inv_freq =
      std::pow(rope.theta, -2.0 * static_cast<double>(i) / static_cast<double>(rd)) / rope.factor;
  const double angle = static_cast<double>(pos) * inv_freq;
  const auto c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
  const float x = a, y = b;
  a = x * c - y * s;
  b = y * c + x * s;
}
}  // namespace

void apply_rope(float* head, std::int64_t d, std::int64_t pos, const Rope& rope) {
  const std::int64_t rd = rope.rotary_dim > 0 ? rope.rotary_dim : d, half = rd / 2;
  for (std::int64_t i = 0; i < half; ++i) rotate(head[i], head[i + half], i, rd, pos, rope);
}

void apply_rope_interleaved(float* head, std::int64_t d, std::int64_t pos, const Rope& rope) {
  const std::int64_t rd = rope.rotary_dim > 0 ? rope.rotary_dim : d, half = rd / 2;
  for (std::int64_t i = 0; i < half; ++i) rotate(head[2 * i], head[2 * i + 1], i, rd, pos, rope);
}

void prepare_heads(float* base, std::int64_t stride, std::int64_t T, std::int64_t n_heads,
                   std::int64_t d, const WeightView& norm, double eps, const Rope& rope,
                   bool offset) {
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t h = 0; h < n_heads; ++h) {
      float* head = base + t * stride + h * d;
      if (!norm.empty()) rms_norm(head, d, 1, d, norm, eps, head, d, offset);
      apply_rope(head, d, t, rope);
    }
}

void causal_attention(const float* q, const float* k, const float* v, const AttentionShape& sh,
                      const std::vector<std::int64_t>& kv_of_head, const AttentionMath& math,
                      float* out) {
  std::vector<double> p(static_cast<std::size_t>(sh.T));
  for (std::int64_t h = 0; h < sh.n_q; ++h) {
    const std::int64_t kv = kv_of_head[static_cast<std::size_t>(h)];
    for (std::int64_t t = 0; t < sh.T; ++t) {
      const float* qh = q + t * sh.q_stride + h * sh.q_head_stride;
      const std::int64_t first =
          math.window > 0 ? std::max<std::int64_t>(0, t - math.window + 1) : 0;
      double max_score = -1e300;
      for (std::int64_t s = first; s <= t; ++s) {
        const float* kh = k + s * sh.k_stride + kv * sh.k_head_stride;
        double dot = 0.0;
        for (std::int64_t j = 0; j < sh.qk_dim; ++j) dot += static_cast<double>(qh[j]) * kh[j];
        double score = dot * math.scale;
        if (math.softcap > 0) score = math.softcap * std::tanh(score / math.softcap);
        p[static_cast<std::size_t>(s)] = score;
        max_score = std::max(max_score, score);
      }
      double sum = 0.0;
      for (std::int64_t s = first; s <= t; ++s) {
        auto& ps = p[static_cast<std::size_t>(s)];
        ps = std::exp(ps - max_score);
        sum += ps;
      }
      float* o = out + t * sh.n_q * sh.v_dim + h * sh.v_dim;
      for (std::int64_t j = 0; j < sh.v_dim; ++j) {
        double acc = 0.0;
        for (std::int64_t s = first; s <= t; ++s)
          acc += p[static_cast<std::size_t>(s)] * v[s * sh.v_stride + kv * sh.v_head_stride + j];
        o[j] = static_cast<float>(acc / sum);
      }
    }
  }
}

void causal_attention(const float* q, std::int64_t q_stride, const float* k, const float* v,
                      std::int64_t kv_stride, std::int64_t T, std::int64_t n_q, std::int64_t d,
                      const std::vector<std::int64_t>& kv_of_head, const AttentionMath& math,
                      float* out) {
  const AttentionShape sh{.T = T,
                          .n_q = n_q,
                          .qk_dim = d,
                          .v_dim = d,
                          .q_stride = q_stride,
                          .q_head_stride = d,
                          .k_stride = kv_stride,
                          .k_head_stride = d,
                          .v_stride = kv_stride,
                          .v_head_stride = d};
  causal_attention(q, k, v, sh, kv_of_head, math, out);
}

float gelu_tanh(float x) {
  const double y = x;
  constexpr double kSqrt2OverPi = 0.7978845608028654;
  return static_cast<float>(0.5 * y * (1.0 + std::tanh(kSqrt2OverPi * (y + 0.044715 * y * y * y))));
}

void gated(float* gate, const float* up, std::int64_t n, Activation act) {
  for (std::int64_t i = 0; i < n; ++i)
    gate[i] = (act == Activation::kGeluTanh ? gelu_tanh(gate[i]) : silu(gate[i])) * up[i];
}

Rope layer_rope(const ForwardConfig& fc, std::int64_t layer) {
  const auto l = static_cast<std::size_t>(layer);
  return Rope{.theta = fc.rope_theta[l], .factor = fc.rope_factor[l], .rotary_dim = fc.rotary_dim};
}

AttentionMath layer_attention(const ForwardConfig& fc, const ModelConfig& c, std::int64_t layer) {
  return AttentionMath{
      .scale = fc.attn_scale > 0 ? fc.attn_scale : 1.0 / std::sqrt(static_cast<double>(c.head_dim)),
      .softcap = fc.attn_softcap,
      .window = fc.window[static_cast<std::size_t>(layer)]};
}

Status check_forward_config(const ModelConfig& c, const ForwardConfig& fc, const char* who) {
  const auto layers = static_cast<std::size_t>(std::max<std::int64_t>(c.num_layers, 0));
  if (fc.window.size() != layers || fc.rope_theta.size() != layers ||
      fc.rope_factor.size() != layers)
    return Status::InvalidArgument(fmt::format(
        "{}: the forward config lists {} / {} / {} layers (window, rope base, rope factor); the "
        "model has {}",
        who, fc.window.size(), fc.rope_theta.size(), fc.rope_factor.size(), layers));
  if (fc.rotary_dim < 0 || fc.rotary_dim > c.head_dim || fc.rotary_dim % 2 != 0)
    return Status::InvalidArgument(
        fmt::format("{}: the rotary part of a head ({}) must be even and at most head_dim ({})",
                    who, fc.rotary_dim, c.head_dim));
  return Status::Ok();
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

std::vector<std::pair<std::int64_t, float>> route_token_sigmoid(const float* logits,
                                                                const float* bias, std::int64_t E,
                                                                std::int64_t k, bool normalize,
                                                                const ForwardConfig& fc) {
  const auto u = [](std::int64_t n) { return static_cast<std::size_t>(n); };
  std::vector<double> score(u(E)), choice(u(E));
  for (std::int64_t e = 0; e < E; ++e) {
    score[u(e)] = 1.0 / (1.0 + std::exp(-static_cast<double>(logits[e])));
    choice[u(e)] = score[u(e)] + (bias != nullptr ? static_cast<double>(bias[e]) : 0.0);
  }
  const std::int64_t groups = std::max<std::int64_t>(fc.n_group, 1), per = E / groups;
  if (groups > 1 && fc.topk_group < groups) {
    std::vector<double> rank(u(groups));
    for (std::int64_t g = 0; g < groups; ++g) {
      std::vector<double> c(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      std::sort(c.begin(), c.end(), std::greater<>());
      rank[u(g)] = c[0] + (per > 1 ? c[1] : 0.0);
    }
    std::vector<std::int64_t> order(u(groups));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::int64_t a, std::int64_t b) { return rank[u(a)] > rank[u(b)]; });
    std::vector<bool> keep(u(groups), false);
    for (std::int64_t i = 0; i < std::max<std::int64_t>(fc.topk_group, 0); ++i)
      keep[u(order[u(i)])] = true;
    for (std::int64_t e = 0; e < E; ++e)
      if (!keep[u(e / per)]) choice[u(e)] = 0.0;
  }
  std::vector<std::int64_t> order(u(E));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::int64_t a, std::int64_t b) { return choice[u(a)] > choice[u(b)]; });
  k = std::min(k, E);
  double sum = 0.0;
  for (std::int64_t i = 0; i < k; ++i) sum += score[u(order[u(i)])];
  std::vector<std::pair<std::int64_t, float>> out;
  out.reserve(u(k));
  for (std::int64_t i = 0; i < k; ++i) {
    const double w = score[u(order[u(i)])];
    out.emplace_back(order[u(i)],
                     static_cast<float>((normalize ? w / (sum + 1e-20) : w) * fc.routed_scaling));
  }
  return out;
}

}  // namespace refit::fwd
