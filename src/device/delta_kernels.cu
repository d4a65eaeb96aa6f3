// CUDA kernels of device/delta_kernels.h. The stream they write and read is delta/format.h's, bit
// for bit the CPU loops' (delta/delta_cpu.cc): the layout arithmetic, the chunk checks and the
// decoder are the shared functions of that header.
#include <cuda_runtime.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "common/checksum.h"
#include "delta/format.h"
#include "device/cuda_check.h"
#include "device/delta_kernels.h"
#include "device/element_convert.cuh"

namespace refit {
namespace {

namespace df = delta_format;
using elem::BF16;
using elem::convert_elem;
using elem::dtype_code;
using elem::F16;
using elem::F32;
using elem::FP8;

constexpr unsigned kFull = 0xffffffffu;

enum : std::uint32_t { kSrcLinear = 1, kDstLinear = 2, kKeyLinear = 4 };

// A route as the kernels see it (delta/delta.h DeltaRoute, plus where its chunks start).
struct DevRoute {
  const void* src = nullptr;
  void* dst = nullptr;
  std::int64_t src_offset = 0, src_stride = 0, dst_offset = 0, dst_stride = 0;
  std::uint64_t elements = 0;
  std::int64_t kept = 0;
  std::uint64_t key = 0;
  std::int64_t key_stride = 0;
  std::uint64_t chunk0 = 0;  // its first chunk in the list's numbering
  std::uint32_t chunks = 0;
  std::uint32_t cols = 0;
  std::uint32_t flags = 0;
  std::uint32_t esize = 0;
  std::uint32_t tag = 0;
  std::uint32_t pad = 0;
};
struct DevChunk {
  std::uint32_t route = 0;
  std::uint32_t k = 0;  // chunk k of its route
};

// Per route, what an encode decided (route_plan_kernel, layout_kernel, compact_kernel).
struct RoutePlan {
  unsigned long long bytes = 0, changed = 0, digest = 0, offset = 0, checksum = 0;
  std::uint32_t mode = 0, pad = 0;
};

// What a call reports back to the host (one copy at its end).
struct Totals {
  unsigned long long bytes = 0, changed = 0, digest = 0;
  unsigned long long unchanged = 0, sparse = 0, dense = 0;
  unsigned long long bad = ~0ull;  // apply: (route << 8) | ApplyError of the first failing route
};

// A piece of a payload the checksum kernel sums (at most kPieceWords words of one route).
struct PayloadPiece {
  std::uint64_t begin = 0;  // byte offset in the stream (a multiple of 4)
  std::uint64_t key0 = 0;   // key of its first word
  std::uint32_t bytes = 0;
  std::uint32_t route = 0;
};
constexpr std::uint64_t kPieceWords = 1u << 14;

// ---- small helpers ----

template <class T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(kFull, v, o);
  return v;
}

// Sum over the block (every thread passes its value; thread 0 gets the total). `scratch` holds one
// value per warp.
template <class T, int kThreads>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T total = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kThreads / 32; ++w) total += scratch[w];
  return total;
}

// Exclusive prefix over the block of unsigned 64-bit values; `total` is the block's sum (every
// thread). `scratch` holds one value per warp.
template <int kThreads>
__device__ __forceinline__ unsigned long long block_exclusive_scan(unsigned long long v,
                                                                   unsigned long long* scratch,
                                                                   unsigned long long& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long x = v;
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long t = __shfl_up_sync(kFull, x, o);
    if (lane >= o) x += t;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = x;
  __syncthreads();
  unsigned long long before = 0;
  total = 0;
  for (int w = 0; w < kThreads / 32; ++w) {
    if (w < warp) before += scratch[w];
    total += scratch[w];
  }
  return before + x - v;
}

__device__ __forceinline__ void put_bits_shared(std::uint32_t* w, std::uint64_t at, std::uint32_t v,
                                                int width) {
  if (width == 0 || v == 0) return;
  const auto word = static_cast<std::uint32_t>(at >> 5);
  const int off = static_cast<int>(at & 31);
  const std::uint64_t x = static_cast<std::uint64_t>(v) << off;
  atomicOr(&w[word], static_cast<std::uint32_t>(x));
  if (off + width > 32) {
    const auto hi = static_cast<std::uint32_t>(x >> 32);
    if (hi != 0) atomicOr(&w[word + 1], hi);
  }
}

// Element pe of route r: its row and column.
__device__ __forceinline__ void row_col(const DevRoute& r, std::uint64_t pe, std::uint64_t& row,
                                        std::uint64_t& col) {
  const auto p = static_cast<std::uint32_t>(pe);  // a route holds fewer than 2^32 elements
  const std::uint32_t q = p / r.cols;
  row = q;
  col = p - q * r.cols;
}
__device__ __forceinline__ std::int64_t src_index(const DevRoute& r, std::uint64_t pe) {
  if (r.flags & kSrcLinear) return r.src_offset + static_cast<std::int64_t>(pe);
  std::uint64_t row, col;
  row_col(r, pe, row, col);
  return r.src_offset + static_cast<std::int64_t>(row) * r.src_stride +
         static_cast<std::int64_t>(col);
}
__device__ __forceinline__ std::int64_t dst_index(const DevRoute& r, std::uint64_t pe) {
  if (r.flags & kDstLinear) return r.dst_offset + static_cast<std::int64_t>(pe);
  std::uint64_t row, col;
  row_col(r, pe, row, col);
  return r.dst_offset + static_cast<std::int64_t>(row) * r.dst_stride +
         static_cast<std::int64_t>(col);
}
__device__ __forceinline__ std::uint64_t key_of(const DevRoute& r, std::uint64_t pe) {
  if (r.flags & kKeyLinear) return r.key + pe;
  std::uint64_t row, col;
  row_col(r, pe, row, col);
  return r.key + row * static_cast<std::uint64_t>(r.key_stride) + col;
}

__device__ __forceinline__ std::uint32_t chunk_elems(const DevRoute& r, std::uint32_t k, int log2) {
  const std::uint64_t first = static_cast<std::uint64_t>(k) << log2;
  const std::uint64_t left = r.elements - first;
  return left < (std::uint64_t{1} << log2) ? static_cast<std::uint32_t>(left) : (1u << log2);
}

// |d| and its sign for a difference in ordered space modulo 2^width.
template <int kWidth>
__device__ __forceinline__ std::uint32_t magnitude(std::uint32_t d, bool& neg) {
  neg = d >= (1u << (kWidth - 1));
  return neg ? static_cast<std::uint32_t>((std::uint64_t{1} << kWidth) - d) : d;
}

__device__ __forceinline__ void record_bad(Totals* t, std::uint32_t route, int code) {
  atomicMin(&t->bad, (static_cast<unsigned long long>(route) << 8) | static_cast<unsigned>(code));
}

// ---- encode (and patch), in two kernels ----
//
// scan_kernel streams the chunk once: it reads the source (casting it), compares it with the kept
// copy, writes the kept copy where it differs (and, for a patch, the engine's parameter) and leaves
// three bits per element in the chunk's mask area: changed, negative, exception (|d| >= 2). An
// exception's |d| - 2 goes into the chunk's slot at its position. Each thread takes four
// consecutive elements per step (one vector load where the route is contiguous and aligned) and
// stores their bits as one 16-bit entry: entry i covers elements 4i .. 4i + 3, its bits 0-3 say
// which changed, 4-7 which went down, 8-11 which are exceptions. A warp's entries of a step are
// one 64-byte store; nothing crosses lanes. pack_kernel then codes each chunk from its entries
// (a quarter of a bf16 chunk's bytes): a thread per 32 positions (eight entries, one 16-byte
// load), one scan of the counts for every change's index, the fields OR-ed into shared memory.

constexpr int kScanThreads = 256;
constexpr int kScanVec = 4;     // consecutive elements per thread per step
constexpr int kScanUnroll = 2;  // steps whose loads are in flight together
// Blocks per SM the scan is compiled for (at most 40 registers). The scan waits on its loads; more
// resident warps hide them better than a deeper unroll in fewer warps (64 registers, 4 blocks).
constexpr int kScanMinBlocks = 6;
constexpr int kScanStep = kScanThreads * kScanVec;
constexpr int kPackThreads = 256;
// Blocks of pack_kernel, which loops over the chunks a warp could not code (their count is known
// only on the device).
constexpr int kPackDeferredBlocks = 1024;
constexpr std::uint32_t kMaskWords = (1u << kDeviceDeltaMaxChunkLog2) / 32;  // a bit per element
static_assert(kMaskWords == kPackThreads, "pack_kernel gives each 32 positions a thread");
// A chunk's mask area: a 16-bit entry per kScanVec elements.
constexpr std::uint32_t kMaskAreaWords = (1u << kDeviceDeltaMaxChunkLog2) / kScanVec / 2;
static_assert(kScanVec == 4, "an entry holds 4 elements' changed, negative and exception bits");

// Four consecutive elements at `at` (aligned to four times their size) in one load.
template <class T>
__device__ __forceinline__ void load4(const T* at, T (&x)[kScanVec]) {
  static_assert(kScanVec == 4);
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<uint4*>(x) = *reinterpret_cast<const uint4*>(at);
  } else if constexpr (sizeof(T) == 2) {
    *reinterpret_cast<uint2*>(x) = *reinterpret_cast<const uint2*>(at);
  } else {
    *reinterpret_cast<std::uint32_t*>(x) = *reinterpret_cast<const std::uint32_t*>(at);
  }
}

// `count` (1 ..= 4) elements of a route's source from element pe, cast to the wire dtype.
template <class S, class D>
__device__ __forceinline__ void load_source(const DevRoute& r, std::uint64_t pe, bool vec,
                                            std::uint32_t count, std::uint32_t (&v)[kScanVec]) {
  using ST = typename S::T;
  const ST* src = static_cast<const ST*>(r.src);
  if (vec && count == kScanVec) {
    ST x[kScanVec];
    load4(src + r.src_offset + static_cast<std::int64_t>(pe), x);
#pragma unroll
    for (int k = 0; k < kScanVec; ++k) v[k] = convert_elem<S, D>(x[k]);
    return;
  }
#pragma unroll
  for (int k = 0; k < kScanVec; ++k)
    v[k] =
        static_cast<std::uint32_t>(k) < count ? convert_elem<S, D>(src[src_index(r, pe + k)]) : 0u;
}

// `count` elements of the kept copy at `at` (4 x its size aligned when vec).
template <class DT>
__device__ __forceinline__ void load_kept(const DT* at, bool vec, std::uint32_t count,
                                          std::uint32_t (&v)[kScanVec]) {
  if (vec && count == kScanVec) {
    DT x[kScanVec];
    load4(at, x);
#pragma unroll
    for (int k = 0; k < kScanVec; ++k) v[k] = x[k];
    return;
  }
#pragma unroll
  for (int k = 0; k < kScanVec; ++k) v[k] = static_cast<std::uint32_t>(k) < count ? at[k] : 0u;
}

// v[k] by selects (an indexed register array would live in local memory).
__device__ __forceinline__ std::uint32_t pick(const std::uint32_t (&v)[kScanVec], int k) {
  static_assert(kScanVec == 4);
  const std::uint32_t lo = (k & 1) ? v[1] : v[0], hi = (k & 1) ? v[3] : v[2];
  return (k & 2) ? hi : lo;
}

