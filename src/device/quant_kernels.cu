// FP8 amax and quantize kernels (device/quant_kernels.h; semantics: common/quantize.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_pipeline.h>

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <string>
#include <type_traits>

#include "device/cuda_check.h"
#include "device/element_convert.cuh"
#include "device/quant_kernels.h"

namespace refit {
namespace {

constexpr int kThreads = 256;
// Thread blocks of the quantize kernel resident per SM, registers capped to fit (32): a block
// scaled in the pass waits for its stage and at a barrier for its amax, and other thread blocks
// keep the memory busy meanwhile (shared memory then caps bfloat16 stages at 6). 2048 threads per
// SM, 1536 on sm_86/87/89.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 870 || __CUDA_ARCH__ == 890)
constexpr int kQuantBlocksPerSm = 6;
#else
constexpr int kQuantBlocksPerSm = 8;
#endif

// A tile: `rows` x `cols` elements of run `run` starting at (row0, col0) of the run. Its rows lie
// in one block row of the HF tensor (so every element of a column shares one scale), at most
// kTileRows of them, and at most kTileCols columns: each thread owns whole columns of the tile.
constexpr int kTileRows = 64;
constexpr int kTileCols = 4 * kThreads;
struct QuantTile {
  std::int32_t run = 0;
  std::int32_t rows = 0;
  std::int32_t cols = 0;
  std::int32_t vec = 0;  // the vector paths apply (see load8_f32; offsets in a tile fit 32 bits)
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

// Eight elements as float32 from their raw bytes: a and b for float32 (4 each), a alone for
// 16-bit types.
template <int kSrc>
__device__ __forceinline__ void decode8(const uint4& a, const uint4& b, float (&x)[8]) {
  if constexpr (kSrc == 0) {
    const unsigned int w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = __uint_as_float(w[k]);
  } else {
    const unsigned int w[4] = {a.x, a.y, a.z, a.w};
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

template <int kSrc>
constexpr int kGroupBytes = kSrc == 0 ? 32 : 16;  // 8 elements

// Eight consecutive elements at `base + i` (i a multiple of 8, the address 16-byte aligned) as
// float32: one or two 16-byte loads, streaming (evict first).
template <int kSrc>
__device__ __forceinline__ void load8_f32(const void* base, std::int64_t i, float (&x)[8]) {
  const auto* p = reinterpret_cast<const uint4*>(static_cast<const std::byte*>(base) +
                                                 i * (kGroupBytes<kSrc> / 8));
  const uint4 a = __ldcs(p);
  const uint4 b = kSrc == 0 ? __ldcs(p + 1) : a;
  decode8<kSrc>(a, b, x);
}

// Tiles whose every row is 8-element groups that are 16-byte aligned at the source, 8-byte
// aligned at the destination and never straddle a block column (QuantTile::vec) take the vector
// paths below: one load of 8 elements, one scale and one 8-byte store per group.
//
// A thread takes groups threadIdx.x, + kThreads, + 2 kThreads, ... of a tile `groups` wide: group
// g lies at row g / groups, column (g % groups) * 8. for_each_group(groups, rows, ss, ds, f) calls
// f(col, s, d, i) for the i-th group of this thread (group threadIdx.x + i * kThreads), in order,
// where s = row * ss + col and d = row * ds + col are its element offsets at the source and the
// destination, in 32 bits (QuantTile::vec). Offsets advance by additions: no division by the
// runtime width (~20 instructions) and no 64-bit arithmetic per group. When the width divides
// kThreads (128 columns: 16 groups) the thread keeps its column and only steps rows.
template <class F>
__device__ __forceinline__ void for_each_group(int groups, int rows, int ss, int ds, F&& f) {
  const int tid = static_cast<int>(threadIdx.x);
  int row = tid / groups, col = tid % groups * 8;
  const int drow = kThreads / groups;
  int s = row * ss + col, d = row * ds + col;
  if (kThreads % groups == 0) {
    const int step_s = drow * ss, step_d = drow * ds;
    for (int i = 0; row < rows; row += drow, ++i, s += step_s, d += step_d) f(col, s, d, i);
    return;
  }
  const int dcol = kThreads % groups * 8, width = groups * 8;
  const int step_s = drow * ss + dcol, step_d = drow * ds + dcol;
  const int wrap_s = ss - width, wrap_d = ds - width;  // one row down, back by the width
  for (int i = 0; row < rows; ++i) {
    f(col, s, d, i);
    row += drow;
    col += dcol;
    s += step_s;
    d += step_d;
    if (col >= width) {
      col -= width;
      ++row;
      s += wrap_s;
      d += wrap_d;
    }
  }
}

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
  if (t.vec) {
    for_each_group(t.cols / 8, t.rows, static_cast<int>(r.src_stride), 0,
                   [&](int col, int s, int, int) {
                     float x[8];
                     load8_f32<kSrc>(r.src, src0 + s, x);
                     unsigned int m = 0;
#pragma unroll
                     for (int k = 0; k < 8; ++k) m = max(m, __float_as_uint(x[k]) & 0x7FFFFFFFu);
                     atomicMax(&block_max[(hf_col0 + col) / bc - first_bcol], m);
                   });
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

// x / s rounded to float32 exactly as IEEE division rounds it (__fdiv_rn), without a division
// per element. A Divisor holds s, y = RN(1 / s) and y's error term, once per block:
//  - e = 1 - s * y is exact in an fma (the residual of a correctly rounded reciprocal), and
//    yl = RN(e * y) is within 2^-47 (relative) of 1/s - y;
//  - per element, q0 = RN(x * y + RN(x * yl)) (a multiply and an fma) is within half an ulp plus
//    2^-46 (relative) of x / s, so q0 is faithful;
//  - with y the correctly rounded 1 / s and q0 faithful, the remainder x - q0 * s is exact in an
//    fma, and one Markstein step q = RN(q0 + RN(x - q0 * s) * y) rounds to RN(x / s) (Markstein's
//    theorem), unless something underflows.
// Four floating-point instructions per element (two Markstein steps from RN(x * y) took five).
// Underflow: |x| <= 448.0001 * s (s = amax / 448 rounded), and `fast` holds only for s in
// [2^-90, 2^100]. A quotient of at least 2^-11 then has |x| >= 2^-101, the remainder is a
// multiple of 2^-147 (exact, subnormal or not), and yl and RN(x * yl), where they are subnormal,
// are off by at most 2^-150, under 2^-47 of 1/s and of the quotient. A smaller quotient has FP8
// code zero either way (codes below 2^-10 round to zero, and the steps move a quotient that small
// by far less than 2^-11), and copysign gives it x's sign, as IEEE division does (the fma steps
// would turn -0 into +0). Other scales (subnormal, huge, NaN) take __fdiv_rn. Checked bit for bit
// against the CPU's division for 4663 scales over every bfloat16 x whose quotient can give a
// non-zero code, and float32 x at every FP8 rounding boundary
// (Fp8Plane.CudaDivisionRoundsAsIeee).
struct Divisor {
  float s, y, yl;
  bool fast;
};

__device__ __forceinline__ Divisor divisor(float s) {
  const float y = __frcp_rn(s);
  return Divisor{s, y, __fmul_rn(__fmaf_rn(-s, y, 1.0f), y),
                 s >= 0x1p-90f && s <= 0x1p100f};  // not fast for NaN
}

// |x| / s (m = |x|, or x itself for the float32 path's copysign), the fast path of div_by.
__device__ __forceinline__ float div_fast(float m, const Divisor& d) {
  const float q0 = __fmaf_rn(m, d.y, __fmul_rn(m, d.yl));
  return __fmaf_rn(__fmaf_rn(-q0, d.s, m), d.y, q0);
}

// kFast: the caller checked d.fast once for a whole block (no test per element).
template <bool kFast = false>
__device__ __forceinline__ float div_by(float x, const Divisor& d) {
  if (!kFast && !d.fast) return __fdiv_rn(x, d.s);
  return copysignf(div_fast(x, d), x);
}

template <bool kFast = false>
__device__ __forceinline__ unsigned int fp8_pack2(float a, float b, const Divisor& s) {
  // a in the low byte, b in the high one.
  return __nv_cvt_float2_to_fp8x2(make_float2(div_by<kFast>(a, s), div_by<kFast>(b, s)),
                                  __NV_SATFINITE, __NV_E4M3);
}

// The codes of 8 elements, 8 bytes in element order.
template <bool kFast = false>
__device__ __forceinline__ uint2 fp8_pack8(const float (&x)[8], const Divisor& s) {
  return make_uint2(fp8_pack2<kFast>(x[0], x[1], s) | fp8_pack2<kFast>(x[2], x[3], s) << 16,
                    fp8_pack2<kFast>(x[4], x[5], s) | fp8_pack2<kFast>(x[6], x[7], s) << 16);
}

// The codes of 8 16-bit source elements from their raw words (a: elements 0-7, two per word, the
// first in the low half), scale range checked by the caller (d.fast). The quotient is taken of |x|
// (a free operand modifier) and the sign bits of x are put into the codes with one byte
// permutation: e4m3 is sign-magnitude, and IEEE division gives x / s the sign of x, zeros
// included. That replaces a copysign per element.
template <int kSrc>
__device__ __forceinline__ uint2 fp8_pack8_signed(const uint4& a, const Divisor& d) {
  static_assert(kSrc == 1 || kSrc == 2, "16-bit sources");
  float x[8];
  decode8<kSrc>(a, a, x);
  auto mag = [&](float v) { return div_fast(fabsf(v), d); };
  auto pair = [&](int k) {
    return static_cast<unsigned int>(__nv_cvt_float2_to_fp8x2(
        make_float2(mag(x[k]), mag(x[k + 1])), __NV_SATFINITE, __NV_E4M3));
  };
  // Byte 1 and byte 3 of each word hold the sign bits of its two elements at bit 7.
  const unsigned int lo = pair(0) | pair(2) << 16, hi = pair(4) | pair(6) << 16;
  return make_uint2(lo | (__byte_perm(a.x, a.y, 0x7531) & 0x80808080u),
                    hi | (__byte_perm(a.z, a.w, 0x7531) & 0x80808080u));
}

// max |x| over 8 staged elements folded into `m`, compared as float32 bits (NaN above inf above
// every finite value). 16-bit sources fold pairs with one packed max per word (__hmax2_nan keeps
// NaN), into `m2`: half the instructions of widening every element first.
template <int kSrc>
__device__ __forceinline__ void fold_amax(const uint4& a, const uint4& b, unsigned int& m,
                                          unsigned int& m2) {
  if constexpr (kSrc == 0) {
    const unsigned int w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) m = max(m, w[k] & 0x7FFFFFFFu);
  } else {
    using T2 = std::conditional_t<kSrc == 1, __nv_bfloat162, __half2>;
    const unsigned int w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const unsigned int abs2 = w[k] & 0x7FFF7FFFu;
      const T2 r = __hmax2_nan(*reinterpret_cast<const T2*>(&m2), *reinterpret_cast<const T2*>(&abs2));
      m2 = *reinterpret_cast<const unsigned int*>(&r);
    }
  }
}

// The float32 bits of the larger half of m2 (fold_amax), or m for float32.
template <int kSrc>
__device__ __forceinline__ unsigned int amax_bits(unsigned int m, unsigned int m2) {
  if constexpr (kSrc == 0) {
    return m;
  } else {
    // Non-negative 16-bit floats (and NaN above inf) order like their bits.
    const unsigned int h = max(m2 >> 16, m2 & 0xFFFFu);
    if constexpr (kSrc == 1) return h << 16;
    return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(h))));
  }
}

// One whole block in one pass: read once (staged in shared memory on the vector path), amax over
// the thread block, scale = amax / 448 (1 where that is 0) written to the grid, then the codes.
template <int kSrc>
__device__ __forceinline__ void fused_block(const QuantTile& t, const DeviceQuantRun& r,
                                            std::byte* stage) {
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
    // Warp 0 folds the warps' maxima, thread 0 writes the scale.
    const unsigned int all =
        threadIdx.x < 32 ? __reduce_max_sync(0xFFFFFFFFu, warp_max[threadIdx.x % (kThreads / 32)])
                         : 0;
    if (threadIdx.x == 0) {
      float s;
      if (all > 0x7F7FFFFFu) {  // NaN or inf: no scale
        s = __uint_as_float(0x7FC00000u);
        if (r.bad != nullptr) {
          atomicAdd(r.bad, 1ull);
          atomicMin(r.bad + 1, (static_cast<unsigned long long>(r.tag) << 32) |
                                   static_cast<unsigned long long>(k));
        }
      } else {
        s = __fdiv_rn(__uint_as_float(all), 448.0f);
        if (s == 0.0f) s = 1.0f;  // all zero, or amax / 448 underflows (common/quantize.h)
      }
      static_cast<float*>(r.grid)[k] = s;
      block_scale = s;
    }
    __syncthreads();
    return block_scale;
  };
  if (t.vec) {
    // The block is staged in shared memory (cp.async, every group of this thread in flight at
    // once), so it is read from memory once: the amax and the codes both come from the stage.
    // Each thread reads back only the groups it staged, so no barrier is needed before its amax.
    // (Re-reading from L2 instead lost a fifth of the bandwidth: the blocks in flight on every SM
    // are about the size of L2; docs/fp8.md.)
    constexpr int kG = kGroupBytes<kSrc>;
    const auto* src = static_cast<const std::byte*>(r.src) + src0 * (kG / 8);
    // Group i of this thread is group threadIdx.x + i * kThreads of the tile, at that place in
    // the stage.
    std::byte* mine = stage + threadIdx.x * kG;
    int count = 0;  // this thread's groups
    for_each_group(t.cols / 8, t.rows, static_cast<int>(r.src_stride),
                   static_cast<int>(r.dst_stride), [&](int, int s, int, int i) {
#pragma unroll
                     for (int h = 0; h < kG; h += 16)
                       __pipeline_memcpy_async(mine + i * (kThreads * kG) + h,
                                               src + s * (kG / 8) + h, 16);
                     count = i + 1;
                   });
    __pipeline_commit();
    __pipeline_wait_prior(0);
    // Group i of this thread in the stage.
    const auto* groups = reinterpret_cast<const uint4*>(mine);
    constexpr int kStride = kThreads * kG / 16;
    unsigned int m = 0, m2 = 0;
    for (int i = 0; i < count; ++i) {
      const uint4* q = groups + i * kStride;
      fold_amax<kSrc>(q[0], q[kSrc == 0 ? 1 : 0], m, m2);
    }
    const Divisor inv_s = divisor(reduce(amax_bits<kSrc>(m, m2)));
    // The codes; the scale's range is checked once here, not per element (div_by).
    auto codes = [&](auto fast) {
      for_each_group(t.cols / 8, t.rows, static_cast<int>(r.src_stride),
                     static_cast<int>(r.dst_stride), [&](int, int, int d, int i) {
                       const uint4* q = groups + i * kStride;
                       uint2 c;
                       if constexpr (kSrc != 0 && decltype(fast)::value) {
                         c = fp8_pack8_signed<kSrc>(q[0], inv_s);
                       } else {
                         float x[8];
                         decode8<kSrc>(q[0], q[kSrc == 0 ? 1 : 0], x);
                         c = fp8_pack8<decltype(fast)::value>(x, inv_s);
                       }
                       __stcs(reinterpret_cast<uint2*>(dst + d), c);
                     });
    };
    if (inv_s.fast) {
      codes(std::true_type{});
    } else {
      codes(std::false_type{});
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
__device__ __forceinline__ void quantize_tile(const QuantTile& t, const DeviceQuantRun& r,
                                              std::byte* stage) {
  if (t.fused) {
    fused_block<kSrc>(t, r, stage);
    return;
  }
  const float* scales =
      static_cast<const float*>(r.grid) + ((r.hf_row + t.row0) / r.block_rows) * r.scale_cols;
  auto* dst = static_cast<__nv_fp8_storage_t*>(r.dst) + r.dst_offset + t.row0 * r.dst_stride + t.col0;
  const std::int64_t src0 = r.src_offset + t.row0 * r.src_stride + t.col0;
  const std::int64_t hf_col0 = r.hf_col + t.col0;
  if (t.vec) {
    for_each_group(t.cols / 8, t.rows, static_cast<int>(r.src_stride),
                   static_cast<int>(r.dst_stride), [&](int col, int s, int d, int) {
                     const Divisor inv_s = divisor(scales[(hf_col0 + col) / r.block_cols]);
                     float x[8];
                     load8_f32<kSrc>(r.src, src0 + s, x);
                     __stcs(reinterpret_cast<uint2*>(dst + d), fp8_pack8(x, inv_s));
                   });
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

// One thread block per tile; `stage` holds a whole block scaled in the pass (stage_bytes()).
template <int kSrc>
__global__ void __launch_bounds__(kThreads, kQuantBlocksPerSm)
    quantize_kernel(const QuantTile* __restrict__ tiles, const DeviceQuantRun* __restrict__ runs) {
  extern __shared__ __align__(16) std::byte stage[];
  const QuantTile t = tiles[blockIdx.x];
  quantize_tile<kSrc>(t, runs[t.run], stage);
}

template <template <int> class K>
Status launch(const DeviceQuantTable& table, DType src_dtype, void* stream, const char* what) {
  if (table.num_tiles() == 0) return Status::Ok();
  if (src_dtype != DType::kFloat32 && src_dtype != DType::kBFloat16 &&
      src_dtype != DType::kFloat16)
    return Status::InvalidArgument(std::string(what) + ": source dtype " +
                                   std::string(dtype_name(src_dtype)) +
                                   " (float32, bfloat16 or float16 expected)");
  if (table.num_tiles() > std::numeric_limits<int>::max())
    return Status::InvalidArgument(std::string(what) + ": too many tiles for one launch");
  const int code = elem::dtype_code(src_dtype);  // 0 float32, 1 bfloat16, 2 float16
  const auto* tiles = static_cast<const QuantTile*>(table.data());
  const auto* runs = reinterpret_cast<const DeviceQuantRun*>(
      static_cast<const std::byte*>(table.data()) +
      static_cast<std::size_t>(table.num_tiles()) * sizeof(QuantTile));
  const auto blocks = static_cast<unsigned>(table.num_tiles());
  auto* s = static_cast<cudaStream_t>(stream);
  if (code == 0) REFIT_RETURN_IF_ERROR(K<0>::run(blocks, s, tiles, runs, table.stage_bytes()));
  if (code == 1) REFIT_RETURN_IF_ERROR(K<1>::run(blocks, s, tiles, runs, table.stage_bytes()));
  if (code == 2) REFIT_RETURN_IF_ERROR(K<2>::run(blocks, s, tiles, runs, table.stage_bytes()));
  REFIT_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

template <int kSrc>
struct AmaxK {
  static Status run(unsigned blocks, cudaStream_t s, const QuantTile* t, const DeviceQuantRun* r,
                    std::size_t) {
    amax_kernel<kSrc><<<blocks, kThreads, 0, s>>>(t, r);
    return Status::Ok();
  }
};
template <int kSrc>
struct QuantizeK {
  static Status run(unsigned blocks, cudaStream_t s, const QuantTile* t, const DeviceQuantRun* r,
                    std::size_t stage) {
    // Above 48 KiB a kernel must ask for its dynamic shared memory (a float32 block of 128 x 128
    // stages 64 KiB).
    if (stage > 48 * 1024)
      REFIT_CUDA_CHECK(cudaFuncSetAttribute(quantize_kernel<kSrc>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(stage)));
    quantize_kernel<kSrc><<<blocks, kThreads, stage, s>>>(t, r);
    return Status::Ok();
  }
};

}  // namespace

Result<DeviceQuantTable> DeviceQuantTable::upload(const std::vector<DeviceQuantRun>& runs,
                                                  DType src_dtype, int device) {
  const std::size_t src_esize = dtype_size(src_dtype);
  std::vector<QuantTile> tiles;
  std::size_t stage = 0;  // the largest block staged whole (fused_block)
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const DeviceQuantRun& r = runs[i];
    if (r.rows <= 0 || r.cols <= 0) continue;
    const auto esize = static_cast<std::uintptr_t>(src_esize);
    const bool vec = r.cols % 8 == 0 && r.src_offset % 8 == 0 && r.src_stride % 8 == 0 &&
                     r.dst_offset % 8 == 0 && r.dst_stride % 8 == 0 && r.hf_col % 8 == 0 &&
                     r.block_cols % 8 == 0 && reinterpret_cast<std::uintptr_t>(r.src) % 16 == 0 &&
                     reinterpret_cast<std::uintptr_t>(r.dst) % 8 == 0 && (8 * esize) % 16 == 0 &&
                     // for_each_group's offsets within a tile are 32-bit
                     std::max<std::int64_t>(kTileRows, r.block_rows) *
                             (std::max(r.src_stride, r.dst_stride) + 1) <
                         std::numeric_limits<std::int32_t>::max();
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
            if (vec) stage = std::max(stage, static_cast<std::size_t>((r1 - r0) * (c1 - c0)) * src_esize);
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
  // A block scaled in the pass is staged in shared memory whole (the transfer plan scales blocks
  // of at most 16384 elements this way: 64 KiB of float32).
  if (stage > 96 * 1024)
    return Status::InvalidArgument(fmt::format(
        "fp8 quantize: a block scaled in the pass holds {} bytes of {}; at most 98304 fit in "
        "shared memory (scale it from the grid instead)",
        stage, dtype_name(src_dtype)));
  t.tiles_ = static_cast<std::int64_t>(tiles.size());
  t.stage_bytes_ = stage;
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
