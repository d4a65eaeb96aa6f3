// Delta encode, apply, capture and patch on the GPU (delta/delta.h; the CPU twins are
// delta/delta_cpu.h, and both write and read the bytes of delta/format.h).
//
// A list of routes is uploaded once (DeviceDelta::create: per route its addresses and shape, per
// chunk of 2^chunk_log2 elements its route) with the scratch its calls need. Every call is a
// fixed sequence of kernel launches on one stream and one bounded wait at its end, whatever the
// number of routes (apply reads the stream's directory first, and uploads the list of payload
// pieces its checksum kernel takes: two waits):
//  - encode: one thread block per chunk reads the new values (the source cast to the wire dtype),
//    compares them with the kept copy, writes the kept copy where they differ and codes the chunk
//    into its slot (of the chunk's raw size); then per route a scan of the chunks' sizes, per
//    list a scan of the routes' payloads, one block per chunk compacting the slots into the
//    stream, one block writing the directory and the header;
//  - apply: the payload checksums, then every chunk table checked, all before anything is written;
//    then one thread per sparse chunk decodes and scatters its changes, one block per dense chunk
//    compares and writes, and per route the changes and the digest are checked against the
//    directory.
// No CUDA includes: CPU code may include this header. Without CUDA, create returns kUnsupported.
// Not thread-safe: one thread drives a DeviceDelta.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "delta/delta.h"
#include "delta/format.h"
#include "device/device.h"
#include "refit/status.h"

namespace refit {

// The largest chunk the CUDA kernels code: the encode gives each of a chunk's 32-element mask words
// a thread of one 256-thread block, and the apply keeps a bit per change of a chunk in shared
// memory.
inline constexpr int kDeviceDeltaMaxChunkLog2 = 13;

// The encode's scratch, grown to the largest list it served: each chunk's coded data and its
// mask entries (about 1.5 bytes per raw byte of the list). Encodes that run one after another on
// one CUDA stream share one, so a rank's lists cost their tables, not a scratch each.
class DeviceDeltaScratch {
 public:
  DeviceDeltaScratch() = default;
  DeviceDeltaScratch(const DeviceDeltaScratch&) = delete;
  DeviceDeltaScratch& operator=(const DeviceDeltaScratch&) = delete;
  // Device memory of at least `slot_bytes` and `mask_bytes` (the old contents are not kept).
  Status reserve(std::size_t slot_bytes, std::size_t mask_bytes, int device);
  void* slots() const { return slots_.data(); }
  void* masks() const { return masks_.data(); }

 private:
  DeviceBuffer slots_, masks_;
};

class DeviceDelta {
 public:
  // `routes` as delta/delta.h describes them (device pointers; checked with check_delta_routes by
  // the caller). chunk_log2 at most kDeviceDeltaMaxChunkLog2.
  static Result<std::unique_ptr<DeviceDelta>> create(const std::vector<DeltaRoute>& routes,
                                                     int chunk_log2, int device);
  ~DeviceDelta();
  DeviceDelta(const DeviceDelta&) = delete;
  DeviceDelta& operator=(const DeviceDelta&) = delete;

  // `scratch` is used by no other list's encode until this one's work on `stream` is done.
  Result<DeltaResult> encode(std::byte* kept, std::byte* out, std::size_t capacity,
                             std::uint64_t base_digest, double dense_ratio, void* stream,
                             std::chrono::milliseconds timeout, DeviceDeltaScratch& scratch);
  Result<DeltaResult> capture(std::byte* kept, void* stream, std::chrono::milliseconds timeout);
  Result<DeltaResult> patch(std::byte* kept, void* stream, std::chrono::milliseconds timeout);

  // What an apply found wrong: the first route (in list order) and why.
  enum class ApplyError : int {
    kNone = 0,
    kPayloadChecksum = 1,  // nothing was written
    kChunkTable = 2,       // nothing was written
    kCodes = 3,            // malformed codes: the route was applied in part
    kResult = 4,           // applied; its changes or digest differ from the directory's
  };
  struct ApplyFailure {
    ApplyError error = ApplyError::kNone;
    std::size_t route = 0;
  };
  // Applies a stream in device memory whose header and directory the caller read and checked on
  // the host (read_stream_directory: `entries`, one per route). Sparse routes must use this
  // list's chunk size. On a failure the result is kCorruption and `failure` says where.
  Result<DeltaResult> apply(const std::vector<delta_format::RouteEntry>& entries,
                            const std::byte* stream, std::size_t bytes, void* cuda_stream,
                            std::chrono::milliseconds timeout, ApplyFailure* failure);

  int chunk_log2() const { return chunk_log2_; }

 private:
  DeviceDelta() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int chunk_log2_ = 13;
};

}  // namespace refit
