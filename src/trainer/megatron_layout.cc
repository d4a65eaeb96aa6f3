// Megatron-Core GPT layout (docs/design.md §6.3; verified facts and sources in docs/megatron.md).
//
// Each local tensor is described by Pieces of the full HF tensors. Ownership follows one rule
// per kind of parameter so that the owned pieces of all ranks tile every HF tensor once:
//   - dense parameters split over TP: the rank with dp_rank == 0 owns its slice;
//   - parameters replicated over TP (norms, router): tp_rank == 0 and dp_rank == 0 own;
//   - experts: the expert-data-parallel replica with dp_rank == ep_rank (edp_rank 0) owns;
//   - the last stage's copy of tied embeddings (output_layer.weight): nobody (the first stage
//     owns the embedding).
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "trainer/trainer_layout.h"

namespace refit {
namespace {

// This rank's place in Megatron's default 'tp-cp-ep-dp-pp' order with cp = 1.
struct Coords {
  int tp = 1, pp = 1, dp = 1, ep = 1;
  int tp_rank = 0, dp_rank = 0, pp_rank = 0, ep_rank = 0;
};

// Index of an HF tensor by what it is rather than by its name.
class HfIndex {
 public:
  explicit HfIndex(const ModelSpec& spec) {
    const auto& ts = spec.tensors();
    for (std::size_t i = 0; i < ts.size(); ++i)
      index_[{static_cast<int>(ts[i].role), ts[i].layer, ts[i].expert}] =
          static_cast<std::uint32_t>(i);
  }
  Result<std::uint32_t> find(ParamRole role, std::int64_t layer = -1,
                             std::int64_t expert = -1) const {
    auto it = index_.find({static_cast<int>(role), layer, expert});
    if (it == index_.end())
      return Status::Internal(
          fmt::format("megatron layout: model spec has no tensor of role {} (layer {}, expert {})",
                      static_cast<int>(role), layer, expert));
    return it->second;
  }

 private:
  std::map<std::tuple<int, std::int64_t, std::int64_t>, std::uint32_t> index_;
};

// Appends local tensors and their pieces. Positions are given in dim-0 terms ("rows") of the
// HF and local tensors; for 1-D tensors those are columns of the [1, n] matrix view.
class Builder {
 public:
  Builder(const ModelSpec& spec, TrainerShardLayout& out) : spec_(spec), out_(out) {}

  std::size_t add(std::string name, std::vector<std::int64_t> shape) {
    out_.tensors.push_back(LocalTensor{std::move(name), std::move(shape), {}, {}});
    return out_.tensors.size() - 1;
  }

  // HF dim-0 range [hf_begin, hf_begin + n) to local dim-0 offset `dst`, all columns.
  void rows(std::size_t local, std::uint32_t hf, std::int64_t hf_begin, std::int64_t n,
            std::int64_t dst, bool owned) {
    if (n <= 0) return;
    const auto& shape = spec_.tensors()[hf].shape;
    const MatrixShape m = matrix_shape(shape);
    Piece p;
    p.hf_tensor = hf;
    if (shape.size() == 1) {
      p.src_row = 0, p.src_col = hf_begin, p.rows = 1, p.cols = n, p.dst_row = 0, p.dst_col = dst;
    } else {
      p.src_row = hf_begin, p.src_col = 0, p.rows = n, p.cols = m.cols, p.dst_row = dst;
      p.dst_col = 0;
    }
    push(local, p, owned);
  }

  // All rows, HF columns [col_begin, col_begin + n) to the local tensor (2-D only).
  void cols(std::size_t local, std::uint32_t hf, std::int64_t col_begin, std::int64_t n,
            bool owned) {
    Piece p;
    p.hf_tensor = hf;
    p.src_row = 0, p.src_col = col_begin;
    p.rows = matrix_shape(spec_.tensors()[hf].shape).rows, p.cols = n;
    push(local, p, owned);
  }

  void whole(std::size_t local, std::uint32_t hf, bool owned) {
    rows(local, hf, 0, spec_.tensors()[hf].rows(), 0, owned);
  }

 private:
  void push(std::size_t local, const Piece& p, bool owned) {
    auto& t = out_.tensors[local];
    if (owned) t.owned.push_back(static_cast<std::uint32_t>(t.pieces.size()));
    t.pieces.push_back(p);
  }

