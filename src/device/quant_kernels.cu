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

// A tile: `rows` x `cols` elements of run `run` starting at (row0, col0) of the run. Its rows lie
// in one block row of the HF tensor (so every element of a column shares one scale), at most
// kTileRows of them, and at most kTileCols columns: each thread owns whole columns of the tile.
constexpr int kTileRows = 64;
constexpr int kTileCols = 4 * kThreads;
struct QuantTile {
  std::int32_t run = 0;
  std::int32_t rows = 0;
  std::int32_t cols = 0;
  std::int32_t vec = 0;  // the vector paths apply (see load8_f32)
  std::int64_t row0 = 0, col0 = 0;
  std::int32_t fused = 0;  // one whole block: its scale is computed here (fused_block)
  std::int32_t pad = 0;
};

template <int kSrc>  // 0: float32, 1: bfloat16, 2: float16
__device__ __forceinline__ float load_f32(const void* base, std::int64_t i) {
  if constexpr (kSrc == 0) {
    return __ldcs(static_cast<const float*>(base) + i);
  } else if constexpr (kSrc == 1) {
    const std::uint32_t u =
        static_cast<std::uint32_t>(__ldcs(static_cast<const unsigned short*>(base) + i)) << 16;
    return __uint_as_float(u);
  } else {
    return __half2float(__ushort_as_half(__ldcs(static_cast<const unsigned short*>(base) + i)));
  }
}

// Eight consecutive elements at `base + i` (i a multiple of 8, the address 16-byte aligned) as
// float32: one or two 16-byte loads.
// kKeep: a first read whose data is read again soon (cached normally, so that the second read
// hits L2); otherwise streaming (evict first).
template <int kSrc, bool kKeep = false>
__device__ __forceinline__ void load8_f32(const void* base, std::int64_t i, float (&x)[8]) {
  if constexpr (kSrc == 0) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    const float4 a = kKeep ? __ldg(p) : __ldcs(p), b = kKeep ? __ldg(p + 1) : __ldcs(p + 1);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(base) + i);
    const uint4 q = kKeep ? __ldg(p) : __ldcs(p);
    const unsigned int w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (kSrc == 1) {
        x[2 * k] = __uint_as_float(w[k] << 16);
        x[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
      } else {
        x[2 * k] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[k] & 0xFFFFu)));
        x[2 * k + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[k] >> 16)));
      }
    }
  }
}

// Tiles whose every row is 8-element groups that are 16-byte aligned at the source, 8-byte
// aligned at the destination and never straddle a block column (QuantTile::vec) take the vector
// paths below: one load of 8 elements, one scale and one 8-byte store per group.

// Each thread folds max |x| down its columns (no division per element), then the tile's threads
// fold per block column in shared memory, and one atomic per block column reaches the grid.
template <int kSrc>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const QuantTile* __restrict__ tiles, const DeviceQuantRun* __restrict__ runs) {
  __shared__ unsigned int block_max[kTileCols + 2];
  const QuantTile t = tiles[blockIdx.x];
  const DeviceQuantRun& r = runs[t.run];
  const std::int64_t hf_col0 = r.hf_col + t.col0;
  const auto bc = static_cast<std::int64_t>(r.block_cols);
  const std::int64_t first_bcol = hf_col0 / bc;
  const int nbcols = static_cast<int>((hf_col0 + t.cols - 1) / bc - first_bcol + 1);
  for (int i = threadIdx.x; i < nbcols; i += kThreads) block_max[i] = 0;
  __syncthreads();
  const std::int64_t src0 = r.src_offset + t.row0 * r.src_stride + t.col0;
  if (t.vec) {  // thread i: group i % groups of row i / groups (and every kThreads-th after)
    const int groups = t.cols / 8;
    for (int g = threadIdx.x; g < groups * t.rows; g += kThreads) {
      const int row = g / groups, c = (g % groups) * 8;
      float x[8];
      load8_f32<kSrc>(r.src, src0 + row * r.src_stride + c, x);
      unsigned int m = 0;
#pragma unroll
      for (int k = 0; k < 8; ++k) m = max(m, __float_as_uint(x[k]) & 0x7FFFFFFFu);
      atomicMax(&block_max[(hf_col0 + c) / bc - first_bcol], m);
    }
  }
  for (int c = threadIdx.x; !t.vec && c < t.cols; c += kThreads) {
    unsigned int m = 0;
    // Unrolled: eight independent loads in flight per thread (the kernel is latency-bound
    // otherwise, one 2-byte load at a time).
#pragma unroll 8
    for (int row = 0; row < t.rows; ++row)
      m = max(m, __float_as_uint(load_f32<kSrc>(r.src, src0 + row * r.src_stride + c)) & 0x7FFFFFFFu);
    atomicMax(&block_max[(hf_col0 + c) / bc - first_bcol], m);
  }
  __syncthreads();
  auto* grid = static_cast<unsigned int*>(r.grid);
  const std::int64_t brow = (r.hf_row + t.row0) / r.block_rows;
  for (int i = threadIdx.x; i < nbcols; i += kThreads)
    atomicMax(grid + brow * r.scale_cols + first_bcol + i, block_max[i]);
}

