// The data plane: where a rank's bytes live and the one operation every stage performs on them —
// executing a list of strided block copies with a dtype conversion (pack: shards → bucket,
// scatter: gathered contributions → bucket, apply: bucket → engine parameters).
//
// The CPU plane uses host memory and a small worker pool; a CUDA plane (device: cuda) uses device
// memory and one kernel launch per call. Runs hold absolute pointers, so a list is built once per
// bucket after the storage is registered and reused by every refit. Not thread-safe: one thread
// drives a plane.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/piece.h"
#include "delta/delta.h"
#include "refit/config.h"
#include "refit/dtype.h"
#include "refit/status.h"

namespace refit {

// One strided block: `block.src_*` index elements of `src`, `block.dst_*` elements of `dst`.
// A list of runs is built once and never changed afterwards, so a device plane may keep an
// uploaded copy of it (keyed by the vector's address and size).
struct CopyRun {
  const std::byte* src = nullptr;
  std::byte* dst = nullptr;
  Block2D block;
};

// Runs whose elements differ in size (an FP8 engine's fp8 weights, float32 scales and bf16
// norms arriving in one staging slot) are copied as bytes: a same-dtype copy of a 1-byte dtype
// moves bits unchanged.
inline constexpr DType kByteCopyDType = DType::kFloat8E4M3;
// `elems` (offsets, strides and columns in elements of `esize` bytes) as a run of bytes.
inline CopyRun byte_run(const std::byte* src, std::byte* dst, const Block2D& elems,
                        std::size_t esize) {
  const auto e = static_cast<std::int64_t>(esize);
  return CopyRun{.src = src,
                 .dst = dst,
                 .block = {.src_offset = elems.src_offset * e,
                           .src_stride = elems.src_stride * e,
                           .dst_offset = elems.dst_offset * e,
                           .dst_stride = elems.dst_stride * e,
                           .rows = elems.rows,
                           .cols = elems.cols * e}};
}

// FP8 quantization (common/quantize.h) of one run: element (r, c) of `run` is element
// (hf_row + r, hf_col + c) of its HF tensor, whose block grid (block_rows x block_cols blocks,
// scale_cols blocks per row) lives at `grid` in plane memory: float32 scales for quantize(),
// uint32 amax bits (abs_bits) for block_amax().
//
// quantize() in one pass: where `from_grid` (host memory, one flag per block of the grid) is 0 for
// a block, the block lies whole in this run and its scale is not in the grid yet: the call computes
// it from the block (amax, as block_amax + fp8_scale_from_amax would), writes it to the grid and
// quantizes with it. A non-finite block is counted at `bad` (plane memory, two uint64: the count,
// then the smallest (tag << 32 | block index) seen); its codes are undefined.
struct QuantRun {
  CopyRun run;
  std::byte* grid = nullptr;
  std::int64_t hf_row = 0, hf_col = 0;
  std::int64_t block_rows = 1, block_cols = 1;
  std::int64_t scale_cols = 1;
  const std::uint8_t* from_grid = nullptr;  // null: every scale is in the grid
  std::byte* bad = nullptr;
  std::uint32_t tag = 0;  // the HF tensor, for `bad`
  std::int64_t block_index(std::int64_t r, std::int64_t c) const {
    return ((hf_row + r) / block_rows) * scale_cols + (hf_col + c) / block_cols;
  }
};

struct RankModel;

// A tensor of plane memory built from pieces of HF tensors (trainer shards, engine parameters).
struct PieceTarget {
  const std::vector<Piece>* pieces = nullptr;
  std::vector<std::int64_t> shape;
  std::byte* data = nullptr;
};

class PlaneBuffer {
 public:
  virtual ~PlaneBuffer() = default;
  virtual std::byte* data() = 0;
  virtual std::size_t size() const = 0;
  // Exported memory: the peer has mapped it, drop any name that would outlive a crash.
  virtual void release_name() {}
};

// What the CLI's harness (`refit run`, `refit bench`, `--fault`) does with a plane besides moving a
// refit's bytes: generate and check the deterministic weights, measure the bandwidths behind the
// floor, damage a byte. Reached by DataPlane::diagnostics(); nothing on the refit path uses it.
class PlaneDiagnostics {
 public:
  virtual ~PlaneDiagnostics() = default;
  // The deterministic weights (weights/weights.h) of `step` into several tensors at once: each
  // target's pieces, rounded to `via`, then written as `out` dtype. Elements no piece covers are
  // left as they are.
  virtual Status fill_weights(const RankModel& model, const std::vector<PieceTarget>& targets,
                              int step, DType via, DType out) = 0;
  // Compares each target with what fill_weights would write; the first differing element
  // (target index, element index), or nullopt when every covered element matches.
  virtual Result<std::optional<std::pair<std::size_t, std::int64_t>>> find_mismatch(
      const RankModel& model, const std::vector<PieceTarget>& targets, int step, DType via,
      DType dtype) = 0;
  // Read+write bytes per second of a large copy within this plane's memory (median of a few
  // copies of a 1 GiB buffer): the bandwidth behind the floor of a colocated refit (docs/design.md
  // §7).
  virtual Result<double> measure_copy_bandwidth() = 0;
  // Payload bytes per second of a large copy from this plane's device to device `peer` (GPU:
  // copy engines over NVLink / PCIe; CPU, or peer == ordinal(): half the copy bandwidth, since
  // every byte is read and written in one memory). The floor of a refit across devices.
  virtual Result<double> measure_peer_bandwidth(int peer) = 0;
  // Flips bits of one byte of plane memory (fault injection).
  virtual Status corrupt_byte(std::byte* at) = 0;
};

class DataPlane {
 public:
  virtual ~DataPlane() = default;
  virtual Device device() const = 0;
  virtual int ordinal() const = 0;  // GPU index (0 on CPU)
  // Copies `bytes` bytes within plane memory (raw transport passes).
  Status copy_bytes(std::byte* dst, const std::byte* src, std::size_t bytes);
  // Zero-filled memory of this plane, faulted in / allocated now (registration cost is paid at
  // setup, not during a refit).
  virtual Result<std::unique_ptr<PlaneBuffer>> allocate(std::size_t bytes) = 0;
  // Memory another process on the same device can map (CPU: a POSIX shared-memory segment named
  // `name`; CUDA: an IPC memory handle). `handle` receives what the peer passes to open_exported.
  virtual Result<std::unique_ptr<PlaneBuffer>> allocate_exported(std::size_t bytes,
                                                                 const std::string& name,
                                                                 std::string* handle) = 0;
  // A handle for open_exported to `bytes` of memory the caller allocated (registered storage).
  // CUDA: an IPC handle of the cudaMalloc allocation holding it (the caching allocators' memory
  // qualifies); CPU: kUnsupported — host memory a caller allocated cannot be mapped by another
  // process (use allocate_exported).
  virtual Result<std::string> export_existing(std::byte* ptr, std::size_t bytes) = 0;
  // Whether export_existing can succeed on this plane at all.
  virtual bool can_export_existing() const = 0;
  // Maps memory exported by a peer on the same host, once (never per refit).
  virtual Result<std::unique_ptr<PlaneBuffer>> open_exported(const std::string& handle,
                                                             std::size_t bytes) = 0;
  // Copies `bytes` of plane memory to host memory (reading results, error messages).
  virtual Status read(void* host_dst, const std::byte* src, std::size_t bytes) = 0;
  // Copies `bytes` of host memory into plane memory.
  virtual Status write(std::byte* dst, const void* host_src, std::size_t bytes) = 0;
  // What the CLI's harness does with a plane besides moving a refit's bytes (PlaneDiagnostics);
  // null on a plane that offers none.
  virtual PlaneDiagnostics* diagnostics() { return nullptr; }

