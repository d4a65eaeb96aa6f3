// CUDA kernels of device/copy_kernels.h. Bit-level conversions mirror common/convert.cc exactly;
// weights mirror weights/weights.cc (splitmix64, float ops without contraction).
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "common/checksum.h"
#include "device/copy_kernels.h"
#include "device/cuda_check.h"
#include "device/element_convert.cuh"

namespace refit {
namespace {

constexpr int kThreads = 256;

using elem::BF16;
using elem::convert_elem;
using elem::dtype_code;
using elem::F16;
using elem::F32;
using elem::FP8;
using elem::from_f32;
using elem::to_f32;

// ---- one contiguous row of n elements, 16-byte accesses where the addresses allow ----

template <class S, class D>
struct VecShape {
  using ST = typename S::T;
  using DT = typename D::T;
  static constexpr int kV = 16 / (sizeof(ST) < sizeof(DT) ? sizeof(ST) : sizeof(DT));
  static constexpr int kSrcWords = kV * sizeof(ST) / 4;  // multiple of 4 (16 bytes)
  static constexpr int kDstWords = kV * sizeof(DT) / 4;
  // Units in flight per thread: about 128 source bytes, enough loads outstanding to cover the
  // memory latency (run 1: 4 units of 16 B left a bf16 copy 17 % short of a memcpy).
  static constexpr int kUnroll = kSrcWords >= 32 ? 1 : 32 / kSrcWords;
};

// Kernel modes (CopyKernelTuning): 16-byte thread loads and stores (evict-first), or — for
// same-dtype contiguous tiles — the Hopper bulk-copy engine (TMA, cp.async.bulk) staged through
// shared memory. (An L2::256B prefetch hint on the thread loads was measured too: no gain; see
// notes/gpu-runs.md, run 3.)
enum Mode : int { kPlain = 0, kBulk = 1 };

template <class S, class D>
__device__ __forceinline__ void load_vec(const typename S::T* s,
                                         std::uint32_t (&w)[VecShape<S, D>::kSrcWords]) {
#pragma unroll
  for (int i = 0; i < VecShape<S, D>::kSrcWords / 4; ++i) {
    const uint4 q = __ldcs(reinterpret_cast<const uint4*>(s) + i);
    w[4 * i] = q.x;
    w[4 * i + 1] = q.y;
    w[4 * i + 2] = q.z;
    w[4 * i + 3] = q.w;
  }
}

template <class S, class D>
__device__ __forceinline__ void convert_store_vec(
    const std::uint32_t (&w)[VecShape<S, D>::kSrcWords], typename D::T* d) {
  using V = VecShape<S, D>;
  using ST = typename S::T;
  using DT = typename D::T;
  constexpr int kSper = 4 / sizeof(ST);  // elements per 32-bit word
  constexpr int kDper = 4 / sizeof(DT);
  std::uint32_t out[V::kDstWords];
#pragma unroll
  for (int i = 0; i < V::kDstWords; ++i) out[i] = 0;
#pragma unroll
  for (int e = 0; e < V::kV; ++e) {
    const ST x = static_cast<ST>(w[e / kSper] >> (8 * sizeof(ST) * (e % kSper)));
    const DT y = convert_elem<S, D>(x);
    out[e / kDper] |= static_cast<std::uint32_t>(y) << (8 * sizeof(DT) * (e % kDper));
  }
#pragma unroll
  for (int i = 0; i < V::kDstWords / 4; ++i)
    __stcs(reinterpret_cast<uint4*>(d) + i,
           make_uint4(out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]));
}

template <class S, class D>
__device__ __forceinline__ void copy_scalar(const typename S::T* s, typename D::T* d, int begin,
                                            int end) {
  for (int i = begin + static_cast<int>(threadIdx.x); i < end; i += kThreads)
    d[i] = convert_elem<S, D>(s[i]);
}

template <class S, class D>
__device__ __forceinline__ void copy_row(const typename S::T* s, typename D::T* d, int n) {
  using V = VecShape<S, D>;
  using DT = typename D::T;
  const auto da = reinterpret_cast<std::uintptr_t>(d);
  int head = static_cast<int>(((16 - (da & 15)) & 15) / sizeof(DT));
  if (head > n) head = n;
  if ((reinterpret_cast<std::uintptr_t>(s + head) & 15) != 0) {  // src and dst never co-aligned
    copy_scalar<S, D>(s, d, 0, n);
    return;
  }
  copy_scalar<S, D>(s, d, 0, head);
  const int units = (n - head) / V::kV;
  const auto* sv = s + head;
  auto* dv = d + head;
  for (int u0 = threadIdx.x; u0 < units; u0 += kThreads * V::kUnroll) {
    std::uint32_t w[V::kUnroll][V::kSrcWords];
#pragma unroll
    for (int k = 0; k < V::kUnroll; ++k) {
      const int u = u0 + k * kThreads;
      if (u < units) load_vec<S, D>(sv + static_cast<std::int64_t>(u) * V::kV, w[k]);
    }
#pragma unroll
    for (int k = 0; k < V::kUnroll; ++k) {
      const int u = u0 + k * kThreads;
      if (u < units) convert_store_vec<S, D>(w[k], dv + static_cast<std::int64_t>(u) * V::kV);
    }
  }
  copy_scalar<S, D>(s, d, head + units * V::kV, n);
}

// ---- bulk-copy engine (sm_90): one thread streams a row through shared memory ----

constexpr int kBulkStages = 4;
constexpr int kBulkChunk = 16384;
constexpr int kBulkSmem = kBulkStages * kBulkChunk + 64;  // + the stages' mbarriers

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// The bulk engine exists from sm_90 on; older architectures take the plain path (bulk_row
// returns false there).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define REFIT_BULK_COPY 1
#endif

#ifdef REFIT_BULK_COPY
// Copies `bytes` (a multiple of 16; src and dst 16-byte aligned) with the TMA engine. Called by
// one thread; kBulkStages chunk loads in flight, each stage reused once its store read it.
__device__ void bulk_copy_bytes(const char* src, char* dst, long long bytes, unsigned char* smem) {
  auto* bars = reinterpret_cast<unsigned long long*>(smem + kBulkStages * kBulkChunk);
  const int n = static_cast<int>((bytes + kBulkChunk - 1) / kBulkChunk);
  for (int st = 0; st < kBulkStages; ++st)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bars[st])) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  auto chunk_size = [&](int c) {
    const long long left = bytes - static_cast<long long>(c) * kBulkChunk;
    return static_cast<unsigned>(left < kBulkChunk ? left : kBulkChunk);
  };
  auto issue_load = [&](int c) {
    const int st = c % kBulkStages;
    const unsigned size = chunk_size(c);
    asm volatile(
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&bars[st])),
        "r"(size)
        : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
        "[%3];" ::"r"(smem_u32(smem + st * kBulkChunk)),
        "l"(src + static_cast<long long>(c) * kBulkChunk), "r"(size), "r"(smem_u32(&bars[st]))
        : "memory");
  };
  const int prologue = n < kBulkStages ? n : kBulkStages;
  for (int c = 0; c < prologue; ++c) issue_load(c);
  for (int c = 0; c < n; ++c) {
    const int st = c % kBulkStages;
    const unsigned parity = static_cast<unsigned>(c / kBulkStages) & 1u;
    unsigned done = 0;
    do {
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
          " selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(smem_u32(&bars[st])), "r"(parity)
          : "memory");
    } while (!done);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                     dst + static_cast<long long>(c) * kBulkChunk),
                 "r"(smem_u32(smem + st * kBulkChunk)), "r"(chunk_size(c))
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (c + kBulkStages < n) {
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      issue_load(c + kBulkStages);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
#endif  // REFIT_BULK_COPY

// A contiguous same-dtype row: thread 0 moves the 16-byte-multiple prefix with the bulk engine,
// the other threads the tail. False when the addresses do not allow it.
template <class S>
__device__ __forceinline__ bool bulk_row(const typename S::T* s, typename S::T* d, int n) {
#ifndef REFIT_BULK_COPY
  return false;
#else
  using T = typename S::T;
  if (((reinterpret_cast<std::uintptr_t>(s) | reinterpret_cast<std::uintptr_t>(d)) & 15) != 0)
    return false;
  const long long bytes = static_cast<long long>(n) * sizeof(T);
  const long long prefix = bytes & ~15ll;
  extern __shared__ __align__(128) unsigned char bulk_smem[];
  if (threadIdx.x == 0) {
    if (prefix > 0)
      bulk_copy_bytes(reinterpret_cast<const char*>(s), reinterpret_cast<char*>(d), prefix,
                      bulk_smem);
  } else {
    for (int i = static_cast<int>(prefix / sizeof(T)) + threadIdx.x - 1; i < n; i += kThreads - 1)
      d[i] = s[i];
  }
  return true;
#endif
}

// ---- the batched strided copy: one thread block per tile ----

template <class S, class D, int kMode>
__global__ void __launch_bounds__(kThreads)
    block_copy_kernel(const DeviceTile* __restrict__ tiles, std::int64_t tile0,
                      const typename S::T* __restrict__ src, typename D::T* __restrict__ dst) {
  using V = VecShape<S, D>;
  using ST = typename S::T;
  using DT = typename D::T;
  const DeviceTile t = tiles[tile0 + blockIdx.x];
  const ST* s = src + t.src_offset;
  DT* d = dst + t.dst_offset;
  if (t.rows == 1) {
    if constexpr (kMode == kBulk && std::is_same_v<S, D>) {
      if (bulk_row<S>(s, d, t.cols)) return;
    }
    copy_row<S, D>(s, d, t.cols);
    return;
  }
  const bool vec = t.cols % V::kV == 0 && (reinterpret_cast<std::uintptr_t>(s) & 15) == 0 &&
                   (reinterpret_cast<std::uintptr_t>(d) & 15) == 0 &&
                   (static_cast<std::int64_t>(t.src_stride) * sizeof(ST)) % 16 == 0 &&
                   (static_cast<std::int64_t>(t.dst_stride) * sizeof(DT)) % 16 == 0;
  if (!vec) {
    const int n = t.rows * t.cols;
    for (int e = threadIdx.x; e < n; e += kThreads) {
      const int r = e / t.cols;
      const int c = e - r * t.cols;
      d[static_cast<std::int64_t>(r) * t.dst_stride + c] =
          convert_elem<S, D>(s[static_cast<std::int64_t>(r) * t.src_stride + c]);
    }
    return;
  }
  const int upr = t.cols / V::kV;
  const int units = t.rows * upr;
  for (int u0 = threadIdx.x; u0 < units; u0 += kThreads * V::kUnroll) {
    std::uint32_t w[V::kUnroll][V::kSrcWords];
#pragma unroll
    for (int k = 0; k < V::kUnroll; ++k) {
      const int u = u0 + k * kThreads;
      if (u < units) {
        const int r = u / upr;
        const int c = (u - r * upr) * V::kV;
        load_vec<S, D>(s + static_cast<std::int64_t>(r) * t.src_stride + c, w[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < V::kUnroll; ++k) {
      const int u = u0 + k * kThreads;
      if (u < units) {
        const int r = u / upr;
        const int c = (u - r * upr) * V::kV;
        convert_store_vec<S, D>(w[k], d + static_cast<std::int64_t>(r) * t.dst_stride + c);
      }
    }
  }
}

template <class S, class D, int kMode>
__global__ void __launch_bounds__(kThreads)
    flat_convert_kernel(const typename S::T* __restrict__ src, typename D::T* __restrict__ dst,
                        std::int64_t n) {
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.x) * kTileElems;
  const std::int64_t rest = n - begin;
  const int len = static_cast<int>(rest < kTileElems ? rest : kTileElems);
  if constexpr (kMode == kBulk && std::is_same_v<S, D>) {
    if (bulk_row<S>(src + begin, dst + begin, len)) return;
  }
  copy_row<S, D>(src + begin, dst + begin, len);
}

// Launches K<kPlain>, or K<kBulk> (with its shared memory) when the tuning asks for the bulk
// engine and the dtypes are equal (`kSame`); the bulk kernels are only instantiated then.
template <bool kSame, template <int> class K, class... Args>
Status launch_mode_kernel(unsigned blocks, cudaStream_t stream, const char* what, Args... args) {
  if constexpr (kSame) {
    if (copy_kernel_tuning().bulk_same_dtype) {
      static bool attribute_set = false;  // per kernel instantiation
      if (!attribute_set) {
        REFIT_CUDA_CHECK(cudaFuncSetAttribute(
            K<kBulk>::kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkSmem));
        attribute_set = true;
      }
      K<kBulk>::kernel<<<blocks, kThreads, kBulkSmem, stream>>>(args...);
      REFIT_CUDA_CHECK_LAUNCH(what);
      return Status::Ok();
    }
  }
  K<kPlain>::kernel<<<blocks, kThreads, 0, stream>>>(args...);
  REFIT_CUDA_CHECK_LAUNCH(what);
  return Status::Ok();
}

template <class S, class D>
struct BlockCopyK {
  template <int M>
  struct K {
    static constexpr auto kernel = block_copy_kernel<S, D, M>;
  };
};
template <class S, class D>
struct FlatK {
  template <int M>
  struct K {
    static constexpr auto kernel = flat_convert_kernel<S, D, M>;
  };
};

// ---- deterministic weights (weights/weights.cc) ----

__device__ __forceinline__ std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

__device__ __forceinline__ float unit(std::uint64_t bits24) {
  const int v = static_cast<int>(bits24 & 0xffffff) - (1 << 23);
  return __fmul_rn(__int2float_rn(v), 1.0f / (1 << 24));
}

// fp32 bits of w(tag, i, step), rounded to `via` (returned as fp32 bits, exact). `lr` > 0: the
// update adam:lr, else drift.
__device__ __forceinline__ std::uint32_t weight_bits(std::uint64_t key, std::int64_t i, float s,
                                                     int via, float lr) {
  const std::uint64_t h = mix(key ^ static_cast<std::uint64_t>(i));
  const float b = __fmul_rn(unit(h >> 40), 0.2f);
  float v;
  if (lr > 0) {
    const float u = unit(h);
    const float a = __fadd_rn(__fmul_rn(2.0f, u), u < 0 ? -0.5f : 0.5f);
    v = __fadd_rn(b, __fmul_rn(__fmul_rn(s, lr), a));
  } else {
    const float delta = __fmul_rn(unit(h), 1.0f / 64);
    v = __fadd_rn(b, __fmul_rn(s, delta));
  }
  const std::uint32_t u = __float_as_uint(v);
  switch (via) {
    case 1:
      return to_f32<BF16>(from_f32<BF16>(u));
    case 2:
      return to_f32<F16>(from_f32<F16>(u));
    case 3:
      return to_f32<FP8>(from_f32<FP8>(u));
    default:
      return u;
  }
}

__device__ __forceinline__ std::uint64_t tensor_key(std::uint64_t seed, std::uint32_t tag) {
  return mix(seed * 0x9e3779b97f4a7c15ull + tag + 1);
}

template <class D>
__global__ void __launch_bounds__(kThreads)
    generate_kernel(const DeviceTile* __restrict__ tiles, std::int64_t tile0, std::uint64_t seed,
                    float step, int via, float lr, typename D::T* __restrict__ dst) {
  const DeviceTile t = tiles[tile0 + blockIdx.x];
  const std::uint64_t key = tensor_key(seed, t.tag);
  const int n = t.rows * t.cols;
  for (int e = threadIdx.x; e < n; e += kThreads) {
    const int r = t.rows == 1 ? 0 : e / t.cols;
    const int c = e - r * t.cols;
    const std::int64_t i = t.src_offset + static_cast<std::int64_t>(r) * t.src_stride + c;
    dst[t.dst_offset + static_cast<std::int64_t>(r) * t.dst_stride + c] =
        from_f32<D>(weight_bits(key, i, step, via, lr));
  }
}

struct VerifyCounters {
  unsigned long long mismatches;
  unsigned long long first;  // smallest mismatching dst offset
};

template <class D>
__global__ void __launch_bounds__(kThreads)
    verify_kernel(const DeviceTile* __restrict__ tiles, std::int64_t tile0, std::uint64_t seed,
                  float step, int via, float lr, const typename D::T* __restrict__ actual,
                  VerifyCounters* counters) {
  const DeviceTile t = tiles[tile0 + blockIdx.x];
  const std::uint64_t key = tensor_key(seed, t.tag);
  const int n = t.rows * t.cols;
  unsigned mine = 0;
  unsigned long long first = ~0ull;
  for (int e = threadIdx.x; e < n; e += kThreads) {
    const int r = t.rows == 1 ? 0 : e / t.cols;
    const int c = e - r * t.cols;
    const std::int64_t i = t.src_offset + static_cast<std::int64_t>(r) * t.src_stride + c;
    const std::int64_t at = t.dst_offset + static_cast<std::int64_t>(r) * t.dst_stride + c;
    if (actual[at] != from_f32<D>(weight_bits(key, i, step, via, lr))) {
      ++mine;
      if (static_cast<unsigned long long>(at) < first) first = static_cast<unsigned long long>(at);
    }
  }
  const int block_mismatches = __syncthreads_count(mine != 0);
  if (block_mismatches == 0) return;
  if (mine != 0) {
    atomicAdd(&counters->mismatches, static_cast<unsigned long long>(mine));
    atomicMin(&counters->first, first);
  }
}

// ---- the refit checksum (common/checksum.h: checksum_term) ----

template <class S, class D>
__global__ void __launch_bounds__(kThreads)
    checksum_kernel(const DeviceTile* __restrict__ tiles, const typename S::T* __restrict__ src,
                    unsigned long long* sum) {
  using ST = typename S::T;
  const DeviceTile t = tiles[blockIdx.x];
  const int n = t.rows * t.cols;
  if (n == 0) return;
  std::uint64_t acc = 0;
  auto add = [&](ST x, std::uint64_t key) {
    acc += checksum_term(key, static_cast<std::uint32_t>(convert_elem<S, D>(x)));
  };
  int first = threadIdx.x;  // of the elements the strided loop below takes
  if (t.rows == 1) {
    // One contiguous row (most tiles: whole tensors and long slices): 16-byte loads, several in
    // flight per thread, so that the kernel runs at memory speed. A scalar head reaches the
    // alignment; the strided loop takes the tail.
    constexpr int kV = 16 / sizeof(ST);
    constexpr int kUnroll = 4;
    const ST* p = src + t.src_offset;
    const int head = static_cast<int>(
        ((16 - reinterpret_cast<std::uintptr_t>(p) % 16) % 16) / sizeof(ST));
    const int lead = head < n ? head : n;
    if (static_cast<int>(threadIdx.x) < lead)
      add(p[threadIdx.x], static_cast<std::uint64_t>(t.dst_offset) + threadIdx.x);
    const int vecs = (n - lead) / kV;
    const auto* v = reinterpret_cast<const uint4*>(p + lead);
    for (int i0 = threadIdx.x; i0 < vecs; i0 += kThreads * kUnroll) {
      uint4 w[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (i0 + u * kThreads < vecs) w[u] = v[i0 + u * kThreads];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * kThreads;
        if (i >= vecs) break;
        ST e[kV];
        memcpy(e, &w[u], 16);
        const auto key0 = static_cast<std::uint64_t>(t.dst_offset) + lead +
                          static_cast<std::uint64_t>(i) * kV;
#pragma unroll
        for (int j = 0; j < kV; ++j) add(e[j], key0 + j);
      }
    }
    first = lead + vecs * kV + threadIdx.x;
  }
  // (r, c) of element e, advanced by kThreads; a division only when a row ends.
  int r = first / t.cols, c = first - r * t.cols;
  for (int e = first; e < n; e += kThreads) {
    add(src[t.src_offset + static_cast<std::int64_t>(r) * t.src_stride + c],
        static_cast<std::uint64_t>(t.dst_offset + static_cast<std::int64_t>(r) * t.dst_stride + c));
    c += kThreads;
    if (c >= t.cols) {
      const int q = c / t.cols;
      r += q;
      c -= q * t.cols;
    }
  }
  for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
  if ((threadIdx.x & 31) == 0) atomicAdd(sum, static_cast<unsigned long long>(acc));
}

// ---- dispatch ----

template <class F>
Status dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(F32{});
    case DType::kBFloat16:
      return f(BF16{});
    case DType::kFloat16:
      return f(F16{});
    case DType::kFloat8E4M3:
      return f(FP8{});
  }
  return Status::Internal("unknown dtype");
}

// Launched never: cudaFuncGetAttributes on it tells whether this binary has code for a device.
__global__ void kernel_image_probe() {}

Status check_grid(std::int64_t blocks, const char* what) {
  if (blocks > std::numeric_limits<int>::max())
    return Status::InvalidArgument(std::string(what) + ": " + std::to_string(blocks) +
                                   " tiles exceed one launch's grid; split the table into groups");
  return Status::Ok();
}

Status launch_copy_range(const DeviceBlockTable& table, std::int64_t t0, std::int64_t t1,
                         const void* src, DType sdt, void* dst, DType ddt, void* stream) {
  if (t1 <= t0) return Status::Ok();
  REFIT_RETURN_IF_ERROR(check_grid(t1 - t0, "launch_block_copy"));
  return dispatch_dtype(sdt, [&](auto s) {
    return dispatch_dtype(ddt, [&](auto d) {
      using S = decltype(s);
      using D = decltype(d);
      return launch_mode_kernel<std::is_same_v<S, D>, BlockCopyK<S, D>::template K>(
          static_cast<unsigned>(t1 - t0), static_cast<cudaStream_t>(stream),
          "block_copy_kernel launch", table.tiles(), t0, static_cast<const typename S::T*>(src),
          static_cast<typename D::T*>(dst));
    });
  });
}

Status launch_generate_range(const DeviceBlockTable& table, std::int64_t t0, std::int64_t t1,
                             const WeightsParams& p, void* dst, DType ddt, void* stream) {
  if (t1 <= t0) return Status::Ok();
  REFIT_RETURN_IF_ERROR(check_grid(t1 - t0, "launch_generate"));
  return dispatch_dtype(ddt, [&](auto d) {
    using D = decltype(d);
    generate_kernel<D>
        <<<static_cast<unsigned>(t1 - t0), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
            table.tiles(), t0, p.seed, static_cast<float>(p.step), dtype_code(p.via), p.adam_lr,
            static_cast<typename D::T*>(dst));
    REFIT_CUDA_CHECK_LAUNCH("generate_kernel launch");
    return Status::Ok();
  });
}

}  // namespace

