// The delta component on host memory (delta/delta_cpu.h): every list is cut into chunks of
// 2^chunk_log2 elements of one route, and the workers take ranges of chunks.
#include "delta/delta_cpu.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "common/checksum.h"
#include "common/convert.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace refit {

namespace df = delta_format;

HostWorkers HostWorkers::inline_only() {
  HostWorkers w;
  w.count = 1;
  w.run = [](std::int64_t items, const std::function<void(std::int64_t, std::int64_t, int)>& body) {
    if (items > 0) body(0, items, 0);
  };
  return w;
}

Status check_delta_pointers(const std::vector<DeltaRoute>& routes, const DeltaOptions& options,
                            bool need_src, bool need_dst) {
  for (const DeltaRoute& r : routes) {
    if (r.elements() == 0) continue;
    if (need_src && r.src == nullptr)
      return Status::InvalidArgument(fmt::format("delta: {}: no source to read the new values from",
                                                 describe_route(options, r.tag)));
    if (need_dst && r.dst == nullptr)
      return Status::InvalidArgument(
          fmt::format("delta: {}: no destination to apply to", describe_route(options, r.tag)));
  }
  return Status::Ok();
}

std::uint64_t delta_words_checksum(const std::byte* p, std::uint64_t bytes,
                                   std::uint64_t first_key) {
  std::uint64_t sum = 0;
  const std::uint64_t whole = bytes / 4;
  for (std::uint64_t i = 0; i < whole; ++i) {
    std::uint32_t w;
    std::memcpy(&w, p + i * 4, 4);
    sum += checksum_term(first_key + i, w);
  }
  if (bytes % 4 != 0) {
    std::uint32_t w = 0;
    std::memcpy(&w, p + whole * 4, bytes % 4);
    sum += checksum_term(first_key + whole, w);
  }
  return sum;
}