  // Executes every run, converting `src_dtype` elements to `dst_dtype`. Runs must not overlap in
  // their destinations. When `src_base` is set it replaces every run's `src` (a bucket that
  // arrived in one of several slots). Returns when the copies are complete.
  virtual Status copy(const std::vector<CopyRun>& runs, DType src_dtype, DType dst_dtype,
                      const std::byte* src_base = nullptr) = 0;

  // FP8: folds max |x| of every element of every run (src elements of `src_dtype`) into its
  // block's amax in the run's grid (uint32 bits, compared as integers: NaN above inf). The grid
  // keeps what it held: zero it before the first call of a refit. Returns when complete.
  virtual Status block_amax(const std::vector<QuantRun>& runs, DType src_dtype) = 0;
  // FP8: writes quantize_fp8(x, scale of x's block) of every element to the run's dst (float8
  // e4m3fn), the scales read from the run's grid (float32), or computed in the same pass where
  // from_grid says so (QuantRun). Returns when complete.
  virtual Status quantize(const std::vector<QuantRun>& runs, DType src_dtype) = 0;
  // FP8: copy(cast, cast_from, cast_to) and quantize(quant, quant_from), which write disjoint
  // destinations. The GPU plane runs them at once on two streams: the cast takes the memory
  // bandwidth the quantize kernel leaves between its reads (docs/fp8.md). Returns when both are
  // complete.
  virtual Status copy_and_quantize(const std::vector<CopyRun>& cast, DType cast_from, DType cast_to,
                                   const std::vector<QuantRun>& quant, DType quant_from) {
    REFIT_RETURN_IF_ERROR(copy(cast, cast_from, cast_to));
    return quantize(quant, quant_from);
  }
  // The refit checksum (common/checksum.h) of every element of every run: element (r, c) of a
  // run is read at `src` element block.src_offset + r*block.src_stride + c, converted from
  // `src_dtype` to `as_dtype` exactly as copy() would, and keyed block.dst_offset +
  // r*block.dst_stride + c (`dst` is unused). The sum does not depend on how the elements are
  // split into runs.
  virtual Result<std::uint64_t> checksum(const std::vector<CopyRun>& runs, DType src_dtype,
                                         DType as_dtype) = 0;

