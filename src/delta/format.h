// The delta stream: what a trainer rank sends instead of a route's values when only some of them
// changed since the engine last received them (docs/delta.md, "Format"). Every encoder (the CPU
// loops of delta/delta.cc, the CUDA kernels of device/delta_kernels.cu) writes exactly these
// bytes, and every decoder reads them, so the layout arithmetic lives here once, for host and
// device code alike. No includes beyond <cstdint>: the CUDA sources include this header.
//
// A stream covers a list of routes (a segment, a pair, or any list the caller encodes at once):
//
//   StreamHeader (48 bytes) | RouteEntry (64 bytes) x routes | payload of route 0 | route 1 | ...
//
// Payloads start at multiples of 8 bytes, in route order. A route's elements are its rows x
// cols in row-major order; what changed is said in the wire dtype's bits (the target precision),
// as the difference of the old and new bits in *ordered* integer space (ordered_key below), in
// which the next representable value up is +1: an update of one ulp is +1 or -1 there.
//
// A route's payload is one of:
//  - unchanged: nothing (0 bytes);
//  - dense: every element's new bits, elements x esize bytes;
//  - sparse: a table of one ChunkEntry per chunk of 2^chunk_log2 elements (the last one shorter),
//    then the chunks' data, each at a multiple of 4 bytes. A chunk with no change has no data. A
//    chunk whose coding would take more than its raw bytes holds its raw new bits instead
//    (kChunkDense). Otherwise its data is a bit stream (32-bit little-endian words, bit i of the
//    stream is bit i % 32 of word i / 32) of fields at offsets fixed by the counts (chunk_fields):
//      [exceptions word]  m | Le << 17 | W << 21, when the chunk has exceptions;
//      low[n]             position low bits, L each;
//      sign[n]            1: the change is negative;
//      high               Elias-Fano upper bits: bit (p_j >> L) + j set for change j;
//      exc_low[m]         low bits of the exceptions' change indices, Le each;
//      exc_mag[m]         |d| - 2 of each exception, W bits each;
//      exc_high           Elias-Fano upper bits of the exceptions' change indices.
//    Change j has position p_j in the chunk (increasing) and difference d_j = +-1, unless it is an
//    exception (|d| >= 2), listed by change index in exc_*.
#pragma once

#include <cstdint>
#include <type_traits>

#ifdef __CUDACC__
#define REFIT_DELTA_HD __host__ __device__ __forceinline__
#else
#define REFIT_DELTA_HD inline
#endif