template <class S, class D, bool kPatch>
__global__ void __launch_bounds__(kScanThreads, kScanMinBlocks)
    scan_kernel(const DevRoute* __restrict__ routes, const DevChunk* __restrict__ chunks,
                const std::uint32_t* __restrict__ group_chunks, int log2,
                std::byte* __restrict__ kept_base, std::uint32_t* __restrict__ masks,
                std::uint32_t* __restrict__ slots, std::uint64_t slot_words,
                std::uint32_t* __restrict__ chunk_count, std::uint32_t* __restrict__ chunk_width,
                unsigned long long* __restrict__ chunk_digest) {
  using ST = typename S::T;
  using DT = typename D::T;
  constexpr int kWidth = 8 * static_cast<int>(sizeof(DT));
  constexpr auto kMask = static_cast<std::uint32_t>((std::uint64_t{1} << kWidth) - 1);
  __shared__ unsigned long long scratch[kScanThreads / 32];
  __shared__ unsigned s_width[kScanThreads / 32];

  const std::uint32_t g = group_chunks[blockIdx.x];
  const DevChunk ch = chunks[g];
  const DevRoute r = routes[ch.route];
  const std::uint64_t first = static_cast<std::uint64_t>(ch.k) << log2;
  const std::uint32_t elems = chunk_elems(r, ch.k, log2);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  DT* kept = reinterpret_cast<DT*>(kept_base + r.kept) + first;
  DT* exc_mag = kPatch ? nullptr : reinterpret_cast<DT*>(slots + g * slot_words);
  auto* entries = reinterpret_cast<std::uint16_t*>(masks + std::uint64_t{kMaskAreaWords} * g);
  // Vector loads where the route's source is contiguous and both sides are aligned (the chunk's
  // first element is a multiple of 2^log2, so this holds for the whole chunk).
  const bool vec =
      (r.flags & kSrcLinear) != 0 &&
      reinterpret_cast<std::uintptr_t>(static_cast<const ST*>(r.src) + r.src_offset + first) %
              (kScanVec * sizeof(ST)) ==
          0 &&
      reinterpret_cast<std::uintptr_t>(kept) % (kScanVec * sizeof(DT)) == 0;

  unsigned long long digest = 0;
  std::uint32_t n = 0;
  unsigned W = 0;
  // A whole chunk of the largest size (the default chunk_log2) of a contiguous, aligned route
  // (nearly every chunk) takes the loop without the per-element range tests; a route's last
  // chunk, strided routes and smaller chunk sizes take the general one.
  constexpr std::uint32_t kWholeElems = 1u << kDeviceDeltaMaxChunkLog2;
  const auto scan = [&](auto whole) {
    constexpr bool kWhole = decltype(whole)::value;
    for (std::uint32_t base = 0; base < (kWhole ? kWholeElems : elems);
         base += kScanStep * kScanUnroll) {
      std::uint32_t nv[kScanUnroll][kScanVec], ov[kScanUnroll][kScanVec];
#pragma unroll
      for (int u = 0; u < kScanUnroll; ++u) {
        const std::uint32_t e0 =
            base + static_cast<std::uint32_t>(u * kScanStep) + kScanVec * threadIdx.x;
        const std::uint32_t count =
            kWhole ? kScanVec
                   : (e0 < elems ? min(elems - e0, static_cast<std::uint32_t>(kScanVec)) : 0u);
        load_source<S, D>(r, first + e0, kWhole || vec, count, nv[u]);
        load_kept(kept + e0, kWhole || vec, count, ov[u]);
      }
#pragma unroll
      for (int u = 0; u < kScanUnroll; ++u) {
        const std::uint32_t step0 = base + static_cast<std::uint32_t>(u * kScanStep);
        const std::uint32_t e0 = step0 + kScanVec * threadIdx.x;
        // (Elements past the chunk's end load as 0 on both sides, so they never differ.)
        std::uint32_t changed = 0;
        [[maybe_unused]] std::uint32_t negative = 0, exception = 0;  // (unused by a patch)
#pragma unroll
        for (int k = 0; k < kScanVec; ++k)
          if (nv[u][k] != ov[u][k]) changed |= 1u << k;
        for (std::uint32_t left = changed; left != 0; left &= left - 1) {
          const int k = __ffs(static_cast<int>(left)) - 1;
          const std::uint32_t e = e0 + static_cast<std::uint32_t>(k), x = pick(nv[u], k),
                              o = pick(ov[u], k);
          const std::uint64_t pe = first + e;
          kept[e] = static_cast<DT>(x);
          const std::uint64_t key = key_of(r, pe);
          digest += checksum_term(key, x) - checksum_term(key, o);
          bool neg;
          const std::uint32_t mag = magnitude<kWidth>(
              (df::ordered_key(x, kWidth) - df::ordered_key(o, kWidth)) & kMask, neg);
          if constexpr (kPatch) {
            static_cast<DT*>(r.dst)[dst_index(r, pe)] = static_cast<DT>(x);
            ++n;
          } else {
            if (neg) negative |= 1u << k;
            if (mag >= 2) {
              exception |= 1u << k;
              exc_mag[e] = static_cast<DT>(mag - 2);
              W = max(W, static_cast<unsigned>(df::bit_width(mag - 2)));
            }
          }
        }
        // Every entry of a warp's 128 elements is written when the first is in the chunk, so the
        // entries pack_kernel reads past the chunk's end (to a multiple of 32) are zero.
        if constexpr (!kPatch) {
          if (kWhole || step0 + 128u * static_cast<std::uint32_t>(warp) < elems)
            entries[e0 / kScanVec] =
                static_cast<std::uint16_t>(changed | negative << 4 | exception << 8);
        }
      }
    }
  };
  if (vec && elems == kWholeElems)
    scan(std::true_type{});
  else
    scan(std::false_type{});
  W = __reduce_max_sync(kFull, W);
  if (lane == 0) s_width[warp] = W;
  digest = block_sum<unsigned long long, kScanThreads>(digest, scratch);
  if constexpr (kPatch) {
    const unsigned long long total =
        block_sum<unsigned long long, kScanThreads>(static_cast<unsigned long long>(n), scratch);
    if (threadIdx.x == 0) chunk_count[g] = static_cast<std::uint32_t>(total);
  } else if (threadIdx.x == 0) {
    unsigned w = 0;
    for (int i = 0; i < kScanThreads / 32; ++i) w = max(w, s_width[i]);
    chunk_width[g] = w;
  }
  if (threadIdx.x == 0) chunk_digest[g] = digest;
}

// One of an entry's three nibbles (shift 0: changed, 4: negative, 8: exception) for the 32
// positions of eight consecutive entries (two per word of w), in position order.
__device__ __forceinline__ std::uint32_t positions_of(const uint4& w, int shift) {
  const auto two = [shift](std::uint32_t x) {  // entries 2q and 2q + 1 -> 8 bits
    return ((x >> shift) & 0xFu) | ((x >> (shift + 12)) & 0xF0u);
  };
  return two(w.x) | two(w.y) << 8 | two(w.z) << 16 | two(w.w) << 24;
}

// A chunk that goes raw: its new bits, which the kept copy holds (scan_kernel wrote them), as
// the slot's `words` words; thread `t` of `threads` copies every threads-th word.
template <class DT>
__device__ __forceinline__ void copy_raw_chunk(const std::byte* kept, std::uint32_t k, int log2,
                                               std::uint32_t elems, std::uint32_t* slot,
                                               std::uint32_t words, std::uint32_t t,
                                               std::uint32_t threads) {
  const auto* kb = reinterpret_cast<const unsigned char*>(
      kept + (static_cast<std::uint64_t>(k) << log2) * sizeof(DT));
  const std::uint32_t raw = elems * static_cast<std::uint32_t>(sizeof(DT));
  for (std::uint32_t w = t; w < words; w += threads) {
    std::uint32_t v = 0;
    for (std::uint32_t b = 0; b < 4; ++b)
      if (4 * w + b < raw) v |= static_cast<std::uint32_t>(kb[4 * w + b]) << (8 * b);
    slot[w] = v;
  }
}

// Codes the changes of one 32-position group into a chunk's bits (shared memory): positions p0 +
// b for each bit b of `bc` (changed), with its sign (`bn`) and exception (`bx`) bits; `j` and `e`
// are the indices of the group's first change and first exception in the chunk, and advance.
template <class DT>
__device__ __forceinline__ void code_group(std::uint32_t* bits, const df::ChunkFields& f, int W,
                                           std::uint32_t p0, std::uint32_t bc, std::uint32_t bn,
                                           std::uint32_t bx, const DT* exc_mag, std::uint32_t& j,
                                           std::uint32_t& e) {
  const std::uint32_t low_mask = (1u << f.L) - 1u, exc_mask = (1u << f.Le) - 1u;
  for (std::uint32_t left = bc; left != 0; left &= left - 1) {
    const int b = __ffs(static_cast<int>(left)) - 1;
    const std::uint32_t p = p0 + static_cast<std::uint32_t>(b);
    put_bits_shared(bits, f.low + static_cast<std::uint64_t>(j) * f.L, p & low_mask, f.L);
    if ((bn >> b) & 1u) put_bits_shared(bits, f.sign + j, 1, 1);
    put_bits_shared(bits, f.high + (p >> f.L) + j, 1, 1);
    if ((bx >> b) & 1u) {
      put_bits_shared(bits, f.exc_low + static_cast<std::uint64_t>(e) * f.Le, j & exc_mask, f.Le);
      put_bits_shared(bits, f.exc_mag + static_cast<std::uint64_t>(e) * W, exc_mag[p], W);
      put_bits_shared(bits, f.exc_high + (j >> f.Le) + e, 1, 1);
      ++e;
    }
    ++j;
  }
}

