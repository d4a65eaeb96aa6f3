// Delta refits: send only the elements that changed since the engine last received a route, and
// apply them in place (docs/delta.md). This header is the component's interface: the routes it
// works on, its options and results, the layout of the trainer's kept copy, and the size
// prediction behind `refit.delta: auto`. The work itself runs on a data plane
// (DataPlane::delta_encode / delta_apply / delta_capture / delta_patch, plane/data_plane.h): the
// CPU plane's workers run the loops of this folder (delta/delta_cpu.h), the CUDA plane the kernels
// of device/delta_kernels.h. Both write and read the same bytes (delta/format.h).
//
// Who holds what (docs/delta.md, "State"):
//  - the trainer rank keeps, per list of routes it encodes (one per engine rank it feeds), a copy
//    of what it last sent, in the wire dtype, in its own plane memory (the *kept* copy), and the
//    list's *digest*: the refit checksum (common/checksum.h) of the kept values, keyed by their
//    positions in the engine rank's parameters;
//  - the engine rank holds the base itself, its parameters, and the same digest of the elements
//    each trainer rank sends it.
// A stream names the digest it was computed against (StreamHeader::base_digest), and each route
// what it adds to it (RouteEntry::digest_delta), so an engine refuses a stream meant for another
// base before it touches a byte, and checks every route it applied.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/piece.h"
#include "refit/dtype.h"
#include "refit/status.h"

