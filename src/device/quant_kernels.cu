// FP8 amax and quantize kernels (device/quant_kernels.h; semantics: common/quantize.h).
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <limits>
#include <string>

#include "device/cuda_check.h"
#include "device/quant_kernels.h"

namespace refit {
namespace {

constexpr int kThreads = 256;

// A tile: `rows` x `cols` elements of run `run` starting at (row0, col0) of the run.
struct QuantTile {
  std::int32_t run = 0;
  std::int32_t rows = 0;
  std::int32_t cols = 0;
  std::int32_t pad = 0;
  std::int64_t row0 = 0, col0 = 0;
};

template <int kSrc>  // 0: float32, 1: bfloat16, 2: float16
__device__ __forceinline__ float load_f32(const void* base, std::int64_t i) {
  if constexpr (kSrc == 0) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (kSrc == 1) {
    const std::uint32_t u = static_cast<std::uint32_t>(static_cast<const std::uint16_t*>(base)[i])
                            << 16;
    return __uint_as_float(u);
  } else {
    return __half2float(static_cast<const __half*>(base)[i]);
  }
}

template <int kSrc>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const QuantTile* __restrict__ tiles, const DeviceQuantRun* __restrict__ runs) {
  const QuantTile t = tiles[blockIdx.x];
  const DeviceQuantRun& r = runs[t.run];
  auto* grid = static_cast<unsigned int*>(r.grid);
  const int n = t.rows * t.cols;
  // Every thread of a warp takes part in every step (the warp votes below).
  for (int base = 0; base < n; base += kThreads) {
    const int i = base + static_cast<int>(threadIdx.x);
    long long block = -1;
    unsigned int bits = 0;
    if (i < n) {
      const std::int64_t row = t.row0 + i / t.cols, col = t.col0 + i % t.cols;
      const float x = load_f32<kSrc>(r.src, r.src_offset + row * r.src_stride + col);
      bits = __float_as_uint(x) & 0x7FFFFFFFu;
      block = ((r.hf_row + row) / r.block_rows) * r.scale_cols + (r.hf_col + col) / r.block_cols;
    }
    const unsigned int active = __ballot_sync(0xFFFFFFFFu, i < n);
    if (i >= n) continue;
    // Lanes of one block fold their maximum first; the lowest of them writes it.
    const unsigned int same = __match_any_sync(active, block);
    const unsigned int m = __reduce_max_sync(same, bits);
    if ((threadIdx.x & 31) == static_cast<unsigned>(__ffs(same) - 1)) atomicMax(grid + block, m);
  }
}

template <int kSrc>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const QuantTile* __restrict__ tiles, const DeviceQuantRun* __restrict__ runs) {
  const QuantTile t = tiles[blockIdx.x];
  const DeviceQuantRun& r = runs[t.run];
  const auto* scales = static_cast<const float*>(r.grid);
  auto* dst = static_cast<__nv_fp8_storage_t*>(r.dst);
  const int n = t.rows * t.cols;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += kThreads) {
    const std::int64_t row = t.row0 + i / t.cols, col = t.col0 + i % t.cols;
    const float x = load_f32<kSrc>(r.src, r.src_offset + row * r.src_stride + col);
    const float s =
        scales[((r.hf_row + row) / r.block_rows) * r.scale_cols + (r.hf_col + col) / r.block_cols];
    // IEEE division (never the fast reciprocal), then saturating round-to-nearest-even.
    dst[r.dst_offset + row * r.dst_stride + col] =
        __nv_cvt_float_to_fp8(__fdiv_rn(x, s), __NV_SATFINITE, __NV_E4M3);
  }
}

int src_code(DType d) {
  switch (d) {
    case DType::kFloat32:
      return 0;
    case DType::kBFloat16:
      return 1;
    case DType::kFloat16:
      return 2;
    default:
      return -1;
  }
}

