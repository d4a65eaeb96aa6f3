// The logit check's engine pass (harness/forward.h): one engine TP rank runs the decoder from its
// own vLLM / SGLang shards and combines partial results with its TP peers, the way the engine's
// parallel layers do: vocabulary-parallel embedding (all-reduce), column-parallel qkv and gate_up
// (local heads / rows), row-parallel o_proj and down_proj (all-reduce), expert slices
// (all-reduce), vocabulary-parallel lm_head (all-gather).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <unordered_map>

#include "common/convert.h"
#include "harness/forward.h"
#include "harness/forward_kernels.h"
#include "refit/dtype.h"

namespace refit {
namespace {

using fwd::WeightView;
constexpr const char* kWho = "engine forward";

std::size_t uz(std::int64_t n) { return static_cast<std::size_t>(n); }
std::int64_t fwd_shape_rows(const std::vector<std::int64_t>& shape) {
  return shape.empty() ? -1 : shape[0];
}

// Sums and gathers over the TP group with all_gather_v only. A null group is a group of one.
class TpCombiner {
 public:
  TpCombiner(Communicator* group, int tp_size, int tp_rank)
      : group_(group), tp_size_(tp_size), tp_rank_(tp_rank) {}

  // data := sum over TP ranks of every rank's `data`, added in rank order so that every rank
  // gets the same bits.
  Status all_reduce_sum(std::vector<float>& data, const std::string& what) {
    if (tp_size_ == 1) return Status::Ok();
    std::vector<float> gathered;
    REFIT_RETURN_IF_ERROR(all_gather(data, gathered, what));
    const std::size_t n = data.size();
    for (std::size_t i = 0; i < n; ++i) {
      float sum = gathered[i];
      for (int r = 1; r < tp_size_; ++r) sum += gathered[uz(r) * n + i];
      data[i] = sum;
    }
    return Status::Ok();
  }

  // out := every rank's `local` (same size on every rank), rank-major.
  Status all_gather(const std::vector<float>& local, std::vector<float>& out,
                    const std::string& what) {
    if (tp_size_ == 1) {
      out = local;
      return Status::Ok();
    }
    out.assign(local.size() * uz(tp_size_), 0.0f);
    const std::vector<std::size_t> counts(uz(tp_size_), local.size() * sizeof(float));
    const Status s = group_->all_gather_v(local.data(), out.data(), counts);
    if (!s.ok())
      return s.with_context(
          fmt::format("{}: tp rank {}/{}: combining {}", kWho, tp_rank_, tp_size_, what));
    return Status::Ok();
  }

 private:
  Communicator* group_;
  int tp_size_, tp_rank_;
};

// The rank's parameters by engine name, each checked against the shape the layout must give it.
class EngineParams {
 public:
  EngineParams(const EngineShardLayout& layout, const std::vector<const void*>& data)
      : layout_(layout), data_(data) {
    for (std::size_t i = 0; i < layout.params.size(); ++i)
      by_name_.emplace(layout.params[i].name, i);
  }

  // The shape of parameter `name`, or empty when the layout has none.
  std::vector<std::int64_t> shape_of(const std::string& name) const {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? std::vector<std::int64_t>{} : layout_.params[it->second].shape;
  }