namespace {

// ---- bits ----

void put_bits(std::uint32_t* w, std::uint64_t at, std::uint32_t v, int width) {
  if (width == 0) return;
  const std::uint64_t word = at >> 5;
  const int off = static_cast<int>(at & 31);
  const std::uint64_t x = static_cast<std::uint64_t>(v) << off;
  w[word] |= static_cast<std::uint32_t>(x);
  if (off + width > 32) w[word + 1] |= static_cast<std::uint32_t>(x >> 32);
}

// ---- routes and chunks ----

// Global chunk numbering over a list: route i owns chunks [begin[i], begin[i + 1]).
struct ChunkIndex {
  std::vector<std::int64_t> begin;
  int log2 = 13;
  std::int64_t total() const { return begin.back(); }
  std::size_t route_of(std::int64_t g) const {
    return static_cast<std::size_t>(std::upper_bound(begin.begin(), begin.end(), g) -
                                    begin.begin() - 1);
  }
};

ChunkIndex index_chunks(const std::vector<DeltaRoute>& routes, int log2) {
  ChunkIndex ix;
  ix.log2 = log2;
  ix.begin.reserve(routes.size() + 1);
  ix.begin.push_back(0);
  for (const DeltaRoute& r : routes)
    ix.begin.push_back(ix.begin.back() + static_cast<std::int64_t>(df::chunk_count(
                                             static_cast<std::uint64_t>(r.elements()), log2)));
  return ix;
}

// The chunk's first element in its route and its element count.
struct ChunkSpan {
  std::size_t route = 0;
  std::int64_t first = 0;
  std::uint32_t elems = 0;
};
ChunkSpan chunk_span(const ChunkIndex& ix, const std::vector<DeltaRoute>& routes, std::int64_t g) {
  ChunkSpan s;
  s.route = ix.route_of(g);
  s.first = (g - ix.begin[s.route]) << ix.log2;
  s.elems = static_cast<std::uint32_t>(
      std::min<std::int64_t>(std::int64_t{1} << ix.log2, routes[s.route].elements() - s.first));
  return s;
}

std::int64_t total_elements(const std::vector<DeltaRoute>& routes) {
  std::int64_t n = 0;
  for (const DeltaRoute& r : routes) n += r.elements();
  return n;
}

// Runs body over [0, items) on the workers, or on this thread when the list is small.
void run_items(const HostWorkers& workers, const DeltaOptions& o, std::int64_t elements,
               std::int64_t items,
               const std::function<void(std::int64_t, std::int64_t, int)>& body) {
  if (items <= 0) return;
  if (workers.count <= 1 || !workers.run || elements < o.parallel_min_elements || items == 1) {
    body(0, items, 0);
    return;
  }
  workers.run(items, body);
}

// Calls row(r, c, k0, len) for each row segment of elements [first, first + elems) of a route:
// element (r, c) of the route is the range's k0-th.
template <class Row>
void walk_rows(const DeltaRoute& r, std::int64_t first, std::uint32_t elems, Row&& row) {
  const std::int64_t cols = r.block.cols;
  std::int64_t rr = first / cols, cc = first % cols;
  std::int64_t k = 0;
  while (k < elems) {
    const std::int64_t len = std::min<std::int64_t>(cols - cc, elems - k);
    row(rr, cc, k, len);
    k += len;
    cc = 0;
    ++rr;
  }
}

// Calls f(k, key) for the chunk's elements k = 0 .. elems-1 in order, with k's digest key, and
// row(r, c, k0, len) before each row segment (element (r, c) of the route is the chunk's k0).
template <class Row, class F>
void walk_chunk(const DeltaRoute& r, std::int64_t first, std::uint32_t elems, Row&& row, F&& f) {
  walk_rows(
      r, first, elems, [&](std::int64_t rr, std::int64_t cc, std::int64_t k, std::int64_t len) {
        row(rr, cc, k, len);
        const std::uint64_t key0 =
            r.key + static_cast<std::uint64_t>(rr) * static_cast<std::uint64_t>(r.key_stride) +
            static_cast<std::uint64_t>(cc);
        for (std::int64_t i = 0; i < len; ++i) f(k + i, key0 + static_cast<std::uint64_t>(i));
      });
}

// The new values of a chunk, in the wire dtype, into `out`.
void read_new(const DeltaRoute& r, std::int64_t first, std::uint32_t elems, std::byte* out) {
  const Block2D& b = r.block;
  const std::int64_t cols = b.cols;
  if (b.rows <= 1 || b.src_stride == cols) {  // the chunk is one run of the source
    convert_block(r.src, r.src_dtype, b.src_offset + first, 0, out, r.wire_dtype, 0, 0, 1, elems);
    return;
  }
  std::int64_t rr = first / cols, cc = first % cols, k = 0;
  const std::size_t esize = dtype_size(r.wire_dtype);
  while (k < elems) {
    const std::int64_t len = std::min<std::int64_t>(cols - cc, elems - k);
    convert_block(r.src, r.src_dtype, b.src_offset + rr * b.src_stride + cc, 0,
                  out + static_cast<std::size_t>(k) * esize, r.wire_dtype, 0, 0, 1, len);
    k += len;
    cc = 0;
    ++rr;
  }
}

// Element e of route r: its digest key and its place at dst (in elements), with divisions only
// for routes whose rows are not contiguous there.
std::uint64_t key_at(const DeltaRoute& r, std::int64_t e) {
  if (r.block.rows <= 1 || r.key_stride == r.block.cols)
    return r.key + static_cast<std::uint64_t>(e);
  const std::int64_t rr = e / r.block.cols, cc = e % r.block.cols;
  return r.key + static_cast<std::uint64_t>(rr) * static_cast<std::uint64_t>(r.key_stride) +
         static_cast<std::uint64_t>(cc);
}
std::byte* dst_elem(const DeltaRoute& r, std::int64_t e, std::size_t esize) {
  if (r.block.rows <= 1 || r.block.dst_stride == r.block.cols)
    return r.dst + static_cast<std::size_t>(r.block.dst_offset + e) * esize;
  const std::int64_t rr = e / r.block.cols, cc = e % r.block.cols;
  return r.dst +
         static_cast<std::size_t>(r.block.dst_offset + rr * r.block.dst_stride + cc) * esize;
}

std::byte* dst_at(const DeltaRoute& r, std::int64_t rr, std::int64_t cc) {
  const std::size_t esize = dtype_size(r.wire_dtype);
  return r.dst +
         static_cast<std::size_t>(r.block.dst_offset + rr * r.block.dst_stride + cc) * esize;
}

template <class F>
void dispatch_esize(std::size_t esize, F&& f) {
  switch (esize) {
    case 1:
      f(std::uint8_t{});
      return;
    case 2:
      f(std::uint16_t{});
      return;
    default:
      f(std::uint32_t{});
      return;
  }
}

// ---- encode ----

struct ChunkOut {
  std::uint32_t info = 0;
  std::uint32_t bytes = 0;  // of its data (4-aligned)
  int worker = 0;
  std::uint64_t word = 0;  // where its data starts in the worker's arena
  std::uint64_t digest = 0;
};

struct Change {
  std::uint32_t pos;
  std::int32_t neg;   // 1: d < 0
  std::uint32_t mag;  // |d|
};

// Codes one chunk's changes (positions increasing) into the worker's arena.
void code_chunk(const std::vector<Change>& ch, std::uint32_t elems, int esize,
                const std::byte* raw_new, ChunkOut& out, std::vector<std::uint32_t>& arena) {
  const auto n = static_cast<std::uint32_t>(ch.size());
  if (n == 0) return;
  std::uint32_t m = 0;
  int W = 0;
  for (const Change& c : ch)
    if (c.mag >= 2) ++m, W = std::max(W, df::bit_width(c.mag - 2));
  const df::ChunkFields f = df::chunk_fields(n, m, W, elems);
  const bool dense = df::chunk_goes_dense(f.bits, elems, esize);
  const std::uint64_t bytes = df::chunk_data_bytes(n, dense, f.bits, elems, esize);
  out.info = df::chunk_info(n, f.L, m > 0 && !dense, dense);
  out.bytes = static_cast<std::uint32_t>(bytes);
  out.word = arena.size();
  arena.resize(arena.size() + bytes / 4, 0);
  std::uint32_t* w = arena.data() + out.word;
  if (dense) {
    std::memcpy(w, raw_new, static_cast<std::size_t>(elems) * static_cast<std::size_t>(esize));
    return;
  }
  if (m > 0) w[0] = df::exceptions_word(m, f.Le, W);
  const std::uint32_t low_mask = (1u << f.L) - 1u, exc_mask = (1u << f.Le) - 1u;
  std::uint32_t e = 0;
  for (std::uint32_t j = 0; j < n; ++j) {
    const Change& c = ch[j];
    put_bits(w, f.low + static_cast<std::uint64_t>(j) * f.L, c.pos & low_mask, f.L);
    if (c.neg) put_bits(w, f.sign + j, 1, 1);
    put_bits(w, f.high + (c.pos >> f.L) + j, 1, 1);
    if (c.mag >= 2) {
      put_bits(w, f.exc_low + static_cast<std::uint64_t>(e) * f.Le, j & exc_mask, f.Le);
      put_bits(w, f.exc_mag + static_cast<std::uint64_t>(e) * W, c.mag - 2, W);
      put_bits(w, f.exc_high + (j >> f.Le) + e, 1, 1);
      ++e;
    }
  }
}

// What a compare does with each element that changed: update the kept copy (and dst when
// patching), add to the digest delta, note the change for the coder.
template <class T>
struct ChangeSink {
  const DeltaRoute& r;
  std::int64_t first;
  T* kept;
  std::vector<Change>* changes = nullptr;
  bool patch = false;
  std::uint64_t digest = 0;
  std::int64_t count = 0;
  void operator()(std::uint32_t k, std::uint32_t nv, std::uint32_t ov) {
    constexpr int width = 8 * sizeof(T);
    const std::int64_t e = first + k;
    const std::uint64_t key = key_at(r, e);
    digest += checksum_term(key, nv) - checksum_term(key, ov);
    const auto v = static_cast<T>(nv);
    kept[k] = v;
    if (patch) std::memcpy(dst_elem(r, e, sizeof(T)), &v, sizeof(T));
    ++count;
    if (changes != nullptr) {
      const std::int64_t d = df::ordered_difference(ov, nv, width);
      changes->push_back(Change{
          .pos = k, .neg = d < 0 ? 1 : 0, .mag = static_cast<std::uint32_t>(d < 0 ? -d : d)});
    }
  }
};

// `n` new values at `fresh` (wire dtype) against kept[k0 ..): blocks of 64 bytes that match are
// skipped whole (a memcmp); at the densities of training most are.
template <class T>
void compare_run(const T* fresh, std::uint32_t k0, std::uint32_t n, ChangeSink<T>& sink) {
  constexpr std::uint32_t kBlock = 64 / sizeof(T);
  T* kept = sink.kept;
  for (std::uint32_t b = 0; b < n; b += kBlock) {
    const std::uint32_t e = std::min(n, b + kBlock);
    if (std::memcmp(fresh + b, kept + k0 + b, (e - b) * sizeof(T)) == 0) continue;
    for (std::uint32_t i = b; i < e; ++i)
      if (fresh[i] != kept[k0 + i]) sink(k0 + i, fresh[i], kept[k0 + i]);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// Eight float32 bits to bfloat16 bits in 32-bit lanes (common/convert.h: nearest even, NaN quiet).
__attribute__((target("avx2"))) inline __m256i round_bf16_avx2(__m256i u) {
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                         _mm256_and_si256(hi, _mm256_set1_epi32(1))),
                        16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x0040)), nan);
}