// The chunks pack_warp_kernel leaves to a block (`list`, `*list_count` of them): a block per
// chunk in turn. Every pass of the loop starts with the block scan's barriers, so the shared
// fields and bits of one chunk are not overwritten while a thread still reads the last's.
template <class D>
__global__ void __launch_bounds__(kPackThreads)
    pack_kernel(const DevRoute* __restrict__ routes, const DevChunk* __restrict__ chunks,
                const std::uint32_t* __restrict__ list, const unsigned int* __restrict__ list_count,
                int log2, const std::byte* __restrict__ kept_base,
                const std::uint32_t* __restrict__ masks, std::uint32_t* __restrict__ slots,
                std::uint64_t slot_words, const std::uint32_t* __restrict__ chunk_width,
                std::uint32_t* __restrict__ chunk_info, std::uint32_t* __restrict__ chunk_bytes) {
  using DT = typename D::T;
  extern __shared__ std::uint32_t bits[];
  __shared__ unsigned long long scratch[kPackThreads / 32];
  // (ChunkFields has default member initialisers, which __shared__ variables may not have.)
  __shared__ alignas(8) unsigned char s_fields[sizeof(df::ChunkFields)];
  __shared__ bool s_dense;

  const unsigned int count = *list_count;
  for (unsigned int idx = blockIdx.x; idx < count; idx += gridDim.x) {
    const std::uint32_t g = list[idx];
    const DevChunk ch = chunks[g];
    const DevRoute r = routes[ch.route];
    const std::uint32_t elems = chunk_elems(r, ch.k, log2);
    const std::uint32_t t = threadIdx.x;
    const auto* mw = reinterpret_cast<const uint4*>(masks + std::uint64_t{kMaskAreaWords} * g);
    std::uint32_t bc = 0, bn = 0, bx = 0;
    if (t * 32 < elems) {
      const uint4 w = mw[t];
      bc = positions_of(w, 0);
      bn = positions_of(w, 4);
      bx = positions_of(w, 8);
    }
    // Changes and exceptions before this thread's positions, in one scan (each count < 2^32).
    unsigned long long total = 0;
    const unsigned long long before = block_exclusive_scan<kPackThreads>(
        static_cast<unsigned long long>(__popc(bc)) << 32 | static_cast<unsigned>(__popc(bx)),
        scratch, total);
    const auto n = static_cast<std::uint32_t>(total >> 32), m = static_cast<std::uint32_t>(total);
    if (n == 0) {
      if (t == 0) chunk_info[g] = 0, chunk_bytes[g] = 0;
      continue;
    }
    const int W = static_cast<int>(chunk_width[g]);
    if (t == 0) {
      const df::ChunkFields fields = df::chunk_fields(n, m, W, elems);
      memcpy(s_fields, &fields, sizeof(fields));
      s_dense = df::chunk_goes_dense(fields.bits, elems, static_cast<int>(sizeof(DT)));
    }
    __syncthreads();
    df::ChunkFields f;
    memcpy(&f, s_fields, sizeof(f));
    const bool dense = s_dense;
    const std::uint64_t nbytes =
        df::chunk_data_bytes(n, dense, f.bits, elems, static_cast<int>(sizeof(DT)));
    const auto words = static_cast<std::uint32_t>(nbytes / 4);
    std::uint32_t* slot = slots + static_cast<std::uint64_t>(g) * slot_words;
    if (dense) {
      copy_raw_chunk<DT>(kept_base + r.kept, ch.k, log2, elems, slot, words, t, kPackThreads);
    } else {
      for (std::uint32_t w = t; w < words; w += kPackThreads) bits[w] = 0;
      __syncthreads();
      if (t == 0 && m > 0) bits[0] = df::exceptions_word(m, f.Le, W);
      const DT* exc_mag = reinterpret_cast<const DT*>(slot);
      auto j = static_cast<std::uint32_t>(before >> 32), e = static_cast<std::uint32_t>(before);
      code_group(bits, f, W, t * 32, bc, bn, bx, exc_mag, j, e);
      __syncthreads();  // every exception's magnitude is read before the slot is overwritten
      for (std::uint32_t w = t; w < words; w += kPackThreads) slot[w] = bits[w];
    }
    if (t == 0) {
      chunk_info[g] = df::chunk_info(n, f.L, m > 0 && !dense, dense);
      chunk_bytes[g] = static_cast<std::uint32_t>(nbytes);
    }
  }
}

// A warp per chunk: the same coding as pack_kernel without block barriers, its bits in a share of
// the block's shared memory. Lane l takes positions 256 l .. 256 l + 255 (eight groups of 32, an
// entry area's 16-byte word each); a warp scan of the lanes' counts gives each change its index.
// A chunk whose coding needs more than kPackWarpWords words (dense ones aside: they are copied
// from the kept copy here) goes on `deferred` for pack_kernel. At the densities of an RL step
// (up to about 20 % changed) every chunk fits.
constexpr int kPackWarps = 8;
constexpr std::uint32_t kPackWarpWords = 512;  // 2 KB of coded bits per warp
constexpr int kPackGroups = kMaskWords / 32;   // a lane's 32-position groups
template <class D>
__global__ void __launch_bounds__(kPackWarps * 32)
    pack_warp_kernel(const DevRoute* __restrict__ routes, const DevChunk* __restrict__ chunks,
                     const std::uint32_t* __restrict__ group_chunks, std::uint64_t count, int log2,
                     const std::byte* __restrict__ kept_base,
                     const std::uint32_t* __restrict__ masks, std::uint32_t* __restrict__ slots,
                     std::uint64_t slot_words, const std::uint32_t* __restrict__ chunk_width,
                     std::uint32_t* __restrict__ chunk_info,
                     std::uint32_t* __restrict__ chunk_bytes, std::uint32_t* __restrict__ deferred,
                     unsigned int* __restrict__ deferred_count) {
  using DT = typename D::T;
  __shared__ std::uint32_t s_bits[kPackWarps][kPackWarpWords];
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::uint64_t gi = static_cast<std::uint64_t>(blockIdx.x) * kPackWarps + warp;
  if (gi >= count) return;  // (no block barriers below)
  const std::uint32_t g = group_chunks[gi];
  const DevChunk ch = chunks[g];
  const DevRoute& r = routes[ch.route];
  const std::uint32_t elems = chunk_elems(r, ch.k, log2);
  const auto* mw = reinterpret_cast<const uint4*>(masks + std::uint64_t{kMaskAreaWords} * g);
  const auto group_of = [&](int q, int shift) -> std::uint32_t {
    const std::uint32_t t = lane * kPackGroups + static_cast<std::uint32_t>(q);
    return t * 32 < elems ? positions_of(mw[t], shift) : 0u;
  };
  // Changes (high half) and exceptions (low half) of this lane, then before it (each <= 2^13).
  std::uint32_t mine = 0;
#pragma unroll
  for (int q = 0; q < kPackGroups; ++q) {
    const std::uint32_t t = lane * kPackGroups + static_cast<std::uint32_t>(q);
    if (t * 32 < elems) {
      const uint4 w = mw[t];
      mine += static_cast<std::uint32_t>(__popc(positions_of(w, 0))) << 16 |
              static_cast<std::uint32_t>(__popc(positions_of(w, 8)));
    }
  }
  std::uint32_t upto = mine;
  for (int o = 1; o < 32; o <<= 1) {
    const std::uint32_t v = __shfl_up_sync(kFull, upto, o);
    if (lane >= static_cast<unsigned>(o)) upto += v;
  }
  const std::uint32_t total = __shfl_sync(kFull, upto, 31), before = upto - mine;
  const std::uint32_t n = total >> 16, m = total & 0xFFFFu;
  if (n == 0) {
    if (lane == 0) chunk_info[g] = 0, chunk_bytes[g] = 0;
    return;
  }
  const int W = static_cast<int>(chunk_width[g]);
  const df::ChunkFields f = df::chunk_fields(n, m, W, elems);
  const bool dense = df::chunk_goes_dense(f.bits, elems, static_cast<int>(sizeof(DT)));
  const std::uint64_t nbytes =
      df::chunk_data_bytes(n, dense, f.bits, elems, static_cast<int>(sizeof(DT)));
  const auto words = static_cast<std::uint32_t>(nbytes / 4);
  std::uint32_t* slot = slots + static_cast<std::uint64_t>(g) * slot_words;
  if (dense) {
    copy_raw_chunk<DT>(kept_base + r.kept, ch.k, log2, elems, slot, words, lane, 32);
  } else if (words > kPackWarpWords) {
    if (lane == 0) deferred[atomicAdd(deferred_count, 1u)] = g;
    return;
  } else {
    std::uint32_t* bits = s_bits[warp];
    for (std::uint32_t w = lane; w < words; w += 32) bits[w] = 0;
    __syncwarp();
    if (lane == 0 && m > 0) bits[0] = df::exceptions_word(m, f.Le, W);
    const DT* exc_mag = reinterpret_cast<const DT*>(slot);
    std::uint32_t j = before >> 16, e = before & 0xFFFFu;
    for (int q = 0; q < kPackGroups; ++q) {
      const std::uint32_t bc = group_of(q, 0);
      if (bc == 0) continue;
      const std::uint32_t bn = group_of(q, 4), bx = group_of(q, 8);
      code_group(bits, f, W, (lane * kPackGroups + static_cast<std::uint32_t>(q)) * 32, bc, bn, bx,
                 exc_mag, j, e);
    }
    __syncwarp();  // every exception's magnitude is read before the slot is overwritten
    for (std::uint32_t w = lane; w < words; w += 32) slot[w] = bits[w];
  }
  if (lane == 0) {
    chunk_info[g] = df::chunk_info(n, f.L, m > 0 && !dense, dense);
    chunk_bytes[g] = static_cast<std::uint32_t>(nbytes);
  }
}

// ---- capture: the kept copy becomes the new values; the digest of every element ----

constexpr int kBlockThreads = 256;

template <class S, class D>
__global__ void __launch_bounds__(kBlockThreads)
    capture_kernel(const DevRoute* __restrict__ routes, const DevChunk* __restrict__ chunks,
                   const std::uint32_t* __restrict__ group_chunks, int log2,
                   std::byte* __restrict__ kept_base,
                   unsigned long long* __restrict__ chunk_digest) {
  using ST = typename S::T;
  using DT = typename D::T;
  __shared__ unsigned long long scratch[kBlockThreads / 32];
  const std::uint32_t g = group_chunks[blockIdx.x];
  const DevChunk ch = chunks[g];
  const DevRoute r = routes[ch.route];
  const std::uint64_t first = static_cast<std::uint64_t>(ch.k) << log2;
  const std::uint32_t elems = chunk_elems(r, ch.k, log2);
  DT* kept = reinterpret_cast<DT*>(kept_base + r.kept) + first;
  const ST* src = static_cast<const ST*>(r.src);
  unsigned long long sum = 0;
  for (std::uint32_t e = threadIdx.x; e < elems; e += kBlockThreads) {
    const DT v = convert_elem<S, D>(src[src_index(r, first + e)]);
    kept[e] = v;
    sum += checksum_term(key_of(r, first + e), v);
  }
  sum = block_sum<unsigned long long, kBlockThreads>(sum, scratch);
  if (threadIdx.x == 0) chunk_digest[g] = sum;
}

// Patch and capture: the chunks' counts and digests summed (one block).
__global__ void __launch_bounds__(1024)
    sum_chunks_kernel(const std::uint32_t* __restrict__ chunk_info,
                      const unsigned long long* __restrict__ chunk_digest, std::uint64_t chunks,
                      Totals* totals) {
  __shared__ unsigned long long scratch[32];
  unsigned long long changed = 0, digest = 0;
  for (std::uint64_t g = threadIdx.x; g < chunks; g += 1024) {
    if (chunk_info != nullptr) changed += df::info_count(chunk_info[g]);
    digest += chunk_digest[g];
  }
  changed = block_sum<unsigned long long, 1024>(changed, scratch);
  digest = block_sum<unsigned long long, 1024>(digest, scratch);
  if (threadIdx.x == 0) totals->changed = changed, totals->digest = digest;
}

// ---- encode: from chunk slots to the stream ----

