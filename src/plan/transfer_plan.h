// The transfer plan: which trainer rank sends which block of which tensor to which engine rank.
//
// Built at setup from metadata alone, identically on every rank: every trainer rank's owned
// pieces (each element of every HF tensor has exactly one owner, trainer_layout.h) intersected
// with every engine rank's pieces (engine_layout.h), over every engine replica. The result is a
// list of routes; each route is a rectangle of one HF tensor that moves once, straight from the
// trainer rank that holds it to one engine rank that keeps it — no all-gather, no funnel through
// trainer rank 0. An engine rank therefore receives exactly the elements of its own shard
// (1/T of the model with TP = T, plus what every TP rank replicates). Every element is sent once
// per engine rank that keeps it; where several trainer ranks hold copies of it (data-parallel
// replicas, TP-replicated norms), the engine ranks take turns among the holders.
//
// Routes are grouped into rounds for executors that stage bytes through buffers (point-to-point
// over Gloo or NCCL): within one round every trainer rank sends, and every engine rank receives,
// at most `buffer_bytes`; a route that alone exceeds the buffer is split by rows (and a row that
// exceeds it by columns). Within a round, a trainer rank's bytes for engine g form one contiguous
// segment (routes end to end in plan order), and the engine lays its segments out by trainer rank.
// Executors that move bytes straight between mapped memories (peer access) ignore the rounds.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/engine_layout.h"
#include "refit/dtype.h"
#include "refit/model_spec.h"
#include "trainer/trainer_layout.h"

namespace refit {

// Segments start at this byte alignment inside a round's staging buffer.
inline constexpr std::int64_t kSegmentAlignment = 256;
inline std::int64_t aligned_segment_bytes(std::int64_t bytes) {
  return (bytes + kSegmentAlignment - 1) / kSegmentAlignment * kSegmentAlignment;
}

// One rectangle of HF tensor `hf_tensor` moving from trainer rank `trainer` to engine rank
// `engine` (global: engine index * tp_size + tp rank). Positions are (row, col) in the 2-D
// matrix view of each side's tensor (common/piece.h).
struct Route {
  int trainer = 0;
  int engine = 0;
  std::uint32_t hf_tensor = 0;
  std::uint32_t trainer_tensor = 0;  // index into the trainer rank's LocalTensor list
  std::uint32_t engine_param = 0;    // index into the engine rank's EngineParam list
  std::int64_t rows = 0, cols = 0;
  std::int64_t trainer_row = 0, trainer_col = 0;  // top-left in the trainer's local tensor
  std::int64_t engine_row = 0, engine_col = 0;    // top-left in the engine's parameter
  std::int64_t hf_row = 0, hf_col = 0;            // top-left in the HF tensor
  int round = 0;
  std::int64_t segment_offset = 0;  // bytes from the start of its (round, trainer, engine)
                                    // segment; a multiple of the route's element size
  std::int64_t numel() const { return rows * cols; }
};

// Bytes of one (trainer rank, engine rank) pair of one round.
struct Segment {
  int trainer = 0;
  int engine = 0;
  std::int64_t bytes = 0;
  std::size_t first_route = 0, num_routes = 0;  // routes[first_route, +num_routes)
};

struct TransferPlan {
  int trainer_ranks = 0;
  int engine_ranks = 0;
  // Per tensor of the wire model (spec/fp8.h): the dtype on the wire and in the engine.
  std::vector<DType> tensor_dtype;
  DType dtype_of(const Route& r) const { return tensor_dtype[r.hf_tensor]; }
  std::int64_t bytes_of(const Route& r) const {
    return r.numel() * static_cast<std::int64_t>(dtype_size(dtype_of(r)));
  }
  std::int64_t buffer_bytes = 0;    // round bound per rank
  std::vector<Route> routes;        // ordered by (round, trainer, engine)
  int rounds = 0;
  // rounds x segments, ordered by (trainer, engine); only non-empty segments.
  std::vector<std::vector<Segment>> segments;
  std::vector<std::int64_t> trainer_bytes;  // sent per refit, per trainer rank
  std::vector<std::int64_t> engine_bytes;   // received per refit, per engine rank
  std::int64_t max_send_bytes = 0;          // largest per-round total a trainer rank sends
  std::int64_t max_recv_bytes = 0;          // largest per-round total an engine rank receives
  std::uint64_t hash = 0;                   // over every route (agreed at setup)

  std::string hash_hex() const;
  // Bytes trainer rank r sends engine rank g per refit (0 when it sends nothing).
  std::int64_t pair_bytes(int trainer, int engine) const;
  // Trainer ranks with at least one route to engine rank g, ascending.
  std::vector<int> sources_of(int engine) const;
  // Engine ranks trainer rank r has at least one route to, ascending.
  std::vector<int> targets_of(int trainer) const;

  std::vector<std::int64_t> pair_bytes_;  // trainer_ranks x engine_ranks, row-major
};

// `trainers[r]` is trainer rank r's layout; `engines[t]` is TP rank t's layout (the same for
// every replica); `num_engines` replicas; `dtypes[t]` the wire dtype of tensor t of `spec`.
// `buffer_bytes` bounds each rank's bytes per round. Routes of different dtypes share segments,
// each starting at a multiple of its element size.
TransferPlan make_transfer_plan(const ModelSpec& spec,
                                const std::vector<TrainerShardLayout>& trainers,
                                const std::vector<EngineShardLayout>& engines, int num_engines,
                                const std::vector<DType>& dtypes, std::int64_t buffer_bytes);

}  // namespace refit
