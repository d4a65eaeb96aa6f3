// Engine TP layout (docs/design.md §6.4): vLLM / SGLang parameter names and shapes of one TP rank, each
// parameter described as Pieces of the full HF tensors.
#include <fmt/format.h>
#include <algorithm>
#include <tuple>

#include "engine/engine_layout.h"

namespace refit {
namespace {

constexpr std::uint32_t kNone = ~0u;

// HF tensor indices of one decoder layer, gathered in one pass over the spec.
struct LayerTensors {
  std::uint32_t q = kNone, k = kNone, v = kNone;
  std::uint32_t q_bias = kNone, k_bias = kNone, v_bias = kNone;
  std::uint32_t o = kNone, q_norm = kNone, k_norm = kNone;
  std::uint32_t gate = kNone, up = kNone, down = kNone, router = kNone;
  std::vector<std::uint32_t> expert_gate, expert_up, expert_down;  // by expert index
  std::uint32_t input_norm = kNone, post_attn_norm = kNone;
  std::uint32_t pre_ffn_norm = kNone, post_ffn_norm = kNone;  // Gemma
  std::uint32_t qkv = kNone, gate_up = kNone;                 // fused in the checkpoint (Phi-3)
  std::uint32_t shared_gate = kNone, shared_up = kNone, shared_down = kNone;  // Qwen2-MoE
  std::uint32_t shared_expert_gate = kNone;
  std::uint32_t router_bias = kNone;                         // DeepSeek-V3, GLM-4.5
  std::uint32_t q_a = kNone, q_a_norm = kNone, q_b = kNone;  // MLA
  std::uint32_t kv_a = kNone, kv_a_norm = kNone, kv_b = kNone;
};

struct SpecIndex {
  std::uint32_t embed = kNone, final_norm = kNone, lm_head = kNone;
  std::vector<LayerTensors> layers;
};

Result<SpecIndex> index_spec(const ModelSpec& spec) {
  const ModelConfig& c = spec.config();
  SpecIndex ix;
  ix.layers.resize(static_cast<std::size_t>(c.num_layers));
  const auto& ts = spec.tensors();
  for (std::uint32_t i = 0; i < ts.size(); ++i) {
    const TensorSpec& t = ts[i];
    LayerTensors* L = nullptr;
    if (t.layer >= 0) {
      if (t.layer >= c.num_layers)
        return Status::Internal(fmt::format("engine layout: tensor {} has layer {} >= {}", t.name,
                                            t.layer, c.num_layers));
      L = &ix.layers[static_cast<std::size_t>(t.layer)];
    }
    auto expert_slot = [&](std::vector<std::uint32_t>& v) -> Status {
      if (t.expert < 0 || t.expert >= c.num_experts)
        return Status::Internal(
            fmt::format("engine layout: tensor {} has expert {} outside [0, {})", t.name, t.expert,
                        c.num_experts));
      v.resize(static_cast<std::size_t>(c.num_experts), kNone);
      v[static_cast<std::size_t>(t.expert)] = i;
      return Status::Ok();
    };
    switch (t.role) {
      case ParamRole::kEmbedding:
        ix.embed = i;
        break;
      case ParamRole::kLmHead:
        ix.lm_head = i;
        break;
      case ParamRole::kFinalNorm:
        ix.final_norm = i;
        break;
      case ParamRole::kInputNorm:
        L->input_norm = i;
        break;
      case ParamRole::kPostAttnNorm:
        L->post_attn_norm = i;
        break;
      case ParamRole::kQProj:
        L->q = i;
        break;
      case ParamRole::kKProj:
        L->k = i;
        break;
      case ParamRole::kVProj:
        L->v = i;
        break;
      case ParamRole::kQBias:
        L->q_bias = i;
        break;
      case ParamRole::kKBias:
        L->k_bias = i;
        break;
      case ParamRole::kVBias:
        L->v_bias = i;
        break;
      case ParamRole::kOProj:
        L->o = i;
        break;
      case ParamRole::kQNorm:
        L->q_norm = i;
        break;
      case ParamRole::kKNorm:
        L->k_norm = i;
        break;
      case ParamRole::kGateProj:
        L->gate = i;
        break;
      case ParamRole::kUpProj:
        L->up = i;
        break;
      case ParamRole::kDownProj:
        L->down = i;
        break;
      case ParamRole::kRouter:
        L->router = i;
        break;
      case ParamRole::kExpertGate:
        REFIT_RETURN_IF_ERROR(expert_slot(L->expert_gate));
        break;
      case ParamRole::kExpertUp:
        REFIT_RETURN_IF_ERROR(expert_slot(L->expert_up));
        break;
      case ParamRole::kExpertDown:
        REFIT_RETURN_IF_ERROR(expert_slot(L->expert_down));
        break;
      case ParamRole::kPreFfnNorm:
        L->pre_ffn_norm = i;
        break;
      case ParamRole::kPostFfnNorm:
        L->post_ffn_norm = i;
        break;
      case ParamRole::kQkvProj:
        L->qkv = i;
        break;
      case ParamRole::kGateUpProj:
        L->gate_up = i;
        break;
      case ParamRole::kSharedGate:
        L->shared_gate = i;
        break;
      case ParamRole::kSharedUp:
        L->shared_up = i;
        break;
      case ParamRole::kSharedDown:
        L->shared_down = i;
        break;
      case ParamRole::kSharedExpertGate:
        L->shared_expert_gate = i;
        break;
      case ParamRole::kRouterBias:
        L->router_bias = i;
        break;
      case ParamRole::kQAProj:
        L->q_a = i;
        break;
      case ParamRole::kQALayerNorm:
        L->q_a_norm = i;
        break;
      case ParamRole::kQBProj:
        L->q_b = i;
        break;
      case ParamRole::kKvAProj:
        L->kv_a = i;
        break;
      case ParamRole::kKvALayerNorm:
        L->kv_a_norm = i;
        break;
      case ParamRole::kKvBProj:
        L->kv_b = i;
        break;
      case ParamRole::kOther:
        return Status::Internal(
            fmt::format("engine layout: tensor {} has no role for the fused layout", t.name));
    }
  }
  return ix;
}

// Appends parameters and their pieces (the caller indexes them by tensor when done).
class Builder {
 public:
  // `matrix`: every tensor's matrix view when the caller has them (WireModel::matrix), or null.
  Builder(const ModelSpec& spec, EngineShardLayout& out,
          const std::vector<MatrixShape>* matrix = nullptr)
      : spec_(spec), out_(out), matrix_(matrix) {}

