#include "plan/trainer_index.h"

#include <fmt/format.h>

#include <algorithm>
#include <tuple>

#include "trainer/trainer_layout.h"

namespace refit {
namespace {

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// The blocks of scale tensor `s` that start inside weight piece `p` (blocks `b`), placed where
// they sit in the whole scale tensor; rows == 0 when none does.
Piece scale_block(const Piece& p, MatrixShape b, std::uint32_t s) {
  const std::int64_t r0 = ceil_div(p.src_row, b.rows), r1 = ceil_div(p.src_row + p.rows, b.rows);
  const std::int64_t c0 = ceil_div(p.src_col, b.cols), c1 = ceil_div(p.src_col + p.cols, b.cols);
  if (p.rows <= 0 || r0 >= r1 || c0 >= c1) return Piece{.hf_tensor = s};
  return Piece{.hf_tensor = s,
               .src_row = r0,
               .src_col = c0,
               .rows = r1 - r0,
               .cols = c1 - c0,
               .dst_row = r0,
               .dst_col = c0};
}

auto block_key(const Piece& p) { return std::tie(p.src_row, p.src_col, p.rows, p.cols); }

bool holder_less(const Holder& a, const Holder& b) {
  if (block_key(a.rect) != block_key(b.rect)) return block_key(a.rect) < block_key(b.rect);
  return std::tie(a.rank, a.local, a.piece) < std::tie(b.rank, b.local, b.piece);
}

// The difference between two pieces that hold the same block of two tensors, or nothing.
std::optional<HolderStep> piece_step(std::uint32_t local_a, const Piece& a, std::uint32_t local_b,
                                     const Piece& b) {
  if (block_key(a) != block_key(b)) return std::nullopt;
  return HolderStep{.local = static_cast<std::int64_t>(local_b) - local_a,
                    .dst_row = b.dst_row - a.dst_row,
                    .dst_col = b.dst_col - a.dst_col};
}

// FSDP2: rank r holds one dim-0 chunk of every tensor as local tensor t (fsdp2_layout), and the
// blocks of each scale tensor that start in its chunk of the weight as local tensor s (local
// tensors are numbered as the wire tensors).
class Fsdp2Index final : public TrainerIndex {
 public:
  Fsdp2Index(const WireModel& wire, int world) : TrainerIndex(world), wire_(wire) {
    model_tensors_ = wire.fp8 ? wire.fp8->model_tensors : wire.spec.tensors().size();
  }

  std::size_t user_tensors(int) const override { return model_tensors_; }

  void pieces_of(int rank, std::uint32_t t, std::vector<Holder>& out) const override {
    const Piece p = piece(t, rank);
    if (p.rows > 0) out.push_back(Holder{.rank = rank, .local = t, .piece = 0, .rect = p});
  }

  void holders(std::uint32_t t, const Box& box, std::vector<Holder>& out) const override {
    // The ranks whose chunk of the tensor (or, for a scale, of its weight) can meet the box.
    const bool scale = t >= model_tensors_;
    const std::uint32_t u = scale ? weight_of(t) : t;
    const std::vector<std::int64_t>& shape = wire_.spec.tensors()[u].shape;
    const std::int64_t dim0 = shape.empty() ? 1 : shape[0];
    const std::int64_t chunk = ceil_div(dim0, world());
    const bool by_cols = shape.size() <= 1;
    std::int64_t per = chunk, lo = by_cols ? box.c0 : box.r0, hi = by_cols ? box.c1 : box.r1;
    if (!by_cols)
      for (std::size_t k = 1; k + 1 < shape.size(); ++k) per *= shape[k];
    if (scale) {  // a block index k covers weight rows (or columns) [k * b, (k + 1) * b)
      const MatrixShape b = wire_.fp8->block(wire_.spec, u);
      const std::int64_t bs = by_cols ? b.cols : b.rows;
      lo = lo * bs;
      hi = (hi - 1) * bs + 1;
    }
    if (per <= 0 || lo >= hi) return;
    const int first = static_cast<int>(std::max<std::int64_t>(0, lo / per));
    const int last = static_cast<int>(std::min<std::int64_t>(world() - 1, (hi - 1) / per));
    for (int r = first; r <= last; ++r) {
      const Piece p = piece(t, r);
      if (p.rows > 0 && box.meets(p))
        out.push_back(Holder{.rank = r, .local = t, .piece = 0, .rect = p});
    }
  }

