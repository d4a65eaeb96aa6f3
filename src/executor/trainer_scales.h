// FP8 scales on a trainer rank (docs/fp8.md, "Where the quantization happens").
//
// Each trainer rank quantizes its own slices as it sends them (one byte per element on the link).
// A block that every route holds whole gets its scale in that quantizing pass (read once). The
// others (RouteSetup::fp8_from_grid: cut by an FSDP2 chunk boundary, a Megatron shard or a round,
// or with replicas) get theirs before the refit: each rank folds max |x| of the pieces it owns
// into an amax grid per weight, the trainer group combines the grids (an all-gather and a max),
// and scale = amax / 448 (1 for an all-zero block). The scale tensors are local tensors of every
// rank (RouteSetup::trainer, after the caller's shards); a rank sends the blocks that start in
// its pieces.
#pragma once
#include <memory>
#include <optional>
#include <vector>

#include "comm/communicator.h"
#include "executor/routes.h"
#include "plane/data_plane.h"

namespace refit {

class TrainerScales {
 public:
  // Storage for every scale tensor of `setup.wire` on this rank's plane.
  static Result<std::unique_ptr<TrainerScales>> create(const RouteSetup& setup, int rank,
                                                       DataPlane& plane);
  // The scale tensors' storage, as the local tensors after the caller's shards.
  std::vector<void*> local_tensors() const;
  // The float32 scale grid of quantized wire tensor `weight`.
  std::byte* grid(std::uint32_t weight) const;
  // Every scale, from the rank's shards (policy dtype `dtype`), combined over `trainer_group`
  // (null with one trainer rank). Collective over the trainer group. A block holding NaN or inf
  // is an error naming the tensor and the block, on every rank alike.
  Status compute(const std::vector<void*>& shards, DType dtype, Communicator* trainer_group);
  // Where the quantizing copies count the blocks they found non-finite (QuantRun::bad); compute()
  // clears it. check_in_pass(): an error naming the first such block, after copies ran.
  std::byte* bad() const { return bad_->data(); }
  Status check_in_pass();

 private:
  TrainerScales(const RouteSetup& setup, int rank, DataPlane& plane)
      : setup_(setup), rank_(rank), plane_(plane) {}

  const RouteSetup& setup_;
  const int rank_;
  DataPlane& plane_;
  std::vector<std::int64_t> offset_;  // per scale tensor (wire index - model tensors): elements
  std::int64_t total_ = 0;            // elements of every grid
  void log_once(Communicator* trainer_group);

  std::unique_ptr<PlaneBuffer> scales_, amax_, gathered_, bad_;
  std::vector<QuantRun> runs_;        // this rank's owned pieces of every quantized weight
  std::vector<void*> runs_for_;       // the shards runs_ were built for
  bool logged_ = false;
  std::optional<bool> any_from_grid_;  // some rank's blocks need the pass before (agreed once)
};

}  // namespace refit
