// The logit check's single-process reference forward on full HF tensors, its token sequence and
// its comparison (harness/forward.h). The TP engine pass lives in forward_engine.cc.
#include "harness/forward.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "harness/forward_kernels.h"

namespace refit {
namespace {

using fwd::WeightView;

constexpr std::int64_t kNoTensor = -1;

// HF tensor indices of one decoder layer.
struct HfLayer {
  std::int64_t q = kNoTensor, k = kNoTensor, v = kNoTensor, o = kNoTensor;
  std::int64_t q_bias = kNoTensor, k_bias = kNoTensor, v_bias = kNoTensor;
  std::int64_t q_norm = kNoTensor, k_norm = kNoTensor;
  std::int64_t input_norm = kNoTensor, post_attn_norm = kNoTensor;
  std::int64_t gate = kNoTensor, up = kNoTensor, down = kNoTensor, router = kNoTensor;
  std::vector<std::int64_t> expert_gate, expert_up, expert_down;
  std::int64_t pre_ffn_norm = kNoTensor, post_ffn_norm = kNoTensor;  // Gemma
  std::int64_t qkv = kNoTensor, gate_up = kNoTensor;                 // Phi-3
  std::int64_t shared_gate = kNoTensor, shared_up = kNoTensor, shared_down = kNoTensor;
  std::int64_t shared_expert_gate = kNoTensor;  // Qwen2-MoE
  std::int64_t router_bias = kNoTensor;         // DeepSeek-V3, GLM-4.5
  // MLA (DeepSeek-V3); q_proj (q_lora_rank null) is `q`.
  std::int64_t q_a = kNoTensor, q_a_norm = kNoTensor, q_b = kNoTensor;
  std::int64_t kv_a = kNoTensor, kv_a_norm = kNoTensor, kv_b = kNoTensor;
};

struct HfIndex {
  std::int64_t embed = kNoTensor, final_norm = kNoTensor, lm_head = kNoTensor;
  std::vector<HfLayer> layers;
};

HfIndex index_hf(const ModelSpec& spec) {
  const ModelConfig& c = spec.config();
  HfIndex ix;
  ix.layers.resize(static_cast<std::size_t>(std::max<std::int64_t>(c.num_layers, 0)));
  const auto& ts = spec.tensors();
  for (std::size_t i = 0; i < ts.size(); ++i) {
    const TensorSpec& t = ts[i];
    const auto n = static_cast<std::int64_t>(i);
    HfLayer* L = (t.layer >= 0 && t.layer < c.num_layers)
                     ? &ix.layers[static_cast<std::size_t>(t.layer)]
                     : nullptr;
    auto expert_slot = [&](std::vector<std::int64_t>& v) {
      if (t.expert < 0 || t.expert >= c.num_experts) return;
      v.resize(static_cast<std::size_t>(c.num_experts), kNoTensor);
      v[static_cast<std::size_t>(t.expert)] = n;
    };
    if (!L && t.layer >= 0) continue;  // caught as a missing tensor below
    switch (t.role) {
      case ParamRole::kEmbedding:
        ix.embed = n;
        break;
      case ParamRole::kLmHead:
        ix.lm_head = n;
        break;
      case ParamRole::kFinalNorm:
        ix.final_norm = n;
        break;
      case ParamRole::kInputNorm:
        if (L) L->input_norm = n;
        break;
      case ParamRole::kPostAttnNorm:
        if (L) L->post_attn_norm = n;
        break;
      case ParamRole::kQProj:
        if (L) L->q = n;
        break;
      case ParamRole::kKProj:
        if (L) L->k = n;
        break;
      case ParamRole::kVProj:
        if (L) L->v = n;
        break;
      case ParamRole::kQBias:
        if (L) L->q_bias = n;
        break;
      case ParamRole::kKBias:
        if (L) L->k_bias = n;
        break;
      case ParamRole::kVBias:
        if (L) L->v_bias = n;
        break;
      case ParamRole::kOProj:
        if (L) L->o = n;
        break;
      case ParamRole::kQNorm:
        if (L) L->q_norm = n;
        break;
      case ParamRole::kKNorm:
        if (L) L->k_norm = n;
        break;
      case ParamRole::kGateProj:
        if (L) L->gate = n;
        break;
      case ParamRole::kUpProj:
        if (L) L->up = n;
        break;
      case ParamRole::kDownProj:
        if (L) L->down = n;
        break;
      case ParamRole::kRouter:
        if (L) L->router = n;
        break;
      case ParamRole::kExpertGate:
        if (L) expert_slot(L->expert_gate);
        break;
      case ParamRole::kExpertUp:
        if (L) expert_slot(L->expert_up);
        break;
      case ParamRole::kExpertDown:
        if (L) expert_slot(L->expert_down);
        break;
      case ParamRole::kPreFfnNorm:
        if (L) L->pre_ffn_norm = n;
        break;
      case ParamRole::kPostFfnNorm:
        if (L) L->post_ffn_norm = n;
        break;
      case ParamRole::kQkvProj:
        if (L) L->qkv = n;
        break;
      case ParamRole::kGateUpProj:
        if (L) L->gate_up = n;
        break;
      case ParamRole::kSharedGate:
        if (L) L->shared_gate = n;
        break;
      case ParamRole::kSharedUp:
        if (L) L->shared_up = n;
        break;
      case ParamRole::kSharedDown:
        if (L) L->shared_down = n;
        break;
      case ParamRole::kSharedExpertGate:
        if (L) L->shared_expert_gate = n;
        break;
      case ParamRole::kRouterBias:
        if (L) L->router_bias = n;
        break;
      case ParamRole::kQAProj:
        if (L) L->q_a = n;
        break;
      case ParamRole::kQALayerNorm:
        if (L) L->q_a_norm = n;
        break;
      case ParamRole::kQBProj:
        if (L) L->q_b = n;
        break;
      case ParamRole::kKvAProj:
        if (L) L->kv_a = n;
        break;
      case ParamRole::kKvALayerNorm:
        if (L) L->kv_a_norm = n;
        break;
      case ParamRole::kKvBProj:
        if (L) L->kv_b = n;
        break;
      default:  // kOther: tables read from headers have no forward (refused before, forward.h)
        break;
    }
  }
  return ix;
}

// Views HF tensors by index, checking presence.
class HfTensors {
 public:
  HfTensors(const ModelSpec& spec, const std::vector<const float*>& hf) : spec_(spec), hf_(hf) {}