  // Starts a new parameter, of `pieces` pieces when known; pieces added next belong to it.
  void param(std::string name, std::vector<std::int64_t> shape, std::size_t pieces = 1) {
    dst_ = matrix_shape(shape);
    out_.params.push_back(EngineParam{std::move(name), std::move(shape), {}});
    out_.params.back().pieces.reserve(pieces);
  }

  // HF block [src_row, +rows) x [src_col, +cols) of tensor `hf` (matrix view) to (dst_row,
  // dst_col) of the current parameter. Empty blocks are dropped.
  Status piece(std::uint32_t hf, std::int64_t src_row, std::int64_t src_col, std::int64_t rows,
               std::int64_t cols, std::int64_t dst_row, std::int64_t dst_col) {
    EngineParam& p = out_.params.back();
    if (hf == kNone)
      return Status::Internal(
          fmt::format("engine layout: {} reads an HF tensor the spec lacks", p.name));
    if (rows <= 0 || cols <= 0) return Status::Ok();
    const MatrixShape src = matrix_ ? (*matrix_)[hf] : matrix_shape(spec_.tensors()[hf].shape);
    const MatrixShape dst = dst_;
    if (src_row < 0 || src_col < 0 || src_row + rows > src.rows || src_col + cols > src.cols ||
        dst_row < 0 || dst_col < 0 || dst_row + rows > dst.rows || dst_col + cols > dst.cols)
      return Status::Internal(fmt::format(
          "engine layout: piece of {} [{}+{}, {}+{}] -> {} [{}+{}, {}+{}] out of bounds",
          spec_.tensors()[hf].name, src_row, rows, src_col, cols, p.name, dst_row, rows, dst_col,
          cols));
    p.pieces.push_back(Piece{hf, src_row, src_col, rows, cols, dst_row, dst_col});
    return Status::Ok();
  }