  const ModelSpec& spec_;
  TrainerShardLayout& out_;
};

Status invalid(std::string_view key, int value, std::string_view what) {
  return Status::InvalidArgument(fmt::format("{}: {} {}", key, value, what));
}

Result<Coords> check_parallel(const ModelSpec& spec, const MegatronParallel& par, int world_size,
                              int rank) {
  const ModelConfig& c = spec.config();
  const std::string model = spec.source().empty() ? std::string("the model") : spec.source();
  if (par.tp < 1) return invalid("policy.megatron.tp", par.tp, "must be >= 1");
  if (par.pp < 1) return invalid("policy.megatron.pp", par.pp, "must be >= 1");
  if (par.ep < 1) return invalid("policy.megatron.ep", par.ep, "must be >= 1");
  if (world_size < 1) return invalid("policy.world_size", world_size, "must be >= 1");
  if (rank < 0 || rank >= world_size)
    return Status::InvalidArgument(fmt::format(
        "megatron layout: trainer rank {} is outside policy.world_size {}", rank, world_size));
  if (world_size % (par.tp * par.pp) != 0)
    return invalid(
        "policy.world_size", world_size,
        fmt::format("is not a multiple of tp*pp = {}*{} (world_size = tp*pp*dp)", par.tp, par.pp));
  auto tp_must_divide = [&](std::int64_t n, std::string_view what) -> Status {
    if (n % par.tp == 0) return Status::Ok();
    return invalid(
        "policy.megatron.tp", par.tp,
        fmt::format("does not divide {} = {} of {}; choose a tp that divides it", what, n, model));
  };
  REFIT_RETURN_IF_ERROR(tp_must_divide(c.num_heads, "num_attention_heads"));
  REFIT_RETURN_IF_ERROR(tp_must_divide(c.num_kv_heads, "num_key_value_heads"));
  bool any_dense = false, any_moe = false;
  for (std::int64_t i = 0; i < c.num_layers; ++i) (c.is_moe_layer(i) ? any_moe : any_dense) = true;
  if (any_dense) REFIT_RETURN_IF_ERROR(tp_must_divide(c.intermediate_size, "intermediate_size"));
  if (any_moe)
    REFIT_RETURN_IF_ERROR(tp_must_divide(c.moe_intermediate_size, "moe_intermediate_size"));
  if (c.num_layers % par.pp != 0)
    return invalid("policy.megatron.pp", par.pp,
                   fmt::format("does not divide num_hidden_layers = {} of {}; stages hold equal "
                               "numbers of layers",
                               c.num_layers, model));
  const int dp = world_size / (par.tp * par.pp);
  if (par.ep > 1 && !any_moe)
    return invalid("policy.megatron.ep", par.ep,
                   fmt::format("needs a model with experts; {} is dense (use ep: 1)", model));
  if (any_moe && c.num_experts % par.ep != 0)
    return invalid("policy.megatron.ep", par.ep,
                   fmt::format("does not divide num_experts = {} of {}", c.num_experts, model));
  if (dp % par.ep != 0)
    return invalid("policy.megatron.ep", par.ep,
                   fmt::format("does not divide the data-parallel size {} (= policy.world_size {} "
                               "/ (tp {} * pp {})); experts are split over data-parallel ranks",
                               dp, world_size, par.tp, par.pp));
  Coords k;
  k.tp = par.tp, k.pp = par.pp, k.dp = dp, k.ep = par.ep;
  k.tp_rank = rank % par.tp;
  k.dp_rank = (rank / par.tp) % dp;
  k.pp_rank = rank / (par.tp * dp);
  k.ep_rank = k.dp_rank % par.ep;
  return k;
}

// Vocabulary-parallel rows of the embedding / output layer: the padded vocabulary (a multiple
// of 128 * tp) split evenly; rows past V are padding and get no piece.
void add_vocab_parallel(Builder& b, std::size_t local, std::uint32_t hf, std::int64_t vocab,
                        std::int64_t per_rank, const Coords& k, bool owned) {
  const std::int64_t begin = k.tp_rank * per_rank;
  const std::int64_t end = std::min(begin + per_rank, vocab);
  b.rows(local, hf, begin, end - begin, 0, owned);
}

}  // namespace

Result<TrainerShardLayout> megatron_layout(const ModelSpec& spec, const MegatronParallel& par,
                                           int world_size, int rank) {
  REFIT_ASSIGN_OR_RETURN(const Coords k, check_parallel(spec, par, world_size, rank));
  const ModelConfig& c = spec.config();
  const HfIndex hf(spec);
  TrainerShardLayout out;
  out.rank = rank;
  out.world_size = world_size;
  Builder b(spec, out);

  const std::int64_t H = c.hidden_size, d = c.head_dim;
  const std::int64_t vocab_multiple = 128 * static_cast<std::int64_t>(k.tp);
  const std::int64_t vocab_padded =
      (c.vocab_size + vocab_multiple - 1) / vocab_multiple * vocab_multiple;
  const std::int64_t vocab_per_rank = vocab_padded / k.tp;
  const bool first_stage = k.pp_rank == 0, last_stage = k.pp_rank == k.pp - 1;
  // Dense parameters: one data-parallel replica owns; TP-replicated ones only on tp_rank 0.
  const bool own_split = k.dp_rank == 0;
  const bool own_replicated = own_split && k.tp_rank == 0;
  const bool own_expert = k.dp_rank == k.ep_rank;

  if (first_stage) {
    REFIT_ASSIGN_OR_RETURN(const std::uint32_t emb, hf.find(ParamRole::kEmbedding));
    const auto t = b.add("embedding.word_embeddings.weight", {vocab_per_rank, H});
    add_vocab_parallel(b, t, emb, c.vocab_size, vocab_per_rank, k, own_split);
  }

  const std::int64_t layers_per_stage = c.num_layers / k.pp;
  const std::int64_t groups = c.num_kv_heads / k.tp;              // local query groups
  const std::int64_t q_per_group = c.num_heads / c.num_kv_heads;  // query heads per group
  const std::int64_t group_rows = (q_per_group + 2) * d;
  for (std::int64_t local = 0; local < layers_per_stage; ++local) {
    const std::int64_t layer = k.pp_rank * layers_per_stage + local;
    const std::string p = fmt::format("decoder.layers.{}.", local);
    auto role = [&](ParamRole r) { return hf.find(r, layer); };

    REFIT_ASSIGN_OR_RETURN(const std::uint32_t in_norm, role(ParamRole::kInputNorm));
    b.whole(b.add(p + "self_attention.linear_qkv.layer_norm_weight", {H}), in_norm, own_replicated);

    // Fused QKV (and its bias): per local query group [q heads of the group ; k ; v].
    auto add_qkv = [&](std::string name, ParamRole q, ParamRole kk, ParamRole v) -> Status {
      REFIT_ASSIGN_OR_RETURN(const std::uint32_t qi, role(q));
      REFIT_ASSIGN_OR_RETURN(const std::uint32_t ki, role(kk));
      REFIT_ASSIGN_OR_RETURN(const std::uint32_t vi, role(v));
      std::vector<std::int64_t> shape = {groups * group_rows};
      if (spec.tensors()[qi].shape.size() == 2) shape.push_back(H);
      const auto t = b.add(std::move(name), std::move(shape));
      for (std::int64_t g = 0; g < groups; ++g) {
        const std::int64_t global_group = k.tp_rank * groups + g;
        const std::int64_t base = g * group_rows;
        b.rows(t, qi, global_group * q_per_group * d, q_per_group * d, base, own_split);
        b.rows(t, ki, global_group * d, d, base + q_per_group * d, own_split);
        b.rows(t, vi, global_group * d, d, base + (q_per_group + 1) * d, own_split);
      }
      return Status::Ok();
    };
    REFIT_RETURN_IF_ERROR(add_qkv(p + "self_attention.linear_qkv.weight", ParamRole::kQProj,
                                  ParamRole::kKProj, ParamRole::kVProj));
    if (c.attention_bias)
      REFIT_RETURN_IF_ERROR(add_qkv(p + "self_attention.linear_qkv.bias", ParamRole::kQBias,
                                    ParamRole::kKBias, ParamRole::kVBias));
    if (c.qk_norm) {
      REFIT_ASSIGN_OR_RETURN(const std::uint32_t qn, role(ParamRole::kQNorm));
      REFIT_ASSIGN_OR_RETURN(const std::uint32_t kn, role(ParamRole::kKNorm));
      b.whole(b.add(p + "self_attention.q_layernorm.weight", {d}), qn, own_replicated);
      b.whole(b.add(p + "self_attention.k_layernorm.weight", {d}), kn, own_replicated);
    }
    {
      REFIT_ASSIGN_OR_RETURN(const std::uint32_t o, role(ParamRole::kOProj));
      const std::int64_t cols = c.num_heads * d / k.tp;
      b.cols(b.add(p + "self_attention.linear_proj.weight", {H, cols}), o, k.tp_rank * cols, cols,
             own_split);
    }

    REFIT_ASSIGN_OR_RETURN(const std::uint32_t post_norm, role(ParamRole::kPostAttnNorm));
    if (c.is_moe_layer(layer)) {
      b.whole(b.add(p + "pre_mlp_layernorm.weight", {H}), post_norm, own_replicated);
      REFIT_ASSIGN_OR_RETURN(const std::uint32_t router, role(ParamRole::kRouter));
      b.whole(b.add(p + "mlp.router.weight", {c.num_experts, H}), router, own_replicated);
      const std::int64_t local_experts = c.num_experts / k.ep;
      const std::int64_t im = c.moe_intermediate_size / k.tp;  // expert TP size = tp
      for (std::int64_t j = 0; j < local_experts; ++j) {
        const std::int64_t e = k.ep_rank * local_experts + j;
        const std::string q = fmt::format("{}mlp.experts.local_experts.{}.", p, j);
        REFIT_ASSIGN_OR_RETURN(const std::uint32_t gate, hf.find(ParamRole::kExpertGate, layer, e));
        REFIT_ASSIGN_OR_RETURN(const std::uint32_t up, hf.find(ParamRole::kExpertUp, layer, e));
        REFIT_ASSIGN_OR_RETURN(const std::uint32_t down, hf.find(ParamRole::kExpertDown, layer, e));
        const auto fc1 = b.add(q + "linear_fc1.weight", {2 * im, H});
        b.rows(fc1, gate, k.tp_rank * im, im, 0, own_expert);
        b.rows(fc1, up, k.tp_rank * im, im, im, own_expert);
        b.cols(b.add(q + "linear_fc2.weight", {H, im}), down, k.tp_rank * im, im, own_expert);
      }
    } else {
      b.whole(b.add(p + "mlp.linear_fc1.layer_norm_weight", {H}), post_norm, own_replicated);
      REFIT_ASSIGN_OR_RETURN(const std::uint32_t gate, role(ParamRole::kGateProj));
      REFIT_ASSIGN_OR_RETURN(const std::uint32_t up, role(ParamRole::kUpProj));
      REFIT_ASSIGN_OR_RETURN(const std::uint32_t down, role(ParamRole::kDownProj));
      const std::int64_t im = c.intermediate_size / k.tp;
      const auto fc1 = b.add(p + "mlp.linear_fc1.weight", {2 * im, H});
      b.rows(fc1, gate, k.tp_rank * im, im, 0, own_split);
      b.rows(fc1, up, k.tp_rank * im, im, im, own_split);
      b.cols(b.add(p + "mlp.linear_fc2.weight", {H, im}), down, k.tp_rank * im, im, own_split);
    }
  }

  if (last_stage) {
    REFIT_ASSIGN_OR_RETURN(const std::uint32_t norm, hf.find(ParamRole::kFinalNorm));
    b.whole(b.add("decoder.final_layernorm.weight", {H}), norm, own_replicated);
    if (!c.tie_word_embeddings) {
      REFIT_ASSIGN_OR_RETURN(const std::uint32_t head, hf.find(ParamRole::kLmHead));
      const auto t = b.add("output_layer.weight", {vocab_per_rank, H});
      add_vocab_parallel(b, t, head, c.vocab_size, vocab_per_rank, k, own_split);
    } else if (!first_stage) {
      // Tied embeddings with pp > 1: the last stage keeps its own copy of the word embeddings
      // as output_layer.weight; the first stage's embedding is the one that owns.
      REFIT_ASSIGN_OR_RETURN(const std::uint32_t emb, hf.find(ParamRole::kEmbedding));
      const auto t = b.add("output_layer.weight", {vocab_per_rank, H});
      add_vocab_parallel(b, t, emb, c.vocab_size, vocab_per_rank, k, /*owned=*/false);
    }
  }

  out.index_owned(spec.tensors().size());
  return out;
}

}  // namespace refit