__attribute__((target("avx2"))) inline __m256i load_avx2(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}
// 16 float32 at p -> 16 bfloat16, in order.
__attribute__((target("avx2"))) inline __m256i bf16x16_avx2(const std::byte* p) {
  return _mm256_permute4x64_epi64(
      _mm256_packus_epi32(round_bf16_avx2(load_avx2(p)), round_bf16_avx2(load_avx2(p + 32))), 0xD8);
}

// float32 -> bfloat16 and compare in one pass (32 elements a step: one 64-byte line of the kept
// copy; the rounding of common/convert.h: nearest even, NaN quiet), for `n` contiguous source
// elements against kept[k0 ..). A step whose line matches costs one test; in one that does not,
// only the elements that changed reach the sink (the bits of the compare mask, two per element).
__attribute__((target("avx2"))) void compare_f32_bf16_avx2(const std::byte* src, std::uint32_t k0,
                                                           std::uint32_t n,
                                                           ChangeSink<std::uint16_t>& sink) {
  std::uint16_t* kept = sink.kept + k0;
  alignas(32) std::uint16_t fresh[32];
  std::uint32_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i v = bf16x16_avx2(src + 4 * i), w = bf16x16_avx2(src + 4 * i + 64);
    const __m256i ov = load_avx2(kept + i), ow = load_avx2(kept + i + 16);
    const __m256i x = _mm256_or_si256(_mm256_xor_si256(v, ov), _mm256_xor_si256(w, ow));
    if (_mm256_testz_si256(x, x)) continue;
    const auto same_v = static_cast<std::uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi16(v, ov)));
    const auto same_w = static_cast<std::uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi16(w, ow)));
    std::uint64_t diff = ~(std::uint64_t{same_v} | std::uint64_t{same_w} << 32);
    _mm256_store_si256(reinterpret_cast<__m256i*>(fresh), v);
    _mm256_store_si256(reinterpret_cast<__m256i*>(fresh + 16), w);
    while (diff != 0) {  // an element that changed sets both of its bits
      const std::uint32_t j = static_cast<std::uint32_t>(__builtin_ctzll(diff)) / 2;
      diff &= diff - 1;
      diff &= diff - 1;
      sink(k0 + i + j, fresh[j], kept[i + j]);
    }
  }
  for (; i < n; ++i) {
    std::uint32_t u;
    std::memcpy(&u, src + 4 * i, 4);
    const std::uint16_t v = f32_bits_to_bf16(u);
    if (v != kept[i]) sink(k0 + i, v, kept[i]);
  }
}
#endif

// Compares a chunk's new values with its kept copy in one pass over the source where it can: a
// source in the wire dtype is compared in place, float32 -> bfloat16 is cast and compared at once
// (AVX2); other casts go through `fresh`.
template <class T>
void compare_chunk(const DeltaRoute& r, std::int64_t first, std::uint32_t elems,
                   std::vector<std::byte>& fresh, ChangeSink<T>& sink) {
  const Block2D& b = r.block;
  const std::size_t ssize = dtype_size(r.src_dtype);
  auto each_run = [&](auto&& f) {  // f(source byte pointer, first k, count) per contiguous run
    const std::int64_t cols = b.cols;
    if (b.rows <= 1 || b.src_stride == cols) {
      f(r.src + static_cast<std::size_t>(b.src_offset + first) * ssize, 0u, elems);
      return;
    }
    std::int64_t rr = first / cols, cc = first % cols;
    std::uint32_t k = 0;
    while (k < elems) {
      const auto len = static_cast<std::uint32_t>(std::min<std::int64_t>(cols - cc, elems - k));
      f(r.src + static_cast<std::size_t>(b.src_offset + rr * b.src_stride + cc) * ssize, k, len);
      k += len;
      cc = 0;
      ++rr;
    }
  };
  if (r.src_dtype == r.wire_dtype) {
    each_run([&](const std::byte* p, std::uint32_t k0, std::uint32_t n) {
      compare_run(reinterpret_cast<const T*>(p), k0, n, sink);
    });
    return;
  }
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (sizeof(T) == 2) {
    static const bool avx2 = __builtin_cpu_supports("avx2");
    if (avx2 && r.src_dtype == DType::kFloat32 && r.wire_dtype == DType::kBFloat16) {
      each_run([&](const std::byte* p, std::uint32_t k0, std::uint32_t n) {
        compare_f32_bf16_avx2(p, k0, n, sink);
      });
      return;
    }
  }
#endif
  read_new(r, first, elems, fresh.data());
  compare_run(reinterpret_cast<const T*>(fresh.data()), 0, elems, sink);
}

}  // namespace