  Result<WeightView> get(const std::string& name, const std::vector<std::int64_t>& shape) const {
    auto it = by_name_.find(name);
    if (it == by_name_.end())
      return Status::InvalidArgument(
          fmt::format("{}: tp rank {}/{}: the layout has no parameter {}", kWho, layout_.tp_rank,
                      layout_.tp_size, name));
    const EngineParam& p = layout_.params[it->second];
    if (p.shape != shape)
      return Status::InvalidArgument(fmt::format(
          "{}: tp rank {}/{}: parameter {} has shape [{}], the forward pass expects [{}]", kWho,
          layout_.tp_rank, layout_.tp_size, name, fmt::join(p.shape, ", "),
          fmt::join(shape, ", ")));
    if (data_[it->second] == nullptr)
      return Status::InvalidArgument(fmt::format("{}: tp rank {}/{}: no data for parameter {}",
                                                 kWho, layout_.tp_rank, layout_.tp_size, name));
    const MatrixShape m = matrix_shape(shape);
    if (p.dtype == DType::kFloat32)
      return WeightView::f32(static_cast<const float*>(data_[it->second]), m.rows, m.cols);
    if (p.dtype != DType::kBFloat16)
      return Status::InvalidArgument(fmt::format("{}: tp rank {}/{}: parameter {} is {}", kWho,
                                                 layout_.tp_rank, layout_.tp_size, name,
                                                 dtype_name(p.dtype)));
    return WeightView::bf16(static_cast<const std::uint16_t*>(data_[it->second]), m.rows, m.cols);
  }
  // The first of `names` the layout has ("" when none).
  std::string first_of(std::initializer_list<const char*> names, const std::string& prefix) const {
    for (const char* n : names)
      if (by_name_.count(prefix + n) != 0) return prefix + n;
    return "";
  }

