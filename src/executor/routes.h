// What the trainer and engine sides of the transfer plan (plan/transfer_plan.h) share: the plan
// built from the config, where each rank runs, and which executor moves each pair's bytes.
//
// Executors, chosen per (trainer rank, engine rank) pair at every refit from what is reachable:
//  - peer: both ranks are on one host and the engine's parameters are exported memory
//    (Engine::allocate_params): the trainer rank maps them once and writes its routes straight
//    into them, cast fused, in one copy call per refit (POSIX shared memory on CPU, CUDA IPC
//    over NVLink / PCIe on GPU). No staging, no rounds.
//  - p2p: everything else. Round by round, the trainer rank casts its routes for each engine rank
//    into one contiguous segment of a staging buffer and sends it (Gloo on CPU, NCCL on GPU,
//    grouped send/recv on the "p2p" group); the engine rank receives its segments into its own
//    staging buffer and scatters them into its parameters on an apply thread.
// Both sides decide a pair's executor the same way: the engine says in its pause answer whether
// its parameters are exported, and both know each other's host from the store.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "control/messages.h"
#include "engine/engine_layout.h"
#include "plan/transfer_plan.h"
#include "plane/data_plane.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "refit/rank.h"
#include "refit/status.h"
#include "trainer/trainer_layout.h"

namespace refit {

class Store;

// What one rank of the transfer plan derives at setup (plan/transfer_plan.h): its view of the plan
// and, on a trainer rank, its own layout.
struct RouteSetup {
  // The wire model, the trainer index and the engine layouts the view was derived from (shared
  // between the views of `refit check`).
  std::shared_ptr<PlanInputs> inputs;
  PlanView view;
  // Trainer rank: its local tensors; [0, user_tensors) are the caller's shards, the rest are FP8
  // scale tensors the trainer computes (every rank holds all of them).
  TrainerShardLayout trainer;
  std::size_t user_tensors = 0;
  // FP8, trainer rank, per wire tensor (empty for all but the quantized weights it holds): per
  // block of its grid, 1 when the block's scale is computed before the refit (amax over the
  // trainer ranks' pieces, combined over the trainer group) because a trainer rank's piece or a
  // route holds only part of it, or the tensor has data-parallel replicas, or its blocks exceed
  // kFp8FusedBlockElems; 0 when every route that moves it holds it whole, so the quantizing copy
  // computes its scale in the same pass (docs/fp8.md, "Where the quantization happens"). A block
  // this rank holds no part of is not marked.
  std::vector<std::vector<std::uint8_t>> fp8_from_grid;
  // Some block this rank holds needs the pass before the refit (TrainerScales combines it over the
  // trainer group: the pass is collective).
  bool fp8_any_from_grid = false;
  // Of the blocks whose scale this rank sends (those that start in its owned pieces): how many are
  // scaled in the quantizing pass, and how many before the refit.
  std::int64_t fp8_blocks_in_pass = 0, fp8_blocks_before = 0;
  double seconds = 0;  // to derive all of it