Result<DeltaResult> delta_encode_host(const std::vector<DeltaRoute>& routes, std::byte* kept,
                                      std::byte* out, std::size_t capacity,
                                      std::uint64_t base_digest, const DeltaOptions& o,
                                      const HostWorkers& workers) {
  REFIT_RETURN_IF_ERROR(check_delta_routes(routes, o));
  REFIT_RETURN_IF_ERROR(check_delta_pointers(routes, o, true, false));
  const ChunkIndex ix = index_chunks(routes, o.chunk_log2);
  const std::int64_t elements = total_elements(routes);
  std::vector<ChunkOut> chunks(static_cast<std::size_t>(ix.total()));
  std::vector<std::vector<std::uint32_t>> arenas(
      static_cast<std::size_t>(std::max(1, workers.count)));
  // Pass 1: compare, update the kept copy, code each chunk into its worker's arena.
  run_items(workers, o, elements, ix.total(), [&](std::int64_t g0, std::int64_t g1, int worker) {
    std::vector<std::byte> fresh(std::size_t{4} << ix.log2);
    std::vector<Change> changes;
    changes.reserve(std::size_t{1} << ix.log2);
    auto& arena = arenas[static_cast<std::size_t>(worker)];
    for (std::int64_t g = g0; g < g1; ++g) {
      const ChunkSpan s = chunk_span(ix, routes, g);
      const DeltaRoute& r = routes[s.route];
      const std::size_t esize = dtype_size(r.wire_dtype);
      std::byte* k = kept + r.kept + static_cast<std::size_t>(s.first) * esize;
      changes.clear();
      ChunkOut& c = chunks[static_cast<std::size_t>(g)];
      c.worker = worker;
      dispatch_esize(esize, [&](auto t) {
        using T = decltype(t);
        ChangeSink<T> sink{
            .r = r, .first = s.first, .kept = reinterpret_cast<T*>(k), .changes = &changes};
        compare_chunk(r, s.first, s.elems, fresh, sink);
        c.digest = sink.digest;
      });
      // The kept copy holds every new value of the chunk now: a chunk that goes raw copies it.
      code_chunk(changes, s.elems, static_cast<int>(esize), k, c, arena);
    }
  });
  // Layout: per route its mode, payload offset and size.
  std::vector<df::RouteEntry> entries(routes.size());
  std::vector<std::uint64_t> data_offset(chunks.size(), 0);  // from the route's table end
  std::uint64_t at = df::kHeaderBytes + sizeof(df::RouteEntry) * routes.size();
  DeltaResult res;
  res.elements = elements;
  for (std::size_t i = 0; i < routes.size(); ++i) {
    const DeltaRoute& r = routes[i];
    df::RouteEntry& e = entries[i];
    e.tag = r.tag;
    e.esize = static_cast<std::uint8_t>(dtype_size(r.wire_dtype));
    e.chunk_log2 = static_cast<std::uint8_t>(ix.log2);
    e.elements = static_cast<std::uint64_t>(r.elements());
    std::uint64_t data = 0;
    const auto c0 = static_cast<std::size_t>(ix.begin[i]),
               c1 = static_cast<std::size_t>(ix.begin[i + 1]);
    for (std::size_t g = c0; g < c1; ++g) {
      data_offset[g] = data;
      data += chunks[g].bytes;
      e.changed += df::info_count(chunks[g].info);
      e.digest_delta += chunks[g].digest;
    }
    const std::uint64_t sparse = sizeof(df::ChunkEntry) * (c1 - c0) + data;
    const std::uint64_t raw = e.elements * e.esize;
    if (e.changed == 0) {
      e.mode = df::kUnchanged;
    } else if (static_cast<double>(sparse) >= o.dense_ratio * static_cast<double>(raw) ||
               data > std::numeric_limits<std::uint32_t>::max()) {
      e.mode = df::kDense;
      e.bytes = raw;
    } else {
      e.mode = df::kSparse;
      e.bytes = sparse;
    }
    at = df::align8(at);
    e.offset = e.mode == df::kUnchanged ? 0 : at;
    at += e.bytes;
    res.changed += static_cast<std::int64_t>(e.changed);
    res.digest_delta += e.digest_delta;
    res.routes_unchanged += e.mode == df::kUnchanged;
    res.routes_sparse += e.mode == df::kSparse;
    res.routes_dense += e.mode == df::kDense;
  }
  const std::uint64_t total = df::align8(at);
  if (total > capacity)
    return Status::Internal(
        fmt::format("delta: the stream of {} routes takes {} bytes, more than the {} of its buffer",
                    routes.size(), total, capacity));
  // Pass 2: payloads and their checksums, chunk by chunk.
  std::vector<std::uint64_t> chunk_sum(chunks.size(), 0);
  run_items(workers, o, elements, ix.total(), [&](std::int64_t g0, std::int64_t g1, int) {
    for (std::int64_t g = g0; g < g1; ++g) {
      const ChunkSpan s = chunk_span(ix, routes, g);
      const df::RouteEntry& e = entries[s.route];
      const std::int64_t k = g - ix.begin[s.route];
      std::byte* payload = out + e.offset;
      const ChunkOut& c = chunks[static_cast<std::size_t>(g)];
      std::uint64_t sum = 0;
      if (e.mode == df::kDense) {
        const std::uint64_t b0 = static_cast<std::uint64_t>(s.first) * e.esize;
        const std::uint64_t len = static_cast<std::uint64_t>(s.elems) * e.esize;
        std::memcpy(payload + b0, kept + routes[s.route].kept + b0, len);
        sum = delta_words_checksum(payload + b0, len, b0 / 4);
      } else if (e.mode == df::kSparse) {
        const std::uint64_t nchunks =
            static_cast<std::uint64_t>(ix.begin[s.route + 1] - ix.begin[s.route]);
        const df::ChunkEntry entry{
            .offset = static_cast<std::uint32_t>(data_offset[static_cast<std::size_t>(g)]),
            .info = c.info};
        std::memcpy(payload + static_cast<std::uint64_t>(k) * sizeof(df::ChunkEntry), &entry,
                    sizeof(entry));
        sum = checksum_term(static_cast<std::uint64_t>(2 * k), entry.offset) +
              checksum_term(static_cast<std::uint64_t>(2 * k + 1), entry.info);
        const std::uint64_t table = nchunks * sizeof(df::ChunkEntry);
        std::byte* data = payload + table + data_offset[static_cast<std::size_t>(g)];
        if (c.bytes > 0) {
          std::memcpy(data, arenas[static_cast<std::size_t>(c.worker)].data() + c.word, c.bytes);
          sum += delta_words_checksum(data, c.bytes,
                                      (table + data_offset[static_cast<std::size_t>(g)]) / 4);
        }
      }
      chunk_sum[static_cast<std::size_t>(g)] = sum;
    }
  });
  for (std::size_t i = 0; i < routes.size(); ++i) {
    for (auto g = static_cast<std::size_t>(ix.begin[i]);
         g < static_cast<std::size_t>(ix.begin[i + 1]); ++g)
      entries[i].payload_checksum += chunk_sum[g];
    // Padding to the next payload reads as zero, never as old bytes of the buffer.
    const std::uint64_t end = entries[i].offset + entries[i].bytes;
    if (entries[i].mode != df::kUnchanged && df::align8(end) > end)
      std::memset(out + end, 0, df::align8(end) - end);
  }
  df::StreamHeader h;
  h.routes = static_cast<std::uint32_t>(routes.size());
  h.total_bytes = total;
  h.base_digest = base_digest;
  std::memcpy(out + df::kHeaderBytes, entries.data(), sizeof(df::RouteEntry) * entries.size());
  std::memcpy(out, &h, sizeof(h));
  h.header_checksum =
      delta_words_checksum(out, df::kHeaderChecksumWords * 4, 0) +
      delta_words_checksum(out + df::kHeaderBytes, sizeof(df::RouteEntry) * entries.size(),
                           df::kDirectoryKey0);
  std::memcpy(out, &h, sizeof(h));
  res.stream_bytes = static_cast<std::size_t>(total);
  return res;
}