  std::optional<HolderStep> step(std::uint32_t a, std::uint32_t b) const override {
    const bool sa = a >= model_tensors_, sb = b >= model_tensors_;
    if (sa != sb) return std::nullopt;
    const std::uint32_t ua = sa ? weight_of(a) : a, ub = sb ? weight_of(b) : b;
    if (wire_.spec.tensors()[ua].shape != wire_.spec.tensors()[ub].shape) return std::nullopt;
    if (sa) {
      const MatrixShape ba = wire_.fp8->block(wire_.spec, ua),
                        bb = wire_.fp8->block(wire_.spec, ub);
      if (ba.rows != bb.rows || ba.cols != bb.cols) return std::nullopt;
    }
    return HolderStep{.local = static_cast<std::int64_t>(b) - a};
  }

  bool has_copies(std::uint32_t) const override { return false; }

 private:
  std::uint32_t weight_of(std::uint32_t s) const {
    return static_cast<std::uint32_t>(wire_.fp8->weight_of[s]);
  }
  Piece piece(std::uint32_t t, int rank) const {
    if (t < model_tensors_) return fsdp2_piece(wire_.spec.tensors()[t].shape, t, world(), rank);
    const std::uint32_t w = weight_of(t);
    return scale_block(fsdp2_piece(wire_.spec.tensors()[w].shape, w, world(), rank),
                       wire_.fp8->block(wire_.spec, w), t);
  }

  const WireModel& wire_;
  std::size_t model_tensors_ = 0;
};

// Megatron: the layout of a rank depends on its (tp, pp, ep) coordinates; its data-parallel index
// only decides what it owns, and the owner of a block is its lowest holder (megatron_layout.cc).
class MegatronIndex final : public TrainerIndex {
 public:
  MegatronIndex(const WireModel& wire, int world) : TrainerIndex(world), wire_(wire) {}

  Status build(const ModelSpec& model, const MegatronParallel& par) {
    model_tensors_ = model.tensors().size();
    if (par.tp < 1 || par.pp < 1 || par.ep < 1 || world() % (par.tp * par.pp) != 0) {
      // megatron_layout names the key that is wrong.
      REFIT_ASSIGN_OR_RETURN(auto unused, megatron_layout(model, par, world(), 0));
      (void)unused;
      return Status::Internal("megatron index: a split megatron_layout accepted");
    }
    const int dp = world() / (par.tp * par.pp);
    by_tensor_.assign(model_tensors_, {});
    class_of_rank_.assign(static_cast<std::size_t>(world()), 0);
    for (int pp = 0; pp < par.pp; ++pp)
      for (int ep = 0; ep < std::min(par.ep, dp); ++ep)
        for (int tp = 0; tp < par.tp; ++tp) {
          Class c;
          for (int d = ep; d < dp; d += par.ep)
            c.ranks.push_back(tp + par.tp * d + par.tp * dp * pp);
          REFIT_ASSIGN_OR_RETURN(TrainerShardLayout lay,
                                 megatron_layout(model, par, world(), c.ranks.front()));
          const auto cls = static_cast<std::uint32_t>(classes_.size());
          c.user_tensors = lay.tensors.size();
          for (int r : c.ranks) class_of_rank_[static_cast<std::size_t>(r)] = cls;
          for (std::uint32_t l = 0; l < lay.tensors.size(); ++l)
            for (std::uint32_t p = 0; p < lay.tensors[l].pieces.size(); ++p) {
              const Piece& pc = lay.tensors[l].pieces[p];
              by_tensor_[pc.hf_tensor].push_back(
                  Entry{.cls = cls, .local = l, .piece = p, .rect = pc});
            }
          classes_.push_back(std::move(c));
        }
    for (std::uint32_t t = 0; t < by_tensor_.size(); ++t) {
      auto& list = by_tensor_[t];
      std::sort(list.begin(), list.end(), [](const Entry& a, const Entry& b) {
        if (block_key(a.rect) != block_key(b.rect)) return block_key(a.rect) < block_key(b.rect);
        return std::tie(a.cls, a.local, a.piece) < std::tie(b.cls, b.local, b.piece);
      });
      // Distinct blocks tile the tensor: two that overlap would send elements twice.
      for (std::size_t i = 1; i < list.size(); ++i) {
        if (block_key(list[i].rect) == block_key(list[i - 1].rect)) continue;
        for (std::size_t j = 0; j < i; ++j)
          if (Box::of(list[j].rect).meets(list[i].rect) &&
              block_key(list[j].rect) != block_key(list[i].rect))
            return Status::Internal(fmt::format(
                "megatron index: two different blocks of {} overlap (rows {}+{} and {}+{})",
                model.tensors()[t].name, list[j].rect.src_row, list[j].rect.rows,
                list[i].rect.src_row, list[i].rect.rows));
      }
    }
    return Status::Ok();
  }

