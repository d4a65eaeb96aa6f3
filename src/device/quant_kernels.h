// FP8 quantization on the GPU (common/quantize.h gives the semantics, bit for bit): block amax
// and quantize-in-copy over lists of strided runs, the twins of DataPlane::block_amax and
// DataPlane::quantize on device memory.
//
// A list is tiled once (tile_quant_runs) and uploaded (DeviceQuantTable); each launch runs one
// thread block per tile. No CUDA includes: CPU code may include this header. Without CUDA every
// launch returns kUnsupported.
#pragma once
#include <cstdint>
#include <vector>

#include "device/device.h"
#include "refit/dtype.h"
#include "refit/status.h"

namespace refit {

// One run as the kernels see it: element (r, c) is read at src + (src_offset + r*src_stride + c)
// elements and written at dst + (dst_offset + r*dst_stride + c) bytes (quantize); it sits at
// (hf_row + r, hf_col + c) of its HF tensor, whose grid (uint32 amax bits, or float32 scales)
// has scale_cols blocks per row of block_rows x block_cols.
struct DeviceQuantRun {
  const void* src = nullptr;
  void* dst = nullptr;
  void* grid = nullptr;
  std::int64_t src_offset = 0, src_stride = 0;
  std::int64_t dst_offset = 0, dst_stride = 0;
  std::int64_t rows = 0, cols = 0;
  std::int64_t hf_row = 0, hf_col = 0;
  std::int64_t block_rows = 1, block_cols = 1, scale_cols = 1;
  // quantize in one pass (DataPlane::QuantRun): per block of the grid (host memory, read when the
  // table is built), 0 where the block lies whole in this run and the kernel computes its scale.
  const std::uint8_t* from_grid = nullptr;
  unsigned long long* bad = nullptr;  // [count, smallest tag << 32 | block] of non-finite blocks
  std::uint32_t tag = 0;
};

// The runs cut into tiles (up to 64 rows of one block row, up to 1024 columns; a block the kernel
// scales itself is one tile), uploaded to `device`.
class DeviceQuantTable {
 public:
  // `src_dtype`: the runs' source dtype (the vector paths depend on its size).
  static Result<DeviceQuantTable> upload(const std::vector<DeviceQuantRun>& runs, DType src_dtype,
                                         int device);
  std::int64_t num_tiles() const { return tiles_; }
  const void* data() const { return table_.data(); }
  // Shared memory a quantize thread block stages its whole block in (0: no such tile).
  std::size_t stage_bytes() const { return stage_bytes_; }

 private:
  DeviceBuffer table_;
  std::int64_t tiles_ = 0;
  std::size_t stage_bytes_ = 0;
};

// Folds max |x| of every element into its block's amax (atomic max on the uint32 bits).
Status launch_fp8_amax(const DeviceQuantTable& table, DType src_dtype, void* stream);
// Writes quantize_fp8(x, scale) of every element (float8 e4m3fn bytes).
Status launch_fp8_quantize(const DeviceQuantTable& table, DType src_dtype, void* stream);

}  // namespace refit