Result<DeltaResult> delta_capture_host(const std::vector<DeltaRoute>& routes, std::byte* kept,
                                       const DeltaOptions& o, const HostWorkers& workers) {
  REFIT_RETURN_IF_ERROR(check_delta_routes(routes, o));
  REFIT_RETURN_IF_ERROR(check_delta_pointers(routes, o, true, false));
  const ChunkIndex ix = index_chunks(routes, o.chunk_log2);
  const std::int64_t elements = total_elements(routes);
  std::vector<std::uint64_t> sums(static_cast<std::size_t>(ix.total()), 0);
  run_items(workers, o, elements, ix.total(), [&](std::int64_t g0, std::int64_t g1, int) {
    for (std::int64_t g = g0; g < g1; ++g) {
      const ChunkSpan s = chunk_span(ix, routes, g);
      const DeltaRoute& r = routes[s.route];
      const std::size_t esize = dtype_size(r.wire_dtype);
      std::byte* k = kept + r.kept + static_cast<std::size_t>(s.first) * esize;
      read_new(r, s.first, s.elems, k);
      std::uint64_t sum = 0;
      dispatch_esize(esize, [&](auto t) {
        using T = decltype(t);
        const T* v = reinterpret_cast<const T*>(k);
        walk_chunk(
            r, s.first, s.elems, [](std::int64_t, std::int64_t, std::int64_t, std::int64_t) {},
            [&](std::int64_t i, std::uint64_t key) { sum += checksum_term(key, v[i]); });
      });
      sums[static_cast<std::size_t>(g)] = sum;
    }
  });
  DeltaResult res;
  res.elements = elements;
  for (std::uint64_t s : sums) res.digest_delta += s;
  return res;
}

Result<DeltaResult> delta_patch_host(const std::vector<DeltaRoute>& routes, std::byte* kept,
                                     const DeltaOptions& o, const HostWorkers& workers) {
  REFIT_RETURN_IF_ERROR(check_delta_routes(routes, o));
  REFIT_RETURN_IF_ERROR(check_delta_pointers(routes, o, true, true));
  const ChunkIndex ix = index_chunks(routes, o.chunk_log2);
  const std::int64_t elements = total_elements(routes);
  std::vector<std::uint64_t> sums(static_cast<std::size_t>(ix.total()), 0);
  std::vector<std::int64_t> changed(static_cast<std::size_t>(ix.total()), 0);
  run_items(workers, o, elements, ix.total(), [&](std::int64_t g0, std::int64_t g1, int) {
    std::vector<std::byte> fresh(std::size_t{4} << ix.log2);
    for (std::int64_t g = g0; g < g1; ++g) {
      const ChunkSpan s = chunk_span(ix, routes, g);
      const DeltaRoute& r = routes[s.route];
      const std::size_t esize = dtype_size(r.wire_dtype);
      std::byte* k = kept + r.kept + static_cast<std::size_t>(s.first) * esize;
      std::uint64_t sum = 0;
      std::int64_t n = 0;
      dispatch_esize(esize, [&](auto t) {
        using T = decltype(t);
        ChangeSink<T> sink{
            .r = r, .first = s.first, .kept = reinterpret_cast<T*>(k), .patch = true};
        compare_chunk(r, s.first, s.elems, fresh, sink);
        sum = sink.digest;
        n = sink.count;
      });
      sums[static_cast<std::size_t>(g)] = sum;
      changed[static_cast<std::size_t>(g)] = n;
    }
  });
  DeltaResult res;
  res.elements = elements;
  for (std::size_t g = 0; g < sums.size(); ++g) {
    res.digest_delta += sums[g];
    res.changed += changed[g];
  }
  return res;
}

Result<std::vector<df::RouteEntry>> read_stream_directory(const std::vector<DeltaRoute>& routes,
                                                          const std::byte* head, std::size_t bytes,
                                                          std::uint64_t base_digest,
                                                          const DeltaOptions& o) {
  auto corrupt = [](const std::string& what) {
    return Status::Corruption("delta stream: " + what);
  };
  if (bytes < df::kHeaderBytes)
    return corrupt(
        fmt::format("{} bytes is shorter than its {}-byte header", bytes, df::kHeaderBytes));
  df::StreamHeader h;
  std::memcpy(&h, head, sizeof(h));
  if (h.magic != df::kMagic)
    return corrupt(fmt::format("bad magic 0x{:08x} (a delta stream starts with 0x{:08x})", h.magic,
                               df::kMagic));
  if (h.version != df::kVersion)
    return corrupt(
        fmt::format("format version {}, this build reads version {}", h.version, df::kVersion));
  if (h.total_bytes != bytes)
    return corrupt(fmt::format("its header says {} bytes, {} arrived", h.total_bytes, bytes));
  if (h.routes != routes.size())
    return corrupt(
        fmt::format("it holds {} routes, this receiver expects {}", h.routes, routes.size()));
  const std::uint64_t dir_bytes = sizeof(df::RouteEntry) * routes.size();
  if (bytes < df::kHeaderBytes + dir_bytes)
    return corrupt(
        fmt::format("{} bytes cannot hold the directory of {} routes", bytes, routes.size()));
  const std::uint64_t sum =
      delta_words_checksum(head, df::kHeaderChecksumWords * 4, 0) +
      delta_words_checksum(head + df::kHeaderBytes, dir_bytes, df::kDirectoryKey0);
  if (sum != h.header_checksum)
    return corrupt("its header and directory fail their checksum: the stream was corrupted");
  if (h.base_digest != base_digest)
    return Status::Corruption(fmt::format(
        "delta stream: computed against the base with digest {:016x}, but this receiver holds the "
        "base {:016x}: a delta applies only to the exact base it was computed against (send the "
        "full routes instead)",
        h.base_digest, base_digest));
  std::vector<df::RouteEntry> entries(routes.size());
  std::memcpy(entries.data(), head + df::kHeaderBytes, dir_bytes);
  std::uint64_t end = df::kHeaderBytes + dir_bytes;
  for (std::size_t i = 0; i < routes.size(); ++i) {
    const df::RouteEntry& e = entries[i];
    const DeltaRoute& r = routes[i];
    auto bad = [&](const std::string& what) {
      return Status::Corruption(
          fmt::format("delta stream: {}: {}", describe_route(o, r.tag), what));
    };
    if (e.tag != r.tag)
      return bad(fmt::format("entry {} is for route tag {}, expected here", i, e.tag));
    if (e.elements != static_cast<std::uint64_t>(r.elements()))
      return bad(fmt::format("{} elements in the stream, {} in this receiver's route", e.elements,
                             r.elements()));
    if (e.esize != dtype_size(r.wire_dtype))
      return bad(fmt::format("{}-byte elements in the stream, {} ({} bytes) here", e.esize,
                             dtype_name(r.wire_dtype), dtype_size(r.wire_dtype)));
    const std::uint64_t raw = e.elements * e.esize;
    switch (e.mode) {
      case df::kUnchanged:
        if (e.bytes != 0 || e.changed != 0 || e.digest_delta != 0)
          return bad("an unchanged route with a payload");
        continue;
      case df::kDense:
        if (e.bytes != raw)
          return bad(fmt::format("a dense payload of {} bytes, not {}", e.bytes, raw));
        break;
      case df::kSparse:
        // Both ends code with the session's chunk size; any other would only change how much
        // work (and host memory) the apply spends per element.
        if (e.chunk_log2 != o.chunk_log2)
          return bad(fmt::format("chunks of 2^{} elements, not the session's 2^{}", e.chunk_log2,
                                 o.chunk_log2));
        if (e.bytes < sizeof(df::ChunkEntry) * df::chunk_count(e.elements, e.chunk_log2))
          return bad(
              fmt::format("a sparse payload of {} bytes is shorter than its table", e.bytes));
        break;
      default:
        return bad(fmt::format("unknown payload mode {}", e.mode));
    }
    if (e.changed == 0 || e.changed > e.elements)
      return bad(fmt::format("{} changed elements of {}", e.changed, e.elements));
    if (e.offset % 8 != 0 || e.offset < end || e.offset + e.bytes > bytes ||
        e.offset + e.bytes < e.offset)
      return bad(fmt::format("its payload [{}, +{}) lies outside the stream's free bytes [{}, {})",
                             e.offset, e.bytes, end, bytes));
    end = e.offset + e.bytes;
  }
  return entries;
}