  Result<WeightView> get(std::int64_t index, const char* what, std::int64_t layer) const {
    if (index == kNoTensor)
      return Status::InvalidArgument(
          fmt::format("reference forward: the model spec has no {} tensor{}", what,
                      layer >= 0 ? fmt::format(" in layer {}", layer) : std::string()));
    const TensorSpec& t = spec_.tensors()[static_cast<std::size_t>(index)];
    const MatrixShape m = matrix_shape(t.shape);
    return WeightView::f32(hf_[static_cast<std::size_t>(index)], m.rows, m.cols);
  }
  // An optional tensor: an empty view when absent.
  WeightView optional(std::int64_t index) const {
    if (index == kNoTensor) return {};
    const MatrixShape m = matrix_shape(spec_.tensors()[static_cast<std::size_t>(index)].shape);
    return WeightView::f32(hf_[static_cast<std::size_t>(index)], m.rows, m.cols);
  }

 private:
  const ModelSpec& spec_;
  const std::vector<const float*>& hf_;
};

Status check_model_math(const ModelConfig& c, const char* who) {
  if (c.hidden_size <= 0 || c.num_heads <= 0 || c.num_kv_heads <= 0 || c.head_dim <= 0 ||
      c.vocab_size <= 0 || c.num_layers < 0)
    return Status::InvalidArgument(fmt::format(
        "{}: hidden_size ({}), num_attention_heads ({}), num_key_value_heads ({}), head_dim ({}) "
        "and vocab_size ({}) must be positive",
        who, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size));
  if (c.num_heads % c.num_kv_heads != 0)
    return Status::InvalidArgument(
        fmt::format("{}: num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                    who, c.num_heads, c.num_kv_heads));
  if (c.head_dim % 2 != 0)
    return Status::InvalidArgument(
        fmt::format("{}: head_dim ({}) must be even for RoPE", who, c.head_dim));
  if (c.num_experts > 0 && (c.num_experts_per_tok <= 0 || c.num_experts_per_tok > c.num_experts))
    return Status::InvalidArgument(
        fmt::format("{}: num_experts_per_tok ({}) must be in [1, num_experts = {}]", who,
                    c.num_experts_per_tok, c.num_experts));
  return Status::Ok();
}

Status check_tokens(const std::vector<std::int32_t>& tokens, std::int64_t vocab, const char* who) {
  for (std::size_t t = 0; t < tokens.size(); ++t)
    if (tokens[t] < 0 || tokens[t] >= vocab)
      return Status::InvalidArgument(
          fmt::format("{}: token {} at position {} outside [0, {})", who, tokens[t], t, vocab));
  return Status::Ok();
}

// Multi-head latent attention of one layer as transformers' DeepseekV3Attention computes it:
// keys and values of every head expanded from the latent through kv_b_proj. Writes the o_proj
// output [T, H] to `delta`.
Status mla_reference(const ModelConfig& c, const ForwardConfig& fc, const HfTensors& w,
                     const HfLayer& L, std::int64_t layer, const float* h, std::int64_t T,
                     float* delta) {
  const auto uz = [](std::int64_t n) { return static_cast<std::size_t>(n); };
  const std::int64_t N = c.num_heads, P = c.qk_nope_head_dim, R = c.qk_rope_head_dim;
  const std::int64_t Vd = c.v_head_dim, Lr = c.kv_lora_rank, Lq = c.q_lora_rank, QK = P + R;
  const double eps = c.rms_norm_eps;
  std::vector<float> q(uz(T * N * QK)), kva(uz(T * (Lr + R))), latent(uz(T * Lr));
  std::vector<float> kvb(uz(T * N * (P + Vd))), k(uz(T * N * QK)), v(uz(T * N * Vd));
  std::vector<float> out(uz(T * N * Vd));
  if (Lq > 0) {
    REFIT_ASSIGN_OR_RETURN(const WeightView qa, w.get(L.q_a, "q_a_proj", layer));
    REFIT_ASSIGN_OR_RETURN(const WeightView qa_norm, w.get(L.q_a_norm, "q_a_layernorm", layer));
    REFIT_ASSIGN_OR_RETURN(const WeightView qb, w.get(L.q_b, "q_b_proj", layer));
    std::vector<float> qc(uz(T * Lq));
    fwd::linear(h, T, qa, {}, qc.data());
    fwd::rms_norm(qc.data(), Lq, T, Lq, qa_norm, eps, qc.data(), Lq);
    fwd::linear(qc.data(), T, qb, {}, q.data());
  } else {
    REFIT_ASSIGN_OR_RETURN(const WeightView wq, w.get(L.q, "q_proj", layer));
    fwd::linear(h, T, wq, {}, q.data());
  }
  REFIT_ASSIGN_OR_RETURN(const WeightView kv_a, w.get(L.kv_a, "kv_a_proj_with_mqa", layer));
  REFIT_ASSIGN_OR_RETURN(const WeightView kv_norm, w.get(L.kv_a_norm, "kv_a_layernorm", layer));
  REFIT_ASSIGN_OR_RETURN(const WeightView kv_b, w.get(L.kv_b, "kv_b_proj", layer));
  REFIT_ASSIGN_OR_RETURN(const WeightView wo, w.get(L.o, "o_proj", layer));
  fwd::linear(h, T, kv_a, {}, kva.data());
  fwd::rms_norm(kva.data(), Lr + R, T, Lr, kv_norm, eps, latent.data(), Lr);
  fwd::linear(latent.data(), T, kv_b, {}, kvb.data());
  fwd::Rope rope = fwd::layer_rope(fc, layer);
  rope.rotary_dim = 0;  // the whole rope part
  for (std::int64_t t = 0; t < T; ++t) {
    float* k_pe = kva.data() + t * (Lr + R) + Lr;
    fwd::rope_head(k_pe, R, t, rope, fc);
    for (std::int64_t n = 0; n < N; ++n) {
      float* qh = q.data() + (t * N + n) * QK;
      fwd::rope_head(qh + P, R, t, rope, fc);
      const float* kv = kvb.data() + (t * N + n) * (P + Vd);
      float* kh = k.data() + (t * N + n) * QK;
      std::copy(kv, kv + P, kh);
      std::copy(k_pe, k_pe + R, kh + P);
      std::copy(kv + P, kv + P + Vd, v.data() + (t * N + n) * Vd);
    }
  }
  std::vector<std::int64_t> self(uz(N));
  for (std::int64_t n = 0; n < N; ++n) self[uz(n)] = n;
  const fwd::AttentionShape sh{.T = T,
                               .n_q = N,
                               .qk_dim = QK,
                               .v_dim = Vd,
                               .q_stride = N * QK,
                               .q_head_stride = QK,
                               .k_stride = N * QK,
                               .k_head_stride = QK,
                               .v_stride = N * Vd,
                               .v_head_stride = Vd};
  fwd::causal_attention(q.data(), k.data(), v.data(), sh, self, fwd::layer_attention(fc, c, layer),
                        out.data());
  fwd::linear(out.data(), T, wo, {}, delta);
  return Status::Ok();
}

// DeepSeek-V3 / GLM-4.5 MoE of one layer (transformers' DeepseekV3MoE): the routed experts by
// route_token_sigmoid plus the shared experts' MLP. Writes [T, H] to `delta`.
Status deepseek_moe_reference(const ModelConfig& c, const ForwardConfig& fc, const HfTensors& w,
                              const HfLayer& L, std::int64_t layer, const float* h, std::int64_t T,
                              float* delta) {
  const auto uz = [](std::int64_t n) { return static_cast<std::size_t>(n); };
  const std::int64_t E = c.num_experts, I = c.moe_intermediate_size, H = c.hidden_size;
  REFIT_ASSIGN_OR_RETURN(const WeightView router, w.get(L.router, "mlp.gate (router)", layer));
  REFIT_ASSIGN_OR_RETURN(const WeightView bias,
                         w.get(L.router_bias, "mlp.gate.e_score_correction_bias", layer));
  if (static_cast<std::int64_t>(L.expert_gate.size()) != E ||
      static_cast<std::int64_t>(L.expert_up.size()) != E ||
      static_cast<std::int64_t>(L.expert_down.size()) != E)
    return Status::InvalidArgument(
        fmt::format("reference forward: layer {} does not list all {} experts", layer, E));
  std::vector<float> logits(uz(T * E)), gate(uz(I)), up(uz(I)), out(uz(H)), scratch;
  fwd::linear(h, T, router, {}, logits.data());
  const float* b = bias.row(0, scratch);
  std::fill(delta, delta + T * H, 0.0f);
  for (std::int64_t t = 0; t < T; ++t) {
    const float* ht = h + t * H;
    for (const auto& [e, weight] : fwd::route_token_sigmoid(
             logits.data() + t * E, b, E, c.num_experts_per_tok, c.norm_topk_prob, fc)) {
      REFIT_ASSIGN_OR_RETURN(const WeightView wg, w.get(L.expert_gate[uz(e)], "expert", layer));
      REFIT_ASSIGN_OR_RETURN(const WeightView wu, w.get(L.expert_up[uz(e)], "expert", layer));
      REFIT_ASSIGN_OR_RETURN(const WeightView wd, w.get(L.expert_down[uz(e)], "expert", layer));
      fwd::linear(ht, 1, wg, {}, gate.data());
      fwd::linear(ht, 1, wu, {}, up.data());
      fwd::gated(gate.data(), up.data(), I, fc.activation);
      fwd::linear(gate.data(), 1, wd, {}, out.data());
      for (std::int64_t j = 0; j < H; ++j) delta[t * H + j] += weight * out[uz(j)];
    }
  }
  if (c.shared_expert_intermediate_size > 0) {
    const std::int64_t S = c.shared_expert_intermediate_size;
    REFIT_ASSIGN_OR_RETURN(const WeightView sg,
                           w.get(L.shared_gate, "shared_experts.gate_proj", layer));
    REFIT_ASSIGN_OR_RETURN(const WeightView su,
                           w.get(L.shared_up, "shared_experts.up_proj", layer));
    REFIT_ASSIGN_OR_RETURN(const WeightView sd,
                           w.get(L.shared_down, "shared_experts.down_proj", layer));
    std::vector<float> g(uz(T * S)), u(uz(T * S)), shared(uz(T * H));
    fwd::linear(h, T, sg, {}, g.data());
    fwd::linear(h, T, su, {}, u.data());
    fwd::gated(g.data(), u.data(), T * S, fc.activation);
    fwd::linear(g.data(), T, sd, {}, shared.data());
    for (std::int64_t i = 0; i < T * H; ++i) delta[i] += shared[uz(i)];
  }
  return Status::Ok();
}

}  // namespace

namespace fwd {
// Shared with forward_engine.cc.
Status check_forward_inputs(const ModelConfig& c, const std::vector<std::int32_t>& tokens,
                            const char* who) {
  REFIT_RETURN_IF_ERROR(check_model_math(c, who));
  return check_tokens(tokens, c.vocab_size, who);
}
}  // namespace fwd

Result<std::vector<float>> reference_forward(const ModelSpec& spec,
                                             const std::vector<const float*>& hf,
                                             const std::vector<std::int32_t>& tokens) {
  REFIT_ASSIGN_OR_RETURN(const ForwardConfig fc, forward_config(spec, "{}"));
  return reference_forward(spec, fc, hf, tokens);
}

Result<std::vector<float>> reference_forward(const ModelSpec& spec, const ForwardConfig& fc,
                                             const std::vector<const float*>& hf,
                                             const std::vector<std::int32_t>& tokens) {
  constexpr const char* kWho = "reference forward";
  const ModelConfig& c = spec.config();
  REFIT_RETURN_IF_ERROR(fwd::check_forward_inputs(c, tokens, kWho));
  REFIT_RETURN_IF_ERROR(fwd::check_forward_config(c, fc, kWho));
  if (hf.size() != spec.tensors().size())
    return Status::InvalidArgument(fmt::format("{}: got {} tensors, the spec of {} lists {}", kWho,
                                               hf.size(), spec.source(), spec.tensors().size()));
  for (std::size_t i = 0; i < hf.size(); ++i)
    if (hf[i] == nullptr)
      return Status::InvalidArgument(
          fmt::format("{}: no data for tensor {}", kWho, spec.tensors()[i].name));

  const HfIndex ix = index_hf(spec);
  const HfTensors w(spec, hf);
  const auto T = static_cast<std::int64_t>(tokens.size());
  const std::int64_t H = c.hidden_size, d = c.head_dim, nq = c.num_heads, nkv = c.num_kv_heads;
  const auto uz = [](std::int64_t n) { return static_cast<std::size_t>(n); };
  const bool off = fc.offset_norms;
  const double eps = c.rms_norm_eps;

  REFIT_ASSIGN_OR_RETURN(const WeightView embed, w.get(ix.embed, "embed_tokens", -1));
  std::vector<float> x(uz(T * H));
  const auto escale = static_cast<float>(fc.embed_scale);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < H; ++j)
      x[uz(t * H + j)] =
          fc.embed_scale == 1.0 ? embed.at(tokens[uz(t)], j) : embed.at(tokens[uz(t)], j) * escale;

  std::vector<std::int64_t> kv_of_head(uz(nq));
  for (std::int64_t h = 0; h < nq; ++h) kv_of_head[uz(h)] = h / (nq / nkv);

  std::vector<float> h_norm(uz(T * H)), q(uz(T * nq * d)), k(uz(T * nkv * d)), v(uz(T * nkv * d));
  std::vector<float> attn(uz(T * nq * d)), delta(uz(T * H));
  for (std::int64_t layer = 0; layer < c.num_layers; ++layer) {
    const HfLayer& L = ix.layers[uz(layer)];
    REFIT_ASSIGN_OR_RETURN(const WeightView in_norm, w.get(L.input_norm, "input_layernorm", layer));
    if (c.mla) {
      fwd::rms_norm(x.data(), H, T, H, in_norm, eps, h_norm.data(), H, off);
      REFIT_RETURN_IF_ERROR(mla_reference(c, fc, w, L, layer, h_norm.data(), T, delta.data()));
    } else {
      WeightView wq, wk, wv;
      if (c.fused_in_checkpoint) {  // Phi-3: [q; k; v] rows of one tensor
        REFIT_ASSIGN_OR_RETURN(const WeightView wqkv, w.get(L.qkv, "qkv_proj", layer));
        wq = wqkv.row_block(0, nq * d);
        wk = wqkv.row_block(nq * d, nkv * d);
        wv = wqkv.row_block(nq * d + nkv * d, nkv * d);
      } else {
        REFIT_ASSIGN_OR_RETURN(wq, w.get(L.q, "q_proj", layer));
        REFIT_ASSIGN_OR_RETURN(wk, w.get(L.k, "k_proj", layer));
        REFIT_ASSIGN_OR_RETURN(wv, w.get(L.v, "v_proj", layer));
      }
      REFIT_ASSIGN_OR_RETURN(const WeightView wo, w.get(L.o, "o_proj", layer));
      WeightView q_norm, k_norm;
      if (c.qk_norm) {
        REFIT_ASSIGN_OR_RETURN(q_norm, w.get(L.q_norm, "q_norm", layer));
        REFIT_ASSIGN_OR_RETURN(k_norm, w.get(L.k_norm, "k_norm", layer));
      }
      const fwd::Rope rope = fwd::layer_rope(fc, layer);

      fwd::rms_norm(x.data(), H, T, H, in_norm, eps, h_norm.data(), H, off);
      fwd::linear(h_norm.data(), T, wq, w.optional(L.q_bias), q.data());
      fwd::linear(h_norm.data(), T, wk, w.optional(L.k_bias), k.data());
      fwd::linear(h_norm.data(), T, wv, w.optional(L.v_bias), v.data());
      fwd::prepare_heads(q.data(), nq * d, T, nq, d, q_norm, eps, rope, off);
      fwd::prepare_heads(k.data(), nkv * d, T, nkv, d, k_norm, eps, rope, off);
      fwd::causal_attention(q.data(), nq * d, k.data(), v.data(), nkv * d, T, nq, d, kv_of_head,
                            fwd::layer_attention(fc, c, layer), attn.data());
      fwd::linear(attn.data(), T, wo, {}, delta.data());
    }

    REFIT_ASSIGN_OR_RETURN(const WeightView post_norm,
                           w.get(L.post_attn_norm, "post_attention_layernorm", layer));
    if (fc.sandwich_norms) {  // Gemma: the attention output is normalized, then added
      REFIT_ASSIGN_OR_RETURN(const WeightView pre_ffn,
                             w.get(L.pre_ffn_norm, "pre_feedforward_layernorm", layer));
      fwd::rms_norm(delta.data(), H, T, H, post_norm, eps, delta.data(), H, off);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] += delta[i];
      fwd::rms_norm(x.data(), H, T, H, pre_ffn, eps, h_norm.data(), H, off);
    } else {
      for (std::size_t i = 0; i < x.size(); ++i) x[i] += delta[i];
      fwd::rms_norm(x.data(), H, T, H, post_norm, eps, h_norm.data(), H, off);
    }
    if (c.is_moe_layer(layer) && fc.sigmoid_router) {
      REFIT_RETURN_IF_ERROR(
          deepseek_moe_reference(c, fc, w, L, layer, h_norm.data(), T, delta.data()));
    } else if (c.is_moe_layer(layer)) {
      const std::int64_t E = c.num_experts, I = c.moe_intermediate_size;
      REFIT_ASSIGN_OR_RETURN(const WeightView router, w.get(L.router, "mlp.gate (router)", layer));
      if (static_cast<std::int64_t>(L.expert_gate.size()) != E ||
          static_cast<std::int64_t>(L.expert_up.size()) != E ||
          static_cast<std::int64_t>(L.expert_down.size()) != E)
        return Status::InvalidArgument(
            fmt::format("{}: layer {} does not list all {} experts", kWho, layer, E));
      std::vector<float> router_logits(uz(T * E)), gate(uz(I)), up(uz(I)), out(uz(H));
      fwd::linear(h_norm.data(), T, router, {}, router_logits.data());
      std::fill(delta.begin(), delta.end(), 0.0f);
      for (std::int64_t t = 0; t < T; ++t) {
        const float* ht = h_norm.data() + t * H;
        for (const auto& [e, weight] : fwd::route_token(router_logits.data() + t * E, E,
                                                        c.num_experts_per_tok, c.norm_topk_prob)) {
          const char* name = "expert";
          REFIT_ASSIGN_OR_RETURN(const WeightView wg, w.get(L.expert_gate[uz(e)], name, layer));
          REFIT_ASSIGN_OR_RETURN(const WeightView wu, w.get(L.expert_up[uz(e)], name, layer));
          REFIT_ASSIGN_OR_RETURN(const WeightView wd, w.get(L.expert_down[uz(e)], name, layer));
          fwd::linear(ht, 1, wg, {}, gate.data());
          fwd::linear(ht, 1, wu, {}, up.data());
          fwd::gated(gate.data(), up.data(), I, fc.activation);
          fwd::linear(gate.data(), 1, wd, {}, out.data());
          for (std::int64_t j = 0; j < H; ++j) delta[uz(t * H + j)] += weight * out[uz(j)];
        }
      }
      if (c.shared_expert_intermediate_size > 0) {  // Qwen2-MoE: sigmoid(gate . h) * shared MLP
        const std::int64_t S = c.shared_expert_intermediate_size;
        REFIT_ASSIGN_OR_RETURN(const WeightView sg,
                               w.get(L.shared_gate, "shared_expert.gate_proj", layer));
        REFIT_ASSIGN_OR_RETURN(const WeightView su,
                               w.get(L.shared_up, "shared_expert.up_proj", layer));
        REFIT_ASSIGN_OR_RETURN(const WeightView sd,
                               w.get(L.shared_down, "shared_expert.down_proj", layer));
        REFIT_ASSIGN_OR_RETURN(const WeightView sgate,
                               w.get(L.shared_expert_gate, "shared_expert_gate", layer));
        std::vector<float> g(uz(T * S)), u(uz(T * S)), shared(uz(T * H)), scale(uz(T));
        fwd::linear(h_norm.data(), T, sg, {}, g.data());
        fwd::linear(h_norm.data(), T, su, {}, u.data());
        fwd::gated(g.data(), u.data(), T * S, fc.activation);
        fwd::linear(g.data(), T, sd, {}, shared.data());
        fwd::linear(h_norm.data(), T, sgate, {}, scale.data());
        for (std::int64_t t = 0; t < T; ++t)
          for (std::int64_t j = 0; j < H; ++j)
            delta[uz(t * H + j)] += fwd::sigmoid(scale[uz(t)]) * shared[uz(t * H + j)];
      }
    } else {
      const std::int64_t I = c.intermediate_size;
      WeightView wg, wu;
      if (c.fused_in_checkpoint) {  // Phi-3: [gate; up] rows of one tensor
        REFIT_ASSIGN_OR_RETURN(const WeightView wgu, w.get(L.gate_up, "gate_up_proj", layer));
        wg = wgu.row_block(0, I);
        wu = wgu.row_block(I, I);
      } else {
        REFIT_ASSIGN_OR_RETURN(wg, w.get(L.gate, "gate_proj", layer));
        REFIT_ASSIGN_OR_RETURN(wu, w.get(L.up, "up_proj", layer));
      }
      REFIT_ASSIGN_OR_RETURN(const WeightView wd, w.get(L.down, "down_proj", layer));
      std::vector<float> gate(uz(T * I)), up(uz(T * I));
      fwd::linear(h_norm.data(), T, wg, {}, gate.data());
      fwd::linear(h_norm.data(), T, wu, {}, up.data());
      fwd::gated(gate.data(), up.data(), T * I, fc.activation);
      fwd::linear(gate.data(), T, wd, {}, delta.data());
    }
    if (fc.sandwich_norms) {
      REFIT_ASSIGN_OR_RETURN(const WeightView post_ffn,
                             w.get(L.post_ffn_norm, "post_feedforward_layernorm", layer));
      fwd::rms_norm(delta.data(), H, T, H, post_ffn, eps, delta.data(), H, off);
    }
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += delta[i];
  }