 private:
  const EngineShardLayout& layout_;
  const std::vector<const void*>& data_;
  std::unordered_map<std::string, std::size_t> by_name_;
};

// One layer's multi-head latent attention on this rank's heads, in the absorbed form the engines
// decode with: q_nope through w_uk_t into the latent space, scores against the latent and the
// shared rope key, the latent-space output through w_uv, then this rank's o_proj columns.
// Writes the rank's partial o_proj output [T, H] to `delta`.
Status mla_engine(const ModelConfig& c, const ForwardConfig& fc, const EngineParams& w,
                  const MlaAbsorbed& ab, std::int64_t layer, std::int64_t t_size, const float* h,
                  std::int64_t T, float* delta, const std::string& where) {
  const std::int64_t N = c.num_heads / t_size, P = c.qk_nope_head_dim, R = c.qk_rope_head_dim;
  const std::int64_t Vd = c.v_head_dim, Lr = c.kv_lora_rank, Lq = c.q_lora_rank, QK = P + R;
  const std::int64_t H = c.hidden_size;
  const double eps = c.rms_norm_eps;
  const std::string p = fmt::format("model.layers.{}.self_attn.", layer);
  if (static_cast<std::int64_t>(ab.w_uk_t.size()) != N * P * Lr ||
      static_cast<std::int64_t>(ab.w_uv.size()) != N * Lr * Vd)
    return Status::InvalidArgument(fmt::format(
        "{}: layer {}: the absorbed MLA matrices hold {} and {} elements, want [{}, {}, {}] and "
        "[{}, {}, {}]",
        where, layer, ab.w_uk_t.size(), ab.w_uv.size(), N, P, Lr, N, Lr, Vd));
  std::vector<float> q(uz(T * N * QK)), kva(uz(T * (Lr + R)));
  if (Lq > 0) {  // the fused a-projection: [q_a rows; kv_a rows], replicated
    const std::string fused =
        w.first_of({"fused_qkv_a_proj.weight", "fused_qkv_a_proj_with_mqa.weight"}, p);
    if (fused.empty())
      return Status::InvalidArgument(
          fmt::format("{}: the layout has no fused a-projection in layer {}", where, layer));
    REFIT_ASSIGN_OR_RETURN(const WeightView wa, w.get(fused, {Lq + Lr + R, H}));
    REFIT_ASSIGN_OR_RETURN(const WeightView qa_norm, w.get(p + "q_a_layernorm.weight", {Lq}));
    REFIT_ASSIGN_OR_RETURN(const WeightView qb, w.get(p + "q_b_proj.weight", {N * QK, Lq}));
    std::vector<float> all(uz(T * (Lq + Lr + R))), qc(uz(T * Lq));
    fwd::linear(h, T, wa, {}, all.data());
    for (std::int64_t i = 0; i < T; ++i) {
      const float* row = all.data() + i * (Lq + Lr + R);
      std::copy(row, row + Lq, qc.data() + i * Lq);
      std::copy(row + Lq, row + Lq + Lr + R, kva.data() + i * (Lr + R));
    }
    fwd::rms_norm(qc.data(), Lq, T, Lq, qa_norm, eps, qc.data(), Lq);
    fwd::linear(qc.data(), T, qb, {}, q.data());
  } else {
    REFIT_ASSIGN_OR_RETURN(const WeightView wq, w.get(p + "q_proj.weight", {N * QK, H}));
    REFIT_ASSIGN_OR_RETURN(const WeightView wa,
                           w.get(p + "kv_a_proj_with_mqa.weight", {Lr + R, H}));
    fwd::linear(h, T, wq, {}, q.data());
    fwd::linear(h, T, wa, {}, kva.data());
  }
  REFIT_ASSIGN_OR_RETURN(const WeightView kv_norm, w.get(p + "kv_a_layernorm.weight", {Lr}));
  REFIT_ASSIGN_OR_RETURN(const WeightView wo, w.get(p + "o_proj.weight", {H, N * Vd}));
  // Keys: [latent (normalized); rope key] per token, shared by every head; queries [q_nope
  // absorbed into the latent space; q_pe] per head.
  std::vector<float> key(uz(T * (Lr + R))), query(uz(T * N * (Lr + R)));
  fwd::rms_norm(kva.data(), Lr + R, T, Lr, kv_norm, eps, key.data(), Lr + R);
  fwd::Rope rope = fwd::layer_rope(fc, layer);
  rope.rotary_dim = 0;
  for (std::int64_t i = 0; i < T; ++i) {
    float* k_pe = key.data() + i * (Lr + R) + Lr;
    std::copy(kva.data() + i * (Lr + R) + Lr, kva.data() + (i + 1) * (Lr + R), k_pe);
    fwd::rope_head(k_pe, R, i, rope, fc);
    for (std::int64_t n = 0; n < N; ++n) {
      float* qh = q.data() + (i * N + n) * QK;
      fwd::rope_head(qh + P, R, i, rope, fc);
      float* out = query.data() + (i * N + n) * (Lr + R);
      for (std::int64_t l = 0; l < Lr; ++l) {
        double acc = 0.0;
        for (std::int64_t j = 0; j < P; ++j)
          acc += static_cast<double>(qh[j]) *
                 fwd::bf16_bits_to_float(ab.w_uk_t[uz((n * P + j) * Lr + l)]);
        out[l] = static_cast<float>(acc);
      }
      std::copy(qh + P, qh + QK, out + Lr);
    }
  }
  const std::vector<std::int64_t> shared(uz(N), 0);
  const fwd::AttentionShape sh{.T = T,
                               .n_q = N,
                               .qk_dim = Lr + R,
                               .v_dim = Lr,
                               .q_stride = N * (Lr + R),
                               .q_head_stride = Lr + R,
                               .k_stride = Lr + R,
                               .k_head_stride = 0,
                               .v_stride = Lr + R,
                               .v_head_stride = 0};
  std::vector<float> latent_out(uz(T * N * Lr)), attn(uz(T * N * Vd));
  fwd::causal_attention(query.data(), key.data(), key.data(), sh, shared,
                        fwd::layer_attention(fc, c, layer), latent_out.data());
  for (std::int64_t i = 0; i < T; ++i)
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t v = 0; v < Vd; ++v) {
        double acc = 0.0;
        for (std::int64_t l = 0; l < Lr; ++l)
          acc += static_cast<double>(latent_out[uz((i * N + n) * Lr + l)]) *
                 fwd::bf16_bits_to_float(ab.w_uv[uz((n * Lr + l) * Vd + v)]);
        attn[uz((i * N + n) * Vd + v)] = static_cast<float>(acc);
      }
  fwd::linear(attn.data(), T, wo, {}, delta);
  return Status::Ok();
}

}  // namespace