namespace {

// One piece of apply's work: a chunk of a route (sparse: the chunk of its table; dense: 2^log2
// elements).
struct ApplyOut {
  std::int64_t changed = 0;
  std::uint64_t digest = 0;
  std::string error;  // empty: fine
};

std::string chunk_error_text(int error) {
  switch (error) {
    case df::kChunkBadOffset:
      return "its data offset is unaligned or past the next chunk's";
    case df::kChunkBadCount:
      return "more changes than elements";
    case df::kChunkBadFlags:
      return "unknown flags";
    case df::kChunkBadExceptions:
      return "a bad exceptions word";
    case df::kChunkBadLowBits:
      return "low-bit counts other than its counts imply";
    case df::kChunkShort:
      return "its data runs past its extent";
    default:
      return "malformed";
  }
}

// Where an apply logs one chunk's changes (DeltaLog): its positions and new bits; null when the
// apply does not log.
struct ChunkLog {
  std::uint16_t* positions = nullptr;
  std::byte* values = nullptr;
};

// Applies one sparse chunk at dst (never writes outside the chunk's elements).
template <class T>
void apply_sparse_chunk(const DeltaRoute& r, std::int64_t first, std::uint32_t elems,
                        const std::uint32_t* words, const df::ChunkView& v, ChunkLog log,
                        ApplyOut& out) {
  constexpr int width = 8 * sizeof(T);
  // Changes are decoded a batch at a time and their parameters' cache lines prefetched before the
  // batch is applied: the elements lie far apart, and a miss per change would dominate.
  constexpr int kBatch = 32;
  struct Pending {
    std::byte* at;
    std::int64_t e;
    std::int64_t d;
  };
  Pending batch[kBatch];
  int held = 0;
  auto flush = [&] {
    for (int i = 0; i < held; ++i) {
      T old;
      std::memcpy(&old, batch[i].at, sizeof(T));
      const T nv = static_cast<T>(df::add_ordered(old, batch[i].d, width));
      const std::uint64_t key = key_at(r, batch[i].e);
      out.digest += checksum_term(key, nv) - checksum_term(key, old);
      std::memcpy(batch[i].at, &nv, sizeof(T));
      if (log.positions != nullptr) {
        *log.positions++ = static_cast<std::uint16_t>(batch[i].e - first);
        std::memcpy(log.values, &nv, sizeof(T));
        log.values += sizeof(T);
      }
    }
    out.changed += held;
    held = 0;
  };
  const bool ok =
      df::decode_chunk(words, v, elems, [&](std::uint32_t p, bool neg, std::uint32_t mag) {
        const std::int64_t e = first + static_cast<std::int64_t>(p);
        std::byte* at = dst_elem(r, e, sizeof(T));
        __builtin_prefetch(at, 1);
        batch[held++] =
            Pending{at, e, neg ? -static_cast<std::int64_t>(mag) : static_cast<std::int64_t>(mag)};
        if (held == kBatch) flush();
      });
  flush();
  if (!ok) out.error = "malformed position or exception codes";
}

// Raw new bits of elements [first, first + elems) of a route at `raw`: compare, write what
// differs.
template <class T>
void apply_raw(const DeltaRoute& r, std::int64_t first, std::uint32_t elems, const std::byte* raw,
               ApplyOut& out) {
  std::int64_t rr = 0, cc = 0, k0 = 0;
  walk_chunk(
      r, first, elems,
      [&](std::int64_t row, std::int64_t col, std::int64_t first_k, std::int64_t) {
        rr = row, cc = col, k0 = first_k;
      },
      [&](std::int64_t i, std::uint64_t key) {
        T nv, old;
        std::memcpy(&nv, raw + i * static_cast<std::int64_t>(sizeof(T)), sizeof(T));
        std::byte* at = dst_at(r, rr, cc + (i - k0));
        std::memcpy(&old, at, sizeof(T));
        if (nv == old) return;
        out.digest += checksum_term(key, nv) - checksum_term(key, old);
        std::memcpy(at, &nv, sizeof(T));
        ++out.changed;
      });
}

// The apply's work items: per sparse route its chunks, per dense route pieces of 2^chunk_log2
// elements.
struct ApplyItem {
  std::size_t route;
  std::uint64_t k;
  std::int64_t first;
  std::uint32_t elems;
};

// Lays out `log` for an apply's items, checked (views) and not yet applied: one run per chunk
// with changes, in item order, and where each one's positions and values go. A chunk that
// travels dense (a dense route's pieces, a sparse route's dense chunks) logs its raw bits whole.
void start_log(DeltaLog& log, const std::vector<ApplyItem>& items,
               const std::vector<df::RouteEntry>& entries, const std::vector<df::ChunkView>& views,
               std::vector<ChunkLog>& chunk_logs) {
  std::int64_t changes = 0, value_bytes = 0;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const df::RouteEntry& e = entries[items[i].route];
    if (e.mode == df::kDense || views[i].dense) {
      value_bytes += static_cast<std::int64_t>(items[i].elems) * e.esize;
    } else {
      changes += views[i].n;
      value_bytes += static_cast<std::int64_t>(views[i].n) * e.esize;
    }
  }
  log.positions.resize(static_cast<std::size_t>(changes));
  log.values.resize(static_cast<std::size_t>(value_bytes));
  std::int64_t at = 0, value_at = 0;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const df::RouteEntry& e = entries[items[i].route];
    const bool dense = e.mode == df::kDense || views[i].dense;
    const std::uint32_t n = dense ? items[i].elems : views[i].n;
    if (n == 0) continue;
    log.runs.push_back(DeltaLog::Run{.route = static_cast<std::uint32_t>(items[i].route),
                                     .count = n,
                                     .first = items[i].first,
                                     .at = at,
                                     .value_at = value_at,
                                     .dense = dense});
    chunk_logs[i] =
        ChunkLog{dense ? nullptr : log.positions.data() + at, log.values.data() + value_at};
    if (!dense) at += n;
    value_at += static_cast<std::int64_t>(n) * e.esize;
  }
}

}  // namespace