// x / s rounded to float32 exactly as IEEE division rounds it, from one reciprocal per block:
// RN_f(RN_d(x * RN_d(1 / s))). The double product is within 2^-52 (relative) of x / s, and a
// quotient of two floats is never closer than 2^-49 to a float rounding boundary (it would need
// a 25-bit odd significand times a 24-bit one to fit 24 bits), so rounding the double to float
// gives the IEEE float quotient (checked bit for bit against __fdiv_rn's CPU twin by Fp8Plane).
__device__ __forceinline__ float div_by(float x, double inv_s) {
  return __double2float_rn(static_cast<double>(x) * inv_s);
}

__device__ __forceinline__ unsigned int fp8_pack4(float a, float b, float c, float d, double inv_s) {
  return static_cast<unsigned int>(__nv_cvt_float_to_fp8(div_by(a, inv_s), __NV_SATFINITE, __NV_E4M3)) |
         static_cast<unsigned int>(__nv_cvt_float_to_fp8(div_by(b, inv_s), __NV_SATFINITE, __NV_E4M3)) << 8 |
         static_cast<unsigned int>(__nv_cvt_float_to_fp8(div_by(c, inv_s), __NV_SATFINITE, __NV_E4M3)) << 16 |
         static_cast<unsigned int>(__nv_cvt_float_to_fp8(div_by(d, inv_s), __NV_SATFINITE, __NV_E4M3)) << 24;
}