// Per route (one block): its chunks' data offsets, changes and digest, and its mode.
__global__ void __launch_bounds__(kBlockThreads)
    route_plan_kernel(const DevRoute* __restrict__ routes,
                      const std::uint32_t* __restrict__ chunk_info,
                      const std::uint32_t* __restrict__ chunk_bytes,
                      const unsigned long long* __restrict__ chunk_digest,
                      std::uint32_t* __restrict__ chunk_offset, double dense_ratio,
                      RoutePlan* __restrict__ plans) {
  __shared__ unsigned long long scratch[kBlockThreads / 32];
  const DevRoute r = routes[blockIdx.x];
  unsigned long long running = 0, changed = 0, digest = 0;
  for (std::uint64_t base = 0; base < r.chunks; base += kBlockThreads) {
    const std::uint64_t i = base + threadIdx.x;
    const bool in = i < r.chunks;
    const std::uint64_t gi = r.chunk0 + i;
    const unsigned long long b = in ? chunk_bytes[gi] : 0;
    if (in) {
      changed += df::info_count(chunk_info[gi]);
      digest += chunk_digest[gi];
    }
    unsigned long long total = 0;
    const unsigned long long before = block_exclusive_scan<kBlockThreads>(b, scratch, total);
    if (in) chunk_offset[gi] = static_cast<std::uint32_t>(running + before);
    running += total;
  }
  changed = block_sum<unsigned long long, kBlockThreads>(changed, scratch);
  digest = block_sum<unsigned long long, kBlockThreads>(digest, scratch);
  if (threadIdx.x != 0) return;
  RoutePlan p;
  p.changed = changed;
  p.digest = digest;
  const std::uint64_t sparse =
      sizeof(df::ChunkEntry) * static_cast<std::uint64_t>(r.chunks) + running;
  const std::uint64_t raw = r.elements * r.esize;
  if (changed == 0) {
    p.mode = df::kUnchanged;
  } else if (static_cast<double>(sparse) >= dense_ratio * static_cast<double>(raw) ||
             running > 0xffffffffull) {
    p.mode = df::kDense;
    p.bytes = raw;
  } else {
    p.mode = df::kSparse;
    p.bytes = sparse;
  }
  plans[blockIdx.x] = p;
}

// One block: the routes' payload offsets (8-aligned, in order after the directory) and totals.
__global__ void __launch_bounds__(1024)
    layout_kernel(RoutePlan* __restrict__ plans, std::uint64_t routes, Totals* totals) {
  __shared__ unsigned long long scratch[32];
  unsigned long long running = df::kHeaderBytes + sizeof(df::RouteEntry) * routes;
  unsigned long long changed = 0, digest = 0, n_unchanged = 0, n_sparse = 0, n_dense = 0;
  for (std::uint64_t base = 0; base < routes; base += 1024) {
    const std::uint64_t i = base + threadIdx.x;
    const bool in = i < routes;
    const bool payload = in && plans[i].mode != df::kUnchanged;
    const unsigned long long v = payload ? df::align8(plans[i].bytes) : 0;
    unsigned long long total = 0;
    const unsigned long long before = block_exclusive_scan<1024>(v, scratch, total);
    if (in) {
      plans[i].offset = payload ? running + before : 0;
      changed += plans[i].changed;
      digest += plans[i].digest;
      n_unchanged += plans[i].mode == df::kUnchanged;
      n_sparse += plans[i].mode == df::kSparse;
      n_dense += plans[i].mode == df::kDense;
    }
    running += total;
  }
  changed = block_sum<unsigned long long, 1024>(changed, scratch);
  digest = block_sum<unsigned long long, 1024>(digest, scratch);
  n_unchanged = block_sum<unsigned long long, 1024>(n_unchanged, scratch);
  n_sparse = block_sum<unsigned long long, 1024>(n_sparse, scratch);
  n_dense = block_sum<unsigned long long, 1024>(n_dense, scratch);
  if (threadIdx.x == 0) {
    totals->bytes = running;
    totals->changed = changed;
    totals->digest = digest;
    totals->unchanged = n_unchanged;
    totals->sparse = n_sparse;
    totals->dense = n_dense;
  }
}

// Per chunk (one warp): its table entry and data (sparse routes) or its raw bytes from the kept
// copy (dense routes) into the stream, summed into its route's payload checksum.
constexpr int kCompactWarps = kBlockThreads / 32;
__global__ void __launch_bounds__(kBlockThreads)
    compact_kernel(const DevRoute* __restrict__ routes, const DevChunk* __restrict__ chunks,
                   std::uint64_t n_chunks, int log2, const std::byte* __restrict__ kept_base,
                   const std::uint32_t* __restrict__ slots, std::uint64_t slot_words,
                   const std::uint32_t* __restrict__ chunk_info,
                   const std::uint32_t* __restrict__ chunk_bytes,
                   const std::uint32_t* __restrict__ chunk_offset, RoutePlan* __restrict__ plans,
                   std::byte* __restrict__ out) {
  const unsigned lane = threadIdx.x & 31;
  const std::uint64_t g =
      static_cast<std::uint64_t>(blockIdx.x) * kCompactWarps + (threadIdx.x >> 5);
  if (g >= n_chunks) return;
  const DevChunk ch = chunks[g];
  const std::uint32_t mode = plans[ch.route].mode;
  if (mode == df::kUnchanged) return;
  const DevRoute r = routes[ch.route];
  std::byte* payload = out + plans[ch.route].offset;
  const std::uint32_t elems = chunk_elems(r, ch.k, log2);
  unsigned long long sum = 0;
  if (mode == df::kDense) {
    const std::uint64_t b0 = (static_cast<std::uint64_t>(ch.k) << log2) * r.esize;
    const std::uint64_t len = static_cast<std::uint64_t>(elems) * r.esize;
    const auto* kb = reinterpret_cast<const unsigned char*>(kept_base + r.kept + b0);
    auto* dw = reinterpret_cast<std::uint32_t*>(payload + b0);
    const std::uint64_t words = (len + 3) / 4;
    for (std::uint64_t w = lane; w < words; w += 32) {
      std::uint32_t v;
      if (4 * w + 4 <= len) {
        v = reinterpret_cast<const std::uint32_t*>(kb)[w];
      } else {
        v = 0;
        for (std::uint64_t b = 0; 4 * w + b < len; ++b)
          v |= static_cast<std::uint32_t>(kb[4 * w + b]) << (8 * b);
      }
      dw[w] = v;
      sum += checksum_term(b0 / 4 + w, v);
    }
  } else {
    const std::uint64_t table = sizeof(df::ChunkEntry) * static_cast<std::uint64_t>(r.chunks);
    const std::uint32_t off = chunk_offset[g], info = chunk_info[g];
    if (lane == 0) {
      auto* e = reinterpret_cast<df::ChunkEntry*>(payload) + ch.k;
      e->offset = off;
      e->info = info;
      sum += checksum_term(2ull * ch.k, off) + checksum_term(2ull * ch.k + 1, info);
    }
    const std::uint32_t words = chunk_bytes[g] / 4;
    const std::uint32_t* sw = slots + g * slot_words;
    auto* dw = reinterpret_cast<std::uint32_t*>(payload + table + off);
    const std::uint64_t key0 = (table + off) / 4;
    for (std::uint32_t w = lane; w < words; w += 32) {
      const std::uint32_t v = sw[w];
      dw[w] = v;
      sum += checksum_term(key0 + w, v);
    }
  }
  sum = warp_sum(sum);
  if (lane == 0 && sum != 0) atomicAdd(&plans[ch.route].checksum, sum);
}

// One block: the directory, the zero padding after each payload, the header.
__global__ void __launch_bounds__(kBlockThreads)
    directory_kernel(const DevRoute* __restrict__ routes, const RoutePlan* __restrict__ plans,
                     std::uint64_t n_routes, int log2, std::uint64_t base_digest,
                     const Totals* __restrict__ totals, std::byte* __restrict__ out) {
  __shared__ unsigned long long scratch[kBlockThreads / 32];
  unsigned long long sum = 0;
  for (std::uint64_t i = threadIdx.x; i < n_routes; i += kBlockThreads) {
    const RoutePlan p = plans[i];
    df::RouteEntry e;
    e.tag = routes[i].tag;
    e.mode = static_cast<std::uint8_t>(p.mode);
    e.esize = static_cast<std::uint8_t>(routes[i].esize);
    e.chunk_log2 = static_cast<std::uint8_t>(log2);
    e.elements = routes[i].elements;
    e.offset = p.offset;
    e.bytes = p.bytes;
    e.changed = p.changed;
    e.digest_delta = p.digest;
    e.payload_checksum = p.checksum;
    std::uint32_t w[16];
    memcpy(w, &e, sizeof(e));
    auto* dst =
        reinterpret_cast<std::uint32_t*>(out + df::kHeaderBytes + sizeof(df::RouteEntry) * i);
    for (int k = 0; k < 16; ++k) {
      dst[k] = w[k];
      sum += checksum_term(df::kDirectoryKey0 + 16 * i + k, w[k]);
    }
    if (p.mode != df::kUnchanged)
      for (std::uint64_t b = p.offset + p.bytes; b < df::align8(p.offset + p.bytes); ++b)
        out[b] = std::byte{0};
  }
  sum = block_sum<unsigned long long, kBlockThreads>(sum, scratch);
  if (threadIdx.x != 0) return;
  df::StreamHeader h;
  h.routes = static_cast<std::uint32_t>(n_routes);
  h.total_bytes = totals->bytes;
  h.base_digest = base_digest;
  std::uint32_t w[12];
  memcpy(w, &h, sizeof(h));
  for (int k = 0; k < static_cast<int>(df::kHeaderChecksumWords); ++k)
    sum += checksum_term(k, w[k]);
  h.header_checksum = sum;
  memcpy(w, &h, sizeof(h));
  auto* dst = reinterpret_cast<std::uint32_t*>(out);
  for (int k = 0; k < 12; ++k) dst[k] = w[k];
}

// ---- apply ----

__global__ void __launch_bounds__(kBlockThreads)
    payload_checksum_kernel(const PayloadPiece* __restrict__ pieces,
                            const std::byte* __restrict__ stream,
                            unsigned long long* __restrict__ route_sum) {
  __shared__ unsigned long long scratch[kBlockThreads / 32];
  const PayloadPiece pc = pieces[blockIdx.x];
  const auto* p = reinterpret_cast<const unsigned char*>(stream + pc.begin);
  const std::uint32_t words = (pc.bytes + 3) / 4;
  unsigned long long sum = 0;
  for (std::uint32_t w = threadIdx.x; w < words; w += kBlockThreads) {
    std::uint32_t v;
    if (4 * w + 4 <= pc.bytes) {
      v = reinterpret_cast<const std::uint32_t*>(p)[w];
    } else {
      v = 0;
      for (std::uint32_t b = 0; 4 * w + b < pc.bytes; ++b)
        v |= static_cast<std::uint32_t>(p[4 * w + b]) << (8 * b);
    }
    sum += checksum_term(pc.key0 + w, v);
  }
  sum = block_sum<unsigned long long, kBlockThreads>(sum, scratch);
  if (threadIdx.x == 0) atomicAdd(&route_sum[pc.route], sum);
}

__device__ __forceinline__ const df::RouteEntry& entry_of(const std::byte* stream,
                                                          std::uint32_t route) {
  return reinterpret_cast<const df::RouteEntry*>(stream + df::kHeaderBytes)[route];
}