  // ---- delta refits (delta/delta.h, docs/delta.md) ----
  // A list of routes is built once and reused by every refit (the CUDA plane uploads it once,
  // keyed by the vector's address and content, like copy lists). `kept` is plane memory of
  // assign_kept_offsets(routes) bytes; `out` and `stream` are plane memory, 8-byte aligned. Every
  // call returns when it is complete. Errors name the route (options.describe).
  //
  // encode: reads every route's new values once (its source cast to the wire dtype), compares them
  // with the kept copy, updates the kept copy where they differ, and writes the stream (at most
  // `capacity` bytes: delta_stream_capacity) computed against the base of digest `base_digest`.
  virtual Result<DeltaResult> delta_encode(const std::vector<DeltaRoute>& routes, std::byte* kept,
                                           std::byte* out, std::size_t capacity,
                                           std::uint64_t base_digest,
                                           const DeltaOptions& options) = 0;
  // capture: the kept copy becomes the new values (after a full refit of them); digest_delta is
  // their digest.
  virtual Result<DeltaResult> delta_capture(const std::vector<DeltaRoute>& routes, std::byte* kept,
                                            const DeltaOptions& options) = 0;
  // apply: the stream, in place at every route's dst, which must hold the base of digest
  // `base_digest`. A stream for another base, or one that fails its checksums or its tables, is
  // refused (kCorruption) before anything is written; a route whose applied changes differ from
  // the trainer's (the engine's bytes differ from the base at a changed element) fails after.
  virtual Result<DeltaResult> delta_apply(const std::vector<DeltaRoute>& routes,
                                          const std::byte* stream, std::size_t bytes,
                                          std::uint64_t base_digest,
                                          const DeltaOptions& options) = 0;
  // replay: writes what an apply logged (DeltaOptions::log, complete) onto `routes`, the logged
  // list with other destinations that hold the same base. A plane that cannot log leaves every
  // log incomplete, and refuses this (kUnsupported).
  virtual Status delta_replay(const std::vector<DeltaRoute>& routes, const DeltaLog& log,
                              const DeltaOptions& options) = 0;
  // patch (peer access, where the trainer writes the engine's memory): what changed is written to
  // the kept copy and to dst, nothing else.
  virtual Result<DeltaResult> delta_patch(const std::vector<DeltaRoute>& routes, std::byte* kept,
                                          const DeltaOptions& options) = 0;
  // The digest of every route's elements at dst (an engine rank's after a full refit): the sum of
  // refit.checksum over them, keyed as the routes say.
  Result<std::uint64_t> delta_digest(const std::vector<DeltaRoute>& routes);

  // Bytes copy() has moved so far, by who moved them: on CUDA the copy kernel or the copy engines
  // (REFIT_COPY_ENGINE); the CPU plane counts its threads' copies as `kernel`.
  struct CopyPathBytes {
    std::int64_t kernel = 0;
    std::int64_t copy_engines = 0;
  };
  CopyPathBytes copy_path_bytes() const {
    return {.kernel = kernel_bytes_.load(), .copy_engines = copy_engine_bytes_.load()};
  }

 protected:
  // Counted by copy(), which stages on different threads may call.
  std::atomic<std::int64_t> kernel_bytes_{0}, copy_engine_bytes_{0};
};

// What a plane takes from the process's environment, read once at the edge (the library's
// Trainer::create / Engine::create, the CLI) and passed in: REFIT_CPU_THREADS, REFIT_COPY_ENGINE
// and REFIT_DEVICE (common/env.h). Default-constructed: the defaults, whatever the environment.
struct PlaneSettings {
  int cpu_threads = 0;        // CPU workers; 0: the number of cores, at most 8
  int copy_engine = 2;        // env::CopyEngineUse as int: 0 kernel, 1 copy engines, 2 auto
  std::optional<int> device;  // the GPU every rank of this process uses; nullopt: by placement
  // The settings this process's environment gives; a bad value is an InvalidArgument naming it.
  static Result<PlaneSettings> from_environment();
};

// The plane of `config.device`. CPU: `settings.cpu_threads` workers. CUDA: GPU `device` (modulo
// the visible GPUs), one stream, `settings.copy_engine`.
Result<std::unique_ptr<DataPlane>> make_data_plane(const Config& config, int device = 0,
                                                   const PlaneSettings& settings = {});

// Verification on the host: the first element of target `t` whose bytes at `actual` (host memory)
// differ from what the weight source gives at `step` (elements no piece covers must be zero), or
// nullopt. `expected` is scratch space, reused across calls.
std::optional<std::int64_t> first_host_mismatch(const RankModel& model, const PieceTarget& t,
                                                int step, DType via, DType dtype,
                                                const std::byte* actual,
                                                std::vector<std::byte>& expected);
// The GPU a rank uses: `settings.device` (REFIT_DEVICE) when set; otherwise colocated ranks share
// the device of their trainer rank, and non-colocated trainer ranks take the first GPUs and
// engine ranks the next (modulo the count).
int default_device(const Config& config, bool trainer, int rank, const PlaneSettings& settings);
// The device ordinal that rank's plane actually uses: default_device modulo the visible GPUs
// (0 on CPU, where every rank shares one memory).
int device_ordinal(const Config& config, bool trainer, int rank, const PlaneSettings& settings);

}  // namespace refit
