// Batched strided copies with a dtype cast on the GPU: the one copy engine behind pack (trainer
// shards → bucket), unshard scatter (gathered stage → bucket) and apply (bucket → engine
// parameters) on `device: cuda` — the GPU twin of common/convert.h's convert_block, bit for bit.
//
// A copy is described once, at setup, as a list of Block2D runs (common/piece.h; offsets and
// strides in elements of the respective dtype). DeviceBlockTable cuts the runs into tiles of at
// most kTileElems elements and uploads them to device memory once; one kernel launch then
// executes a whole group of runs (a bucket, or a whole model) with one thread block per tile,
// 16-byte loads and stores wherever the tile's addresses allow, scalar accesses otherwise.
//
// Casts round exactly like common/convert.h (round-to-nearest-even, NaN → quiet NaN keeping its
// sign and top payload bits, fp8 e4m3fn saturating); same-dtype copies move bits unchanged.
//
// The same tables drive the deterministic-weights kernels: with runs whose src_offset is a flat
// element index into HF tensor `tag` (src_stride = that tensor's row length), launch_generate
// writes exactly what weights/weights.h WeightSource::values would compute (synthetic weights,
// no checkpoint), rounded through `via` like weights/materialize.h, and verify_generated counts
// the elements of a tensor that differ from it — so GPU ranks fill and verify billions of
// elements without a host copy.
//
// No CUDA includes: CPU code may include this header. Without CUDA every launch returns
// kUnsupported. Launches are asynchronous on `stream` (a cudaStream_t, null = default stream);
// the caller keeps src, dst and the table alive until the stream has passed the launch.
// A DeviceBlockTable is immutable after upload and may be used by several streams at once.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/piece.h"
#include "device/device.h"
#include "refit/dtype.h"
#include "refit/model_spec.h"
#include "refit/status.h"

namespace refit {

// Elements per tile (one thread block). Large enough that per-tile overhead vanishes, small
// enough that a whole bucket spreads over every multiprocessor.
inline constexpr std::int64_t kTileElems = std::int64_t{1} << 16;

// One tile as it lives in device memory (40 bytes): rows x cols elements.
struct DeviceTile {
  std::int64_t src_offset = 0;
  std::int64_t dst_offset = 0;
  std::int32_t src_stride = 0;
  std::int32_t dst_stride = 0;
  std::int32_t rows = 0;
  std::int32_t cols = 0;
  std::uint32_t tag = 0;  // HF tensor index for generate/verify; unused by copies
  std::uint32_t reserved = 0;
};

// Cuts `run` into tiles (appended to `out`): a run whose rows are contiguous on both sides
// becomes one long row first; rows longer than kTileElems are split into column chunks of
// kTileElems; short rows are grouped, kTileElems / cols rows per tile. Tiles preserve the run's
// element order and cover it exactly once. Errors (kInvalidArgument) when a stride or row length
// exceeds 2^31 - 1 elements, or a dimension or offset is negative.
Status tile_run(const Block2D& run, std::uint32_t tag, std::vector<DeviceTile>& out);

class DeviceBlockTable {
 public:
  DeviceBlockTable() = default;
  // groups[g] holds the runs of group g; tags (optional, same shape) the per-run tag.
  // Tiles every run and uploads the tiles of all groups in one device allocation on `device`.
  static Result<DeviceBlockTable> upload(
      const std::vector<std::vector<Block2D>>& groups, int device,
      const std::vector<std::vector<std::uint32_t>>* tags = nullptr);

  std::size_t num_groups() const { return group_begin_.empty() ? 0 : group_begin_.size() - 1; }
  std::int64_t num_tiles() const { return group_begin_.empty() ? 0 : group_begin_.back(); }
  std::int64_t group_numel(std::size_t group) const { return group_numel_[group]; }
  std::int64_t numel() const;                                 // elements over every group
  std::size_t device_bytes() const { return tiles_.size(); }  // the table's device memory
  int device() const { return tiles_.device(); }

  // For the launchers: tiles [tile_begin(g), tile_end(g)) belong to group g.
  const DeviceTile* tiles() const { return static_cast<const DeviceTile*>(tiles_.data()); }
  std::int64_t tile_begin(std::size_t group) const { return group_begin_[group]; }
  std::int64_t tile_end(std::size_t group) const { return group_begin_[group + 1]; }