// Per chunk (one thread): a sparse chunk's table entry and extent, before anything is written;
// counts its changes into its route.
// Chunks held raw (every chunk of a dense route, a sparse route's dense chunks) are listed for
// apply_dense_kernel.
__global__ void __launch_bounds__(kBlockThreads)
    table_check_kernel(const DevRoute* __restrict__ routes, const DevChunk* __restrict__ chunks,
                       std::uint64_t n_chunks, int log2, const std::byte* __restrict__ stream,
                       unsigned long long* __restrict__ route_counted,
                       std::uint32_t* __restrict__ dense_list, unsigned int* dense_count,
                       Totals* totals) {
  const std::uint64_t g = static_cast<std::uint64_t>(blockIdx.x) * kBlockThreads + threadIdx.x;
  if (g >= n_chunks) return;
  const DevChunk ch = chunks[g];
  const df::RouteEntry& e = entry_of(stream, ch.route);
  if (e.mode == df::kDense) {
    dense_list[atomicAdd(dense_count, 1u)] = static_cast<std::uint32_t>(g);
    return;
  }
  if (e.mode != df::kSparse) return;
  const df::ChunkView v = df::check_chunk(reinterpret_cast<const unsigned char*>(stream + e.offset),
                                          e.bytes, routes[ch.route].chunks, ch.k,
                                          chunk_elems(routes[ch.route], ch.k, log2), e.esize);
  if (v.error != df::kChunkOk) {
    record_bad(totals, ch.route, static_cast<int>(DeviceDelta::ApplyError::kChunkTable));
    return;
  }
  if (v.n > 0) atomicAdd(&route_counted[ch.route], static_cast<unsigned long long>(v.n));
  if (v.n > 0 && v.dense) dense_list[atomicAdd(dense_count, 1u)] = static_cast<std::uint32_t>(g);
}

// One block: every route's payload checksum and counted changes against its directory entry.
__global__ void __launch_bounds__(kBlockThreads)
    precheck_kernel(const std::byte* __restrict__ stream, std::uint64_t n_routes,
                    const unsigned long long* __restrict__ route_sum,
                    const unsigned long long* __restrict__ route_counted, Totals* totals) {
  for (std::uint64_t i = threadIdx.x; i < n_routes; i += kBlockThreads) {
    const df::RouteEntry& e = entry_of(stream, static_cast<std::uint32_t>(i));
    if (e.mode == df::kUnchanged) continue;
    if (route_sum[i] != e.payload_checksum)
      record_bad(totals, static_cast<std::uint32_t>(i),
                 static_cast<int>(DeviceDelta::ApplyError::kPayloadChecksum));
    else if (e.mode == df::kSparse && route_counted[i] != e.changed)
      record_bad(totals, static_cast<std::uint32_t>(i),
                 static_cast<int>(DeviceDelta::ApplyError::kChunkTable));
  }
}

// ---- the sparse apply: a warp per chunk ----
//
// A chunk's changes are found in parallel: each lane takes a 32-bit window of an Elias-Fano upper
// bit array, a warp scan of the windows' counts gives every set bit its index, and the index with
// the bit's position gives the element (or, for the exceptions, the change). Every code is checked
// (positions increasing and inside the chunk, exception indices increasing and inside the
// changes, enough set bits); nothing outside the chunk is ever written.

constexpr int kApplyWarps = 8;
// Blocks per SM the apply is compiled for (registers at most 65536 / (kApplyWarps * 32 * 4)).
constexpr int kApplyMinBlocks = 4;

__device__ __forceinline__ std::uint32_t warp_inclusive_sum(std::uint32_t v, int lane) {
  for (int o = 1; o < 32; o <<= 1) {
    const std::uint32_t t = __shfl_up_sync(kFull, v, o);
    if (lane >= o) v += t;
  }
  return v;
}
template <class T>
__device__ __forceinline__ T warp_inclusive_max(T v, int lane) {
  for (int o = 1; o < 32; o <<= 1) {
    const T t = __shfl_up_sync(kFull, v, o);
    if (lane >= o) v = max(v, t);
  }
  return v;
}
// One round of values decoded lane after lane, each lane's increasing from `first` to `last` (-1:
// none): false when a lane's first is not above every value of the lanes before it and of the
// rounds before (`before`, which becomes the largest value so far).
template <class T>
__device__ __forceinline__ bool warp_round_increases(T first, T last, T& before, int lane) {
  const T upto = warp_inclusive_max(last, lane);
  T prior = __shfl_up_sync(kFull, upto, 1);
  if (lane == 0) prior = -1;
  const bool ok = first < 0 || first > max(prior, before);
  before = max(before, __shfl_sync(kFull, upto, 31));
  return ok;
}

// The position of the set bit of rank `r` (from 0) in `v`, which has more than r set bits.
__device__ __forceinline__ int select_bit(std::uint32_t v, std::uint32_t r) {
  int pos = 0;
  for (int half = 16; half >= 1; half >>= 1) {
    const auto below = static_cast<std::uint32_t>(__popc(v & ((1u << half) - 1u)));
    if (r >= below) {
      r -= below;
      v >>= half;
      pos += half;
    }
  }
  return pos;
}

// Visits the first `count` set bits of the `len` bits at bit `start` of `words`, in order within
// each lane and lane after lane: value(i, bit) for set bit i at `bit` from start returns what the
// bit codes (a position, a change index), or -1 when that is out of range. True when every value
// is in range and strictly above the ones before it, and `count` bits were set (on every lane).
template <class F>
__device__ __forceinline__ bool warp_elias_fano(const std::uint32_t* words, std::uint64_t start,
                                                std::uint64_t len, std::uint32_t count, int lane,
                                                F&& value) {
  std::uint32_t found = 0;
  long long before_round = -1;
  bool ok = true;
  for (std::uint64_t w0 = 0; w0 * 32 < len && found < count; w0 += 32) {
    const std::uint64_t w = w0 + static_cast<std::uint64_t>(lane);
    std::uint32_t bits = 0;
    if (w * 32 < len)
      bits = df::get_bits(words, start + 32 * w,
                          static_cast<int>(len - 32 * w < 32 ? len - 32 * w : 32));
    const std::uint32_t c = __popc(bits);
    const std::uint32_t incl = warp_inclusive_sum(c, lane);
    std::uint32_t i = found + incl - c;
    long long first = -1, last = -1;
    while (bits != 0 && i < count) {
      const int b = __ffs(static_cast<int>(bits)) - 1;
      bits &= bits - 1;
      const long long v = value(i, 32 * w + static_cast<std::uint64_t>(b));
      if (v < 0 || v <= last) {
        ok = false;
      } else {
        if (first < 0) first = v;
        last = v;
      }
      ++i;
    }
    if (!warp_round_increases(first, last, before_round, lane)) ok = false;
    found += __shfl_sync(kFull, incl, 31);
  }
  return __all_sync(kFull, ok) && found >= count;
}

// Decodes one sparse chunk (a checked view) and scatters its changes at dst; false when a code is
// malformed (positions not increasing or past the chunk, exception indices not increasing or past
// the changes, too few set bits). Exceptions are checked before anything is written; a position
// that is out of order or out of the chunk is not written, but the others of the chunk may be.
// exc_bits and exc_rank: the warp's shared memory, kMaskWords words each.
template <class DT>
__device__ __forceinline__ bool warp_apply_chunk(const DevRoute& r, const std::uint32_t* words,
                                                 const df::ChunkView& v, std::uint64_t first,
                                                 std::uint32_t elems, std::uint32_t* exc_bits,
                                                 std::uint32_t* exc_rank, int lane,
                                                 std::uint32_t& count, unsigned long long& digest) {
  constexpr int kWidth = 8 * static_cast<int>(sizeof(DT));
  const df::ChunkFields& f = v.f;
  const std::uint32_t n = v.n, m = v.m;
  if (m > 0) {
    // The exceptions' change indices as a bit set over the changes, with each word's rank.
    const std::uint32_t nw = (n + 31) / 32;
    for (std::uint32_t w = lane; w < nw; w += 32) exc_bits[w] = 0;
    __syncwarp();
    const std::uint64_t xlen = df::ef_bits(m, n, f.Le) - static_cast<std::uint64_t>(m) * f.Le;
    const bool ok = warp_elias_fano(
        words, f.exc_high, xlen, m, lane, [&](std::uint32_t e, std::uint64_t bit) -> long long {
          const std::uint64_t j =
              ((bit - e) << f.Le) |
              df::get_bits(words, f.exc_low + static_cast<std::uint64_t>(e) * f.Le, f.Le);
          if (j >= n) return -1;
          atomicOr(&exc_bits[j >> 5], 1u << (j & 31));
          return static_cast<long long>(j);
        });
    if (!ok) return false;
    __syncwarp();
    std::uint32_t carry = 0;
    for (std::uint32_t w0 = 0; w0 < nw; w0 += 32) {
      const std::uint32_t w = w0 + static_cast<std::uint32_t>(lane);
      const std::uint32_t c = w < nw ? __popc(exc_bits[w]) : 0u;
      const std::uint32_t incl = warp_inclusive_sum(c, lane);
      if (w < nw) exc_rank[w] = carry + incl - c;
      carry += __shfl_sync(kFull, incl, 31);
    }
    __syncwarp();
  }
  // The positions: a round gives each lane 32 bits of the upper array, and a scan of their counts
  // the index of every set bit. The round's changes are then taken 32 at a time, change t by lane
  // t mod 32: it finds the lane whose window holds the t-th set bit (a binary search over the
  // lanes' counts), the bit in that window, and from it the position. Every lane has a change in
  // every pass but the round's last, and one load instruction's addresses are 32 consecutive
  // changes. Each position must be above the one before it (the lane before, or the last of the
  // previous pass) and inside the chunk; one that is not is not written, and fails the chunk.
  // A sparse chunk's data is at most its raw bytes (else it goes raw): bit offsets fit 32 bits.
  const auto hlen = static_cast<std::uint32_t>(df::ef_bits(n, elems, f.L)) - n * f.L;
  const auto high = static_cast<std::uint32_t>(f.high), low = static_cast<std::uint32_t>(f.low);
  const auto sign = static_cast<std::uint32_t>(f.sign);
  DT* dst = static_cast<DT*>(r.dst);
  std::uint32_t found = 0;
  int last = -1;  // the position of the change before the pass's first
  bool ok = true;
  for (std::uint32_t w0 = 0; w0 * 32 < hlen && found < n; w0 += 32) {
    const std::uint32_t w = w0 + static_cast<std::uint32_t>(lane);
    const std::uint32_t bits =
        w * 32 < hlen
            ? df::get_bits(words, high + 32 * w, static_cast<int>(min(hlen - 32 * w, 32u)))
            : 0u;
    const std::uint32_t c = __popc(bits);
    const std::uint32_t before = warp_inclusive_sum(c, lane) - c;  // set bits of the lanes before
    const std::uint32_t total = __shfl_sync(kFull, before + c, 31);
    const std::uint32_t in_round = min(total, n - found);
    for (std::uint32_t t0 = 0; t0 < in_round; t0 += 32) {
      const std::uint32_t t = t0 + static_cast<std::uint32_t>(lane);
      int owner = 0;
#pragma unroll
      for (int step = 16; step >= 1; step >>= 1) {
        const std::uint32_t b = __shfl_sync(kFull, before, owner + step);
        if (b <= t) owner += step;
      }
      const std::uint32_t window = __shfl_sync(kFull, bits, owner);
      const std::uint32_t rank = t - __shfl_sync(kFull, before, owner);
      int pos = -1;
      bool neg = false;
      const std::uint32_t j = found + t;
      if (t < in_round) {
        const std::uint32_t upper = 32 * (w0 + static_cast<std::uint32_t>(owner)) +
                                    static_cast<std::uint32_t>(select_bit(window, rank));
        // upper - j < 2^14 and L < 16: below 2^31
        pos = static_cast<int>(((upper - j) << f.L) | df::get_bits(words, low + j * f.L, f.L));
        neg = df::get_bits(words, sign + j, 1) != 0;
      }
      int prior = __shfl_up_sync(kFull, pos, 1);
      if (lane == 0) prior = last;
      last = __shfl_sync(kFull, pos, static_cast<int>(min(in_round - t0, 32u)) - 1);
      if (t >= in_round) continue;
      if (pos <= prior || pos >= static_cast<int>(elems)) {
        ok = false;  // out of the chunk, or not above the change before: not written
        continue;
      }
      std::uint32_t mag = 1;
      if (m > 0 && ((exc_bits[j >> 5] >> (j & 31)) & 1u)) {
        const std::uint32_t e =
            exc_rank[j >> 5] + __popc(exc_bits[j >> 5] & ((1u << (j & 31)) - 1u));
        mag = 2 + df::get_bits(words, static_cast<std::uint32_t>(f.exc_mag) + e * f.W, f.W);
      }
      const std::uint64_t pe = first + static_cast<std::uint64_t>(pos);
      DT* at = dst + dst_index(r, pe);
      const DT old = *at;
      const auto nv = static_cast<DT>(df::add_ordered(
          old, neg ? -static_cast<std::int64_t>(mag) : static_cast<std::int64_t>(mag), kWidth));
      const std::uint64_t key = key_of(r, pe);
      digest += checksum_term(key, nv) - checksum_term(key, old);
      *at = nv;
      ++count;
    }
    found += total;
  }
  return __all_sync(kFull, ok) && found >= n;
}