  // The whole HF tensor, unsharded.
  Status replicated(std::string name, std::uint32_t hf) {
    if (hf == kNone)
      return Status::Internal(fmt::format("engine layout: no HF tensor for {}", name));
    param(std::move(name), spec_.tensors()[hf].shape);
    const MatrixShape m = matrix_shape(spec_.tensors()[hf].shape);
    return piece(hf, 0, 0, m.rows, m.cols, 0, 0);
  }

 private:
  const ModelSpec& spec_;
  EngineShardLayout& out_;
  const std::vector<MatrixShape>* matrix_;
  MatrixShape dst_;  // of the current parameter
};

// Grouped-query attention of one layer on TP rank r of t (vLLM's and SGLang's QKVParallelLinear,
// RowParallelLinear): q heads split; kv heads split when t <= nkv, else replicated with rank r
// holding kv head r*nkv/t.
Status gqa_attention(Builder& b, const ModelConfig& c, const LayerTensors& L, const std::string& p,
                     std::int64_t t, std::int64_t r) {
  const std::int64_t H = c.hidden_size, d = c.head_dim;
  const std::int64_t q_rows = c.num_heads / t * d;
  const std::int64_t kv_heads_local = t <= c.num_kv_heads ? c.num_kv_heads / t : 1;
  const std::int64_t kv_rows = kv_heads_local * d;
  const std::int64_t kv_row0 = r * c.num_kv_heads / t * d;
  const std::int64_t qkv_rows = q_rows + 2 * kv_rows;
  b.param(p + "self_attn.qkv_proj.weight", {qkv_rows, H});
  if (c.fused_in_checkpoint) {  // Phi-3: q, k and v are row ranges of one HF tensor
    const std::int64_t k0 = c.num_heads * d, v0 = k0 + c.num_kv_heads * d;
    REFIT_RETURN_IF_ERROR(b.piece(L.qkv, r * q_rows, 0, q_rows, H, 0, 0));
    REFIT_RETURN_IF_ERROR(b.piece(L.qkv, k0 + kv_row0, 0, kv_rows, H, q_rows, 0));
    REFIT_RETURN_IF_ERROR(b.piece(L.qkv, v0 + kv_row0, 0, kv_rows, H, q_rows + kv_rows, 0));
  } else {
    REFIT_RETURN_IF_ERROR(b.piece(L.q, r * q_rows, 0, q_rows, H, 0, 0));
    REFIT_RETURN_IF_ERROR(b.piece(L.k, kv_row0, 0, kv_rows, H, q_rows, 0));
    REFIT_RETURN_IF_ERROR(b.piece(L.v, kv_row0, 0, kv_rows, H, q_rows + kv_rows, 0));
  }
  if (c.attention_bias) {  // 1-D: matrix view [1, n], so row ranges become column ranges
    b.param(p + "self_attn.qkv_proj.bias", {qkv_rows});
    REFIT_RETURN_IF_ERROR(b.piece(L.q_bias, 0, r * q_rows, 1, q_rows, 0, 0));
    REFIT_RETURN_IF_ERROR(b.piece(L.k_bias, 0, kv_row0, 1, kv_rows, 0, q_rows));
    REFIT_RETURN_IF_ERROR(b.piece(L.v_bias, 0, kv_row0, 1, kv_rows, 0, q_rows + kv_rows));
  }
  const std::int64_t o_cols = c.num_heads * d / t;
  b.param(p + "self_attn.o_proj.weight", {H, o_cols});
  REFIT_RETURN_IF_ERROR(b.piece(L.o, 0, r * o_cols, H, o_cols, 0, 0));
  if (c.qk_norm) {
    REFIT_RETURN_IF_ERROR(b.replicated(p + "self_attn.q_norm.weight", L.q_norm));
    REFIT_RETURN_IF_ERROR(b.replicated(p + "self_attn.k_norm.weight", L.k_norm));
  }
  return Status::Ok();
}

// Multi-head latent attention of one layer on TP rank r of t (vLLM's DeepseekV2MLAAttention and
// SGLang's DeepseekV2AttentionMLA, both in models/deepseek_v2.py):
//  - q_lora_rank set: q_a_proj and kv_a_proj_with_mqa in one replicated parameter, [q_a rows;
//    kv_a rows] (vLLM: fused_qkv_a_proj, a MergedColumnParallelLinear with disable_tp; SGLang:
//    fused_qkv_a_proj_with_mqa, a ReplicatedLinear its loader fills with torch.cat), then
//    q_a_layernorm replicated and q_b_proj column-parallel (the rank's heads);
//  - q_lora_rank null: q_proj column-parallel and kv_a_proj_with_mqa replicated;
//  - kv_a_layernorm replicated, kv_b_proj column-parallel (the rank's heads, nope + v rows each),
//    o_proj row-parallel (the rank's heads' v columns).
Status mla_attention(Builder& b, const ModelConfig& c, const LayerTensors& L, const std::string& p,
                     std::int64_t t, std::int64_t r, EngineProtocol protocol) {
  const std::int64_t H = c.hidden_size, heads = c.num_heads / t;
  const std::int64_t qk_head = c.qk_nope_head_dim + c.qk_rope_head_dim;
  const std::int64_t kv_a_rows = c.kv_lora_rank + c.qk_rope_head_dim;
  if (c.q_lora_rank > 0) {
    const char* fused = protocol == EngineProtocol::kSglang
                            ? "self_attn.fused_qkv_a_proj_with_mqa.weight"
                            : "self_attn.fused_qkv_a_proj.weight";
    b.param(p + fused, {c.q_lora_rank + kv_a_rows, H});
    REFIT_RETURN_IF_ERROR(b.piece(L.q_a, 0, 0, c.q_lora_rank, H, 0, 0));
    REFIT_RETURN_IF_ERROR(b.piece(L.kv_a, 0, 0, kv_a_rows, H, c.q_lora_rank, 0));
    REFIT_RETURN_IF_ERROR(b.replicated(p + "self_attn.q_a_layernorm.weight", L.q_a_norm));
    b.param(p + "self_attn.q_b_proj.weight", {heads * qk_head, c.q_lora_rank});
    REFIT_RETURN_IF_ERROR(
        b.piece(L.q_b, r * heads * qk_head, 0, heads * qk_head, c.q_lora_rank, 0, 0));
  } else {
    REFIT_RETURN_IF_ERROR(b.replicated(p + "self_attn.kv_a_proj_with_mqa.weight", L.kv_a));
    b.param(p + "self_attn.q_proj.weight", {heads * qk_head, H});
    REFIT_RETURN_IF_ERROR(b.piece(L.q, r * heads * qk_head, 0, heads * qk_head, H, 0, 0));
  }
  REFIT_RETURN_IF_ERROR(b.replicated(p + "self_attn.kv_a_layernorm.weight", L.kv_a_norm));
  const std::int64_t kv_b_rows = heads * (c.qk_nope_head_dim + c.v_head_dim);
  b.param(p + "self_attn.kv_b_proj.weight", {kv_b_rows, c.kv_lora_rank});
  REFIT_RETURN_IF_ERROR(b.piece(L.kv_b, r * kv_b_rows, 0, kv_b_rows, c.kv_lora_rank, 0, 0));
  const std::int64_t o_cols = heads * c.v_head_dim;
  b.param(p + "self_attn.o_proj.weight", {H, o_cols});
  return b.piece(L.o, 0, r * o_cols, H, o_cols, 0, 0);
}

}  // namespace

std::int64_t EngineParam::numel() const { return matrix_shape(shape).numel(); }

std::int64_t EngineShardLayout::total_bytes() const {
  std::int64_t total = 0;
  for (const EngineParam& p : params) total += p.bytes();
  return total;
}

std::int64_t EngineShardLayout::total_numel() const {
  std::int64_t total = 0;
  for (const auto& p : params) {
    std::int64_t n = 1;
    for (auto d : p.shape) n *= d;
    total += n;
  }
  return total;
}

namespace {

// engine_layout without its pieces_by_hf; `matrix`: every tensor's matrix view, or null.
Result<EngineShardLayout> engine_params(const ModelSpec& spec, int tp_size, int tp_rank,
                                        EngineLayout layout, EngineProtocol protocol,
                                        const std::vector<MatrixShape>* matrix = nullptr) {
  if (tp_rank < 0 || tp_rank >= tp_size)
    return Status::InvalidArgument(
        fmt::format("engine layout: tp rank {} outside [0, {})", tp_rank, tp_size));
  if (layout == EngineLayout::kHf) {
    EngineShardLayout out;
    out.tp_size = tp_size;
    out.tp_rank = tp_rank;
    out.params.reserve(spec.tensors().size());
    Builder b(spec, out, matrix);
    for (std::uint32_t i = 0; i < spec.tensors().size(); ++i)
      REFIT_RETURN_IF_ERROR(b.replicated(spec.tensors()[i].name, i));
    return out;
  }
  if (!spec.known_architecture())
    return Status::Unsupported(fmt::format(
        "generation.layout: fused needs an architecture refit knows; {} is {}; use "
        "generation.layout: hf",
        spec.source(), spec.config().architecture));
  REFIT_RETURN_IF_ERROR(check_engine_tp(spec, tp_size));
  const ModelConfig& c = spec.config();
  const std::int64_t t = tp_size, r = tp_rank;
  const std::int64_t H = c.hidden_size;
  const std::int64_t padded_vocab =
      (c.vocab_size + kEngineVocabPadding - 1) / kEngineVocabPadding * kEngineVocabPadding;
  if (padded_vocab % t != 0)
    return Status::InvalidArgument(
        fmt::format("generation.tp_size: {} does not divide the padded vocabulary {} (vocab_size "
                    "{} rounded up to a multiple of {})",
                    tp_size, padded_vocab, c.vocab_size, kEngineVocabPadding));
  REFIT_ASSIGN_OR_RETURN(const SpecIndex ix, index_spec(spec));

  EngineShardLayout out;
  out.tp_size = tp_size;
  out.tp_rank = tp_rank;
  out.params.reserve(static_cast<std::size_t>(c.num_layers) * 10 + 3);
  Builder b(spec, out, matrix);

  // Vocabulary-parallel: rank r holds rows [r*Vp/t, (r+1)*Vp/t) of the padded table.
  auto vocab_parallel = [&](std::string name, std::uint32_t hf) -> Status {
    const std::int64_t per_rank = padded_vocab / t, lo = r * per_rank;
    const std::int64_t real = std::max<std::int64_t>(0, std::min(lo + per_rank, c.vocab_size) - lo);
    b.param(std::move(name), {per_rank, H});
    return b.piece(hf, lo, 0, real, H, 0, 0);
  };

  // SGLang's Gemma 3 embeds with a plain nn.Embedding: the whole table on every rank, unpadded
  // (sgl-project/sglang: python/sglang/srt/models/gemma3_causal.py). vLLM's is vocab-parallel.
  if (c.arch == Architecture::kGemma3 && protocol == EngineProtocol::kSglang)
    REFIT_RETURN_IF_ERROR(b.replicated("model.embed_tokens.weight", ix.embed));
  else
    REFIT_RETURN_IF_ERROR(vocab_parallel("model.embed_tokens.weight", ix.embed));
  for (std::int64_t i = 0; i < c.num_layers; ++i) {
    const LayerTensors& L = ix.layers[static_cast<std::size_t>(i)];
    const std::string p = fmt::format("model.layers.{}.", i);

    if (c.mla) {
      REFIT_RETURN_IF_ERROR(mla_attention(b, c, L, p, t, r, protocol));
    } else {
      REFIT_RETURN_IF_ERROR(gqa_attention(b, c, L, p, t, r));
    }

    if (L.router != kNone) {
      const std::int64_t E = c.num_experts, I = c.moe_intermediate_size / t;
      if (static_cast<std::int64_t>(L.expert_gate.size()) != E ||
          static_cast<std::int64_t>(L.expert_up.size()) != E ||
          static_cast<std::int64_t>(L.expert_down.size()) != E)
        return Status::Internal(
            fmt::format("engine layout: layer {} does not list all {} experts", i, E));
      REFIT_RETURN_IF_ERROR(b.replicated(p + "mlp.gate.weight", L.router));
      // DeepSeek-V3 / GLM-4.5: the router's correction bias, a float32 parameter of the gate
      // module in both engines (vLLM: GateLinear / nn.Linear e_score_correction_bias; SGLang:
      // MoEGate / Glm4MoeGate).
      if (c.router_bias)
        REFIT_RETURN_IF_ERROR(b.replicated(p + "mlp.gate.e_score_correction_bias", L.router_bias));
      b.param(p + "mlp.experts.w13_weight", {E, 2 * I, H}, static_cast<std::size_t>(2 * E));
      for (std::int64_t e = 0; e < E; ++e) {
        const auto ue = static_cast<std::size_t>(e);
        REFIT_RETURN_IF_ERROR(b.piece(L.expert_gate[ue], r * I, 0, I, H, e * 2 * I, 0));
        REFIT_RETURN_IF_ERROR(b.piece(L.expert_up[ue], r * I, 0, I, H, e * 2 * I + I, 0));
      }
      b.param(p + "mlp.experts.w2_weight", {E, H, I}, static_cast<std::size_t>(E));
      for (std::int64_t e = 0; e < E; ++e)
        REFIT_RETURN_IF_ERROR(
            b.piece(L.expert_down[static_cast<std::size_t>(e)], 0, r * I, H, I, e * H, 0));
      if (c.n_shared_experts > 0) {
        // DeepSeek-V3 / GLM-4.5: every shared expert in one MergedColumnParallelLinear /
        // RowParallelLinear MLP, mlp.shared_experts (vLLM's and SGLang's DeepseekV2MLP /
        // Glm4MoeMLP with moe_intermediate_size * n_shared_experts).
        const std::int64_t S = c.shared_expert_intermediate_size / t;
        b.param(p + "mlp.shared_experts.gate_up_proj.weight", {2 * S, H});
        REFIT_RETURN_IF_ERROR(b.piece(L.shared_gate, r * S, 0, S, H, 0, 0));
        REFIT_RETURN_IF_ERROR(b.piece(L.shared_up, r * S, 0, S, H, S, 0));
        b.param(p + "mlp.shared_experts.down_proj.weight", {H, S});
        REFIT_RETURN_IF_ERROR(b.piece(L.shared_down, 0, r * S, H, S, 0, 0));
      } else if (c.shared_expert_intermediate_size > 0) {  // Qwen2-MoE: a gated shared expert
        const std::int64_t S = c.shared_expert_intermediate_size / t;
        b.param(p + "mlp.shared_expert.gate_up_proj.weight", {2 * S, H});
        REFIT_RETURN_IF_ERROR(b.piece(L.shared_gate, r * S, 0, S, H, 0, 0));
        REFIT_RETURN_IF_ERROR(b.piece(L.shared_up, r * S, 0, S, H, S, 0));
        b.param(p + "mlp.shared_expert.down_proj.weight", {H, S});
        REFIT_RETURN_IF_ERROR(b.piece(L.shared_down, 0, r * S, H, S, 0, 0));
        REFIT_RETURN_IF_ERROR(
            b.replicated(p + "mlp.shared_expert_gate.weight", L.shared_expert_gate));
      }
    } else if (c.fused_in_checkpoint) {  // Phi-3: gate and up are row ranges of one HF tensor
      const std::int64_t I = c.intermediate_size / t;
      b.param(p + "mlp.gate_up_proj.weight", {2 * I, H});
      REFIT_RETURN_IF_ERROR(b.piece(L.gate_up, r * I, 0, I, H, 0, 0));
      REFIT_RETURN_IF_ERROR(b.piece(L.gate_up, c.intermediate_size + r * I, 0, I, H, I, 0));
      b.param(p + "mlp.down_proj.weight", {H, I});
      REFIT_RETURN_IF_ERROR(b.piece(L.down, 0, r * I, H, I, 0, 0));
    } else {
      const std::int64_t I = c.intermediate_size / t;
      b.param(p + "mlp.gate_up_proj.weight", {2 * I, H});
      REFIT_RETURN_IF_ERROR(b.piece(L.gate, r * I, 0, I, H, 0, 0));
      REFIT_RETURN_IF_ERROR(b.piece(L.up, r * I, 0, I, H, I, 0));
      b.param(p + "mlp.down_proj.weight", {H, I});
      REFIT_RETURN_IF_ERROR(b.piece(L.down, 0, r * I, H, I, 0, 0));
    }
    REFIT_RETURN_IF_ERROR(b.replicated(p + "input_layernorm.weight", L.input_norm));
    REFIT_RETURN_IF_ERROR(b.replicated(p + "post_attention_layernorm.weight", L.post_attn_norm));
    if (c.feedforward_norms) {
      REFIT_RETURN_IF_ERROR(b.replicated(p + "pre_feedforward_layernorm.weight", L.pre_ffn_norm));
      REFIT_RETURN_IF_ERROR(
          b.replicated(p + "post_feedforward_layernorm.weight", L.post_ffn_norm));
    }
  }
  REFIT_RETURN_IF_ERROR(b.replicated("model.norm.weight", ix.final_norm));
  if (!c.tie_word_embeddings) REFIT_RETURN_IF_ERROR(vocab_parallel("lm_head.weight", ix.lm_head));
  return out;
}

// Indexes every piece of the layout's parameters under the tensor it reads.
void index_pieces(EngineShardLayout& out, std::size_t tensors) {
  out.pieces_by_hf.build(tensors, [&](auto&& add) {
    for (std::uint32_t i = 0; i < out.params.size(); ++i)
      for (std::uint32_t k = 0; k < out.params[i].pieces.size(); ++k)
        add(out.params[i].pieces[k].hf_tensor, PiecesByTensor::Entry(i, k));
  });
}

}  // namespace

Result<EngineShardLayout> engine_layout(const ModelSpec& spec, int tp_size, int tp_rank,
                                        EngineLayout layout, EngineProtocol protocol) {
  REFIT_ASSIGN_OR_RETURN(EngineShardLayout out,
                         engine_params(spec, tp_size, tp_rank, layout, protocol));
  index_pieces(out, spec.tensors().size());
  return out;
}

}  // namespace refit