Result<DeltaResult> delta_apply_host(const std::vector<DeltaRoute>& routes, const std::byte* stream,
                                     std::size_t bytes, std::uint64_t base_digest,
                                     const DeltaOptions& o, const HostWorkers& workers) {
  if (o.log != nullptr) {  // incomplete until this apply succeeds; its arrays' memory is reused
    o.log->complete = false;
    o.log->runs.clear();
  }
  REFIT_RETURN_IF_ERROR(check_delta_routes(routes, o));
  REFIT_RETURN_IF_ERROR(check_delta_pointers(routes, o, false, true));
  if (reinterpret_cast<std::uintptr_t>(stream) % 8 != 0)
    return Status::InvalidArgument("delta: a stream must start at an 8-byte boundary");
  REFIT_ASSIGN_OR_RETURN(std::vector<df::RouteEntry> entries,
                         read_stream_directory(routes, stream, bytes, base_digest, o));
  const std::int64_t elements = total_elements(routes);
  // Pass 1: every payload against its checksum, in pieces of 2^16 words.
  constexpr std::uint64_t kPieceWords = std::uint64_t{1} << 16;
  struct Piece {
    std::size_t route;
    std::uint64_t word0, words;
  };
  std::vector<Piece> pieces;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const std::uint64_t words = (entries[i].bytes + 3) / 4;
    for (std::uint64_t w = 0; w < words; w += kPieceWords)
      pieces.push_back({i, w, std::min(kPieceWords, words - w)});
  }
  std::vector<std::uint64_t> piece_sum(pieces.size(), 0);
  run_items(workers, o, static_cast<std::int64_t>(bytes / 2),
            static_cast<std::int64_t>(pieces.size()), [&](std::int64_t p0, std::int64_t p1, int) {
              for (std::int64_t p = p0; p < p1; ++p) {
                const Piece& pc = pieces[static_cast<std::size_t>(p)];
                const df::RouteEntry& e = entries[pc.route];
                const std::uint64_t b0 = pc.word0 * 4;
                const std::uint64_t len = std::min<std::uint64_t>(pc.words * 4, e.bytes - b0);
                piece_sum[static_cast<std::size_t>(p)] =
                    delta_words_checksum(stream + e.offset + b0, len, pc.word0);
              }
            });
  std::vector<std::uint64_t> route_sum(entries.size(), 0);
  for (std::size_t p = 0; p < pieces.size(); ++p) route_sum[pieces[p].route] += piece_sum[p];
  for (std::size_t i = 0; i < entries.size(); ++i)
    if (route_sum[i] != entries[i].payload_checksum)
      return Status::Corruption(fmt::format(
          "delta stream: {}: its payload ({} bytes) fails its checksum: the stream was corrupted "
          "in flight; nothing was applied",
          describe_route(o, routes[i].tag), entries[i].bytes));
  // Pass 2: every sparse chunk's table entry and counts (nothing is written yet).
  // Work items: per sparse route its chunks (of its own size), per dense route pieces of
  // 2^chunk_log2 elements.
  std::vector<ApplyItem> items;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const df::RouteEntry& e = entries[i];
    if (e.mode == df::kUnchanged) continue;
    const int log2 = e.mode == df::kSparse ? e.chunk_log2 : o.chunk_log2;
    for (std::uint64_t k = 0; k < df::chunk_count(e.elements, log2); ++k) {
      const std::uint64_t first = k << log2;
      items.push_back({i, k, static_cast<std::int64_t>(first),
                       static_cast<std::uint32_t>(
                           std::min<std::uint64_t>(std::uint64_t{1} << log2, e.elements - first))});
    }
  }
  std::vector<ApplyOut> outs(items.size());
  std::vector<df::ChunkView> views(items.size());
  run_items(workers, o, elements, static_cast<std::int64_t>(items.size()),
            [&](std::int64_t i0, std::int64_t i1, int) {
              for (std::int64_t i = i0; i < i1; ++i) {
                const ApplyItem& it = items[static_cast<std::size_t>(i)];
                const df::RouteEntry& e = entries[it.route];
                if (e.mode != df::kSparse) continue;
                df::ChunkView& v = views[static_cast<std::size_t>(i)];
                v = df::check_chunk(reinterpret_cast<const unsigned char*>(stream + e.offset),
                                    e.bytes, df::chunk_count(e.elements, e.chunk_log2), it.k,
                                    it.elems, e.esize);
                if (v.error != df::kChunkOk)
                  outs[static_cast<std::size_t>(i)].error =
                      fmt::format("chunk {}: {}", it.k, chunk_error_text(v.error));
              }
            });
  {
    std::vector<std::uint64_t> counted(entries.size(), 0);
    for (std::size_t i = 0; i < items.size(); ++i) {
      if (!outs[i].error.empty())
        return Status::Corruption(fmt::format(
            "delta stream: {}: {}", describe_route(o, routes[items[i].route].tag), outs[i].error));
      counted[items[i].route] += views[i].n;
    }
    for (std::size_t i = 0; i < entries.size(); ++i)
      if (entries[i].mode == df::kSparse && counted[i] != entries[i].changed)
        return Status::Corruption(
            fmt::format("delta stream: {}: its chunks hold {} changes, its directory says {}",
                        describe_route(o, routes[i].tag), counted[i], entries[i].changed));
  }
  // Where each chunk logs what it writes (options.log): laid out now that the counts are known,
  // so that the workers write disjoint ranges.
  std::vector<ChunkLog> chunk_logs(o.log != nullptr ? items.size() : 0);
  if (o.log != nullptr) start_log(*o.log, items, entries, views, chunk_logs);
  // Pass 3: apply.
  run_items(
      workers, o, elements, static_cast<std::int64_t>(items.size()),
      [&](std::int64_t i0, std::int64_t i1, int) {
        for (std::int64_t i = i0; i < i1; ++i) {
          const ApplyItem& it = items[static_cast<std::size_t>(i)];
          const df::RouteEntry& e = entries[it.route];
          const DeltaRoute& r = routes[it.route];
          const std::int64_t first = it.first;
          const std::uint32_t elems = it.elems;
          ApplyOut& out = outs[static_cast<std::size_t>(i)];
          const df::ChunkView& v = views[static_cast<std::size_t>(i)];
          const std::byte* data =
              stream + e.offset +
              (e.mode == df::kSparse
                   ? df::chunk_count(e.elements, e.chunk_log2) * sizeof(df::ChunkEntry) + v.offset
                   : 0);
          const ChunkLog log =
              chunk_logs.empty() ? ChunkLog{} : chunk_logs[static_cast<std::size_t>(i)];
          if (log.values != nullptr && log.positions == nullptr)  // dense: its raw bits
            std::memcpy(
                log.values,
                data + (e.mode == df::kDense ? static_cast<std::uint64_t>(first) * e.esize : 0),
                static_cast<std::size_t>(elems) * e.esize);
          dispatch_esize(e.esize, [&](auto t) {
            using T = decltype(t);
            if (e.mode == df::kDense) {
              apply_raw<T>(r, first, elems, data + static_cast<std::uint64_t>(first) * e.esize,
                           out);
            } else if (v.n == 0) {
              return;
            } else if (v.dense) {
              apply_raw<T>(r, first, elems, data, out);
            } else {
              apply_sparse_chunk<T>(r, first, elems, reinterpret_cast<const std::uint32_t*>(data),
                                    v, log, out);
            }
          });
        }
      });
  DeltaResult res;
  res.elements = elements;
  res.stream_bytes = bytes;
  std::vector<std::int64_t> changed(entries.size(), 0);
  std::vector<std::uint64_t> digest(entries.size(), 0);
  std::string first_error;
  std::size_t error_route = 0;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (!outs[i].error.empty() && first_error.empty())
      first_error = outs[i].error, error_route = items[i].route;
    changed[items[i].route] += outs[i].changed;
    digest[items[i].route] += outs[i].digest;
  }
  if (!first_error.empty())
    return Status::Corruption(fmt::format("delta stream: {}: {} (the route was applied in part)",
                                          describe_route(o, routes[error_route].tag), first_error));
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const df::RouteEntry& e = entries[i];
    if (static_cast<std::uint64_t>(changed[i]) != e.changed || digest[i] != e.digest_delta)
      return Status::Corruption(fmt::format(
          "delta: {}: the applied changes ({} elements, digest +{:016x}) differ from what the "
          "trainer computed ({} elements, +{:016x}): this engine rank's base differs from the "
          "trainer's kept copy at an element that changed",
          describe_route(o, routes[i].tag), changed[i], digest[i], e.changed, e.digest_delta));
    res.changed += changed[i];
    res.digest_delta += digest[i];
    res.routes_unchanged += e.mode == df::kUnchanged;
    res.routes_sparse += e.mode == df::kSparse;
    res.routes_dense += e.mode == df::kDense;
  }
  if (o.log != nullptr) o.log->complete = true;
  return res;
}