// A warp per chunk of a sparse route: decode, check and scatter its changes.
__global__ void __launch_bounds__(kApplyWarps * 32, kApplyMinBlocks)
    apply_sparse_kernel(const DevRoute* __restrict__ routes, const DevChunk* __restrict__ chunks,
                        std::uint64_t n_chunks, int log2, const std::byte* __restrict__ stream,
                        std::uint32_t* __restrict__ chunk_changed,
                        unsigned long long* __restrict__ chunk_digest, Totals* totals) {
  __shared__ std::uint32_t exc_bits[kApplyWarps][kMaskWords], exc_rank[kApplyWarps][kMaskWords];
  if (totals->bad != ~0ull) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::uint64_t g = static_cast<std::uint64_t>(blockIdx.x) * kApplyWarps + warp;
  if (g >= n_chunks) return;
  const DevChunk ch = chunks[g];
  const df::RouteEntry& e = entry_of(stream, ch.route);
  if (e.mode != df::kSparse) return;
  const DevRoute r = routes[ch.route];
  const std::uint32_t elems = chunk_elems(r, ch.k, log2);
  const auto* payload = reinterpret_cast<const unsigned char*>(stream + e.offset);
  const df::ChunkView v = df::check_chunk(payload, e.bytes, r.chunks, ch.k, elems, e.esize);
  if (v.n == 0 || v.dense) return;
  const auto* words = reinterpret_cast<const std::uint32_t*>(
      payload + sizeof(df::ChunkEntry) * static_cast<std::uint64_t>(r.chunks) + v.offset);
  const std::uint64_t first = static_cast<std::uint64_t>(ch.k) << log2;
  std::uint32_t count = 0;
  unsigned long long digest = 0;
  bool ok;
  switch (r.esize) {
    case 1:
      ok = warp_apply_chunk<std::uint8_t>(r, words, v, first, elems, exc_bits[warp], exc_rank[warp],
                                          lane, count, digest);
      break;
    case 2:
      ok = warp_apply_chunk<std::uint16_t>(r, words, v, first, elems, exc_bits[warp],
                                           exc_rank[warp], lane, count, digest);
      break;
    default:
      ok = warp_apply_chunk<std::uint32_t>(r, words, v, first, elems, exc_bits[warp],
                                           exc_rank[warp], lane, count, digest);
      break;
  }
  count = warp_sum(count);
  digest = warp_sum(digest);
  if (lane != 0) return;
  if (!ok) record_bad(totals, ch.route, static_cast<int>(DeviceDelta::ApplyError::kCodes));
  chunk_changed[g] = count;
  chunk_digest[g] = digest;
}

template <class DT>
__device__ __forceinline__ void apply_raw(const DevRoute& r, const unsigned char* raw,
                                          std::uint64_t first, std::uint32_t elems,
                                          unsigned long long& count, unsigned long long& digest) {
  const DT* nvs = reinterpret_cast<const DT*>(raw);
  DT* dst = static_cast<DT*>(r.dst);
  for (std::uint32_t i = threadIdx.x; i < elems; i += kBlockThreads) {
    const DT nv = nvs[i];
    DT* at = dst + dst_index(r, first + i);
    const DT old = *at;
    if (nv == old) continue;
    const std::uint64_t key = key_of(r, first + i);
    digest += checksum_term(key, nv) - checksum_term(key, old);
    *at = nv;
    ++count;
  }
}

// The chunks table_check_kernel listed as raw, a block each in turn: compare, write what differs.
__global__ void __launch_bounds__(kBlockThreads)
    apply_dense_kernel(const DevRoute* __restrict__ routes, const DevChunk* __restrict__ chunks,
                       int log2, const std::byte* __restrict__ stream,
                       const std::uint32_t* __restrict__ dense_list,
                       const unsigned int* __restrict__ dense_count,
                       std::uint32_t* __restrict__ chunk_changed,
                       unsigned long long* __restrict__ chunk_digest, Totals* totals) {
  __shared__ unsigned long long scratch[kBlockThreads / 32];
  __shared__ unsigned long long scratch2[kBlockThreads / 32];
  if (totals->bad != ~0ull) return;
  const unsigned int n = *dense_count;
  for (unsigned int idx = blockIdx.x; idx < n; idx += gridDim.x) {
    const std::uint32_t g = dense_list[idx];
    const DevChunk ch = chunks[g];
    const DevRoute r = routes[ch.route];
    const df::RouteEntry& e = entry_of(stream, ch.route);
    const std::uint32_t elems = chunk_elems(r, ch.k, log2);
    const std::uint64_t first = static_cast<std::uint64_t>(ch.k) << log2;
    const auto* payload = reinterpret_cast<const unsigned char*>(stream + e.offset);
    const unsigned char* raw;
    if (e.mode == df::kDense) {
      raw = payload + first * r.esize;
    } else {
      const df::ChunkView v = df::check_chunk(payload, e.bytes, r.chunks, ch.k, elems, e.esize);
      raw = payload + sizeof(df::ChunkEntry) * static_cast<std::uint64_t>(r.chunks) + v.offset;
    }
    unsigned long long count = 0, digest = 0;
    switch (r.esize) {
      case 1:
        apply_raw<std::uint8_t>(r, raw, first, elems, count, digest);
        break;
      case 2:
        apply_raw<std::uint16_t>(r, raw, first, elems, count, digest);
        break;
      default:
        apply_raw<std::uint32_t>(r, raw, first, elems, count, digest);
        break;
    }
    count = block_sum<unsigned long long, kBlockThreads>(count, scratch);
    digest = block_sum<unsigned long long, kBlockThreads>(digest, scratch2);
    if (threadIdx.x == 0) {
      chunk_changed[g] = static_cast<std::uint32_t>(count);
      chunk_digest[g] = digest;
    }
  }
}

// Per route (one block): its applied changes and digest against the directory; totals.
__global__ void __launch_bounds__(kBlockThreads)
    apply_finish_kernel(const DevRoute* __restrict__ routes, const std::byte* __restrict__ stream,
                        const std::uint32_t* __restrict__ chunk_changed,
                        const unsigned long long* __restrict__ chunk_digest, Totals* totals) {
  __shared__ unsigned long long scratch[kBlockThreads / 32];
  if (totals->bad != ~0ull) return;
  const DevRoute r = routes[blockIdx.x];
  unsigned long long changed = 0, digest = 0;
  for (std::uint64_t i = threadIdx.x; i < r.chunks; i += kBlockThreads) {
    changed += chunk_changed[r.chunk0 + i];
    digest += chunk_digest[r.chunk0 + i];
  }
  changed = block_sum<unsigned long long, kBlockThreads>(changed, scratch);
  digest = block_sum<unsigned long long, kBlockThreads>(digest, scratch);
  if (threadIdx.x != 0) return;
  const df::RouteEntry& e = entry_of(stream, blockIdx.x);
  if (changed != e.changed || digest != e.digest_delta) {
    record_bad(totals, blockIdx.x, static_cast<int>(DeviceDelta::ApplyError::kResult));
    return;
  }
  atomicAdd(&totals->changed, changed);
  atomicAdd(&totals->digest, digest);
  atomicAdd(e.mode == df::kUnchanged ? &totals->unchanged
            : e.mode == df::kSparse  ? &totals->sparse
                                     : &totals->dense,
            1ull);
}

// ---- dispatch ----

// The (source, wire) pairs the kernels are built for: every dtype as itself, and float32 to the
// 16-bit types (a trainer's master cast). Others are refused at create.
bool pair_supported(int src, int wire) {
  return src == wire || (src == 0 && (wire == 1 || wire == 2));
}

template <class F>
Status with_pair(int src, int wire, F&& f) {
  switch (src * 4 + wire) {
    case 0:
      return f(F32{}, F32{});
    case 1:
      return f(F32{}, BF16{});
    case 2:
      return f(F32{}, F16{});
    case 5:
      return f(BF16{}, BF16{});
    case 10:
      return f(F16{}, F16{});
    case 15:
      return f(FP8{}, FP8{});
    default:
      return Status::Unsupported("delta: a dtype pair the CUDA kernels are not built for");
  }
}

template <class T>
Result<DeviceBuffer> upload_vector(const std::vector<T>& v, int device) {
  REFIT_ASSIGN_OR_RETURN(
      DeviceBuffer b,
      DeviceBuffer::allocate(std::max<std::size_t>(v.size() * sizeof(T), 8), device));
  if (!v.empty()) REFIT_RETURN_IF_ERROR(copy_to_device(b.data(), v.data(), v.size() * sizeof(T)));
  return std::move(b);
}

Status check_grid(std::uint64_t blocks, const char* what) {
  if (blocks > static_cast<std::uint64_t>(std::numeric_limits<int>::max()))
    return Status::InvalidArgument(
        fmt::format("{}: {} thread blocks exceed one launch", what, blocks));
  return Status::Ok();
}

}  // namespace

struct DeviceDelta::Impl {
  int device = 0;
  int log2 = 13;
  std::uint64_t n_routes = 0, n_chunks = 0;
  std::uint32_t max_esize = 1;
  struct Group {
    int src = 0, wire = 0;
    std::uint64_t begin = 0, count = 0;  // in group_chunks
  };
  std::vector<Group> groups;
  std::vector<std::uint64_t> chunk0;  // per route (host)
  DeviceBuffer routes, chunks, group_chunks;
  // scratch
  DeviceBuffer chunk_info, chunk_bytes, chunk_offset, chunk_digest, plans, totals;
  DeviceBuffer route_sum, route_counted;
  // apply: the chunks held raw; encode: the chunks pack_warp_kernel leaves to pack_kernel
  DeviceBuffer dense_list, dense_count;
  DeviceBuffer chunk_width;  // encode: bits of the chunk's largest |d| - 2
  DeviceBuffer pieces;

