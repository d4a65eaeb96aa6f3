// Who holds which piece of every wire tensor on the trainer side, for any rank, without building
// every rank's layout (docs/transfer-plan.md, "Per-rank views").
//
// A rank's view of the transfer plan needs, for each tensor it touches, the pieces of the ranks on
// the other side of its pairs: a trainer rank the copies of its own pieces (to take turns with
// data-parallel replicas), an engine rank every trainer piece that overlaps its own. Building the
// layout of every trainer rank costs O(world size x tensors); this index answers the same questions
// from the layout's structure instead:
//  - FSDP2: in closed form from the tensor's shape (every rank holds one dim-0 chunk);
//  - Megatron: from one layout per (tp rank, pp rank, ep rank) — data-parallel replicas of one
//    such class hold the same pieces.
// FP8 scale tensors (wire tensors past the model's) are held by the owner of each piece of their
// weight: the blocks that start inside it (executor/routes.h, RouteSetup). Every element of every
// tensor has exactly one owner, the lowest rank that holds it.
//
// Immutable after create(); safe to read from several threads.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "common/piece.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "refit/status.h"
#include "spec/fp8.h"

namespace refit {

// One piece of a wire tensor on one trainer rank: `rect` is the HF block (src) and where it sits
// in local tensor `local` (dst), the rank's `piece`-th piece of that local tensor.
struct Holder {
  int rank = 0;
  std::uint32_t local = 0;
  std::uint32_t piece = 0;
  Piece rect;
};

// Whether two pieces cover the same block of the same tensor.
inline bool same_block(const Piece& a, const Piece& b) {
  return a.hf_tensor == b.hf_tensor && a.src_row == b.src_row && a.src_col == b.src_col &&
         a.rows == b.rows && a.cols == b.cols;
}

// Rows [r0, r1) x columns [c0, c1) of a tensor's matrix view.
struct Box {
  std::int64_t r0 = 0, r1 = 0, c0 = 0, c1 = 0;
  static Box of(const Piece& p) {
    return {p.src_row, p.src_row + p.rows, p.src_col, p.src_col + p.cols};
  }
  bool meets(const Piece& p) const {
    return p.src_row < r1 && r0 < p.src_row + p.rows && p.src_col < c1 && c0 < p.src_col + p.cols;
  }
};

// How a holder's piece moves from one tensor of a group to the next (plan/transfer_plan.h).
struct HolderStep {
  std::int64_t local = 0, dst_row = 0, dst_col = 0;
  bool operator==(const HolderStep&) const = default;
};

class TrainerIndex {
 public:
  virtual ~TrainerIndex() = default;
  // For config.policy over `model`, holding the tensors of `wire` (its model's tensors, then the
  // FP8 scales). Errors: a parallel split that does not fit the model (naming the key).
  static Result<std::unique_ptr<TrainerIndex>> create(const Config& config, const ModelSpec& model,
                                                      const WireModel& wire);

  int world() const { return world_; }
  // Local tensors of `rank` that hold the caller's shards (the FP8 scale tensors follow them).
  virtual std::size_t user_tensors(int rank) const = 0;
  // Appends rank `rank`'s pieces of wire tensor `t`, in (local, piece) order.
  virtual void pieces_of(int rank, std::uint32_t t, std::vector<Holder>& out) const = 0;
  // Appends every rank's pieces of wire tensor `t` that overlap `box`, ordered by block (src_row,
  // src_col, rows, cols), then rank, local, piece: the holders of one block, in rank order, are
  // its copies.
  virtual void holders(std::uint32_t t, const Box& box, std::vector<Holder>& out) const = 0;
  // When the holders of tensor `b` are those of tensor `a` — the same ranks holding the same blocks
  // in the same order — each moved by one step in its local tensors, that step.
  virtual std::optional<HolderStep> step(std::uint32_t a, std::uint32_t b) const = 0;
  // Whether some block of wire tensor `t` has more than one holder.
  virtual bool has_copies(std::uint32_t t) const = 0;

 protected:
  explicit TrainerIndex(int world) : world_(world) {}

 private:
  int world_;
};

}  // namespace refit