// One whole block in one pass: read once (into registers on the vector path), amax over the
// thread block, scale = amax / 448 (1 when zero) written to the grid, then the codes.
template <int kSrc>
__device__ __forceinline__ void fused_block(const QuantTile& t, const DeviceQuantRun& r) {
  __shared__ unsigned int warp_max[kThreads / 32];
  __shared__ float block_scale;
  const std::int64_t src0 = r.src_offset + t.row0 * r.src_stride + t.col0;
  auto* dst = static_cast<__nv_fp8_storage_t*>(r.dst) + r.dst_offset + t.row0 * r.dst_stride + t.col0;
  const std::int64_t k = ((r.hf_row + t.row0) / r.block_rows) * r.scale_cols +
                         (r.hf_col + t.col0) / r.block_cols;
  auto reduce = [&](unsigned int m) {
    m = __reduce_max_sync(0xFFFFFFFFu, m);
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned int all = 0;
      for (int w = 0; w < kThreads / 32; ++w) all = max(all, warp_max[w]);
      float s;
      if (all > 0x7F7FFFFFu) {  // NaN or inf: no scale
        s = __uint_as_float(0x7FC00000u);
        if (r.bad != nullptr) {
          atomicAdd(r.bad, 1ull);
          atomicMin(r.bad + 1, (static_cast<unsigned long long>(r.tag) << 32) |
                                   static_cast<unsigned long long>(k));
        }
      } else {
        s = all == 0 ? 1.0f : __fdiv_rn(__uint_as_float(all), 448.0f);
      }
      static_cast<float*>(r.grid)[k] = s;
      block_scale = s;
    }
    __syncthreads();
    return block_scale;
  };
  if (t.vec) {
    // Two reads of the block: the first from memory (kept in L2), the second from L2. Holding the
    // block in registers instead costs occupancy, and the pass is then slower (docs/fp8.md).
    const int groups = t.cols / 8, n = groups * t.rows;
    unsigned int m = 0;
#pragma unroll 4
    for (int g = threadIdx.x; g < n; g += kThreads) {
      float x[8];
      load8_f32<kSrc, true>(r.src, src0 + (g / groups) * r.src_stride + (g % groups) * 8, x);
#pragma unroll
      for (int e = 0; e < 8; ++e) m = max(m, __float_as_uint(x[e]) & 0x7FFFFFFFu);
    }
    const double inv_s = 1.0 / static_cast<double>(reduce(m));
#pragma unroll 4
    for (int g = threadIdx.x; g < n; g += kThreads) {
      float x[8];
      load8_f32<kSrc>(r.src, src0 + (g / groups) * r.src_stride + (g % groups) * 8, x);
      __stcs(reinterpret_cast<uint2*>(dst + (g / groups) * r.dst_stride + (g % groups) * 8),
             make_uint2(fp8_pack4(x[0], x[1], x[2], x[3], inv_s),
                        fp8_pack4(x[4], x[5], x[6], x[7], inv_s)));
    }
    return;
  }
  // Scalar: two reads of the block (alignment keeps it off the vector path).
  const int n = t.rows * t.cols;
  unsigned int m = 0;
  for (int i = threadIdx.x; i < n; i += kThreads)
    m = max(m, __float_as_uint(load_f32<kSrc>(r.src, src0 + (i / t.cols) * r.src_stride + i % t.cols)) &
                   0x7FFFFFFFu);
  const float s = reduce(m);
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const float x = load_f32<kSrc>(r.src, src0 + (i / t.cols) * r.src_stride + i % t.cols);
    dst[(i / t.cols) * r.dst_stride + i % t.cols] =
        __nv_cvt_float_to_fp8(__fdiv_rn(x, s), __NV_SATFINITE, __NV_E4M3);
  }
}