namespace refit::delta_format {

inline constexpr std::uint32_t kMagic = 0x4C444652u;  // "RFDL"
inline constexpr std::uint16_t kVersion = 1;

// Route payload modes.
inline constexpr std::uint8_t kUnchanged = 0;
inline constexpr std::uint8_t kSparse = 1;
inline constexpr std::uint8_t kDense = 2;

inline constexpr int kMinChunkLog2 = 5;   // 32 elements
inline constexpr int kMaxChunkLog2 = 16;  // 65536 elements: a count fits the entry's 17 bits

struct StreamHeader {
  std::uint32_t magic = kMagic;
  std::uint16_t version = kVersion;
  std::uint16_t flags = 0;
  std::uint32_t routes = 0;
  std::uint32_t reserved0 = 0;
  std::uint64_t total_bytes = 0;  // the whole stream, this header included
  std::uint64_t base_digest = 0;  // the caller's digest of the base the stream was computed against
  // Sum of checksum_term(k, word) over this header's words 0..7 (k = 0..7) and every directory
  // word (k = 12 + its index from the directory's start).
  std::uint64_t header_checksum = 0;
  std::uint64_t reserved1 = 0;
};
static_assert(sizeof(StreamHeader) == 48);
inline constexpr std::uint64_t kHeaderBytes = sizeof(StreamHeader);
inline constexpr std::uint64_t kHeaderChecksumWords = 8;  // words of the header that are summed
inline constexpr std::uint64_t kDirectoryKey0 = 12;       // key of the directory's first word

struct RouteEntry {
  std::uint32_t tag = 0;  // the caller's name for the route
  std::uint8_t mode = kUnchanged;
  std::uint8_t esize = 0;  // bytes per element of the wire dtype: 1, 2 or 4
  std::uint8_t chunk_log2 = 0;
  std::uint8_t reserved0 = 0;
  std::uint64_t elements = 0;
  std::uint64_t offset = 0;  // of the payload, from the stream's first byte; a multiple of 8
  std::uint64_t bytes = 0;   // of the payload
  std::uint64_t changed = 0;
  // Sum over the changed elements of checksum_term(key, new bits) - checksum_term(key, old bits)
  // (common/checksum.h), modulo 2^64: what the route adds to its base's digest.
  std::uint64_t digest_delta = 0;
  // Sum of checksum_term(k, word) over the payload's 32-bit words (k = 0, 1, ...; a payload whose
  // size is not a multiple of 4 is read as if padded with zero bytes).
  std::uint64_t payload_checksum = 0;
  std::uint64_t reserved1 = 0;
};
static_assert(sizeof(RouteEntry) == 64);

// ChunkEntry.info: the chunk's change count (0 ..= 2^16), L, and two flags.
struct ChunkEntry {
  std::uint32_t offset = 0;  // of the chunk's data, in bytes from the end of the table
  std::uint32_t info = 0;
};
static_assert(sizeof(ChunkEntry) == 8);
inline constexpr std::uint32_t kCountMask = (1u << 17) - 1;
inline constexpr int kLShift = 17;  // 4 bits
inline constexpr std::uint32_t kChunkHasExceptions = 1u << 21;
inline constexpr std::uint32_t kChunkDense = 1u << 22;

REFIT_DELTA_HD std::uint32_t chunk_info(std::uint32_t n, int L, bool exceptions, bool dense) {
  return n | (static_cast<std::uint32_t>(L) << kLShift) | (exceptions ? kChunkHasExceptions : 0u) |
         (dense ? kChunkDense : 0u);
}
REFIT_DELTA_HD std::uint32_t info_count(std::uint32_t info) { return info & kCountMask; }
REFIT_DELTA_HD int info_low_bits(std::uint32_t info) {
  return static_cast<int>((info >> kLShift) & 15u);
}

// The exceptions word.
REFIT_DELTA_HD std::uint32_t exceptions_word(std::uint32_t m, int Le, int W) {
  return m | (static_cast<std::uint32_t>(Le) << 17) | (static_cast<std::uint32_t>(W) << 21);
}

REFIT_DELTA_HD std::uint64_t align8(std::uint64_t b) { return (b + 7) & ~std::uint64_t{7}; }
REFIT_DELTA_HD std::uint64_t align4(std::uint64_t b) { return (b + 3) & ~std::uint64_t{3}; }

// Bits as an unsigned integer ordered like the values they encode: sign-magnitude floats of
// `bits_width` bits (8, 16, 32) map to 0 .. 2^width - 1, most negative first, -0 just below +0.
// A bijection: NaN payloads and every other pattern survive the round trip.
REFIT_DELTA_HD std::uint32_t ordered_key(std::uint32_t bits, int width) {
  const std::uint32_t sign = 1u << (width - 1);
  const std::uint32_t mask = width == 32 ? 0xFFFFFFFFu : (sign << 1) - 1u;
  return (bits & sign) ? (~bits & mask) : (bits | sign);
}
REFIT_DELTA_HD std::uint32_t from_ordered_key(std::uint32_t key, int width) {
  const std::uint32_t sign = 1u << (width - 1);
  const std::uint32_t mask = width == 32 ? 0xFFFFFFFFu : (sign << 1) - 1u;
  return (key & sign) ? (key & ~sign) : (~key & mask);
}
// new - old in ordered space, modulo 2^width, as a value in [-2^(width-1), 2^(width-1)): the
// magnitude is at most 2^(width-1).
REFIT_DELTA_HD std::int64_t ordered_difference(std::uint32_t old_bits, std::uint32_t new_bits,
                                               int width) {
  const std::uint32_t mask = width == 32 ? 0xFFFFFFFFu : (1u << width) - 1u;
  const std::uint32_t d = (ordered_key(new_bits, width) - ordered_key(old_bits, width)) & mask;
  const std::uint32_t half = 1u << (width - 1);
  return d >= half ? static_cast<std::int64_t>(d) - (std::int64_t{1} << width)
                   : static_cast<std::int64_t>(d);
}
// old + d in ordered space (d as ordered_difference gives it).
REFIT_DELTA_HD std::uint32_t add_ordered(std::uint32_t old_bits, std::int64_t d, int width) {
  const std::uint32_t mask = width == 32 ? 0xFFFFFFFFu : (1u << width) - 1u;
  const std::uint32_t key =
      (ordered_key(old_bits, width) + static_cast<std::uint32_t>(static_cast<std::uint64_t>(d))) &
      mask;
  return from_ordered_key(key, width);
}

// Bits needed for v (0 for v = 0).
REFIT_DELTA_HD int bit_width(std::uint32_t v) {
  int w = 0;
  while (v != 0) {
    ++w;
    v >>= 1;
  }
  return w;
}

// Bits of an Elias-Fano coding of `count` increasing values below `universe` with `low` low bits:
// low bits plus the upper part's bound (count set bits and (universe - 1) >> low zeros at most).
REFIT_DELTA_HD std::uint64_t ef_bits(std::uint64_t count, std::uint64_t universe, int low) {
  if (count == 0) return 0;
  return count * static_cast<std::uint64_t>(low) + count + ((universe - 1) >> low) + 1;
}
// The low-bit count that makes ef_bits smallest (ties: the smaller), from 0 to 15. One more low
// bit changes the coding by count - g(L) bits, g(L) = (v >> L) - (v >> (L + 1)) with v =
// universe - 1; g does not grow with L, so the coding is convex in L and the answer is the first
// L at which another bit stops paying: the smallest L below 15 with g(L) <= count, else 15 (a
// binary search, as every sparse chunk's check computes it twice).
REFIT_DELTA_HD int ef_low_bits(std::uint64_t count, std::uint64_t universe) {
  if (count == 0 || universe <= count) return 0;
  const std::uint64_t v = universe - 1;
  int lo = 0, hi = 15;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if ((v >> mid) - (v >> (mid + 1)) <= count)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

// Where each field of a sparse chunk starts (bits from the chunk data's first bit) and how many
// bits the chunk takes. n: changes, m: exceptions among them, elems: the chunk's elements.
struct ChunkFields {
  int L = 0, Le = 0, W = 0;
  std::uint64_t low = 0, sign = 0, high = 0, exc_low = 0, exc_mag = 0, exc_high = 0;
  std::uint64_t bits = 0;
};
REFIT_DELTA_HD ChunkFields chunk_fields(std::uint32_t n, std::uint32_t m, int W,
                                        std::uint32_t elems) {
  ChunkFields f;
  f.L = ef_low_bits(n, elems);
  f.W = W;
  std::uint64_t at = m > 0 ? 32 : 0;
  f.low = at;
  at += static_cast<std::uint64_t>(n) * static_cast<std::uint64_t>(f.L);
  f.sign = at;
  at += n;
  f.high = at;
  at += ef_bits(n, elems, f.L) - static_cast<std::uint64_t>(n) * static_cast<std::uint64_t>(f.L);
  if (m > 0) {
    f.Le = ef_low_bits(m, n);
    f.exc_low = at;
    at += static_cast<std::uint64_t>(m) * static_cast<std::uint64_t>(f.Le);
    f.exc_mag = at;
    at += static_cast<std::uint64_t>(m) * static_cast<std::uint64_t>(W);
    f.exc_high = at;
    at += ef_bits(m, n, f.Le) - static_cast<std::uint64_t>(m) * static_cast<std::uint64_t>(f.Le);
  }
  f.bits = at;
  return f;
}
// Whether a chunk goes raw: its sparse coding takes more bytes than its raw bits.
REFIT_DELTA_HD bool chunk_goes_dense(std::uint64_t sparse_bits, std::uint32_t elems, int esize) {
  return align4((sparse_bits + 7) / 8) > align4(static_cast<std::uint64_t>(elems) * esize);
}
// Bytes of a chunk's data (4-aligned): 0 without changes.
REFIT_DELTA_HD std::uint64_t chunk_data_bytes(std::uint32_t n, bool dense, std::uint64_t bits,
                                              std::uint32_t elems, int esize) {
  if (n == 0) return 0;
  return dense ? align4(static_cast<std::uint64_t>(elems) * esize) : align4((bits + 7) / 8);
}

REFIT_DELTA_HD std::uint64_t chunk_count(std::uint64_t elements, int chunk_log2) {
  return (elements + (std::uint64_t{1} << chunk_log2) - 1) >> chunk_log2;
}

// `width` (0 ..= 32) bits of a bit stream at bit `at` (words read: those the bits lie in). The
// offset is 64 bits within a route's payload, 32 within one chunk's data (the GPU apply, where the
// narrower type saves registers).
template <class Offset>
REFIT_DELTA_HD std::uint32_t get_bits(const std::uint32_t* w, Offset at, int width) {
  static_assert(std::is_unsigned<Offset>::value, "a bit offset is unsigned");
  if (width == 0) return 0;
  const Offset word = at >> 5;
  const auto off = static_cast<std::uint32_t>(at & 31u);
  const std::uint32_t hi = off + static_cast<std::uint32_t>(width) > 32 ? w[word + 1] : 0u;
#ifdef __CUDA_ARCH__
  const std::uint32_t x = __funnelshift_r(w[word], hi, off);
#else
  const auto x =
      static_cast<std::uint32_t>(((static_cast<std::uint64_t>(hi) << 32) | w[word]) >> off);
#endif
  return width == 32 ? x : x & ((1u << width) - 1u);
}

REFIT_DELTA_HD int lowest_bit(std::uint32_t v) {
#ifdef __CUDA_ARCH__
  return __ffs(static_cast<int>(v)) - 1;
#else
  return __builtin_ctz(v);
#endif
}

// The set bits of bits [start, start + len) of a stream, in order: next() gives each one's
// position from `start`, or false after the last.
struct SetBits {
  const std::uint32_t* w = nullptr;
  std::uint64_t start = 0, len = 0, pos = 0, base = 0;
  std::uint32_t window = 0;
  REFIT_DELTA_HD bool next(std::uint64_t& bit) {
    while (window == 0) {
      if (pos >= len) return false;
      const int width = static_cast<int>(len - pos < 32 ? len - pos : 32);
      window = get_bits(w, start + pos, width);
      base = pos;
      pos += static_cast<std::uint64_t>(width);
    }
    bit = base + static_cast<std::uint64_t>(lowest_bit(window));
    window &= window - 1;
    return true;
  }
};

// One sparse chunk's table entry and data extent, checked (before anything is written); `payload`
// is the route's payload (8-byte aligned), `nchunks` its table's length, `elems` the chunk's.
enum ChunkError : int {
  kChunkOk = 0,
  kChunkBadOffset,      // data offset unaligned or past the next chunk's
  kChunkBadCount,       // more changes than elements
  kChunkBadFlags,       // unknown flags, or flags without changes
  kChunkBadExceptions,  // a dense chunk with exceptions, or a bad exceptions word
  kChunkBadLowBits,     // L or Le other than the counts imply
  kChunkShort,          // its data runs past its extent
};
struct ChunkView {
  int error = kChunkOk;
  std::uint32_t n = 0, m = 0;
  bool dense = false;
  std::uint32_t offset = 0;  // of its data from the table's end
  ChunkFields f;
};
REFIT_DELTA_HD ChunkView check_chunk(const unsigned char* payload, std::uint64_t payload_bytes,
                                     std::uint64_t nchunks, std::uint64_t k, std::uint32_t elems,
                                     int esize) {
  ChunkView v;
  const std::uint64_t table = nchunks * sizeof(ChunkEntry);
  const std::uint64_t data_bytes = payload_bytes - table;
  const auto* entries = reinterpret_cast<const ChunkEntry*>(payload);
  const ChunkEntry ce = entries[k];
  std::uint64_t limit = data_bytes;
  if (k + 1 < nchunks && entries[k + 1].offset < limit) limit = entries[k + 1].offset;
  v.n = info_count(ce.info);
  v.dense = (ce.info & kChunkDense) != 0;
  v.offset = ce.offset;
  if (ce.offset % 4 != 0 || ce.offset > limit) return v.error = kChunkBadOffset, v;
  if (v.n > elems) return v.error = kChunkBadCount, v;
  if ((ce.info >> 23) != 0) return v.error = kChunkBadFlags, v;
  if (v.n == 0) {
    if ((ce.info & ~kCountMask) != 0) v.error = kChunkBadFlags;
    return v;
  }
  const auto* words = reinterpret_cast<const std::uint32_t*>(payload + table + ce.offset);
  int W = 0;
  if ((ce.info & kChunkHasExceptions) != 0) {
    if (v.dense || limit - ce.offset < 4) return v.error = kChunkBadExceptions, v;
    const std::uint32_t xw = words[0];
    v.m = xw & kCountMask;
    W = static_cast<int>((xw >> 21) & 31u);
    if (v.m == 0 || v.m > v.n || (xw >> 26) != 0) return v.error = kChunkBadExceptions, v;
  }
  v.f = chunk_fields(v.n, v.m, W, elems);
  if (!v.dense && (v.f.L != info_low_bits(ce.info) ||
                   (v.m > 0 && v.f.Le != static_cast<int>((words[0] >> 17) & 15u))))
    return v.error = kChunkBadLowBits, v;
  if (chunk_data_bytes(v.n, v.dense, v.f.bits, elems, esize) > limit - ce.offset)
    return v.error = kChunkShort, v;
  return v;
}

// Calls change(p, negative, magnitude) for every change of a sparse chunk (a checked view), in
// position order; false when its codes are malformed (positions not increasing or past the chunk,
// exception indices not increasing or past its changes), after which nothing more is called.
template <class F>
REFIT_DELTA_HD bool decode_chunk(const std::uint32_t* words, const ChunkView& v,
                                 std::uint32_t elems, F&& change) {
  const ChunkFields& f = v.f;
  // (C++17 here: the CUDA sources include this header.)
  SetBits high;
  high.w = words;
  high.start = f.high;
  high.len = ef_bits(v.n, elems, f.L) - static_cast<std::uint64_t>(v.n) * f.L;
  SetBits exc;
  exc.w = words;
  exc.start = f.exc_high;
  exc.len = v.m > 0 ? ef_bits(v.m, v.n, f.Le) - static_cast<std::uint64_t>(v.m) * f.Le : 0;
  std::uint32_t e = 0;      // exceptions decoded
  std::int64_t exc_j = -1;  // the next exception's change index (-1: none left)
  std::uint32_t exc_mag = 0;
  auto next_exception = [&]() -> bool {
    if (e >= v.m) {
      exc_j = -1;
      return true;
    }
    std::uint64_t bit = 0;
    if (!exc.next(bit)) return false;
    const std::uint64_t j = ((bit - e) << f.Le) |
                            get_bits(words, f.exc_low + static_cast<std::uint64_t>(e) * f.Le, f.Le);
    if (static_cast<std::int64_t>(j) <= exc_j || j >= v.n) return false;
    exc_j = static_cast<std::int64_t>(j);
    exc_mag = 2 + get_bits(words, f.exc_mag + static_cast<std::uint64_t>(e) * f.W, f.W);
    ++e;
    return true;
  };
  if (!next_exception()) return false;
  std::int64_t prev = -1;
  for (std::uint32_t j = 0; j < v.n; ++j) {
    std::uint64_t bit = 0;
    if (!high.next(bit) || bit < j) return false;
    const std::uint64_t p =
        ((bit - j) << f.L) | get_bits(words, f.low + static_cast<std::uint64_t>(j) * f.L, f.L);
    if (static_cast<std::int64_t>(p) <= prev || p >= elems) return false;
    prev = static_cast<std::int64_t>(p);
    std::uint32_t mag = 1;
    if (exc_j == static_cast<std::int64_t>(j)) {
      mag = exc_mag;
      if (!next_exception()) return false;
    }
    change(static_cast<std::uint32_t>(p), get_bits(words, f.sign + j, 1) != 0, mag);
  }
  return exc_j == -1 && e == v.m;
}

}  // namespace refit::delta_format