  REFIT_ASSIGN_OR_RETURN(const WeightView final_norm, w.get(ix.final_norm, "model.norm", -1));
  fwd::rms_norm(x.data(), H, T, H, final_norm, eps, h_norm.data(), H, off);
  WeightView head = embed;
  if (!c.tie_word_embeddings) {
    REFIT_ASSIGN_OR_RETURN(head, w.get(ix.lm_head, "lm_head", -1));
  }
  std::vector<float> logits(uz(T * c.vocab_size));
  fwd::linear(h_norm.data(), T, head, {}, logits.data());
  for (float& l : logits) l = fwd::softcap(l, fc.final_softcap);
  return logits;
}

std::vector<std::int32_t> logit_check_tokens(const ModelSpec& spec, int n) {
  std::vector<std::int32_t> tokens;
  const std::int64_t V = spec.config().vocab_size;
  if (n <= 0 || V <= 0) return tokens;
  tokens.reserve(static_cast<std::size_t>(n));
  // Last id, first id, then a golden-ratio stride through the vocabulary: distinct ids in
  // every vocabulary-parallel shard for any realistic TP size.
  constexpr std::uint64_t kStride = 0x9E3779B97F4A7C15ull;
  for (int i = 0; i < n; ++i) {
    std::int64_t id;
    if (i == 0)
      id = V - 1;
    else if (i == 1)
      id = 0;
    else
      id = static_cast<std::int64_t>((static_cast<std::uint64_t>(i) * kStride >> 11) %
                                     static_cast<std::uint64_t>(V));
    tokens.push_back(static_cast<std::int32_t>(id));
  }
  return tokens;
}

double logit_error(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return std::nan("");
  double max_want = 0.0, worst = 0.0;
  for (float w : want) max_want = std::max(max_want, std::fabs(static_cast<double>(w)));
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double diff = std::fabs(static_cast<double>(got[i]) - want[i]);
    worst = std::max(worst, std::isfinite(diff) ? diff : HUGE_VAL);
  }
  return worst / (max_want + 1e-6);
}