  std::size_t user_tensors(int rank) const override {
    return classes_[class_of_rank_[static_cast<std::size_t>(rank)]].user_tensors;
  }

  void pieces_of(int rank, std::uint32_t t, std::vector<Holder>& out) const override {
    const std::size_t first = out.size();
    if (t < model_tensors_) {
      const std::uint32_t cls = class_of_rank_[static_cast<std::size_t>(rank)];
      for (const Entry& e : by_tensor_[t])
        if (e.cls == cls)
          out.push_back(Holder{.rank = rank, .local = e.local, .piece = e.piece, .rect = e.rect});
    } else {
      scale_holders(t, nullptr, rank, out);
    }
    std::sort(out.begin() + static_cast<std::ptrdiff_t>(first), out.end(),
              [](const Holder& a, const Holder& b) {
                return std::tie(a.local, a.piece) < std::tie(b.local, b.piece);
              });
  }

  void holders(std::uint32_t t, const Box& box, std::vector<Holder>& out) const override {
    const std::size_t first = out.size();
    if (t < model_tensors_) {
      for (const Entry& e : by_tensor_[t]) {
        if (!box.meets(e.rect)) continue;
        for (int r : classes_[e.cls].ranks)
          out.push_back(Holder{.rank = r, .local = e.local, .piece = e.piece, .rect = e.rect});
      }
    } else {
      scale_holders(t, &box, -1, out);
    }
    std::sort(out.begin() + static_cast<std::ptrdiff_t>(first), out.end(), holder_less);
  }

  std::optional<HolderStep> step(std::uint32_t a, std::uint32_t b) const override {
    const bool sa = a >= model_tensors_, sb = b >= model_tensors_;
    if (sa != sb) return std::nullopt;
    if (sa) {
      const auto wa = static_cast<std::uint32_t>(wire_.fp8->weight_of[a]);
      const auto wb = static_cast<std::uint32_t>(wire_.fp8->weight_of[b]);
      const MatrixShape ba = wire_.fp8->block(wire_.spec, wa),
                        bb = wire_.fp8->block(wire_.spec, wb);
      if (!step(wa, wb) || ba.rows != bb.rows || ba.cols != bb.cols) return std::nullopt;
      return HolderStep{.local = static_cast<std::int64_t>(b) - a};
    }
    const auto& la = by_tensor_[a];
    const auto& lb = by_tensor_[b];
    if (la.size() != lb.size() || la.empty()) return std::nullopt;
    std::optional<HolderStep> out;
    for (std::size_t i = 0; i < la.size(); ++i) {
      if (la[i].cls != lb[i].cls || la[i].piece != lb[i].piece) return std::nullopt;
      const auto s = piece_step(la[i].local, la[i].rect, lb[i].local, lb[i].rect);
      if (!s || (out && *out != *s)) return std::nullopt;
      out = s;
    }
    return out;
  }

