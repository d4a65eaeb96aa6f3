// The transfer plan: which trainer rank sends which block of which tensor to which engine rank
// (docs/transfer-plan.md).
//
// Every element of every HF tensor moves once per engine rank that keeps it, straight from a
// trainer rank that holds it — no all-gather, no funnel through trainer rank 0 — so an engine rank
// receives exactly its own shard. Where several trainer ranks hold copies of a block (data-parallel
// replicas, TP-replicated norms), engine replica e's TP rank k reads it from copy (e + k) mod
// copies.
//
// Per-rank views. No rank builds the whole plan: a trainer rank derives the routes it sends and an
// engine rank the routes it receives (trainer_view, engine_view), in time and memory that follow
// its own share of the model, from PlanInputs — the wire model, an index of every trainer rank's
// pieces (plan/trainer_index.h) and the engine layouts of the TP ranks it talks to. Both ranks of
// a pair derive the same routes for it, in the same order; the pair's digest says so at setup.
//
// Compact routes. Tensors that differ only in their expert (or layer) index form a group
// (TensorGroup). Where every tensor of a run of a group sits in both sides' memory one step from
// the previous one — stacked experts in w13 / w2, one local tensor per expert or layer — the
// blocks that one pair moves of the run are one route with a count and a step, so the number of
// routes per pair does not grow with the number of experts.
//
// Rounds. For executors that stage bytes (point-to-point), each pair's routes are cut, in order,
// into segments of at most `pair_budget` bytes, one per round; the pair budget is
// refit.buffer_size_bytes / max(trainer ranks, engine ranks), so no rank sends or receives more
// than the buffer in one round whatever the pairs it has. A run of members that does not fit is
// split between members, a member larger than the budget by rows (and a row by columns). Within a
// segment routes lie end to end, each at a multiple of its element size; a rank lays its segments
// of one round out by peer, each 256-byte aligned. Executors that move bytes straight between
// mapped memories (peer access) ignore the rounds.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine_layout.h"
#include "plan/trainer_index.h"
#include "refit/config.h"
#include "refit/dtype.h"
#include "refit/model_spec.h"
#include "refit/status.h"
#include "spec/fp8.h"

namespace refit {

// Segments start at this byte alignment inside a round's staging buffer.
inline constexpr std::int64_t kSegmentAlignment = 256;
inline std::int64_t aligned_segment_bytes(std::int64_t bytes) {
  return (bytes + kSegmentAlignment - 1) / kSegmentAlignment * kSegmentAlignment;
}

// The planning algorithm's version, part of every plan's identity: ranks that would plan
// differently refuse each other at setup.
inline constexpr int kPlanAlgorithmVersion = 2;

// How member j + 1 of a compact route differs from member j.
struct RouteStep {
  std::int32_t hf_tensor = 0, trainer_tensor = 0, engine_param = 0;
  std::int64_t trainer_row = 0, trainer_col = 0, engine_row = 0, engine_col = 0;
  bool operator==(const RouteStep&) const = default;
};

// `count` rectangles ("members") moving from trainer rank `trainer` to engine rank `engine`
// (global: engine index * tp_size + tp rank); member 0 is the rectangle of HF tensor `hf_tensor`
// at (hf_row, hf_col), read at (trainer_row, trainer_col) of the trainer's local tensor
// `trainer_tensor` and written at (engine_row, engine_col) of the engine's parameter
// `engine_param`; member j is member 0 moved j steps. Positions are (row, col) in the 2-D matrix
// view of each tensor (common/piece.h).
struct Route {
  int trainer = 0;
  int engine = 0;
  std::uint32_t hf_tensor = 0;
  std::uint32_t trainer_tensor = 0;  // index into the trainer rank's LocalTensor list
  std::uint32_t engine_param = 0;    // index into the engine rank's EngineParam list
  std::int64_t rows = 0, cols = 0;
  std::int64_t trainer_row = 0, trainer_col = 0;
  std::int64_t engine_row = 0, engine_col = 0;
  std::int64_t hf_row = 0, hf_col = 0;
  int round = 0;                    // of member 0 (a slice: of the slice)
  std::int64_t segment_offset = 0;  // bytes from the start of the (round, pair) segment; a
                                    // multiple of the route's element size
  std::int32_t count = 1;
  RouteStep step;