Status launch_block_copy(const DeviceBlockTable& table, std::size_t group, const void* src,
                         DType src_dtype, void* dst, DType dst_dtype, void* stream) {
  if (group >= table.num_groups())
    return Status::InvalidArgument("launch_block_copy: group " + std::to_string(group) +
                                   " of a table with " + std::to_string(table.num_groups()) +
                                   " groups");
  return launch_copy_range(table, table.tile_begin(group), table.tile_end(group), src, src_dtype,
                           dst, dst_dtype, stream);
}

Status launch_block_copy(const DeviceBlockTable& table, const void* src, DType src_dtype, void* dst,
                         DType dst_dtype, void* stream) {
  return launch_copy_range(table, 0, table.num_tiles(), src, src_dtype, dst, dst_dtype, stream);
}

Status launch_flat_convert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                           std::size_t n, void* stream) {
  if (n == 0) return Status::Ok();
  const std::int64_t blocks = (static_cast<std::int64_t>(n) + kTileElems - 1) / kTileElems;
  REFIT_RETURN_IF_ERROR(check_grid(blocks, "launch_flat_convert"));
  return dispatch_dtype(src_dtype, [&](auto s) {
    return dispatch_dtype(dst_dtype, [&](auto d) {
      using S = decltype(s);
      using D = decltype(d);
      return launch_mode_kernel<std::is_same_v<S, D>, FlatK<S, D>::template K>(
          static_cast<unsigned>(blocks), static_cast<cudaStream_t>(stream),
          "flat_convert_kernel launch", static_cast<const typename S::T*>(src),
          static_cast<typename D::T*>(dst), static_cast<std::int64_t>(n));
    });
  });
}