  std::uint64_t slot_words() const { return ((std::uint64_t{1} << log2) * max_esize + 3) / 4; }
  Result<Totals> read_totals(void* stream, std::chrono::milliseconds timeout, const char* what) {
    REFIT_RETURN_IF_ERROR(synchronize_stream(stream, timeout, what));
    Totals t;
    REFIT_RETURN_IF_ERROR(copy_to_host(&t, totals.data(), sizeof(t)));
    return t;
  }
  Status reset_totals(void* stream) {
    const Totals t;
    REFIT_CUDA_CHECK(cudaMemcpyAsync(totals.data(), &t, sizeof(t), cudaMemcpyHostToDevice,
                                     static_cast<cudaStream_t>(stream)));
    return Status::Ok();
  }
};

Result<std::unique_ptr<DeviceDelta>> DeviceDelta::create(const std::vector<DeltaRoute>& routes,
                                                         int chunk_log2, int device) {
  if (chunk_log2 < df::kMinChunkLog2 || chunk_log2 > kDeviceDeltaMaxChunkLog2)
    return Status::Unsupported(
        fmt::format("delta: the CUDA plane codes chunks of 2^{}..2^{} elements, not 2^{}",
                    df::kMinChunkLog2, kDeviceDeltaMaxChunkLog2, chunk_log2));
  REFIT_RETURN_IF_ERROR(set_device(device));
  std::unique_ptr<DeviceDelta> d(new DeviceDelta());
  d->chunk_log2_ = chunk_log2;
  d->impl_ = std::make_unique<Impl>();
  Impl& m = *d->impl_;
  m.device = device;
  m.log2 = chunk_log2;
  m.n_routes = routes.size();
  std::vector<DevRoute> dev;
  std::vector<DevChunk> chunks;
  std::vector<std::vector<std::uint32_t>> by_group(16);
  for (std::size_t i = 0; i < routes.size(); ++i) {
    const DeltaRoute& r = routes[i];
    const Block2D& b = r.block;
    DevRoute x;
    x.src = r.src;
    x.dst = r.dst;
    x.src_offset = b.src_offset;
    x.src_stride = b.src_stride;
    x.dst_offset = b.dst_offset;
    x.dst_stride = b.dst_stride;
    x.elements = static_cast<std::uint64_t>(b.numel());
    x.kept = r.kept;
    x.key = r.key;
    x.key_stride = r.key_stride;
    x.chunk0 = chunks.size();
    x.chunks = static_cast<std::uint32_t>(df::chunk_count(x.elements, chunk_log2));
    x.cols = static_cast<std::uint32_t>(b.cols);
    x.esize = static_cast<std::uint32_t>(dtype_size(r.wire_dtype));
    x.tag = r.tag;
    const bool one_row = b.rows <= 1;
    x.flags = (one_row || b.src_stride == b.cols ? kSrcLinear : 0u) |
              (one_row || b.dst_stride == b.cols ? kDstLinear : 0u) |
              (one_row || r.key_stride == b.cols ? kKeyLinear : 0u);
    m.max_esize = std::max(m.max_esize, x.esize);
    m.chunk0.push_back(x.chunk0);
    if (!pair_supported(dtype_code(r.src_dtype), dtype_code(r.wire_dtype)))
      return Status::Unsupported(fmt::format(
          "delta: route tag {} reads {} and sends {}: the CUDA plane encodes every dtype as itself "
          "and float32 as bfloat16 or float16",
          r.tag, dtype_name(r.src_dtype), dtype_name(r.wire_dtype)));
    const int group = dtype_code(r.src_dtype) * 4 + dtype_code(r.wire_dtype);
    for (std::uint32_t k = 0; k < x.chunks; ++k) {
      by_group[static_cast<std::size_t>(group)].push_back(
          static_cast<std::uint32_t>(chunks.size()));
      chunks.push_back(DevChunk{static_cast<std::uint32_t>(i), k});
    }
    dev.push_back(x);
  }
  if (chunks.size() >= (std::uint64_t{1} << 32))
    return Status::InvalidArgument(
        fmt::format("delta: {} chunks in one list; at most 2^32 - 1", chunks.size()));
  m.n_chunks = chunks.size();
  std::vector<std::uint32_t> group_chunks;
  for (int gi = 0; gi < 16; ++gi) {
    if (by_group[static_cast<std::size_t>(gi)].empty()) continue;
    m.groups.push_back(Impl::Group{gi / 4, gi % 4, group_chunks.size(),
                                   by_group[static_cast<std::size_t>(gi)].size()});
    group_chunks.insert(group_chunks.end(), by_group[static_cast<std::size_t>(gi)].begin(),
                        by_group[static_cast<std::size_t>(gi)].end());
  }
  REFIT_ASSIGN_OR_RETURN(m.routes, upload_vector(dev, device));
  REFIT_ASSIGN_OR_RETURN(m.chunks, upload_vector(chunks, device));
  REFIT_ASSIGN_OR_RETURN(m.group_chunks, upload_vector(group_chunks, device));
  const std::size_t G = std::max<std::uint64_t>(m.n_chunks, 1),
                    R = std::max<std::uint64_t>(m.n_routes, 1);
  REFIT_ASSIGN_OR_RETURN(m.chunk_info, DeviceBuffer::allocate(G * 4, device));
  REFIT_ASSIGN_OR_RETURN(m.chunk_bytes, DeviceBuffer::allocate(G * 4, device));
  REFIT_ASSIGN_OR_RETURN(m.chunk_offset, DeviceBuffer::allocate(G * 4, device));
  REFIT_ASSIGN_OR_RETURN(m.chunk_width, DeviceBuffer::allocate(G * 4, device));
  REFIT_ASSIGN_OR_RETURN(m.chunk_digest, DeviceBuffer::allocate(G * 8, device));
  REFIT_ASSIGN_OR_RETURN(m.plans, DeviceBuffer::allocate(R * sizeof(RoutePlan), device));
  REFIT_ASSIGN_OR_RETURN(m.route_sum, DeviceBuffer::allocate(R * 8, device));
  REFIT_ASSIGN_OR_RETURN(m.route_counted, DeviceBuffer::allocate(R * 8, device));
  REFIT_ASSIGN_OR_RETURN(m.totals, DeviceBuffer::allocate(sizeof(Totals), device));
  REFIT_ASSIGN_OR_RETURN(m.dense_list, DeviceBuffer::allocate(G * 4, device));
  REFIT_ASSIGN_OR_RETURN(m.dense_count, DeviceBuffer::allocate(sizeof(unsigned int), device));
  return std::move(d);
}

DeviceDelta::~DeviceDelta() = default;

Status DeviceDeltaScratch::reserve(std::size_t slot_bytes, std::size_t mask_bytes, int device) {
  if (slots_.size() < slot_bytes) {
    slots_ = DeviceBuffer();
    REFIT_ASSIGN_OR_RETURN(slots_, DeviceBuffer::allocate(slot_bytes, device));
  }
  if (masks_.size() < mask_bytes) {
    masks_ = DeviceBuffer();
    REFIT_ASSIGN_OR_RETURN(masks_, DeviceBuffer::allocate(mask_bytes, device));
  }
  return Status::Ok();
}

Result<DeltaResult> DeviceDelta::encode(std::byte* kept, std::byte* out, std::size_t capacity,
                                        std::uint64_t base_digest, double dense_ratio, void* stream,
                                        std::chrono::milliseconds timeout,
                                        DeviceDeltaScratch& scratch) {
  Impl& m = *impl_;
  REFIT_RETURN_IF_ERROR(set_device(m.device));
  const auto s = static_cast<cudaStream_t>(stream);
  const std::uint64_t slot_words = m.slot_words();
  const std::uint64_t G = std::max<std::uint64_t>(m.n_chunks, 1);
  // Each chunk's coded data (and, between the two kernels, its exceptions' magnitudes), and its
  // mask entries (scan_kernel's bits per element).
  REFIT_RETURN_IF_ERROR(scratch.reserve(G * slot_words * 4, G * kMaskAreaWords * 4, m.device));
  REFIT_RETURN_IF_ERROR(m.reset_totals(stream));
  const auto* routes = static_cast<const DevRoute*>(m.routes.data());
  const auto* chunks = static_cast<const DevChunk*>(m.chunks.data());
  auto* info = static_cast<std::uint32_t*>(m.chunk_info.data());
  auto* bytes = static_cast<std::uint32_t*>(m.chunk_bytes.data());
  auto* offset = static_cast<std::uint32_t*>(m.chunk_offset.data());
  auto* digest = static_cast<unsigned long long*>(m.chunk_digest.data());
  auto* plans = static_cast<RoutePlan*>(m.plans.data());
  auto* totals = static_cast<Totals*>(m.totals.data());
  auto* slots = static_cast<std::uint32_t*>(scratch.slots());
  auto* masks = static_cast<std::uint32_t*>(scratch.masks());
  auto* width = static_cast<std::uint32_t*>(m.chunk_width.data());
  auto* deferred = static_cast<std::uint32_t*>(m.dense_list.data());
  auto* deferred_count = static_cast<unsigned int*>(m.dense_count.data());
  for (const Impl::Group& g : m.groups) {
    REFIT_RETURN_IF_ERROR(check_grid(g.count, "delta encode"));
    const auto* list = static_cast<const std::uint32_t*>(m.group_chunks.data()) + g.begin;
    REFIT_RETURN_IF_ERROR(with_pair(g.src, g.wire, [&](auto src, auto wire) {
      using S = decltype(src);
      using D = decltype(wire);
      scan_kernel<S, D, false><<<static_cast<unsigned>(g.count), kScanThreads, 0, s>>>(
          routes, chunks, list, m.log2, kept, masks, slots, slot_words, nullptr, width, digest);
      REFIT_CUDA_CHECK_LAUNCH("delta scan_kernel launch");
      REFIT_CUDA_CHECK(cudaMemsetAsync(deferred_count, 0, sizeof(unsigned int), s));
      pack_warp_kernel<D><<<static_cast<unsigned>((g.count + kPackWarps - 1) / kPackWarps),
                            kPackWarps * 32, 0, s>>>(routes, chunks, list, g.count, m.log2, kept,
                                                     masks, slots, slot_words, width, info, bytes,
                                                     deferred, deferred_count);
      REFIT_CUDA_CHECK_LAUNCH("delta pack_warp_kernel launch");
      pack_kernel<D><<<kPackDeferredBlocks, kPackThreads, slot_words * 4, s>>>(
          routes, chunks, deferred, deferred_count, m.log2, kept, masks, slots, slot_words, width,
          info, bytes);
      REFIT_CUDA_CHECK_LAUNCH("delta pack_kernel launch");
      return Status::Ok();
    }));
  }
  if (m.n_routes > 0) {
    route_plan_kernel<<<static_cast<unsigned>(m.n_routes), kBlockThreads, 0, s>>>(
        routes, info, bytes, digest, offset, dense_ratio, plans);
    REFIT_CUDA_CHECK_LAUNCH("delta route_plan_kernel launch");
  }
  layout_kernel<<<1, 1024, 0, s>>>(plans, m.n_routes, totals);
  REFIT_CUDA_CHECK_LAUNCH("delta layout_kernel launch");
  if (m.n_chunks > 0) {
    REFIT_RETURN_IF_ERROR(check_grid(m.n_chunks, "delta compact"));
    compact_kernel<<<static_cast<unsigned>((m.n_chunks + kCompactWarps - 1) / kCompactWarps),
                     kBlockThreads, 0, s>>>(routes, chunks, m.n_chunks, m.log2, kept, slots,
                                            slot_words, info, bytes, offset, plans, out);
    REFIT_CUDA_CHECK_LAUNCH("delta compact_kernel launch");
  }
  directory_kernel<<<1, kBlockThreads, 0, s>>>(routes, plans, m.n_routes, m.log2, base_digest,
                                               totals, out);
  REFIT_CUDA_CHECK_LAUNCH("delta directory_kernel launch");
  REFIT_ASSIGN_OR_RETURN(const Totals t, m.read_totals(stream, timeout, "a delta encode"));
  if (t.bytes > capacity)
    return Status::Internal(
        fmt::format("delta: the stream of {} routes took {} bytes, more than the {} of its buffer",
                    m.n_routes, t.bytes, capacity));
  DeltaResult r;
  r.stream_bytes = static_cast<std::size_t>(t.bytes);
  r.changed = static_cast<std::int64_t>(t.changed);
  r.digest_delta = t.digest;
  r.routes_unchanged = static_cast<std::int64_t>(t.unchanged);
  r.routes_sparse = static_cast<std::int64_t>(t.sparse);
  r.routes_dense = static_cast<std::int64_t>(t.dense);
  return r;
}