Status compare_logits(const std::vector<float>& got, const std::vector<float>& want,
                      std::int64_t vocab, double rel_tol) {
  if (vocab <= 0 || got.size() != want.size() || want.size() % static_cast<std::size_t>(vocab) != 0)
    return Status::InvalidArgument(
        fmt::format("logit check: got {} logits, want {}; both must be [T, vocab = {}]", got.size(),
                    want.size(), vocab));
  double max_want = 0.0;
  for (float w : want) max_want = std::max(max_want, std::fabs(static_cast<double>(w)));
  const double scale = max_want + 1e-6;
  double worst = -1.0;
  std::size_t worst_at = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double diff = std::fabs(static_cast<double>(got[i]) - want[i]);
    // A NaN difference compares false everywhere; count it as infinitely wrong.
    const double err = std::isfinite(diff) ? diff : HUGE_VAL;
    if (err > worst) {
      worst = err;
      worst_at = i;
    }
  }
  if (got.empty() || worst / scale <= rel_tol) return Status::Ok();
  const auto v = static_cast<std::size_t>(vocab);
  return Status::Corruption(fmt::format(
      "logit check: position {} vocab index {}: got {}, want {}; error {:.3g} relative to "
      "max|want| = {:.4g} exceeds the tolerance {:.3g}",
      worst_at / v, worst_at % v, got[worst_at], want[worst_at], worst / scale, max_want, rel_tol));
}

}  // namespace refit