Status launch_generate(const DeviceBlockTable& table, std::size_t group,
                       const WeightsParams& params, void* dst, DType dst_dtype, void* stream) {
  if (group >= table.num_groups())
    return Status::InvalidArgument("launch_generate: group " + std::to_string(group) +
                                   " of a table with " + std::to_string(table.num_groups()) +
                                   " groups");
  return launch_generate_range(table, table.tile_begin(group), table.tile_end(group), params, dst,
                               dst_dtype, stream);
}

Status launch_generate(const DeviceBlockTable& table, const WeightsParams& params, void* dst,
                       DType dst_dtype, void* stream) {
  return launch_generate_range(table, 0, table.num_tiles(), params, dst, dst_dtype, stream);
}

Result<VerifyResult> verify_generated(const DeviceBlockTable& table, const WeightsParams& params,
                                      const void* actual, DType dtype, void* stream,
                                      std::chrono::milliseconds timeout) {
  VerifyResult result;
  const std::int64_t tiles = table.num_tiles();
  if (tiles == 0) return result;
  REFIT_RETURN_IF_ERROR(check_grid(tiles, "verify_generated"));
  REFIT_ASSIGN_OR_RETURN(DeviceBuffer counters,
                         DeviceBuffer::allocate(sizeof(VerifyCounters), table.device()));
  const VerifyCounters init{0, ~0ull};
  REFIT_CUDA_CHECK(cudaMemcpyAsync(counters.data(), &init, sizeof(init), cudaMemcpyHostToDevice,
                                   static_cast<cudaStream_t>(stream)));
  REFIT_RETURN_IF_ERROR(dispatch_dtype(dtype, [&](auto d) {
    using D = decltype(d);
    verify_kernel<D>
        <<<static_cast<unsigned>(tiles), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
            table.tiles(), 0, params.seed, static_cast<float>(params.step), dtype_code(params.via),
            params.adam_lr, static_cast<const typename D::T*>(actual),
            static_cast<VerifyCounters*>(counters.data()));
    REFIT_CUDA_CHECK_LAUNCH("verify_kernel launch");
    return Status::Ok();
  }));
  // Bounded wait first: a pageable device-to-host copy would block the host without a timeout.
  REFIT_RETURN_IF_ERROR(synchronize_stream(stream, timeout, "verify_generated"));
  VerifyCounters host{};
  REFIT_RETURN_IF_ERROR(copy_to_host(&host, counters.data(), sizeof(host)));
  result.mismatches = host.mismatches;
  result.first_dst_offset = host.mismatches == 0 ? -1 : static_cast<std::int64_t>(host.first);
  return result;
}

