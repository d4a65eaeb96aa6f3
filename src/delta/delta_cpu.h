// The delta component on host memory (delta/delta.h): the loops the CPU data plane runs on its
// worker pool, chunk by chunk. Streams are bit for bit those of the CUDA kernels
// (delta/format.h), so either side may run on either plane.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "delta/delta.h"
#include "delta/format.h"

namespace refit {

// Workers to run on: run(items, body) calls body(begin, end, worker) over disjoint ranges that
// cover [0, items), worker in [0, count), and returns when every call returned. Each worker id
// is used by one thread at a time.
struct HostWorkers {
  int count = 1;
  std::function<void(std::int64_t items,
                     const std::function<void(std::int64_t, std::int64_t, int)>& body)>
      run;
  // Workers that run every range on the calling thread.
  static HostWorkers inline_only();
};

// Every route with elements has a source (encode, capture, patch) / a destination (apply, patch);
// errors name the route. Every plane checks this before it runs a list.
Status check_delta_pointers(const std::vector<DeltaRoute>& routes, const DeltaOptions& options,
                            bool need_src, bool need_dst);

// DataPlane::delta_encode on host memory: reads every route's new values once, compares them with
// the kept copy at `kept`, updates the kept copy where they differ and writes the stream to `out`
// (at most `capacity` bytes: delta_stream_capacity). `base_digest` goes into the header.
Result<DeltaResult> delta_encode_host(const std::vector<DeltaRoute>& routes, std::byte* kept,
                                      std::byte* out, std::size_t capacity,
                                      std::uint64_t base_digest, const DeltaOptions& options,
                                      const HostWorkers& workers);
// DataPlane::delta_capture: the kept copy becomes the new values; digest_delta is the digest of
// every element (the list's digest after a full refit of the same values).
Result<DeltaResult> delta_capture_host(const std::vector<DeltaRoute>& routes, std::byte* kept,
                                       const DeltaOptions& options, const HostWorkers& workers);
// DataPlane::delta_apply: checks the stream (header, directory, every route's payload checksum,
// its tables) before writing anything, then applies every route in place at its dst. Errors
// (kCorruption) name the route; a stream computed against another base than `base_digest` is
// refused before any byte is written.
Result<DeltaResult> delta_apply_host(const std::vector<DeltaRoute>& routes, const std::byte* stream,
                                     std::size_t bytes, std::uint64_t base_digest,
                                     const DeltaOptions& options, const HostWorkers& workers);
// DataPlane::delta_replay: writes what a complete DeltaLog recorded onto `routes` (the logged
// apply's routes with other destinations, which hold the same base). Checks every run against
// the routes and the log before writing.
Status delta_replay_host(const std::vector<DeltaRoute>& routes, const DeltaLog& log,
                         const DeltaOptions& options, const HostWorkers& workers);
// DataPlane::delta_patch: encode and apply at once where the trainer writes the engine's memory
// (peer access): changed elements are written to the kept copy and to dst, nothing else.
Result<DeltaResult> delta_patch_host(const std::vector<DeltaRoute>& routes, std::byte* kept,
                                     const DeltaOptions& options, const HostWorkers& workers);

// The header and directory of a stream of `bytes` bytes (`head` holds at least the header and
// the directory: kHeaderBytes + 64 x routes bytes), checked against the routes the reader
// expects: magic, version, total size, route count, the header checksum, the base digest, and
// per route its tag, element count, element size, mode, chunk size and payload bounds. Used by
// every plane before it reads a payload.
Result<std::vector<delta_format::RouteEntry>> read_stream_directory(
    const std::vector<DeltaRoute>& routes, const std::byte* head, std::size_t bytes,
    std::uint64_t base_digest, const DeltaOptions& options);

// Sum of checksum_term(first_key + i, word i) over `words` 32-bit words at `p` (the payload and
// header checksums of delta/format.h). The last word may be partial: `bytes` counts the real
// bytes, the rest reads as zero.
std::uint64_t delta_words_checksum(const std::byte* p, std::uint64_t bytes,
                                   std::uint64_t first_key);

}  // namespace refit