  const WireModel& wire() const { return inputs->wire(); }
  // The layout of engine rank `engine_rank`'s TP rank (one this rank talks to).
  const EngineShardLayout& engine_layout(int engine_rank) const {
    return inputs->engine(engine_rank % inputs->tp_size());
  }
};

// Trainer rank `rank`'s setup: its layout (checked against the index the plan uses), its view,
// and the FP8 marks of its blocks.
Result<RouteSetup> make_trainer_route_setup(std::shared_ptr<PlanInputs> inputs, int rank);
// Engine rank `engine_rank`'s setup: its view.
Result<RouteSetup> make_engine_route_setup(std::shared_ptr<PlanInputs> inputs, int engine_rank);
// The same from the config (PlanInputs::create first).
Result<RouteSetup> make_trainer_route_setup(const Config& config, const ModelSpec& spec, int rank);
Result<RouteSetup> make_engine_route_setup(const Config& config, const ModelSpec& spec,
                                           int engine_rank);

// "fp8 (blocks 128x128 from <source>): N weights quantized at the sender; of B blocks, X scaled in
// the quantizing pass, Y before the refit" (`refit check`, the trainer's log); "" without fp8.
// Counts the blocks whose scale the trainer rank sends.
std::string fp8_plan_summary(const RouteSetup& setup);
std::string fp8_plan_summary(const Fp8Table& fp8, std::int64_t in_pass, std::int64_t before);

// The largest block the quantizing copy takes whole in one pass (a CUDA thread block's registers).
inline constexpr std::int64_t kFp8FusedBlockElems = 16384;

class TrainerScales;

// A trainer rank's copies of a set of routes, grouped by what they do to the elements: cast
// (policy dtype -> the tensor's wire dtype; every tensor without fp8), FP8 scales (float32 as
// they are) and FP8 weights (quantized with their block's scale, common/quantize.h).
struct RouteCopies {
  std::vector<CopyRun> cast;  // to the wire model's plain dtype (WireModel::plain)
  DType cast_to = DType::kBFloat16;
  // Casts of the tensors the engines keep in a dtype of their own (engine_dtype, spec/fp8.h: the
  // router correction bias in float32), one group per dtype, in the order first met.
  std::vector<std::pair<DType, std::vector<CopyRun>>> apart;
  std::vector<CopyRun> scales;
  std::vector<QuantRun> quant;
  std::vector<CopyRun> quant_runs;  // quant[i].run, for fault probes and raw passes