MlaAbsorbed derive_mla(const ModelConfig& c, std::int64_t tp_size, const std::uint16_t* kv_b) {
  const std::int64_t N = c.num_heads / tp_size, P = c.qk_nope_head_dim, Vd = c.v_head_dim;
  const std::int64_t Lr = c.kv_lora_rank;
  MlaAbsorbed ab;
  ab.w_uk_t.resize(uz(N * P * Lr));
  ab.w_uv.resize(uz(N * Lr * Vd));
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t l = 0; l < Lr; ++l) {
      for (std::int64_t j = 0; j < P; ++j)
        ab.w_uk_t[uz((n * P + j) * Lr + l)] = kv_b[uz((n * (P + Vd) + j) * Lr + l)];
      for (std::int64_t v = 0; v < Vd; ++v)
        ab.w_uv[uz((n * Lr + l) * Vd + v)] = kv_b[uz((n * (P + Vd) + P + v) * Lr + l)];
    }
  return ab;
}

Result<std::vector<float>> engine_forward(const ModelSpec& spec, const ForwardConfig& fc,
                                          const EngineShardLayout& layout,
                                          const std::vector<const std::uint16_t*>& params,
                                          const std::vector<std::int32_t>& tokens,
                                          Communicator* tp_group) {
  const std::vector<const void*> any(params.begin(), params.end());
  return engine_forward(spec, fc, layout, any, tokens, tp_group, nullptr);
}

Result<std::vector<float>> engine_forward(const ModelSpec& spec, const EngineShardLayout& layout,
                                          const std::vector<const std::uint16_t*>& params,
                                          const std::vector<std::int32_t>& tokens,
                                          Communicator* tp_group) {
  REFIT_ASSIGN_OR_RETURN(const ForwardConfig fc, forward_config(spec, "{}"));
  return engine_forward(spec, fc, layout, params, tokens, tp_group);
}