Result<std::uint64_t> block_checksum(const DeviceBlockTable& table, const void* src,
                                     DType src_dtype, DType as_dtype, void* stream,
                                     std::chrono::milliseconds timeout) {
  const std::int64_t tiles = table.num_tiles();
  if (tiles == 0) return std::uint64_t{0};
  REFIT_RETURN_IF_ERROR(check_grid(tiles, "block_checksum"));
  REFIT_ASSIGN_OR_RETURN(DeviceBuffer sum, DeviceBuffer::allocate(sizeof(std::uint64_t), table.device()));
  const auto s = static_cast<cudaStream_t>(stream);
  REFIT_CUDA_CHECK(cudaMemsetAsync(sum.data(), 0, sizeof(std::uint64_t), s));
  REFIT_RETURN_IF_ERROR(dispatch_dtype(src_dtype, [&](auto sd) {
    using S = decltype(sd);
    return dispatch_dtype(as_dtype, [&](auto dd) {
      using D = decltype(dd);
      checksum_kernel<S, D><<<static_cast<unsigned>(tiles), kThreads, 0, s>>>(
          table.tiles(), static_cast<const typename S::T*>(src),
          static_cast<unsigned long long*>(sum.data()));
      REFIT_CUDA_CHECK_LAUNCH("checksum_kernel launch");
      return Status::Ok();
    });
  }));
  REFIT_RETURN_IF_ERROR(synchronize_stream(stream, timeout, "block_checksum"));
  std::uint64_t host = 0;
  REFIT_RETURN_IF_ERROR(copy_to_host(&host, sum.data(), sizeof(host)));
  return host;
}

Status check_kernel_image(int device) {
#ifndef REFIT_CUDA_ARCHITECTURES
#define REFIT_CUDA_ARCHITECTURES "(unknown)"
#endif
  cudaFuncAttributes attr{};
  const cudaError_t err = cudaFuncGetAttributes(&attr, kernel_image_probe);
  if (err == cudaSuccess) return Status::Ok();
  (void)cudaGetLastError();
  if (err != cudaErrorNoKernelImageForDevice && err != cudaErrorInvalidDeviceFunction &&
      err != cudaErrorUnsupportedPtxVersion)
    return cuda_status(err, "cudaFuncGetAttributes");
  cudaDeviceProp prop{};
  (void)cudaGetDeviceProperties(&prop, device);
  return Status::Unsupported(
      "device " + std::to_string(device) + " (" + prop.name + ", compute capability " +
      std::to_string(prop.major) + "." + std::to_string(prop.minor) +
      ") has no refit kernels: this build has CUDA architectures " REFIT_CUDA_ARCHITECTURES
      "; rebuild with -DCMAKE_CUDA_ARCHITECTURES=" + std::to_string(prop.major * 10 + prop.minor) +
      " (" + cudaGetErrorName(err) + ")");
}

}  // namespace refit