namespace refit {

// One route as the delta component sees it: block.rows x block.cols elements in row-major order.
//  - encode / capture / patch read the new values at `src` (element block.src_offset + r *
//    block.src_stride + c, `src_dtype`), cast to `wire_dtype` exactly as DataPlane::copy casts;
//  - apply / patch write the engine's parameter at `dst` (element block.dst_offset + r *
//    block.dst_stride + c, `wire_dtype`), which holds the base before the call;
//  - encode / capture / patch keep the route's copy at byte `kept` of the kept buffer
//    (assign_kept_offsets), rows x cols elements of `wire_dtype`, contiguous;
//  - every digest keys element (r, c) as key + r * key_stride + c (the position in the engine
//    rank's parameters: the keys of refit.checksum, executor/routes.h).
// A list of routes is built once and reused by every refit (the CUDA plane uploads it once).
struct DeltaRoute {
  const std::byte* src = nullptr;
  std::byte* dst = nullptr;
  Block2D block;
  DType src_dtype = DType::kFloat32;
  DType wire_dtype = DType::kBFloat16;
  std::int64_t kept = 0;  // byte offset in the kept buffer (a multiple of 16)
  std::uint64_t key = 0;
  std::int64_t key_stride = 0;
  std::uint32_t tag = 0;  // the caller's name for the route: the stream's directory and errors
  std::int64_t elements() const { return block.numel(); }
};

// What an apply wrote, kept so that the same changes can be written again onto another copy of
// the same base without reading the stream again (refit.staged: the staging area takes the delta
// while the engine generates; at the pause the parameters, which hold the same base, take only
// the changes). DataPlane::delta_apply fills it when DeltaOptions::log is set;
// DataPlane::delta_replay writes it onto a list of the same routes with other destinations.
struct DeltaLog {
  // One chunk of route `route` from its element `first`: sparse, element first +
  // positions[at + j] takes the bits at values[value_at + j x the route's element size], for j
  // below `count`; dense (the stream carried the chunk's new bits whole), each of its `count`
  // elements takes the next bits from values[value_at].
  struct Run {
    std::uint32_t route = 0;
    std::uint32_t count = 0;
    std::int64_t first = 0;
    std::int64_t at = 0;
    std::int64_t value_at = 0;
    bool dense = false;
  };
  // Set once the apply succeeded with every write logged; false for a plane that cannot log.
  bool complete = false;
  std::vector<Run> runs;
  std::vector<std::uint16_t> positions;  // from the run's first element (chunks <= 2^16)
  std::vector<std::byte> values;         // the new bits, in the wire dtype
  std::int64_t elements() const;         // that a replay writes: the runs' counts
};

struct DeltaOptions {
  // Elements per chunk, as a power of two (delta/format.h: 5 ..= 16). Chunks are the unit of
  // parallel work and of the stream's table; 2^13 keeps the table under 0.1 % of a bf16 route.
  int chunk_log2 = 13;
  // A route is sent dense (every element's new bits) when its sparse payload would take at least
  // this fraction of its raw bytes.
  double dense_ratio = 1.0;  // in (0, 1]: above 1 a stream could outgrow delta_stream_capacity
  // CPU plane: lists of fewer elements run on the caller's thread alone (waking the workers costs
  // more). Tests lower it to cross into the parallel path.
  std::int64_t parallel_min_elements = std::int64_t{1} << 20;
  // Names a route in errors ("route <tag>" when empty).
  std::function<std::string(std::uint32_t tag)> describe;
  // apply: where to record what it writes (DeltaLog), or null.
  DeltaLog* log = nullptr;
};

// What an encode wrote, or an apply read and applied.
struct DeltaResult {
  std::size_t stream_bytes = 0;  // encode: bytes written to `out`; apply: bytes read
  std::int64_t elements = 0;     // over every route of the list
  std::int64_t changed = 0;      // elements whose bits changed
  std::int64_t routes_unchanged = 0, routes_sparse = 0, routes_dense = 0;
  // What the call adds to the list's digest (modulo 2^64): the new digest is the base's plus
  // this. capture: the digest itself (of every element).
  std::uint64_t digest_delta = 0;
};

// Lays out the kept copies of `routes` one after another (16-byte aligned each): sets every
// route's `kept` and returns the kept buffer's size in bytes.
std::int64_t assign_kept_offsets(std::vector<DeltaRoute>& routes);
// The largest stream encode can write for `routes` (every route dense): what `out` must hold.
std::size_t delta_stream_capacity(const std::vector<DeltaRoute>& routes);
// Bytes of the wire dtype over every route: what a full refit of the list moves.
std::int64_t delta_full_bytes(const std::vector<DeltaRoute>& routes);

// Checks a list against what the component can do: wire dtypes of 1, 2 or 4 bytes, non-negative
// shapes and strides, fewer than 2^32 elements per route, chunk_log2 in range. Errors name the
// route (options.describe).
Status check_delta_routes(const std::vector<DeltaRoute>& routes, const DeltaOptions& options);

// ---- `refit.delta: auto`: predicted size and time ----

// The stream's predicted bytes for `elements` elements of `esize` bytes in `routes` routes when a
// fraction `density` of them changed and a fraction `exceptions` of the changes moved more than
// one step in ordered space (docs/delta.md, "Size"). Dense fallbacks are included: a chunk never
// costs more than its raw bytes.
std::int64_t predict_delta_bytes(std::int64_t elements, int esize, std::int64_t routes,
                                 double density, double exceptions = 0.05, int chunk_log2 = 13);

// Delta or full for one list (a trainer/engine pair), from the measured link bandwidth (payload
// bytes/s), the density measured on the last refit, and the rates at which this plane encodes and
// the engine's plane applies (elements/s; 0: free). Full moves full_bytes at the link's rate.
struct DeltaChoice {
  bool use_delta = false;
  double delta_seconds = 0;  // encode + wire + apply
  double full_seconds = 0;   // wire
  std::int64_t delta_bytes = 0;
  std::int64_t full_bytes = 0;
};
DeltaChoice choose_delta(std::int64_t elements, int esize, std::int64_t routes, double density,
                         double link_bytes_per_s, double encode_elems_per_s,
                         double apply_elems_per_s, double exceptions = 0.05, int chunk_log2 = 13);
// The density past which a list of bf16 (esize) routes is cheaper sent full on this link (by
// bisection on choose_delta); 1 when delta always wins, 0 when it never does.
double break_even_density(std::int64_t elements, int esize, std::int64_t routes,
                          double link_bytes_per_s, double encode_elems_per_s,
                          double apply_elems_per_s, double exceptions = 0.05, int chunk_log2 = 13);

// "route <tag>" or what options.describe says.
std::string describe_route(const DeltaOptions& options, std::uint32_t tag);

}  // namespace refit