  std::int64_t member_numel() const { return rows * cols; }
  std::int64_t numel() const { return rows * cols * count; }
  // Members [first, first + n), as a route of count n.
  Route members(std::int32_t first, std::int32_t n) const;
  Route member(std::int32_t j) const { return members(j, 1); }
};

// One (trainer rank, engine rank) pair of a view: its routes, in the order both sides agree on,
// and the bytes of its segment in every round it has.
struct PairPlan {
  int trainer = 0;
  int engine = 0;
  std::vector<Route> routes;              // round and segment_offset: of each route's member 0
  std::vector<std::int64_t> round_bytes;  // per round [0, rounds()): the segment's bytes (> 0)
  std::int64_t bytes = 0;                 // per refit
  std::uint64_t digest = 0;               // over the plan's identity and every route
  int rounds() const { return static_cast<int>(round_bytes.size()); }
  std::string digest_hex() const;
};

// What one rank derives: the pairs it is part of, ascending by the other rank.
struct PlanView {
  bool trainer_side = true;
  int rank = 0;  // trainer rank, or global engine rank
  int trainer_ranks = 0;
  int engine_ranks = 0;
  std::int64_t pair_budget = 0;                      // bytes per pair and round
  std::uint64_t identity = 0;                        // of the plan's inputs (PlanInputs::identity)
  std::shared_ptr<const std::vector<DType>> dtypes;  // per wire tensor: on the wire and engine
  std::vector<PairPlan> pairs;
  int rounds = 0;                    // the most rounds of any pair
  std::int64_t max_stage_bytes = 0;  // the largest round's segments, each aligned
  std::int64_t bytes = 0;            // sent (trainer) or received (engine) per refit

  DType dtype_of(const Route& r) const { return (*dtypes)[r.hf_tensor]; }
  std::int64_t bytes_of(const Route& r) const {
    return r.numel() * static_cast<std::int64_t>(dtype_size(dtype_of(r)));
  }
  // The pair with `peer` (an engine rank of a trainer view, a trainer rank of an engine view),
  // or null.
  const PairPlan* pair_with(int peer) const;
  std::vector<int> peers() const;
  std::size_t routes() const;
  // Heap memory the view holds (the report's plan_bytes).
  std::size_t heap_bytes() const;
  std::string identity_hex() const;
};

// Calls f(slice) for every slice of `routes` (one pair's, in order) in order: a slice lies in one
// round (slice.round) at slice.segment_offset of the pair's segment of that round, and is a run
// of whole members of a route or, when one member exceeds `budget`, part of one member.
// `esize(route)`: the bytes of one of the route's elements.
void for_each_slice(const std::vector<Route>& routes,
                    const std::function<std::int64_t(const Route&)>& esize, std::int64_t budget,
                    const std::function<void(const Route&)>& f);
// The same for one pair of a view.
void for_each_slice(const PlanView& view, const PairPlan& pair,
                    const std::function<void(const Route&)>& f);
// What for_each_slice gives without building the slices: sets every route's round and
// segment_offset (of its first slice), each round's segment bytes, and the bytes in all.
void place_routes(std::vector<Route>& routes,
                  const std::function<std::int64_t(const Route&)>& esize_of, std::int64_t budget,
                  std::vector<std::int64_t>& round_bytes, std::int64_t& bytes);

// Tensors first, first + stride, ... (count of them) of the wire model that share a shape, a
// dtype and a role, and differ in their expert or layer index.
struct TensorGroup {
  std::uint32_t first = 0;
  std::int32_t stride = 0;
  std::int32_t count = 1;
  std::uint32_t member(std::int32_t j) const {
    return first + static_cast<std::uint32_t>(static_cast<std::int64_t>(j) * stride);
  }
};
// How an engine piece moves from one tensor of a group to the next.
struct EngineStep {
  std::int64_t param = 0, dst_row = 0, dst_col = 0;
  bool operator==(const EngineStep&) const = default;
};
// Members [begin, end) of a group over which every trainer holder and every piece of one engine
// TP rank move by one step per member (`engine[i]` for the i-th piece that reads member `begin`).
struct GroupRun {
  std::int32_t begin = 0, end = 1;
  HolderStep trainer;
  std::vector<EngineStep> engine;
};

// Everything a view is derived from: the config, the wire model, the trainer index and the engine
// layouts of TP ranks, built on demand (prepare_engine). One set serves many views (refit check).
// `model` must outlive it.
class PlanInputs {
 public:
  static Result<std::shared_ptr<PlanInputs>> create(const Config& config, const ModelSpec& model);