template <template <int> class K>
Status launch(const DeviceQuantTable& table, DType src_dtype, void* stream, const char* what) {
  if (table.num_tiles() == 0) return Status::Ok();
  const int code = src_code(src_dtype);
  if (code < 0)
    return Status::InvalidArgument(std::string(what) + ": source dtype " +
                                   std::string(dtype_name(src_dtype)) +
                                   " (float32, bfloat16 or float16 expected)");
  if (table.num_tiles() > std::numeric_limits<int>::max())
    return Status::InvalidArgument(std::string(what) + ": too many tiles for one launch");
  const auto* tiles = static_cast<const QuantTile*>(table.data());
  const auto* runs = reinterpret_cast<const DeviceQuantRun*>(
      static_cast<const std::byte*>(table.data()) +
      static_cast<std::size_t>(table.num_tiles()) * sizeof(QuantTile));
  const auto blocks = static_cast<unsigned>(table.num_tiles());
  auto* s = static_cast<cudaStream_t>(stream);
  if (code == 0) K<0>::run(blocks, s, tiles, runs);
  if (code == 1) K<1>::run(blocks, s, tiles, runs);
  if (code == 2) K<2>::run(blocks, s, tiles, runs);
  REFIT_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

template <int kSrc>
struct AmaxK {
  static void run(unsigned blocks, cudaStream_t s, const QuantTile* t, const DeviceQuantRun* r) {
    amax_kernel<kSrc><<<blocks, kThreads, 0, s>>>(t, r);
  }
};
template <int kSrc>
struct QuantizeK {
  static void run(unsigned blocks, cudaStream_t s, const QuantTile* t, const DeviceQuantRun* r) {
    quantize_kernel<kSrc><<<blocks, kThreads, 0, s>>>(t, r);
  }
};

}  // namespace

Result<DeviceQuantTable> DeviceQuantTable::upload(const std::vector<DeviceQuantRun>& runs,
                                                  int device) {
  std::vector<QuantTile> tiles;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const DeviceQuantRun& r = runs[i];
    if (r.rows <= 0 || r.cols <= 0) continue;
    if (r.cols >= kQuantTileElems) {  // one row at a time, in column chunks
      for (std::int64_t row = 0; row < r.rows; ++row)
        for (std::int64_t c = 0; c < r.cols; c += kQuantTileElems)
          tiles.push_back(QuantTile{static_cast<std::int32_t>(i), 1,
                                    static_cast<std::int32_t>(std::min(kQuantTileElems, r.cols - c)),
                                    0, row, c});
    } else {
      const std::int64_t per = kQuantTileElems / r.cols;
      for (std::int64_t row = 0; row < r.rows; row += per)
        tiles.push_back(QuantTile{static_cast<std::int32_t>(i),
                                  static_cast<std::int32_t>(std::min(per, r.rows - row)),
                                  static_cast<std::int32_t>(r.cols), 0, row, 0});
    }
  }
  DeviceQuantTable t;
  t.tiles_ = static_cast<std::int64_t>(tiles.size());
  const std::size_t tile_bytes = tiles.size() * sizeof(QuantTile);
  const std::size_t bytes = tile_bytes + runs.size() * sizeof(DeviceQuantRun);
  REFIT_ASSIGN_OR_RETURN(t.table_, DeviceBuffer::allocate(std::max<std::size_t>(bytes, 1), device));
  if (!tiles.empty()) REFIT_RETURN_IF_ERROR(copy_to_device(t.table_.data(), tiles.data(), tile_bytes));
  if (!runs.empty())
    REFIT_RETURN_IF_ERROR(copy_to_device(t.table_.bytes() + tile_bytes, runs.data(),
                                         runs.size() * sizeof(DeviceQuantRun)));
  return Result<DeviceQuantTable>(std::move(t));
}

Status launch_fp8_amax(const DeviceQuantTable& table, DType src_dtype, void* stream) {
  return launch<AmaxK>(table, src_dtype, stream, "launch_fp8_amax");
}

Status launch_fp8_quantize(const DeviceQuantTable& table, DType src_dtype, void* stream) {
  return launch<QuantizeK>(table, src_dtype, stream, "launch_fp8_quantize");
}

}  // namespace refit