  bool empty() const { return cast.empty() && apart.empty() && scales.empty() && quant.empty(); }
  void clear();
  // Route `r` of `setup`, read at `src` (element block.src_offset, row stride block.src_stride of
  // its local tensor) and written at `dst` (element block.dst_offset, row stride
  // block.dst_stride, in the route's wire dtype). `scales` holds the FP8 grids (null without fp8).
  void add(const RouteSetup& setup, const Route& r, const std::byte* src, std::byte* dst,
           const Block2D& block, const TrainerScales* scales);
  // Executes every group: `policy` is the shards' dtype. Raw (bench): the same bytes without a
  // cast or a quantization (every group copied as its wire dtype).
  Status run(DataPlane& plane, DType policy, bool raw) const;
  // What a fault probe may corrupt: the largest group's runs and their wire dtype.
  std::pair<const std::vector<CopyRun>*, DType> written() const;
};

// Whether the config moves bytes along the transfer plan (every executor but gather).
bool uses_transfer_plan(const Config& config);
// Whether the ranks form the point-to-point group: not for executor peer, and not on CUDA when
// trainer and engine ranks share GPUs (NCCL cannot join two processes on one device).
bool needs_p2p_group(const Config& config);
// Group ranks of the "p2p" group: trainer ranks first, then engine ranks.
inline int p2p_rank_of_trainer(int rank) { return rank; }
inline int p2p_rank_of_engine(const Config& config, int engine_rank) {
  return config.policy.world_size + engine_rank;
}

// Publishes `host_identity` (RankServices::host_identity) under "host/<who>" ("trainer/0",
// "engine/3").
Status publish_host(Store& store, const std::string& who, const std::string& host_identity);
// Reads the host of every id in `who` (bounded by `timeout`, and ended early by a failing
// `alive`: get_while_alive, control/store.h).
Result<std::vector<std::string>> read_hosts(Store& store, const std::vector<std::string>& who,
                                            std::chrono::milliseconds timeout,
                                            const std::function<Status()>& alive);

// What one engine rank receives point-to-point: per feeder, its routes in the pair's order, from
// the engine's own view (vLLM protocol) or from the metadata each feeder sends at setup (SGLang
// protocol). The rounds and segment offsets follow from the routes and the pair budget
// (for_each_slice); a slot of the staging buffer holds one round's segments, by trainer rank, each
// aligned.
struct IncomingPair {
  int trainer = 0;
  std::vector<Route> routes;
  std::vector<std::int64_t> round_bytes;  // per round: the segment's bytes
  std::int64_t bytes = 0;
};
struct IncomingRoutes {
  std::int64_t pair_budget = 0;
  std::vector<IncomingPair> pairs;  // ascending by trainer rank (finish_incoming)
  int rounds = 0;
  std::int64_t max_slot_bytes = 0;  // the largest round's segments, each aligned
  std::int64_t bytes_from(int trainer) const;
};
IncomingRoutes incoming_from_view(const PlanView& view);
// The slices of one pair of `in` (for_each_slice), each route's element size taken from the
// engine parameter it writes.
void for_each_incoming_slice(const IncomingPair& pair, std::int64_t budget,
                             const EngineShardLayout& layout,
                             const std::function<void(const Route&)>& f);
// The metadata trainer rank `pair.trainer` sends engine rank `pair.engine`: its routes there, in
// the pair's order, with the parameters named as the engine names them.
RoutesMessage routes_metadata(const PairPlan& pair, const EngineShardLayout& layout);
// Adds trainer rank `trainer`'s metadata to `in`, checking every route against the engine's
// layout (known parameters, every member inside its parameter, the placement the pair budget
// gives); errors name the trainer, the route and the parameter. Call finish_incoming after the
// last source.
Status add_routes_metadata(IncomingRoutes& in, const RoutesMessage& m, int trainer,
                           const EngineShardLayout& layout);
void finish_incoming(IncomingRoutes& in);

// refit.checksum (common/checksum.h): the runs that checksum what one trainer rank sends one engine
// rank, on each side, keyed by position in the engine rank's parameters (every parameter's
// elements numbered from the first parameter's, in layout order), grouped by the dtype the
// elements travel in (their engine parameter's: the checksum of a pair is the sum of its groups').
//  - trainer side: its routes to engine rank `engine`, read from `shards` (its registered local
//    tensors, policy dtype; checksummed as their parameter's dtype);
//  - engine side: for each trainer rank in `in`, its routes as they landed in `params`.
// Zero-element routes add nothing.
struct ChecksumGroup {
  DType dtype = DType::kBFloat16;
  std::vector<CopyRun> runs;
};
std::vector<ChecksumGroup> trainer_checksum_runs(const RouteSetup& setup, int engine,
                                                 const std::vector<void*>& shards);
std::map<int, std::vector<ChecksumGroup>> engine_checksum_runs(const IncomingRoutes& in,
                                                               const EngineShardLayout& layout,
                                                               const std::vector<void*>& params);
// The refit checksum of every group: `src` is the dtype the runs' sources hold (the trainer's
// policy dtype; the engine's own parameters: nullopt, each group read as its dtype).
Result<std::uint64_t> checksum_groups(DataPlane& plane, const std::vector<ChecksumGroup>& groups,
                                      std::optional<DType> src);

// Engine ranks that a trainer rank talks to: its view's, and, on trainer rank 0, every engine rank
// that receives from no one (it still needs a begin and a commit).
std::vector<int> control_targets(const RouteSetup& setup);
// Trainer ranks that an engine rank hears from (the mirror of control_targets).
std::vector<int> control_sources(const RouteSetup& setup);

// The digest of this rank's routes with `peer` (an engine rank on a trainer rank, a trainer rank
// on an engine rank), as the hello carries it: 16 hex digits, "none" for a peer without routes.
std::string pair_routes_digest(const RouteSetup& setup, int peer);
// The bytes of this rank's routes with `peer` (the plan's, in the wire dtype); 0 without routes.
std::int64_t pair_bytes(const RouteSetup& setup, int peer);
// Setup: trainer rank `trainer` and engine rank `engine` derived different routes for their pair
// (`ours` the trainer's digest, `theirs` the engine's hello's).
Status routes_digest_mismatch(int trainer, const RankId& engine, const std::string& ours,
                              const std::string& theirs);

// At setup, what can be known then: with executor peer, both ranks of the pair share a host
// (whether the engine's parameters can be mapped is known only at the first refit).
Status check_pair_at_setup(const Config& config, bool same_host, int trainer, int engine_rank);

enum class PairExecutor { kPeer, kP2p };
// The executor of one pair, or an error naming the pair and the fix.
Result<PairExecutor> choose_pair_executor(const Config& config, bool same_host,
                                          bool engine_exported, bool have_p2p_group, int trainer,
                                          int engine_rank);

}  // namespace refit