 private:
  DeviceBuffer tiles_;
  std::vector<std::int64_t> group_begin_;  // num_groups + 1 prefix offsets, in tiles
  std::vector<std::int64_t> group_numel_;
};

// How the copy kernels move bytes. Process-wide; set it at setup, before launches start (it is
// read at every launch without synchronisation). Measured on an H200 (notes/gpu-runs.md, run 3):
// the bulk engine copies same-dtype data between two buffers of one process 6 % faster than the
// thread kernel (4.03 vs 3.79 TB/s read+write) but writes through a CUDA IPC mapping 6 % slower
// (3.56 vs 3.78) — so the default (off) suits the zero-copy refit, which writes into the
// engine's IPC-mapped parameters; turn it on in a process whose same-dtype copies stay local
// (unshard scatter, an engine applying from its own bucket).
struct CopyKernelTuning {
  // Same-dtype contiguous tiles go through the Hopper bulk-copy engine (cp.async.bulk, staged in
  // 64 KiB of shared memory per block); other tiles use the thread kernel.
  bool bulk_same_dtype = false;
};
void set_copy_kernel_tuning(const CopyKernelTuning& tuning);
CopyKernelTuning copy_kernel_tuning();

// Executes the runs of one group (or of every group) of `table`: converts src elements (dtype
// src_dtype) to dst elements (dtype dst_dtype). Runs must not overlap in dst; src and dst must
// not overlap. Empty groups launch nothing.
Status launch_block_copy(const DeviceBlockTable& table, std::size_t group, const void* src,
                         DType src_dtype, void* dst, DType dst_dtype, void* stream);
Status launch_block_copy(const DeviceBlockTable& table, const void* src, DType src_dtype, void* dst,
                         DType dst_dtype, void* stream);

// Converts n contiguous elements (the "one flat cast pass" floor of a refit; also a plain copy
// when the dtypes match).
Status launch_flat_convert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                           std::size_t n, void* stream);

// The deterministic weights of weights/weights.h at `step` for every tile of `group` (or of all
// groups): element (r, c) of a run is HF element src_offset + r*src_stride + c of tensor `tag`;
// its fp32 value is rounded to `via` (the trainer's dtype) and then to dst_dtype, and written at
// dst element dst_offset + r*dst_stride + c.
struct WeightsParams {
  std::uint64_t seed = 0;
  int step = 0;
  DType via = DType::kFloat32;
  float adam_lr = 0;  // > 0: the update adam:LR of weights/weights.h; 0: drift
};
Status launch_generate(const DeviceBlockTable& table, std::size_t group,
                       const WeightsParams& params, void* dst, DType dst_dtype, void* stream);
Status launch_generate(const DeviceBlockTable& table, const WeightsParams& params, void* dst,
                       DType dst_dtype, void* stream);

// Compares `actual` against what launch_generate would write, over every group, bit for bit.
// Waits (bounded by `timeout`) for the result.
struct VerifyResult {
  std::uint64_t mismatches = 0;
  std::int64_t first_dst_offset = -1;  // smallest mismatching dst element, -1 when none
};
Result<VerifyResult> verify_generated(const DeviceBlockTable& table, const WeightsParams& params,
                                      const void* actual, DType dtype, void* stream,
                                      std::chrono::milliseconds timeout);

// The refit checksum (common/checksum.h) of every tile of `table`: element (r, c) of a tile is
// read at src element src_offset + r*src_stride + c, converted from src_dtype to as_dtype like
// launch_block_copy, and keyed dst_offset + r*dst_stride + c. Waits (bounded by `timeout`) for
// the sum.
Result<std::uint64_t> block_checksum(const DeviceBlockTable& table, const void* src,
                                     DType src_dtype, DType as_dtype, void* stream,
                                     std::chrono::milliseconds timeout);

// Whether this binary carries kernels `device` can run (SASS for its architecture, or PTX it can
// JIT). kUnsupported names the GPU, its compute capability and the architectures built
// (CMAKE_CUDA_ARCHITECTURES) when it does not. set_device() checks this once per device, so a
// rank on such a GPU fails at setup instead of at its first launch.
Status check_kernel_image(int device);

// ---- building runs from layouts (CPU) ----

// Runs that move the pieces of one local tensor (shape `dst_shape`, starting at element
// `dst_base` of its arena) from HF tensors: for piece p, src_offset = src_base[p.hf_tensor] +
// the flat HF index of (p.src_row, p.src_col), src_stride = the HF tensor's row length; tag =
// p.hf_tensor. With src_base all zero (pass nullptr) the runs address HF element indices, as
// launch_generate expects; with src_base = each HF tensor's offset in a trainer arena (FSDP2 at
// world size 1: local tensors are the HF tensors) they are the zero-copy refit's runs.
void append_piece_runs(const ModelSpec& spec, const std::vector<Piece>& pieces,
                       const std::vector<std::int64_t>& dst_shape, std::int64_t dst_base,
                       const std::vector<std::int64_t>* src_base, std::vector<Block2D>& runs,
                       std::vector<std::uint32_t>& tags);

}  // namespace refit