Result<std::vector<float>> engine_forward(const ModelSpec& spec, const ForwardConfig& fc,
                                          const EngineShardLayout& layout,
                                          const std::vector<const void*>& params,
                                          const std::vector<std::int32_t>& tokens,
                                          Communicator* tp_group,
                                          const std::vector<MlaAbsorbed>* absorbed) {
  const ModelConfig& c = spec.config();
  REFIT_RETURN_IF_ERROR(fwd::check_forward_inputs(c, tokens, kWho));
  REFIT_RETURN_IF_ERROR(fwd::check_forward_config(c, fc, kWho));
  const std::int64_t t = layout.tp_size, r = layout.tp_rank;
  const std::string where = fmt::format("{}: tp rank {}/{}", kWho, r, t);
  if (t < 1 || r < 0 || r >= t)
    return Status::InvalidArgument(fmt::format("{}: invalid TP rank/size", where));
  if (params.size() != layout.params.size())
    return Status::InvalidArgument(fmt::format("{}: got {} parameter buffers, the layout lists {}",
                                               where, params.size(), layout.params.size()));
  if (t > 1 && tp_group == nullptr)
    return Status::InvalidArgument(fmt::format("{}: tp_size > 1 needs a TP group", where));
  if (tp_group != nullptr && (tp_group->size() != t || tp_group->rank() != r))
    return Status::InvalidArgument(
        fmt::format("{}: the TP group is rank {} of {}; it must be rank {} of {}", where,
                    tp_group->rank(), tp_group->size(), r, t));

  const std::int64_t H = c.hidden_size, d = c.head_dim, nq = c.num_heads, nkv = c.num_kv_heads;
  const std::int64_t V = c.vocab_size;
  const std::int64_t padded_vocab =
      (V + kEngineVocabPadding - 1) / kEngineVocabPadding * kEngineVocabPadding;
  const bool kv_replicated = t > nkv;
  if (nq % t != 0 || padded_vocab % t != 0 || (kv_replicated ? t % nkv : nkv % t) != 0)
    return Status::InvalidArgument(fmt::format(
        "{}: TP size {} does not shard num_attention_heads {}, num_key_value_heads {} and the "
        "padded vocabulary {}",
        where, t, nq, nkv, padded_vocab));
  const std::int64_t vocab_per_rank = padded_vocab / t, vocab_lo = r * vocab_per_rank;
  const std::int64_t nq_local = nq / t, nkv_local = kv_replicated ? 1 : nkv / t;
  const std::int64_t q_rows = nq_local * d, kv_rows = nkv_local * d;
  const std::int64_t qkv_rows = q_rows + 2 * kv_rows;
  const std::int64_t kv_head0 = r * nkv / t;  // first kv head this rank holds

  // Local query head j is global head r*nq_local + j; it reads kv head (global)/(nq/nkv).
  std::vector<std::int64_t> kv_of_head(uz(nq_local));
  for (std::int64_t j = 0; j < nq_local; ++j) {
    const std::int64_t local = (r * nq_local + j) / (nq / nkv) - kv_head0;
    if (local < 0 || local >= nkv_local)
      return Status::Internal(fmt::format("{}: query head {} reads kv head {} this rank lacks",
                                          where, r * nq_local + j, local + kv_head0));
    kv_of_head[uz(j)] = local;
  }

  const EngineParams w(layout, params);
  TpCombiner tp(tp_group, static_cast<int>(t), static_cast<int>(r));
  std::vector<MlaAbsorbed> derived_here;
  if (c.mla && absorbed == nullptr) {  // derived here from the rank's kv_b_proj
    for (std::int64_t layer = 0; layer < c.num_layers; ++layer) {
      REFIT_ASSIGN_OR_RETURN(
          const WeightView kv_b,
          w.get(fmt::format("model.layers.{}.self_attn.kv_b_proj.weight", layer),
                {nq_local * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}));
      std::vector<std::uint16_t> bits(uz(kv_b.rows() * kv_b.cols()));
      for (std::int64_t i = 0; i < kv_b.rows(); ++i)
        for (std::int64_t j = 0; j < kv_b.cols(); ++j)
          bits[uz(i * kv_b.cols() + j)] = f32_to_bf16(kv_b.at(i, j));
      derived_here.push_back(derive_mla(c, t, bits.data()));
    }
    absorbed = &derived_here;
  }
  if (c.mla && static_cast<std::int64_t>(absorbed->size()) != c.num_layers)
    return Status::InvalidArgument(
        fmt::format("{}: absorbed MLA matrices of {} layers; the model has {}", where,
                    absorbed->size(), c.num_layers));
  const auto T = static_cast<std::int64_t>(tokens.size());

  // Vocabulary-parallel embedding: rows of tokens outside this rank's range stay zero. SGLang's
  // Gemma 3 keeps the whole table on every rank instead (engine/engine_layout.h).
  const bool whole_embed =
      vocab_per_rank != V && fwd_shape_rows(w.shape_of("model.embed_tokens.weight")) == V;
  REFIT_ASSIGN_OR_RETURN(const WeightView embed,
                         w.get("model.embed_tokens.weight", {whole_embed ? V : vocab_per_rank, H}));
  std::vector<float> x(uz(T * H), 0.0f);
  const auto escale = static_cast<float>(fc.embed_scale);
  for (std::int64_t i = 0; i < T; ++i) {
    const std::int64_t row = whole_embed ? tokens[uz(i)] : tokens[uz(i)] - vocab_lo;
    if (row < 0 || row >= embed.rows()) continue;
    for (std::int64_t j = 0; j < H; ++j)
      x[uz(i * H + j)] = fc.embed_scale == 1.0 ? embed.at(row, j) : embed.at(row, j) * escale;
  }
  if (!whole_embed) REFIT_RETURN_IF_ERROR(tp.all_reduce_sum(x, "embed_tokens"));
  const bool off = fc.offset_norms;
  const double eps = c.rms_norm_eps;

  std::vector<float> h_norm(uz(T * H)), qkv(uz(T * qkv_rows)), attn(uz(T * q_rows));
  std::vector<float> delta(uz(T * H));
  for (std::int64_t layer = 0; layer < c.num_layers; ++layer) {
    const std::string p = fmt::format("model.layers.{}.", layer);
    REFIT_ASSIGN_OR_RETURN(const WeightView in_norm, w.get(p + "input_layernorm.weight", {H}));
    if (c.mla) {
      fwd::rms_norm(x.data(), H, T, H, in_norm, eps, h_norm.data(), H, off);
      REFIT_RETURN_IF_ERROR(mla_engine(c, fc, w, (*absorbed)[uz(layer)], layer, t, h_norm.data(), T,
                                       delta.data(), where));
    } else {
      REFIT_ASSIGN_OR_RETURN(const WeightView w_qkv,
                             w.get(p + "self_attn.qkv_proj.weight", {qkv_rows, H}));
      WeightView b_qkv, q_norm, k_norm;
      if (c.attention_bias) {
        REFIT_ASSIGN_OR_RETURN(b_qkv, w.get(p + "self_attn.qkv_proj.bias", {qkv_rows}));
      }
      if (c.qk_norm) {
        REFIT_ASSIGN_OR_RETURN(q_norm, w.get(p + "self_attn.q_norm.weight", {d}));
        REFIT_ASSIGN_OR_RETURN(k_norm, w.get(p + "self_attn.k_norm.weight", {d}));
      }
      REFIT_ASSIGN_OR_RETURN(const WeightView w_o,
                             w.get(p + "self_attn.o_proj.weight", {H, q_rows}));
      const fwd::Rope rope = fwd::layer_rope(fc, layer);

      fwd::rms_norm(x.data(), H, T, H, in_norm, eps, h_norm.data(), H, off);
      fwd::linear(h_norm.data(), T, w_qkv, b_qkv, qkv.data());
      float* q = qkv.data();
      float* k = q + q_rows;
      float* v = k + kv_rows;
      fwd::prepare_heads(q, qkv_rows, T, nq_local, d, q_norm, eps, rope, off);
      fwd::prepare_heads(k, qkv_rows, T, nkv_local, d, k_norm, eps, rope, off);
      fwd::causal_attention(q, qkv_rows, k, v, qkv_rows, T, nq_local, d, kv_of_head,
                            fwd::layer_attention(fc, c, layer), attn.data());
      fwd::linear(attn.data(), T, w_o, {}, delta.data());
    }
    REFIT_RETURN_IF_ERROR(tp.all_reduce_sum(delta, p + "self_attn.o_proj"));

    REFIT_ASSIGN_OR_RETURN(const WeightView post_norm,
                           w.get(p + "post_attention_layernorm.weight", {H}));
    if (fc.sandwich_norms) {  // Gemma: the combined attention output is normalized, then added
      REFIT_ASSIGN_OR_RETURN(const WeightView pre_ffn,
                             w.get(p + "pre_feedforward_layernorm.weight", {H}));
      fwd::rms_norm(delta.data(), H, T, H, post_norm, eps, delta.data(), H, off);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] += delta[i];
      fwd::rms_norm(x.data(), H, T, H, pre_ffn, eps, h_norm.data(), H, off);
    } else {
      for (std::size_t i = 0; i < x.size(); ++i) x[i] += delta[i];
      fwd::rms_norm(x.data(), H, T, H, post_norm, eps, h_norm.data(), H, off);
    }
    if (c.is_moe_layer(layer)) {
      const std::int64_t E = c.num_experts, I = c.moe_intermediate_size / t;
      if (c.moe_intermediate_size % t != 0)
        return Status::InvalidArgument(
            fmt::format("{}: moe_intermediate_size {} is not divisible "
                        "by the TP size",
                        where, c.moe_intermediate_size));
      REFIT_ASSIGN_OR_RETURN(const WeightView router, w.get(p + "mlp.gate.weight", {E, H}));
      REFIT_ASSIGN_OR_RETURN(const WeightView w13,
                             w.get(p + "mlp.experts.w13_weight", {E, 2 * I, H}));
      REFIT_ASSIGN_OR_RETURN(const WeightView w2, w.get(p + "mlp.experts.w2_weight", {E, H, I}));
      std::vector<float> router_logits(uz(T * E)), gate(uz(I)), up(uz(I)), out(uz(H));
      fwd::linear(h_norm.data(), T, router, {}, router_logits.data());
      std::vector<float> bias_scratch;
      const float* bias = nullptr;
      if (fc.sigmoid_router) {  // DeepSeek-V3 / GLM-4.5: the float32 correction bias
        REFIT_ASSIGN_OR_RETURN(const WeightView b,
                               w.get(p + "mlp.gate.e_score_correction_bias", {E}));
        bias_scratch.assign(uz(E), 0.0f);
        for (std::int64_t e = 0; e < E; ++e) bias_scratch[uz(e)] = b.at(0, e);
        bias = bias_scratch.data();
      }
      std::fill(delta.begin(), delta.end(), 0.0f);
      for (std::int64_t i = 0; i < T; ++i) {
        const float* hi = h_norm.data() + i * H;
        const float* li = router_logits.data() + i * E;
        for (const auto& [e, weight] :
             fc.sigmoid_router ? fwd::route_token_sigmoid(li, bias, E, c.num_experts_per_tok,
                                                          c.norm_topk_prob, fc)
                               : fwd::route_token(li, E, c.num_experts_per_tok, c.norm_topk_prob)) {
          // w13 rows of expert e: [gate slice ; up slice]; w2 rows of e: [H, I] column slice.
          fwd::linear(hi, 1, w13.row_block(e * 2 * I, I), {}, gate.data());
          fwd::linear(hi, 1, w13.row_block(e * 2 * I + I, I), {}, up.data());
          fwd::gated(gate.data(), up.data(), I, fc.activation);
          fwd::linear(gate.data(), 1, w2.row_block(e * H, H), {}, out.data());
          for (std::int64_t j = 0; j < H; ++j) delta[uz(i * H + j)] += weight * out[uz(j)];
        }
      }
      if (c.shared_expert_intermediate_size > 0 && fc.sigmoid_router) {
        // DeepSeek-V3 / GLM-4.5: this rank's columns of the ungated shared experts' MLP.
        const std::int64_t S = c.shared_expert_intermediate_size / t;
        if (c.shared_expert_intermediate_size % t != 0)
          return Status::InvalidArgument(fmt::format(
              "{}: moe_intermediate_size * n_shared_experts ({}) is not divisible by the TP size",
              where, c.shared_expert_intermediate_size));
        REFIT_ASSIGN_OR_RETURN(const WeightView s_gu,
                               w.get(p + "mlp.shared_experts.gate_up_proj.weight", {2 * S, H}));
        REFIT_ASSIGN_OR_RETURN(const WeightView s_down,
                               w.get(p + "mlp.shared_experts.down_proj.weight", {H, S}));
        std::vector<float> g(uz(T * S)), u(uz(T * S)), shared(uz(T * H));
        fwd::linear(h_norm.data(), T, s_gu.row_block(0, S), {}, g.data());
        fwd::linear(h_norm.data(), T, s_gu.row_block(S, S), {}, u.data());
        fwd::gated(g.data(), u.data(), T * S, fc.activation);
        fwd::linear(g.data(), T, s_down, {}, shared.data());
        for (std::size_t i = 0; i < shared.size(); ++i) delta[i] += shared[i];
      } else if (c.shared_expert_intermediate_size > 0) {
        // Qwen2-MoE: this rank's columns of the shared MLP, scaled by the replicated gate.
        const std::int64_t S = c.shared_expert_intermediate_size / t;
        if (c.shared_expert_intermediate_size % t != 0)
          return Status::InvalidArgument(
              fmt::format("{}: shared_expert_intermediate_size {} is not divisible by the TP size",
                          where, c.shared_expert_intermediate_size));
        REFIT_ASSIGN_OR_RETURN(const WeightView s_gu,
                               w.get(p + "mlp.shared_expert.gate_up_proj.weight", {2 * S, H}));
        REFIT_ASSIGN_OR_RETURN(const WeightView s_down,
                               w.get(p + "mlp.shared_expert.down_proj.weight", {H, S}));
        REFIT_ASSIGN_OR_RETURN(const WeightView s_gate,
                               w.get(p + "mlp.shared_expert_gate.weight", {1, H}));
        std::vector<float> g(uz(T * S)), u(uz(T * S)), shared(uz(T * H)), scale(uz(T));
        fwd::linear(h_norm.data(), T, s_gu.row_block(0, S), {}, g.data());
        fwd::linear(h_norm.data(), T, s_gu.row_block(S, S), {}, u.data());
        fwd::gated(g.data(), u.data(), T * S, fc.activation);
        fwd::linear(g.data(), T, s_down, {}, shared.data());
        fwd::linear(h_norm.data(), T, s_gate, {}, scale.data());
        for (std::int64_t i = 0; i < T; ++i)
          for (std::int64_t j = 0; j < H; ++j)
            delta[uz(i * H + j)] += fwd::sigmoid(scale[uz(i)]) * shared[uz(i * H + j)];
      }
      REFIT_RETURN_IF_ERROR(tp.all_reduce_sum(delta, p + "mlp.experts"));
    } else {
      const std::int64_t I = c.intermediate_size / t;
      if (c.intermediate_size % t != 0)
        return Status::InvalidArgument(
            fmt::format("{}: intermediate_size {} is not divisible by the TP size", where,
                        c.intermediate_size));
      REFIT_ASSIGN_OR_RETURN(const WeightView w_gu,
                             w.get(p + "mlp.gate_up_proj.weight", {2 * I, H}));
      REFIT_ASSIGN_OR_RETURN(const WeightView w_down, w.get(p + "mlp.down_proj.weight", {H, I}));
      std::vector<float> gate_up(uz(T * 2 * I)), act(uz(T * I)), up(uz(T * I));
      fwd::linear(h_norm.data(), T, w_gu, {}, gate_up.data());
      for (std::int64_t i = 0; i < T; ++i)
        for (std::int64_t j = 0; j < I; ++j) {
          act[uz(i * I + j)] = gate_up[uz(i * 2 * I + j)];
          up[uz(i * I + j)] = gate_up[uz(i * 2 * I + I + j)];
        }
      fwd::gated(act.data(), up.data(), T * I, fc.activation);
      fwd::linear(act.data(), T, w_down, {}, delta.data());
      REFIT_RETURN_IF_ERROR(tp.all_reduce_sum(delta, p + "mlp.down_proj"));
    }
    if (fc.sandwich_norms) {
      REFIT_ASSIGN_OR_RETURN(const WeightView post_ffn,
                             w.get(p + "post_feedforward_layernorm.weight", {H}));
      fwd::rms_norm(delta.data(), H, T, H, post_ffn, eps, delta.data(), H, off);
    }
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += delta[i];
  }

  REFIT_ASSIGN_OR_RETURN(const WeightView final_norm, w.get("model.norm.weight", {H}));
  fwd::rms_norm(x.data(), H, T, H, final_norm, eps, h_norm.data(), H, off);
  std::vector<float> logits(uz(T * V));
  if (whole_embed && c.tie_word_embeddings) {  // every rank holds the whole head
    fwd::linear(h_norm.data(), T, embed, {}, logits.data());
  } else {
    WeightView head = embed;
    if (!c.tie_word_embeddings) {
      REFIT_ASSIGN_OR_RETURN(head, w.get("lm_head.weight", {vocab_per_rank, H}));
    }
    std::vector<float> local_logits(uz(T * vocab_per_rank)), gathered;
    fwd::linear(h_norm.data(), T, head, {}, local_logits.data());
    REFIT_RETURN_IF_ERROR(tp.all_gather(local_logits, gathered, "lm_head"));
    // gathered is [rank][T][vocab_per_rank]; the full vocabulary drops the padding ids >= V.
    for (std::int64_t i = 0; i < T; ++i)
      for (std::int64_t id = 0; id < V; ++id) {
        const std::int64_t owner = id / vocab_per_rank, local = id % vocab_per_rank;
        logits[uz(i * V + id)] = gathered[uz((owner * T + i) * vocab_per_rank + local)];
      }
  }
  for (float& l : logits) l = fwd::softcap(l, fc.final_softcap);
  return logits;
}

}  // namespace refit