  bool has_copies(std::uint32_t t) const override {
    if (t >= model_tensors_) return false;
    const auto& list = by_tensor_[t];
    for (std::size_t i = 0; i < list.size(); ++i) {
      if (classes_[list[i].cls].ranks.size() > 1) return true;
      if (i > 0 && block_key(list[i].rect) == block_key(list[i - 1].rect)) return true;
    }
    return false;
  }

 private:
  struct Class {
    std::vector<int> ranks;  // ascending: the data-parallel replicas of one (tp, pp, ep) rank
    std::size_t user_tensors = 0;
  };
  struct Entry {
    std::uint32_t cls = 0, local = 0, piece = 0;
    Piece rect;
  };

  // The holders of scale tensor `s` (one per block of its weight that has blocks starting in it:
  // the block's owner), those meeting `box` when given, or those of `only_rank` when >= 0.
  void scale_holders(std::uint32_t s, const Box* box, int only_rank,
                     std::vector<Holder>& out) const {
    const auto w = static_cast<std::uint32_t>(wire_.fp8->weight_of[s]);
    const MatrixShape b = wire_.fp8->block(wire_.spec, w);
    // Each distinct block of the weight with its owner: the lowest rank of its holders.
    struct Owned {
      int owner;
      const Entry* entry;
    };
    std::vector<Owned> owned;
    const auto& list = by_tensor_[w];
    for (std::size_t i = 0; i < list.size();) {
      std::size_t j = i;
      int owner = world();
      const Entry* at = &list[i];
      for (; j < list.size() && block_key(list[j].rect) == block_key(list[i].rect); ++j) {
        const int r = classes_[list[j].cls].ranks.front();
        if (r < owner) owner = r, at = &list[j];
      }
      owned.push_back(Owned{owner, at});
      i = j;
    }
    // The scale tensor's pieces on its owner, in the order the owner's owned pieces of the
    // weight are sorted (src_row, src_col), skipping those that start no block.
    std::sort(owned.begin(), owned.end(), [](const Owned& x, const Owned& y) {
      return std::tie(x.owner, x.entry->rect.src_row, x.entry->rect.src_col) <
             std::tie(y.owner, y.entry->rect.src_row, y.entry->rect.src_col);
    });
    std::uint32_t ordinal = 0;
    for (std::size_t i = 0; i < owned.size(); ++i) {
      if (i > 0 && owned[i].owner != owned[i - 1].owner) ordinal = 0;
      const Piece blocks = scale_block(owned[i].entry->rect, b, s);
      if (blocks.rows == 0) continue;
      const std::uint32_t piece = ordinal++;
      if ((only_rank >= 0 && owned[i].owner != only_rank) || (box && !box->meets(blocks))) continue;
      const std::size_t user = classes_[owned[i].entry->cls].user_tensors;
      out.push_back(Holder{.rank = owned[i].owner,
                           .local = static_cast<std::uint32_t>(user + (s - model_tensors_)),
                           .piece = piece,
                           .rect = blocks});
    }
  }

  const WireModel& wire_;
  std::size_t model_tensors_ = 0;
  std::vector<Class> classes_;
  std::vector<std::uint32_t> class_of_rank_;
  std::vector<std::vector<Entry>> by_tensor_;  // per model tensor, sorted by (block, class)
};

}  // namespace

Result<std::unique_ptr<TrainerIndex>> TrainerIndex::create(const Config& config,
                                                           const ModelSpec& model,
                                                           const WireModel& wire) {
  const int world = config.policy.world_size;
  switch (config.policy.backend) {
    case PolicyBackend::kFsdp2:
      if (world < 1)
        return Status::InvalidArgument(fmt::format("policy.world_size: {} must be >= 1", world));
      return std::unique_ptr<TrainerIndex>(new Fsdp2Index(wire, world));
    case PolicyBackend::kMegatron: {
      auto index = std::make_unique<MegatronIndex>(wire, world);
      REFIT_RETURN_IF_ERROR(index->build(model, config.policy.megatron));
      return std::unique_ptr<TrainerIndex>(std::move(index));
    }
  }
  return Status::Internal(fmt::format("trainer index: unknown policy backend {}",
                                      static_cast<int>(config.policy.backend)));
}

}  // namespace refit