Status delta_replay_host(const std::vector<DeltaRoute>& routes, const DeltaLog& log,
                         const DeltaOptions& o, const HostWorkers& workers) {
  REFIT_RETURN_IF_ERROR(check_delta_routes(routes, o));
  REFIT_RETURN_IF_ERROR(check_delta_pointers(routes, o, false, true));
  if (!log.complete)
    return Status::InvalidArgument(
        "delta: a replay needs a complete log (one whose apply succeeded on a plane that logs)");
  // Every run within its route and the log's arrays before anything is written. Positions
  // increase within a run (they were decoded so), so its last is its largest.
  for (const DeltaLog::Run& run : log.runs) {
    const auto bad = [&](const char* what) {
      return Status::Internal(fmt::format(
          "delta replay: {}: a run of {} changes from element {} {}",
          describe_route(o, run.route < routes.size() ? routes[run.route].tag : run.route),
          run.count, run.first, what));
    };
    if (run.route >= routes.size()) return bad("names no route of this list");
    const auto esize = static_cast<std::int64_t>(dtype_size(routes[run.route].wire_dtype));
    if (run.count == 0 || run.at < 0 || run.value_at < 0 ||
        (!run.dense && run.at + run.count > static_cast<std::int64_t>(log.positions.size())) ||
        run.value_at + run.count * esize > static_cast<std::int64_t>(log.values.size()))
      return bad("lies outside the log");
    const std::int64_t last =
        run.dense ? run.count - 1 : log.positions[static_cast<std::size_t>(run.at + run.count - 1)];
    if (run.first < 0 || run.first + last >= routes[run.route].elements())
      return bad("lies outside its route");
  }
  run_items(workers, o, log.elements(), static_cast<std::int64_t>(log.runs.size()),
            [&](std::int64_t i0, std::int64_t i1, int) {
              for (std::int64_t i = i0; i < i1; ++i) {
                const DeltaLog::Run& run = log.runs[static_cast<std::size_t>(i)];
                const DeltaRoute& r = routes[run.route];
                const std::byte* val = log.values.data() + run.value_at;
                const std::size_t esize = dtype_size(r.wire_dtype);
                if (run.dense) {  // row by row
                  walk_rows(
                      r, run.first, run.count,
                      [&](std::int64_t rr, std::int64_t cc, std::int64_t k, std::int64_t len) {
                        std::memcpy(dst_at(r, rr, cc), val + k * esize,
                                    static_cast<std::size_t>(len) * esize);
                      });
                  continue;
                }
                const std::uint16_t* pos = log.positions.data() + run.at;
                dispatch_esize(esize, [&](auto t) {
                  using T = decltype(t);
                  if (r.block.rows > 1 && r.block.dst_stride != r.block.cols) {
                    for (std::uint32_t j = 0; j < run.count; ++j)
                      std::memcpy(dst_elem(r, run.first + pos[j], sizeof(T)), val + j * sizeof(T),
                                  sizeof(T));
                    return;
                  }
                  // The run's elements lie in one stretch of dst: its lines are prefetched a
                  // few changes ahead, for writing.
                  std::byte* base = dst_elem(r, run.first, sizeof(T));
                  constexpr std::uint32_t kAhead = 16;
                  for (std::uint32_t j = 0; j < run.count; ++j) {
                    if (j + kAhead < run.count)
                      __builtin_prefetch(base + pos[j + kAhead] * sizeof(T), 1);
                    std::memcpy(base + pos[j] * sizeof(T), val + j * sizeof(T), sizeof(T));
                  }
                });
              }
            });
  return Status::Ok();
}

std::int64_t DeltaLog::elements() const {
  std::int64_t n = 0;
  for (const Run& r : runs) n += r.count;
  return n;
}

}  // namespace refit