template <int kSrc>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const QuantTile* __restrict__ tiles, const DeviceQuantRun* __restrict__ runs) {
  const QuantTile t = tiles[blockIdx.x];
  const DeviceQuantRun& r = runs[t.run];
  if (t.fused) {
    fused_block<kSrc>(t, r);
    return;
  }
  const float* scales =
      static_cast<const float*>(r.grid) + ((r.hf_row + t.row0) / r.block_rows) * r.scale_cols;
  auto* dst = static_cast<__nv_fp8_storage_t*>(r.dst) + r.dst_offset + t.row0 * r.dst_stride + t.col0;
  const std::int64_t src0 = r.src_offset + t.row0 * r.src_stride + t.col0;
  const std::int64_t hf_col0 = r.hf_col + t.col0;
  if (t.vec) {
    // Thread i takes group i % groups of rows i / groups, i / groups + threads / groups, ...
    const int groups = (t.cols + 7) / 8;
    for (int g = threadIdx.x; g < groups * t.rows; g += kThreads) {
      const int row = g / groups, c = (g % groups) * 8;
      const double inv_s = 1.0 / static_cast<double>(scales[(hf_col0 + c) / r.block_cols]);
      float x[8];
      load8_f32<kSrc>(r.src, src0 + row * r.src_stride + c, x);
      __stcs(reinterpret_cast<uint2*>(dst + row * r.dst_stride + c),
             make_uint2(fp8_pack4(x[0], x[1], x[2], x[3], inv_s),
                        fp8_pack4(x[4], x[5], x[6], x[7], inv_s)));
    }
    return;
  }
  for (int c = threadIdx.x; c < t.cols; c += kThreads) {
    const float s = scales[(hf_col0 + c) / r.block_cols];
#pragma unroll 8
    for (int row = 0; row < t.rows; ++row) {
      const float x = load_f32<kSrc>(r.src, src0 + row * r.src_stride + c);
      // IEEE division (never the fast reciprocal), then saturating round-to-nearest-even.
      dst[row * r.dst_stride + c] = __nv_cvt_float_to_fp8(__fdiv_rn(x, s), __NV_SATFINITE, __NV_E4M3);
    }
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
                                                  DType src_dtype, int device) {
  const std::size_t src_esize = dtype_size(src_dtype);
  std::vector<QuantTile> tiles;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const DeviceQuantRun& r = runs[i];
    if (r.rows <= 0 || r.cols <= 0) continue;
    const auto esize = static_cast<std::uintptr_t>(src_esize);
    const bool vec =
        r.cols % 8 == 0 && r.src_offset % 8 == 0 && r.src_stride % 8 == 0 &&
        r.dst_offset % 8 == 0 && r.dst_stride % 8 == 0 && r.hf_col % 8 == 0 &&
        r.block_cols % 8 == 0 && reinterpret_cast<std::uintptr_t>(r.src) % 16 == 0 &&
        reinterpret_cast<std::uintptr_t>(r.dst) % 8 == 0 && (8 * esize) % 16 == 0;
    if (r.from_grid != nullptr) {
      // Block by block: a block the kernel scales itself is one tile; the others are cut like
      // below, within their block.
      for (std::int64_t kr = r.hf_row / r.block_rows; kr <= (r.hf_row + r.rows - 1) / r.block_rows; ++kr) {
        const std::int64_t r0 = std::max<std::int64_t>(kr * r.block_rows - r.hf_row, 0);
        const std::int64_t r1 = std::min((kr + 1) * r.block_rows - r.hf_row, r.rows);
        for (std::int64_t kc = r.hf_col / r.block_cols; kc <= (r.hf_col + r.cols - 1) / r.block_cols; ++kc) {
          const std::int64_t c0 = std::max<std::int64_t>(kc * r.block_cols - r.hf_col, 0);
          const std::int64_t c1 = std::min((kc + 1) * r.block_cols - r.hf_col, r.cols);
          if (r.from_grid[kr * r.scale_cols + kc] == 0) {
            tiles.push_back(QuantTile{static_cast<std::int32_t>(i), static_cast<std::int32_t>(r1 - r0),
                                      static_cast<std::int32_t>(c1 - c0), vec ? 1 : 0, r0, c0, 1, 0});
            continue;
          }
          for (std::int64_t row = r0; row < r1; row += kTileRows)
            for (std::int64_t c = c0; c < c1; c += kTileCols)
              tiles.push_back(QuantTile{static_cast<std::int32_t>(i),
                                        static_cast<std::int32_t>(std::min<std::int64_t>(kTileRows, r1 - row)),
                                        static_cast<std::int32_t>(std::min<std::int64_t>(kTileCols, c1 - c)),
                                        vec ? 1 : 0, row, c, 0, 0});
        }
      }
      continue;
    }
    for (std::int64_t row = 0; row < r.rows;) {
      // Up to kTileRows rows, never past the end of the HF block row they start in.
      const std::int64_t block_end = ((r.hf_row + row) / r.block_rows + 1) * r.block_rows - r.hf_row;
      const std::int64_t rows = std::min({std::int64_t{kTileRows}, r.rows - row, block_end - row});
      for (std::int64_t c = 0; c < r.cols; c += kTileCols)
        tiles.push_back(QuantTile{static_cast<std::int32_t>(i), static_cast<std::int32_t>(rows),
                                  static_cast<std::int32_t>(std::min<std::int64_t>(kTileCols, r.cols - c)),
                                  vec ? 1 : 0, row, c, 0, 0});
      row += rows;
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
