// The delta routes (delta/delta.h) of one (trainer rank, engine rank) pair of the transfer plan,
// as both sides build them: the same routes, in the same order, with the same tags and digest
// keys, so that a stream one side encodes is the list the other side applies (docs/delta.md,
// "Wiring").
//
// Order: the pair's slices in its order (for_each_slice: round by round, the order of the
// engine's IncomingRoutes), a compact slice member by member. Tag: the member's index in that
// order over every round, so that a list of one round's routes keeps the tags of the pair's list. Keys: the route's elements' positions in the
// engine rank's parameters (every parameter numbered from the first's, in layout order): the keys
// of refit.checksum (executor/routes.h), so a list's digest is the refit checksum of its elements.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "delta/delta.h"
#include "executor/routes.h"

namespace refit {

struct PairDeltaRoutes {
  std::vector<DeltaRoute> routes;
  std::vector<std::string> names;  // by tag: the tensor and the rectangle, for errors
  // DeltaOptions::describe naming a route by its tensor (the list must outlive the options).
  std::function<std::string(std::uint32_t)> describe() const;
};

// Where the trainer side reads a route's new values.
enum class DeltaSource {
  // The trainer's local tensors (`shards`, by local tensor index), cast in the encode: the
  // one-pass path for every route whose wire value is a cast of the policy dtype (and FP8 scales,
  // float32 as they are). FP8-quantized weights cannot be read this way (a quantization is not a
  // cast): use kSegment for them.
  kShards,
  // A round's staging segment as the p2p sender packs it (`segment`, the segment's first byte):
  // each route at its segment_offset, rows x cols contiguous, already in the wire dtype (cast or
  // quantized). Needs `round`.
  kSegment,
};

// A list's digest as it travels in a pause answer (PausedMessage::delta_bases): 16 hex digits.
std::string digest_hex(std::uint64_t digest);
// refit.delta, point to point: the word a trainer rank sends before each round's bytes to an
// engine rank that offered it a base — the size of the delta stream that follows, or this value:
// the round's segment follows in full (the trainer rank decided so).
inline constexpr std::uint64_t kDeltaFullSegment = ~std::uint64_t{0};
// The bytes of a stream of `routes` routes before its first payload: its header and directory.
std::size_t delta_directory_bytes(std::size_t routes);

// Trainer rank `trainer`'s routes to engine rank `engine` (all rounds, or only `round` >= 0), from
// that trainer rank's setup (`setup`; empty for another rank's, or an engine it does not feed).
// src as `source` says; dst = engine rank `engine`'s parameters `params` when given (peer access:
// patch), else null.
PairDeltaRoutes trainer_delta_routes(const RouteSetup& setup, DType policy, int trainer, int engine,
                                     DeltaSource source, const std::vector<void*>* shards,
                                     const std::byte* segment, const std::vector<void*>* params,
                                     int round = -1);

// What engine rank `engine_rank` receives from trainer rank `trainer` (all rounds, or only
// `round`), in the same order and with the same tags and keys, with dst = its parameters.
PairDeltaRoutes engine_delta_routes(const IncomingRoutes& in, const EngineShardLayout& layout,
                                    int trainer, const std::vector<void*>& params, int round = -1);

}  // namespace refit