Result<DeltaResult> DeviceDelta::capture(std::byte* kept, void* stream,
                                         std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  REFIT_RETURN_IF_ERROR(set_device(m.device));
  const auto s = static_cast<cudaStream_t>(stream);
  REFIT_RETURN_IF_ERROR(m.reset_totals(stream));
  auto* digest = static_cast<unsigned long long*>(m.chunk_digest.data());
  for (const Impl::Group& g : m.groups) {
    REFIT_RETURN_IF_ERROR(check_grid(g.count, "delta capture"));
    REFIT_RETURN_IF_ERROR(with_pair(g.src, g.wire, [&](auto src, auto wire) {
      using S = decltype(src);
      using D = decltype(wire);
      capture_kernel<S, D><<<static_cast<unsigned>(g.count), kBlockThreads, 0, s>>>(
          static_cast<const DevRoute*>(m.routes.data()),
          static_cast<const DevChunk*>(m.chunks.data()),
          static_cast<const std::uint32_t*>(m.group_chunks.data()) + g.begin, m.log2, kept, digest);
      REFIT_CUDA_CHECK_LAUNCH("delta capture_kernel launch");
      return Status::Ok();
    }));
  }
  sum_chunks_kernel<<<1, 1024, 0, s>>>(nullptr, digest, m.n_chunks,
                                       static_cast<Totals*>(m.totals.data()));
  REFIT_CUDA_CHECK_LAUNCH("delta sum_chunks_kernel launch");
  REFIT_ASSIGN_OR_RETURN(const Totals t, m.read_totals(stream, timeout, "a delta capture"));
  DeltaResult r;
  r.digest_delta = t.digest;
  return r;
}

Result<DeltaResult> DeviceDelta::patch(std::byte* kept, void* stream,
                                       std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  REFIT_RETURN_IF_ERROR(set_device(m.device));
  const auto s = static_cast<cudaStream_t>(stream);
  REFIT_RETURN_IF_ERROR(m.reset_totals(stream));
  auto* info = static_cast<std::uint32_t*>(m.chunk_info.data());
  auto* digest = static_cast<unsigned long long*>(m.chunk_digest.data());
  for (const Impl::Group& g : m.groups) {
    REFIT_RETURN_IF_ERROR(check_grid(g.count, "delta patch"));
    REFIT_RETURN_IF_ERROR(with_pair(g.src, g.wire, [&](auto src, auto wire) {
      using S = decltype(src);
      using D = decltype(wire);
      scan_kernel<S, D, true><<<static_cast<unsigned>(g.count), kScanThreads, 0, s>>>(
          static_cast<const DevRoute*>(m.routes.data()),
          static_cast<const DevChunk*>(m.chunks.data()),
          static_cast<const std::uint32_t*>(m.group_chunks.data()) + g.begin, m.log2, kept, nullptr,
          nullptr, 0, info, nullptr, digest);
      REFIT_CUDA_CHECK_LAUNCH("delta patch kernel launch");
      return Status::Ok();
    }));
  }
  sum_chunks_kernel<<<1, 1024, 0, s>>>(info, digest, m.n_chunks,
                                       static_cast<Totals*>(m.totals.data()));
  REFIT_CUDA_CHECK_LAUNCH("delta sum_chunks_kernel launch");
  REFIT_ASSIGN_OR_RETURN(const Totals t, m.read_totals(stream, timeout, "a delta patch"));
  DeltaResult r;
  r.changed = static_cast<std::int64_t>(t.changed);
  r.digest_delta = t.digest;
  return r;
}

Result<DeltaResult> DeviceDelta::apply(const std::vector<df::RouteEntry>& entries,
                                       const std::byte* stream, std::size_t bytes,
                                       void* cuda_stream, std::chrono::milliseconds timeout,
                                       ApplyFailure* failure) {
  Impl& m = *impl_;
  REFIT_RETURN_IF_ERROR(set_device(m.device));
  if (entries.size() != m.n_routes)
    return Status::Internal(
        fmt::format("delta apply: {} directory entries for {} routes", entries.size(), m.n_routes));
  for (const df::RouteEntry& e : entries)
    if (e.mode == df::kSparse && e.chunk_log2 != m.log2)
      return Status::Unsupported(fmt::format(
          "delta apply: route tag {} is coded in chunks of 2^{} elements; this receiver's list "
          "uses 2^{} (give both sides the same chunk size)",
          e.tag, e.chunk_log2, m.log2));
  const auto s = static_cast<cudaStream_t>(cuda_stream);
  std::vector<PayloadPiece> pieces;
  for (std::size_t i = 0; i < entries.size(); ++i)
    for (std::uint64_t b = 0; b < entries[i].bytes; b += kPieceWords * 4) {
      PayloadPiece p;
      p.begin = entries[i].offset + b;
      p.key0 = b / 4;
      p.bytes = static_cast<std::uint32_t>(
          std::min<std::uint64_t>(kPieceWords * 4, entries[i].bytes - b));
      p.route = static_cast<std::uint32_t>(i);
      pieces.push_back(p);
    }
  if (m.pieces.size() < std::max<std::size_t>(pieces.size(), 1) * sizeof(PayloadPiece)) {
    m.pieces = DeviceBuffer();
    REFIT_ASSIGN_OR_RETURN(
        m.pieces,
        DeviceBuffer::allocate(std::max<std::size_t>(pieces.size(), 1) * 2 * sizeof(PayloadPiece),
                               m.device));
  }
  REFIT_RETURN_IF_ERROR(m.reset_totals(cuda_stream));
  if (!pieces.empty())
    REFIT_CUDA_CHECK(cudaMemcpyAsync(m.pieces.data(), pieces.data(),
                                     pieces.size() * sizeof(PayloadPiece), cudaMemcpyHostToDevice,
                                     s));
  const std::size_t R = std::max<std::uint64_t>(m.n_routes, 1),
                    G = std::max<std::uint64_t>(m.n_chunks, 1);
  REFIT_CUDA_CHECK(cudaMemsetAsync(m.route_sum.data(), 0, R * 8, s));
  REFIT_CUDA_CHECK(cudaMemsetAsync(m.route_counted.data(), 0, R * 8, s));
  REFIT_CUDA_CHECK(cudaMemsetAsync(m.chunk_info.data(), 0, G * 4, s));
  REFIT_CUDA_CHECK(cudaMemsetAsync(m.chunk_digest.data(), 0, G * 8, s));
  REFIT_CUDA_CHECK(cudaMemsetAsync(m.dense_count.data(), 0, sizeof(unsigned int), s));
  auto* dense_count = static_cast<unsigned int*>(m.dense_count.data());
  const auto* routes = static_cast<const DevRoute*>(m.routes.data());
  const auto* chunks = static_cast<const DevChunk*>(m.chunks.data());
  auto* totals = static_cast<Totals*>(m.totals.data());
  auto* changed = static_cast<std::uint32_t*>(m.chunk_info.data());
  auto* digest = static_cast<unsigned long long*>(m.chunk_digest.data());
  if (!pieces.empty()) {
    REFIT_RETURN_IF_ERROR(check_grid(pieces.size(), "delta apply checksum"));
    payload_checksum_kernel<<<static_cast<unsigned>(pieces.size()), kBlockThreads, 0, s>>>(
        static_cast<const PayloadPiece*>(m.pieces.data()), stream,
        static_cast<unsigned long long*>(m.route_sum.data()));
    REFIT_CUDA_CHECK_LAUNCH("delta payload_checksum_kernel launch");
  }
  if (m.n_chunks > 0) {
    const std::uint64_t blocks = (m.n_chunks + kBlockThreads - 1) / kBlockThreads;
    table_check_kernel<<<static_cast<unsigned>(blocks), kBlockThreads, 0, s>>>(
        routes, chunks, m.n_chunks, m.log2, stream,
        static_cast<unsigned long long*>(m.route_counted.data()),
        static_cast<std::uint32_t*>(m.dense_list.data()), dense_count, totals);
    REFIT_CUDA_CHECK_LAUNCH("delta table_check_kernel launch");
  }
  precheck_kernel<<<1, kBlockThreads, 0, s>>>(
      stream, m.n_routes, static_cast<const unsigned long long*>(m.route_sum.data()),
      static_cast<const unsigned long long*>(m.route_counted.data()), totals);
  REFIT_CUDA_CHECK_LAUNCH("delta precheck_kernel launch");
  if (m.n_chunks > 0) {
    apply_sparse_kernel<<<static_cast<unsigned>((m.n_chunks + kApplyWarps - 1) / kApplyWarps),
                          kApplyWarps * 32, 0, s>>>(routes, chunks, m.n_chunks, m.log2, stream,
                                                    changed, digest, totals);
    REFIT_CUDA_CHECK_LAUNCH("delta apply_sparse_kernel launch");
    const auto blocks = static_cast<unsigned>(std::min<std::uint64_t>(m.n_chunks, 132 * 8));
    apply_dense_kernel<<<blocks, kBlockThreads, 0, s>>>(
        routes, chunks, m.log2, stream, static_cast<const std::uint32_t*>(m.dense_list.data()),
        dense_count, changed, digest, totals);
    REFIT_CUDA_CHECK_LAUNCH("delta apply_dense_kernel launch");
  }
  if (m.n_routes > 0) {
    apply_finish_kernel<<<static_cast<unsigned>(m.n_routes), kBlockThreads, 0, s>>>(
        routes, stream, changed, digest, totals);
    REFIT_CUDA_CHECK_LAUNCH("delta apply_finish_kernel launch");
  }
  REFIT_ASSIGN_OR_RETURN(const Totals t, m.read_totals(cuda_stream, timeout, "a delta apply"));
  if (t.bad != ~0ull) {
    if (failure != nullptr) {
      failure->route = static_cast<std::size_t>(t.bad >> 8);
      failure->error = static_cast<ApplyError>(t.bad & 0xff);
    }
    return Status::Corruption("delta apply failed");
  }
  DeltaResult r;
  r.stream_bytes = bytes;
  r.changed = static_cast<std::int64_t>(t.changed);
  r.digest_delta = t.digest;
  r.routes_unchanged = static_cast<std::int64_t>(t.unchanged);
  r.routes_sparse = static_cast<std::int64_t>(t.sparse);
  r.routes_dense = static_cast<std::int64_t>(t.dense);
  return r;
}

}  // namespace refit