namespace refit {
namespace {

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// The block scales of parameter `p` (2-D [n, C] or 3-D [E, n, C]): every piece of a weight
// becomes the piece of its scale tensor that covers the same blocks.
Result<EngineParam> block_scale_param(const EngineParam& p, const WireModel& wire,
                                      const std::string& where) {
  const Fp8Table& f = *wire.fp8;
  const std::int64_t br = f.block_rows, bc = f.block_cols;
  const std::size_t nd = p.shape.size();
  if (nd < 2)
    return Status::Internal(fmt::format("fp8: parameter {} is not a matrix", p.name));
  const std::int64_t n = p.shape[nd - 2], C = p.shape[nd - 1];
  EngineParam s{.name = fp8_scale_name(p.name, f.scheme), .shape = p.shape, .dtype = DType::kFloat32};
  s.shape[nd - 2] = ceil_div(n, br);
  s.shape[nd - 1] = ceil_div(C, bc);
  for (const Piece& pc : p.pieces) {
    const TensorSpec& t = wire.spec.tensors()[pc.hf_tensor];
    const MatrixShape m = matrix_shape(t.shape);
    const std::int64_t e = pc.dst_row / n, within = pc.dst_row % n;
    const bool rows_ok = pc.src_row % br == 0 && within % br == 0 &&
                         (pc.rows % br == 0 || (pc.src_row + pc.rows == m.rows && within + pc.rows == n));
    const bool cols_ok = pc.src_col % bc == 0 && pc.dst_col % bc == 0 &&
                         (pc.cols % bc == 0 || (pc.src_col + pc.cols == m.cols && pc.dst_col + pc.cols == C));
    if (!rows_ok || !cols_ok)
      return Status::InvalidArgument(fmt::format(
          "refit.fp8: {}: parameter {} takes rows [{}, {}) x cols [{}, {}) of {} [{}, {}] at "
          "row {}, col {} of its [{}, {}]; that cuts a {} x {} block, and every block has one "
          "scale; allowed: a generation.tp_size whose slices are whole blocks, or a "
          "refit.fp8.block that divides them",
          where, p.name, pc.src_row, pc.src_row + pc.rows, pc.src_col, pc.src_col + pc.cols,
          t.name, m.rows, m.cols, within, pc.dst_col, n, C, br, bc));
    s.pieces.push_back(Piece{.hf_tensor = static_cast<std::uint32_t>(f.scale_of[pc.hf_tensor]),
                             .src_row = pc.src_row / br,
                             .src_col = pc.src_col / bc,
                             .rows = ceil_div(pc.rows, br),
                             .cols = ceil_div(pc.cols, bc),
                             .dst_row = e * ceil_div(n, br) + within / br,
                             .dst_col = pc.dst_col / bc});
  }
  return s;
}

// Per-tensor scales of parameter `p`: one per HF tensor it holds, in the order they sit in it
// ([3] for qkv_proj, [2] for gate_up_proj, [1] otherwise; [E, 2] for w13 and [E] for w2), as
// vLLM's and SGLang's weight_scale parameters.
Result<EngineParam> tensor_scale_param(const EngineParam& p, const WireModel& wire) {
  const Fp8Table& f = *wire.fp8;
  std::vector<const Piece*> order;
  for (const Piece& pc : p.pieces) order.push_back(&pc);
  std::stable_sort(order.begin(), order.end(), [](const Piece* a, const Piece* b) {
    return std::tie(a->dst_row, a->dst_col) < std::tie(b->dst_row, b->dst_col);
  });
  std::vector<std::uint32_t> distinct;
  for (const Piece* pc : order)
    if (std::find(distinct.begin(), distinct.end(), pc->hf_tensor) == distinct.end())
      distinct.push_back(pc->hf_tensor);
  EngineParam s{.name = fp8_scale_name(p.name, f.scheme), .dtype = DType::kFloat32};
  const auto k = static_cast<std::int64_t>(distinct.size());
  if (p.shape.size() == 3) {
    const std::int64_t experts = p.shape[0];
    if (k % experts != 0)
      return Status::Internal(fmt::format("fp8: parameter {} holds {} tensors over {} experts",
                                          p.name, k, experts));
    s.shape = k / experts > 1 ? std::vector<std::int64_t>{experts, k / experts}
                              : std::vector<std::int64_t>{experts};
  } else {
    s.shape = {k};
  }
  const std::int64_t cols = matrix_shape(s.shape).cols;
  for (std::int64_t i = 0; i < k; ++i)
    s.pieces.push_back(Piece{.hf_tensor = static_cast<std::uint32_t>(
                                 f.scale_of[distinct[static_cast<std::size_t>(i)]]),
                             .rows = 1,
                             .cols = 1,
                             .dst_row = i / cols,
                             .dst_col = i % cols});
  return s;
}

}  // namespace

Result<EngineShardLayout> engine_wire_layout(const ModelSpec& model, const WireModel& wire,
                                             int tp_size, int tp_rank, EngineLayout layout,
                                             EngineProtocol protocol) {
  REFIT_ASSIGN_OR_RETURN(
      EngineShardLayout base,
      engine_params(model, tp_size, tp_rank, layout, protocol,
                    wire.matrix.size() == wire.spec.tensors().size() ? &wire.matrix : nullptr));
  const DType plain = wire.fp8 ? kFp8UnquantizedDType : wire.dtype.empty() ? DType::kBFloat16
                                                                             : wire.dtype.front();
  const std::string where = fmt::format("engine tp rank {} of {}", tp_rank, tp_size);
  EngineShardLayout out;
  out.tp_size = base.tp_size;
  out.tp_rank = base.tp_rank;
  out.params.reserve(base.params.size() * (wire.fp8 ? 2 : 1));
  for (EngineParam& p : base.params) {
    p.dtype = p.pieces.empty() ? plain : wire.dtype[p.pieces.front().hf_tensor];
    for (const Piece& pc : p.pieces)
      if (wire.dtype[pc.hf_tensor] != p.dtype)
        return Status::InvalidArgument(fmt::format(
            "refit.fp8: {}: parameter {} fuses {} ({}) and {} ({}); an engine layer is quantized "
            "as a whole; allowed: list all of its modules in the checkpoint's "
            "modules_to_not_convert, or none",
            where, p.name, wire.spec.tensors()[p.pieces.front().hf_tensor].name,
            dtype_name(p.dtype), wire.spec.tensors()[pc.hf_tensor].name,
            dtype_name(wire.dtype[pc.hf_tensor])));
    const bool quantized = wire.fp8 && p.dtype == DType::kFloat8E4M3;
    out.params.push_back(std::move(p));
    if (!quantized) continue;
    const EngineParam& w = out.params.back();
    REFIT_ASSIGN_OR_RETURN(EngineParam s, wire.fp8->scheme == Fp8Scheme::kBlock
                                              ? block_scale_param(w, wire, where)
                                              : tensor_scale_param(w, wire));
    out.params.push_back(std::move(s));
  }
  index_pieces(out, wire.spec.tensors().size());
  return out;
}

Result<EngineShardLayout> engine_wire_layout(const Config& config, const ModelSpec& model,
                                             const WireModel& wire, int tp_rank) {
  return engine_wire_layout(model, wire, config.generation.tp_size, tp_rank,
                            config.generation.layout, config.generation.backend);
}

}  // namespace refit