  const Config& config() const { return config_; }
  const ModelSpec& model() const { return *model_; }
  const WireModel& wire() const { return *wire_; }
  const TrainerIndex& trainers() const { return *index_; }
  int trainer_ranks() const { return config_.policy.world_size; }
  int engine_ranks() const { return config_.engine_ranks(); }
  int tp_size() const { return config_.generation.tp_size; }
  std::int64_t pair_budget() const { return pair_budget_; }
  // A hash of what the plan is derived from: the algorithm's version, every wire tensor's name,
  // shape and dtype, the trainer's backend, world size and Megatron split, the engines' number, TP
  // size, layout and protocol, and the buffer size.
  std::uint64_t identity() const { return identity_; }
  const std::shared_ptr<const std::vector<DType>>& dtypes() const { return dtypes_; }
  const std::vector<TensorGroup>& groups() const { return groups_; }
  // Whether some block of wire tensor `t` has more than one holder (TrainerIndex::has_copies).
  bool has_copies(std::uint32_t t) const { return copies_[t] != 0; }

  // Builds engine TP rank `tp_rank`'s layout and its group runs, once.
  Status prepare_engine(int tp_rank);
  bool has_engine(int tp_rank) const;
  const EngineShardLayout& engine(int tp_rank) const;  // after prepare_engine
  const std::vector<GroupRun>& runs(std::size_t group, int tp_rank) const;

 private:
  PlanInputs() = default;
  struct EngineSide {
    bool ready = false;
    EngineShardLayout layout;
    std::vector<std::vector<GroupRun>> runs;  // per group
  };

  Config config_;
  const ModelSpec* model_ = nullptr;
  std::unique_ptr<const WireModel> wire_;
  std::unique_ptr<TrainerIndex> index_;
  std::shared_ptr<const std::vector<DType>> dtypes_;
  std::vector<TensorGroup> groups_;
  std::vector<std::uint8_t> copies_;  // per wire tensor: has_copies
  // Per group: the trainer holders' step from member j to j + 1, when there is one.
  std::vector<std::vector<std::optional<HolderStep>>> trainer_steps_;
  std::vector<EngineSide> engines_;  // per TP rank
  std::int64_t pair_budget_ = 0;
  std::uint64_t identity_ = 0;
};

// The routes trainer rank `rank` sends (it prepares every engine TP rank).
Result<PlanView> trainer_view(PlanInputs& inputs, int rank);
// The routes engine rank `engine_rank` receives (it prepares its own TP rank only).
Result<PlanView> engine_view(PlanInputs& inputs, int engine_rank);
// Calls f(view) with every trainer rank's view, one at a time (every pair of the plan is in
// exactly one of them), stopping at the first error.
Status for_each_trainer_view(PlanInputs& inputs, const std::function<Status(const PlanView&)>& f);
// The most rounds of any pair of the plan.
Result<int> plan_rounds(PlanInputs& inputs);

}  // namespace refit
