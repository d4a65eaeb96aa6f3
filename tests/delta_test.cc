// The delta component on host memory (delta/delta_cpu.h): encode and apply round trips bit-exact
// against the base for bf16, fp32 -> bf16 (the master cast), fp8 codes and float32 scales, at
// densities 0, one element, a few per cent, past break-even and 1; corrupted streams and wrong
// bases refused naming the route; large lists over several workers and many chunks give the same
// bytes as one thread.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "common/checksum.h"
#include "common/convert.h"
#include "delta/delta.h"
#include "delta/delta_cpu.h"
#include "delta/format.h"
#include "executor/delta_sender.h"
#include "plane/data_plane.h"
#include "refit/config.h"

namespace refit {
namespace {

namespace df = delta_format;

// Real threads: each run splits the items over `count` threads (worker ids 0..count-1).
HostWorkers thread_workers(int count) {
  HostWorkers w;
  w.count = count;
  w.run = [count](std::int64_t items,
                  const std::function<void(std::int64_t, std::int64_t, int)>& body) {
    const std::int64_t share = (items + count - 1) / count;
    std::vector<std::thread> threads;
    for (int t = 0; t < count; ++t) {
      const std::int64_t lo = t * share, hi = std::min(items, lo + share);
      if (lo < hi) threads.emplace_back([&body, lo, hi, t] { body(lo, hi, t); });
    }
    for (auto& th : threads) th.join();
  };
  return w;
}

// A tensor of `esize`-byte elements as raw bytes.
struct Tensor {
  std::vector<std::byte> bytes;
  int esize = 2;
  Tensor(std::int64_t n, int es) : bytes(static_cast<std::size_t>(n) * es), esize(es) {}
  std::uint32_t get(std::int64_t i) const {
    std::uint32_t v = 0;
    std::memcpy(&v, bytes.data() + i * esize, static_cast<std::size_t>(esize));
    return v;
  }
  void set(std::int64_t i, std::uint32_t v) {
    std::memcpy(bytes.data() + i * esize, &v, static_cast<std::size_t>(esize));
  }
  std::byte* data() { return bytes.data(); }
};

// The digest of rows x cols elements at `t` (row stride `stride`), keyed from `key`.
std::uint64_t digest_of(const Tensor& t, std::int64_t offset, std::int64_t stride,
                        std::int64_t rows, std::int64_t cols, std::uint64_t key,
                        std::int64_t key_stride) {
  std::uint64_t sum = 0;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      sum += checksum_term(key + static_cast<std::uint64_t>(r * key_stride + c),
                           t.get(offset + r * stride + c));
  return sum;
}

// One route end to end: the trainer's source, its kept copy, the engine's parameter.
struct Case {
  std::int64_t rows = 0, cols = 0;
  DType src_dtype = DType::kBFloat16, wire = DType::kBFloat16;
  std::int64_t src_stride = 0, dst_stride = 0, src_offset = 0, dst_offset = 0;
};

class Harness {
 public:
  // Routes of the given shapes; sources and parameters filled with `base` (wire bits) by
  // init_base.
  explicit Harness(const std::vector<Case>& cases) : cases_(cases) {
    std::uint32_t tag = 100;
    for (const Case& c : cases) {
      const int ss = static_cast<int>(dtype_size(c.src_dtype)),
                ws = static_cast<int>(dtype_size(c.wire));
      srcs_.emplace_back(c.src_offset + std::max<std::int64_t>(c.rows, 1) * c.src_stride, ss);
      params_.emplace_back(c.dst_offset + std::max<std::int64_t>(c.rows, 1) * c.dst_stride, ws);
      DeltaRoute r;
      r.block = {.src_offset = c.src_offset,
                 .src_stride = c.src_stride,
                 .dst_offset = c.dst_offset,
                 .dst_stride = c.dst_stride,
                 .rows = c.rows,
                 .cols = c.cols};
      r.src_dtype = c.src_dtype;
      r.wire_dtype = c.wire;
      r.key = 1000 + static_cast<std::uint64_t>(routes_.size()) * 1'000'000'007ull;
      r.key_stride = c.dst_stride;
      r.tag = tag++;
      routes_.push_back(r);
    }
    for (std::size_t i = 0; i < routes_.size(); ++i) {
      routes_[i].src = srcs_[i].data();
      routes_[i].dst = params_[i].data();
    }
    kept_.resize(static_cast<std::size_t>(assign_kept_offsets(routes_)));
    out_.resize(delta_stream_capacity(routes_) / 8 + 1);
    options_.describe = [](std::uint32_t tag) { return "tensor-" + std::to_string(tag); };
  }

  std::vector<DeltaRoute>& routes() { return routes_; }
  Tensor& src(std::size_t i) { return srcs_[i]; }
  Tensor& param(std::size_t i) { return params_[i]; }
  DeltaOptions& options() { return options_; }
  std::byte* stream() { return reinterpret_cast<std::byte*>(out_.data()); }

  // Source element (r, c) of route i.
  std::int64_t at_src(std::size_t i, std::int64_t r, std::int64_t c) const {
    return cases_[i].src_offset + r * cases_[i].src_stride + c;
  }
  std::int64_t at_dst(std::size_t i, std::int64_t r, std::int64_t c) const {
    return cases_[i].dst_offset + r * cases_[i].dst_stride + c;
  }
  // The wire bits of source element (r, c) of route i (the cast).
  std::uint32_t wire_of(std::size_t i, std::int64_t r, std::int64_t c) const {
    std::uint32_t out = 0;
    convert_block(srcs_[i].bytes.data(), cases_[i].src_dtype, at_src(i, r, c), 0, &out,
                  cases_[i].wire, 0, 0, 1, 1);
    return out;
  }

  // The full refit: the engine's parameters get the cast, the kept copy too (capture).
  std::uint64_t full_refit(const HostWorkers& w) {
    for (std::size_t i = 0; i < routes_.size(); ++i)
      for (std::int64_t r = 0; r < cases_[i].rows; ++r)
        for (std::int64_t c = 0; c < cases_[i].cols; ++c)
          params_[i].set(at_dst(i, r, c), wire_of(i, r, c));
    auto cap = delta_capture_host(routes_, kept_.data(), options_, w);
    EXPECT_TRUE(cap.ok()) << cap.status().to_string();
    EXPECT_EQ(cap->digest_delta, engine_digest());
    return cap->digest_delta;
  }

  std::uint64_t engine_digest() const {
    std::uint64_t sum = 0;
    for (std::size_t i = 0; i < routes_.size(); ++i)
      sum += digest_of(params_[i], cases_[i].dst_offset, cases_[i].dst_stride, cases_[i].rows,
                       cases_[i].cols, routes_[i].key, routes_[i].key_stride);
    return sum;
  }

  // Every engine element equals the cast of its source; elements outside routes are untouched
  // (`guard` bits).
  void expect_engine_holds_cast(std::uint32_t guard) const {
    for (std::size_t i = 0; i < routes_.size(); ++i) {
      const Case& c = cases_[i];
      std::vector<bool> covered(
          params_[i].bytes.size() / static_cast<std::size_t>(params_[i].esize), false);
      for (std::int64_t r = 0; r < c.rows; ++r)
        for (std::int64_t k = 0; k < c.cols; ++k) {
          covered[static_cast<std::size_t>(at_dst(i, r, k))] = true;
          ASSERT_EQ(params_[i].get(at_dst(i, r, k)), wire_of(i, r, k))
              << "route " << i << " element (" << r << ", " << k << ")";
        }
      for (std::size_t e = 0; e < covered.size(); ++e)
        if (!covered[e]) {
          ASSERT_EQ(params_[i].get(static_cast<std::int64_t>(e)), guard) << "element " << e;
        }
    }
  }

  Result<DeltaResult> encode(const HostWorkers& w, std::uint64_t base) {
    return delta_encode_host(routes_, kept_.data(), stream(), out_.size() * 8, base, options_, w);
  }
  Result<DeltaResult> apply(const HostWorkers& w, std::size_t bytes, std::uint64_t base) {
    return delta_apply_host(routes_, stream(), bytes, base, options_, w);
  }
  std::vector<std::byte>& kept() { return kept_; }

 private:
  std::vector<Case> cases_;
  std::vector<Tensor> srcs_, params_;
  std::vector<DeltaRoute> routes_;
  std::vector<std::byte> kept_;
  std::vector<std::uint64_t> out_;  // 8-byte aligned
  DeltaOptions options_;
};

// A random bf16 weight of magnitude ~0.02 (never NaN).
std::uint16_t random_bf16(std::mt19937_64& rng) {
  std::normal_distribution<float> n(0.0f, 0.02f);
  return f32_to_bf16(n(rng));
}

// Moves a fraction `density` of the elements of route i's source (bf16 source) by +-1 ulp,
// `exceptions` of those by 2..40 ulps; returns how many moved.
std::int64_t move_bf16(Harness& h, std::size_t i, const Case& c, double density, double exceptions,
                       std::mt19937_64& rng) {
  std::bernoulli_distribution pick(density), big(exceptions), up(0.5);
  std::uniform_int_distribution<int> steps(2, 40);
  std::int64_t moved = 0;
  for (std::int64_t r = 0; r < c.rows; ++r)
    for (std::int64_t k = 0; k < c.cols; ++k) {
      if (!pick(rng)) continue;
      const std::int64_t at = h.at_src(i, r, k);
      const std::uint32_t old = h.src(i).get(at);
      const std::int64_t d = (big(rng) ? steps(rng) : 1) * (up(rng) ? 1 : -1);
      h.src(i).set(at, df::add_ordered(old, d, 16));
      ++moved;
    }
  return moved;
}

TEST(DeltaFormat, OrderedKeysAreABijectionAndDifferencesRoundTrip) {
  for (int width : {8, 16}) {
    const std::uint32_t n = 1u << width;
    std::vector<bool> seen(n, false);
    for (std::uint32_t b = 0; b < n; ++b) {
      const std::uint32_t k = df::ordered_key(b, width);
      ASSERT_LT(k, n);
      ASSERT_FALSE(seen[k]);
      seen[k] = true;
      ASSERT_EQ(df::from_ordered_key(k, width), b);
    }
  }
  // One ulp up of a positive bf16 is +1, of a negative one -1 (towards zero); -0 and +0 are
  // neighbours.
  EXPECT_EQ(df::ordered_difference(0x3F80, 0x3F81, 16), 1);
  EXPECT_EQ(df::ordered_difference(0xBF80, 0xBF81, 16), -1);
  EXPECT_EQ(df::ordered_difference(0x8000, 0x0000, 16), 1);
  std::mt19937_64 rng(7);
  for (int width : {8, 16, 32})
    for (int i = 0; i < 20000; ++i) {
      const std::uint32_t mask = width == 32 ? 0xFFFFFFFFu : (1u << width) - 1;
      const auto a = static_cast<std::uint32_t>(rng()) & mask,
                 b = static_cast<std::uint32_t>(rng()) & mask;
      const std::int64_t d = df::ordered_difference(a, b, width);
      ASSERT_LE(std::llabs(d), std::int64_t{1} << (width - 1));
      ASSERT_EQ(df::add_ordered(a, d, width), b) << width << " " << a << " " << b;
    }
}

// ef_low_bits is the smallest L from 0 to 15 that makes the coding shortest: every count of every
// universe up to 2^11, then counts spread over larger universes.
TEST(DeltaFormat, EliasFanoLowBitsMinimiseTheCoding) {
  auto check = [](std::uint64_t n, std::uint64_t universe) {
    const int L = df::ef_low_bits(n, universe);
    for (int other = 0; other <= 15; ++other) {
      if (other < L)
        ASSERT_GT(df::ef_bits(n, universe, other), df::ef_bits(n, universe, L))
            << n << " of " << universe << ": L " << L << " vs " << other;
      else
        ASSERT_LE(df::ef_bits(n, universe, L), df::ef_bits(n, universe, other))
            << n << " of " << universe << ": L " << L << " vs " << other;
    }
  };
  for (std::uint64_t universe = 1; universe <= 2048; ++universe)
    for (std::uint64_t n = 1; n <= universe; ++n) ASSERT_NO_FATAL_FAILURE(check(n, universe));
  for (std::uint64_t universe : {8191ull, 8192ull, 65536ull, 1ull << 24, 1ull << 31})
    for (std::uint64_t n = 1; n <= universe; n = n * 3 + 1)
      ASSERT_NO_FATAL_FAILURE(check(n, universe));
}

// A bf16 route (same dtype on both sides) at every density the brief names; the engine ends bit
// for bit where the trainer is, and the digests agree.
TEST(DeltaHost, Bf16RoundTripsAtEveryDensity) {
  const Case c{.rows = 37, .cols = 1000, .src_stride = 1000, .dst_stride = 1000};
  for (double density : {0.0, -1.0 /* one element */, 0.01, 0.03, 0.2, 0.6, 1.0}) {
    SCOPED_TRACE(density);
    Harness h({c});
    h.options().chunk_log2 = 10;
    std::mt19937_64 rng(42);
    for (std::int64_t i = 0; i < c.rows * c.cols; ++i) h.src(0).set(i, random_bf16(rng));
    const HostWorkers w = HostWorkers::inline_only();
    std::uint64_t base = h.full_refit(w);
    h.expect_engine_holds_cast(0);
    std::int64_t moved = 0;
    if (density < 0) {
      h.src(0).set(12345, df::add_ordered(h.src(0).get(12345), 1, 16));
      moved = 1;
    } else {
      moved = move_bf16(h, 0, c, density, 0.05, rng);
    }
    auto enc = h.encode(w, base);
    ASSERT_TRUE(enc.ok()) << enc.status().to_string();
    EXPECT_EQ(enc->changed, moved);
    EXPECT_EQ(enc->elements, c.rows * c.cols);
    auto app = h.apply(w, enc->stream_bytes, base);
    ASSERT_TRUE(app.ok()) << app.status().to_string();
    EXPECT_EQ(app->changed, moved);
    EXPECT_EQ(app->digest_delta, enc->digest_delta);
    h.expect_engine_holds_cast(0);
    EXPECT_EQ(base + app->digest_delta, h.engine_digest());
    // The kept copy is the new cast.
    std::vector<std::byte> want(h.kept().size());
    for (std::int64_t i = 0; i < c.rows * c.cols; ++i) {
      const std::uint32_t v = h.src(0).get(i);
      std::memcpy(want.data() + i * 2, &v, 2);
    }
    EXPECT_EQ(
        std::memcmp(want.data(), h.kept().data(), static_cast<std::size_t>(c.rows * c.cols * 2)),
        0);
    // Sizes: nothing moved is the header and one directory entry; ±1-ulp changes at a few per
    // cent take a few per cent of the route's bytes; everything changed is no larger than dense.
    const std::size_t raw = static_cast<std::size_t>(c.rows * c.cols * 2);
    const std::size_t fixed = df::kHeaderBytes + sizeof(df::RouteEntry);
    if (moved == 0) {
      EXPECT_EQ(enc->stream_bytes, fixed);
      EXPECT_EQ(enc->routes_unchanged, 1);
    }
    if (density > 0 && density <= 0.2) {  // within the prediction's error (its own test below)
      const auto predicted = static_cast<double>(
          predict_delta_bytes(c.rows * c.cols, 2, 1, density, 0.05, h.options().chunk_log2));
      EXPECT_LT(static_cast<double>(enc->stream_bytes), 1.2 * predicted);
      EXPECT_LT(static_cast<double>(enc->stream_bytes), raw * (density < 0.05 ? 0.03 : 0.12));
    }
    EXPECT_LE(enc->stream_bytes, df::align8(fixed + raw));
    if (density == 1.0) {
      EXPECT_LT(enc->stream_bytes, raw * 0.3) << "+-1 ulp everywhere costs ~4 bits";
    }
    // A second encode of the same values: nothing changed.
    auto again = h.encode(w, base + enc->digest_delta);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->changed, 0);
    EXPECT_EQ(again->stream_bytes, fixed);
    auto noop = h.apply(w, again->stream_bytes, base + enc->digest_delta);
    ASSERT_TRUE(noop.ok()) << noop.status().to_string();
    EXPECT_EQ(noop->changed, 0);
  }
}

// Values that change arbitrarily (the base is unrelated): every route goes dense and the stream
// is its raw bytes; dense_ratio moves the switch.
TEST(DeltaHost, RandomChangesFallBackToDense) {
  const Case c{.rows = 64, .cols = 512, .src_stride = 512, .dst_stride = 512};
  Harness h({c});
  std::mt19937_64 rng(3);
  for (std::int64_t i = 0; i < c.rows * c.cols; ++i) h.src(0).set(i, random_bf16(rng));
  const HostWorkers w = HostWorkers::inline_only();
  const std::uint64_t base = h.full_refit(w);
  for (std::int64_t i = 0; i < c.rows * c.cols; ++i)
    h.src(0).set(i, static_cast<std::uint32_t>(rng()) & 0x7F7Fu);
  auto enc = h.encode(w, base);
  ASSERT_TRUE(enc.ok());
  EXPECT_EQ(enc->routes_dense, 1);
  EXPECT_EQ(enc->stream_bytes,
            df::align8(df::kHeaderBytes + sizeof(df::RouteEntry) + c.rows * c.cols * 2));
  auto app = h.apply(w, enc->stream_bytes, base);
  ASSERT_TRUE(app.ok()) << app.status().to_string();
  EXPECT_EQ(app->routes_dense, 1);
  h.expect_engine_holds_cast(0);

  // 3 % of +-1 ulp: sparse at the default ratio, dense when the ratio says 1 %.
  Harness g({c});
  for (std::int64_t i = 0; i < c.rows * c.cols; ++i) g.src(0).set(i, random_bf16(rng));
  std::uint64_t gb = g.full_refit(w);
  move_bf16(g, 0, c, 0.03, 0, rng);
  g.options().dense_ratio = 0.01;
  auto d = g.encode(w, gb);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->routes_dense, 1);
  ASSERT_TRUE(g.apply(w, d->stream_bytes, gb).ok());
  g.expect_engine_holds_cast(0);
}

// The trainer's fp32 master through the cast: the kept copy and the stream speak bf16, and an
// update smaller than half a bf16 ulp changes nothing.
TEST(DeltaHost, Fp32MasterCastToBf16) {
  const Case c{.rows = 300,
               .cols = 333,
               .src_dtype = DType::kFloat32,
               .wire = DType::kBFloat16,
               .src_stride = 400,
               .dst_stride = 700,
               .src_offset = 5,
               .dst_offset = 9};
  Harness h({c});
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> u(-0.1f, 0.1f);
  std::vector<float> master(h.src(0).bytes.size() / 4);
  for (float& x : master) x = u(rng);
  std::memcpy(h.src(0).data(), master.data(), master.size() * 4);
  for (std::size_t i = 0; i < h.param(0).bytes.size() / 2; ++i)
    h.param(0).set(static_cast<std::int64_t>(i), 0xABCD);
  const HostWorkers w = HostWorkers::inline_only();
  std::uint64_t base = h.full_refit(w);
  // Re-guard the elements outside the route (full_refit wrote only the route).
  h.expect_engine_holds_cast(0xABCD);
  for (int step = 1; step <= 3; ++step) {
    std::int64_t changed_bf16 = 0;
    for (std::int64_t r = 0; r < c.rows; ++r)
      for (std::int64_t k = 0; k < c.cols; ++k) {
        const auto at = static_cast<std::size_t>(h.at_src(0, r, k));
        const std::uint16_t before = f32_to_bf16(master[at]);
        master[at] += (rng() & 1 ? 1e-5f : -1e-5f);
        changed_bf16 += f32_to_bf16(master[at]) != before;
      }
    std::memcpy(h.src(0).data(), master.data(), master.size() * 4);
    auto enc = h.encode(w, base);
    ASSERT_TRUE(enc.ok()) << enc.status().to_string();
    EXPECT_EQ(enc->changed, changed_bf16);
    EXPECT_GT(changed_bf16, 0);
    EXPECT_LT(changed_bf16, c.rows * c.cols / 4);
    auto app = h.apply(w, enc->stream_bytes, base);
    ASSERT_TRUE(app.ok()) << app.status().to_string();
    base += app->digest_delta;
    h.expect_engine_holds_cast(0xABCD);
    EXPECT_EQ(base, h.engine_digest());
  }
}

// FP8: codes (1 byte, quantized elsewhere) change rarely, and nearly every float32 scale
// changes by a few hundred ulps; both round-trip, and the scales still cost less than raw.
TEST(DeltaHost, Fp8CodesAndScales) {
  const Case codes{.rows = 256,
                   .cols = 256,
                   .src_dtype = DType::kFloat8E4M3,
                   .wire = DType::kFloat8E4M3,
                   .src_stride = 256,
                   .dst_stride = 256};
  const Case scales{.rows = 2,
                    .cols = 2000,
                    .src_dtype = DType::kFloat32,
                    .wire = DType::kFloat32,
                    .src_stride = 2000,
                    .dst_stride = 2000};
  Harness h({codes, scales});
  std::mt19937_64 rng(5);
  for (std::int64_t i = 0; i < codes.rows * codes.cols; ++i)
    h.src(0).set(i, static_cast<std::uint32_t>(rng()) & 0x7Eu);  // finite codes
  std::vector<float> s(4000);
  for (float& x : s) x = std::ldexp(1.0f + static_cast<float>(rng() % 1000) / 1000.0f, -10);
  std::memcpy(h.src(1).data(), s.data(), s.size() * 4);
  const HostWorkers w = HostWorkers::inline_only();
  std::uint64_t base = h.full_refit(w);
  std::int64_t moved = 0;
  std::bernoulli_distribution pick(0.003);
  for (std::int64_t i = 0; i < codes.rows * codes.cols; ++i)
    if (pick(rng)) {
      const std::uint32_t v = h.src(0).get(i);
      h.src(0).set(i, df::add_ordered(v, v == 0x7E ? -1 : 1, 8));
      ++moved;
    }
  std::int64_t scales_moved = 0;
  for (float& x : s) {
    if (rng() % 50 == 0) continue;  // ~2 % of the blocks keep their amax
    std::uint32_t b;
    std::memcpy(&b, &x, 4);
    b = df::add_ordered(b, static_cast<std::int64_t>(rng() % 600) - 300, 32);
    if (std::memcmp(&b, &x, 4) != 0) ++scales_moved;
    std::memcpy(&x, &b, 4);
  }
  std::memcpy(h.src(1).data(), s.data(), s.size() * 4);
  auto enc = h.encode(w, base);
  ASSERT_TRUE(enc.ok()) << enc.status().to_string();
  EXPECT_EQ(enc->changed, moved + scales_moved);
  EXPECT_EQ(enc->routes_sparse, 2);
  auto app = h.apply(w, enc->stream_bytes, base);
  ASSERT_TRUE(app.ok()) << app.status().to_string();
  h.expect_engine_holds_cast(0);
  EXPECT_EQ(base + app->digest_delta, h.engine_digest());
  // The scales' payload: about 1 + 1 + 2 + 9 bits per element against 32 raw.
  df::RouteEntry e;
  std::memcpy(&e, h.stream() + df::kHeaderBytes + sizeof(df::RouteEntry), sizeof(e));
  EXPECT_LT(e.bytes, 4000 * 4 / 2);
}

// Several routes of one list, strided on both sides, an empty one among them: one stream.
TEST(DeltaHost, StridedRoutesAndAnEmptyOneInOneStream) {
  const std::vector<Case> cases = {
      {.rows = 10, .cols = 7, .src_stride = 9, .dst_stride = 20, .src_offset = 3, .dst_offset = 1},
      {.rows = 0, .cols = 5, .src_stride = 5, .dst_stride = 5},
      {.rows = 1,
       .cols = 5000,
       .src_dtype = DType::kFloat32,
       .src_stride = 5000,
       .dst_stride = 5000},
      {.rows = 129, .cols = 64, .src_stride = 128, .dst_stride = 64, .src_offset = 64}};
  Harness h(cases);
  h.options().chunk_log2 = 6;
  std::mt19937_64 rng(9);
  for (std::size_t i = 0; i < cases.size(); ++i)
    for (std::size_t e = 0; e < h.src(i).bytes.size() / static_cast<std::size_t>(h.src(i).esize);
         ++e)
      h.src(i).set(static_cast<std::int64_t>(e),
                   cases[i].src_dtype == DType::kFloat32
                       ? 0x3C000000u + static_cast<std::uint32_t>(rng() % 0x800000)
                       : random_bf16(rng));
  for (std::size_t i = 0; i < cases.size(); ++i)
    for (std::size_t e = 0; e < h.param(i).bytes.size() / 2; ++e)
      h.param(i).set(static_cast<std::int64_t>(e), 0x7777);
  const HostWorkers w = HostWorkers::inline_only();
  std::uint64_t base = h.full_refit(w);
  h.expect_engine_holds_cast(0x7777);
  for (std::size_t i : {0u, 3u}) move_bf16(h, i, cases[i], 0.1, 0.2, rng);
  for (int k = 0; k < 5000; k += 3) {  // fp32 moves that change the cast or not
    std::uint32_t v = h.src(2).get(k);
    h.src(2).set(k, v + 0x9000u);
  }
  auto enc = h.encode(w, base);
  ASSERT_TRUE(enc.ok()) << enc.status().to_string();
  EXPECT_EQ(enc->routes_unchanged, 1);  // the empty route
  auto app = h.apply(w, enc->stream_bytes, base);
  ASSERT_TRUE(app.ok()) << app.status().to_string();
  h.expect_engine_holds_cast(0x7777);
  EXPECT_EQ(base + app->digest_delta, h.engine_digest());
}

// Large lists over 4 workers and thousands of chunks: the same stream, byte for byte, as one
// thread, and the same engine afterwards.
TEST(DeltaHost, WorkerPoolGivesTheSameStreamAsOneThread) {
  const std::vector<Case> cases = {
      {.rows = 1531,
       .cols = 896,
       .src_dtype = DType::kFloat32,
       .src_stride = 896,
       .dst_stride = 896},
      {.rows = 896,
       .cols = 448,
       .src_dtype = DType::kFloat32,
       .src_stride = 896,
       .dst_stride = 448},
      {.rows = 1, .cols = 896, .src_dtype = DType::kFloat32, .src_stride = 896, .dst_stride = 896}};
  std::vector<std::vector<std::byte>> streams;
  for (int workers : {1, 4}) {
    Harness h(cases);
    h.options().chunk_log2 = 9;
    h.options().parallel_min_elements = 0;
    std::mt19937_64 rng(21);
    std::uniform_real_distribution<float> u(-0.1f, 0.1f);
    std::vector<std::vector<float>> master;
    for (std::size_t i = 0; i < cases.size(); ++i) {
      master.emplace_back(h.src(i).bytes.size() / 4);
      for (float& x : master.back()) x = u(rng);
      std::memcpy(h.src(i).data(), master.back().data(), master.back().size() * 4);
    }
    const HostWorkers w = workers == 1 ? HostWorkers::inline_only() : thread_workers(workers);
    const std::uint64_t base = h.full_refit(w);
    for (std::size_t i = 0; i < cases.size(); ++i) {
      for (float& x : master[i]) x += (rng() & 1 ? 3e-5f : -3e-5f);
      std::memcpy(h.src(i).data(), master[i].data(), master[i].size() * 4);
    }
    auto enc = h.encode(w, base);
    ASSERT_TRUE(enc.ok()) << enc.status().to_string();
    EXPECT_GT(enc->changed, 0);
    streams.emplace_back(h.stream(), h.stream() + enc->stream_bytes);
    auto app = h.apply(w, enc->stream_bytes, base);
    ASSERT_TRUE(app.ok()) << app.status().to_string();
    h.expect_engine_holds_cast(0);
  }
  ASSERT_EQ(streams[0].size(), streams[1].size());
  EXPECT_TRUE(streams[0] == streams[1]);
}

// A corrupted byte anywhere is refused before anything is written, naming the route (the
// tensor) or the header; a truncated stream too.
// refit.staged: an apply that logs what it writes, replayed onto a second copy of the base
// through the same routes with other destinations, leaves that copy byte for byte what the apply
// left: sparse chunks, a dense chunk and a dense route, strided rows, an empty route, and bytes
// outside the routes untouched. A log that is incomplete or points outside its routes is refused
// before anything is written.
TEST(DeltaHost, ALoggedApplyReplaysOntoACopyOfTheBase) {
  const std::vector<Case> cases = {
      {.rows = 10,
       .cols = 70,
       .src_stride = 90,
       .dst_stride = 80,
       .src_offset = 3,
       .dst_offset = 1},
      {.rows = 0, .cols = 5, .src_stride = 5, .dst_stride = 5},
      {.rows = 64, .cols = 64, .src_stride = 64, .dst_stride = 64},      // takes new values
      {.rows = 40, .cols = 100, .src_stride = 100, .dst_stride = 100}};  // and one chunk of it
  Harness h(cases);
  h.options().chunk_log2 = 7;
  h.options().parallel_min_elements = 1;
  std::mt19937_64 rng(11);
  for (std::size_t i = 0; i < cases.size(); ++i) {
    for (std::size_t e = 0; e < h.src(i).bytes.size() / 2; ++e)
      h.src(i).set(static_cast<std::int64_t>(e), random_bf16(rng));
    for (std::size_t e = 0; e < h.param(i).bytes.size() / 2; ++e)
      h.param(i).set(static_cast<std::int64_t>(e), 0x5555);
  }
  const HostWorkers w = thread_workers(3);
  const std::uint64_t base = h.full_refit(w);
  // The copy: the parameters as they are now, reached through the same routes.
  std::vector<Tensor> copy;
  std::vector<DeltaRoute> mirror = h.routes();
  for (std::size_t i = 0; i < cases.size(); ++i) copy.push_back(h.param(i));
  for (std::size_t i = 0; i < cases.size(); ++i) mirror[i].dst = copy[i].data();
  move_bf16(h, 0, cases[0], 0.05, 0.1, rng);
  for (std::int64_t e = 0; e < 64 * 64; ++e) h.src(2).set(e, random_bf16(rng));        // new values
  for (std::int64_t k = 0; k < 128; ++k) h.src(3).set(5 * 128 + k, random_bf16(rng));  // chunk 5
  move_bf16(h, 3, cases[3], 0.02, 0.0, rng);
  auto enc = h.encode(w, base);
  ASSERT_TRUE(enc.ok()) << enc.status().to_string();
  EXPECT_EQ(enc->routes_dense, 1) << "route 2";
  DeltaLog log;
  h.options().log = &log;
  auto app = h.apply(w, enc->stream_bytes, base);
  h.options().log = nullptr;
  ASSERT_TRUE(app.ok()) << app.status().to_string();
  ASSERT_TRUE(log.complete);
  int dense_runs = 0, sparse_runs = 0;
  for (const DeltaLog::Run& r : log.runs) (r.dense ? dense_runs : sparse_runs)++;
  EXPECT_GT(dense_runs, 32) << "route 2's pieces and route 3's chunk 5";
  EXPECT_GT(sparse_runs, 0);
  EXPECT_GE(log.elements(), app->changed);
  for (std::size_t i : {0u, 2u, 3u}) {
    EXPECT_FALSE(copy[i].bytes == h.param(i).bytes) << "route " << i;
  }

  const std::vector<std::vector<std::byte>> before = {copy[0].bytes, copy[2].bytes};
  DeltaLog bad = log;
  bad.runs.back().first = cases[3].rows * cases[3].cols;  // past its route
  auto refused = delta_replay_host(mirror, bad, h.options(), w);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("tensor-103"), std::string::npos) << refused.message();
  bad = log;
  bad.complete = false;
  EXPECT_EQ(delta_replay_host(mirror, bad, h.options(), w).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(copy[0].bytes == before[0] && copy[2].bytes == before[1]) << "nothing written";

  const Status replayed = delta_replay_host(mirror, log, h.options(), w);
  ASSERT_TRUE(replayed.ok()) << replayed.to_string();
  for (std::size_t i = 0; i < cases.size(); ++i)
    EXPECT_TRUE(copy[i].bytes == h.param(i).bytes) << "route " << i;
  h.expect_engine_holds_cast(0x5555);

  // A failed apply leaves its log incomplete.
  h.options().log = &log;
  auto failed = h.apply(w, enc->stream_bytes - 8, base);
  h.options().log = nullptr;
  ASSERT_FALSE(failed.ok());
  EXPECT_FALSE(log.complete);
}

TEST(DeltaHost, CorruptedStreamFailsNamingTheTensorAndWritesNothing) {
  const std::vector<Case> cases = {{.rows = 50, .cols = 100, .src_stride = 100, .dst_stride = 100},
                                   {.rows = 50, .cols = 100, .src_stride = 100, .dst_stride = 100}};
  Harness h(cases);
  h.options().chunk_log2 = 8;
  std::mt19937_64 rng(1);
  for (std::size_t i = 0; i < 2; ++i)
    for (std::int64_t e = 0; e < 5000; ++e) h.src(i).set(e, random_bf16(rng));
  const HostWorkers w = HostWorkers::inline_only();
  const std::uint64_t base = h.full_refit(w);
  move_bf16(h, 1, cases[1], 0.05, 0.1, rng);
  auto enc = h.encode(w, base);
  ASSERT_TRUE(enc.ok());
  df::RouteEntry e1;
  std::memcpy(&e1, h.stream() + df::kHeaderBytes + sizeof(df::RouteEntry), sizeof(e1));
  ASSERT_EQ(e1.mode, df::kSparse);
  const std::vector<std::byte> good(h.stream(), h.stream() + enc->stream_bytes);
  const std::vector<std::byte> before = h.param(1).bytes;
  for (std::uint64_t at : {e1.offset + 3, e1.offset + e1.bytes - 1, e1.offset + 40}) {
    std::memcpy(h.stream(), good.data(), good.size());
    h.stream()[at] ^= std::byte{0x10};
    auto app = h.apply(w, enc->stream_bytes, base);
    ASSERT_FALSE(app.ok());
    EXPECT_EQ(app.status().code(), StatusCode::kCorruption);
    EXPECT_NE(app.status().message().find("tensor-101"), std::string::npos)
        << app.status().message();
    EXPECT_NE(app.status().message().find("nothing was applied"), std::string::npos)
        << app.status().message();
    EXPECT_TRUE(h.param(1).bytes == before);
  }
  std::memcpy(h.stream(), good.data(), good.size());
  h.stream()[df::kHeaderBytes + 8] ^= std::byte{1};  // route 0's element count
  auto app = h.apply(w, enc->stream_bytes, base);
  ASSERT_FALSE(app.ok());
  EXPECT_NE(app.status().message().find("checksum"), std::string::npos) << app.status().message();
  std::memcpy(h.stream(), good.data(), good.size());
  auto truncated = h.apply(w, enc->stream_bytes - 8, base);
  ASSERT_FALSE(truncated.ok());
  EXPECT_TRUE(h.param(1).bytes == before);
  // Chunks other than the session's (its checksums intact) are refused before any work.
  std::memcpy(h.stream(), good.data(), good.size());
  h.options().chunk_log2 = 9;
  auto other = h.apply(w, enc->stream_bytes, base);
  h.options().chunk_log2 = 8;
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find("tensor-101"), std::string::npos)
      << other.status().message();
  EXPECT_NE(other.status().message().find("chunks of 2^8 elements, not the session's 2^9"),
            std::string::npos)
      << other.status().message();
  EXPECT_TRUE(h.param(1).bytes == before);
  // The intact stream still applies.
  ASSERT_TRUE(h.apply(w, enc->stream_bytes, base).ok());
  h.expect_engine_holds_cast(0);
}

// A stream applies only to its base: another digest is refused before any write; an engine whose
// bytes differ from the trainer's kept copy at a changed element (its digest claimed right) fails
// after the apply, naming the tensor.
TEST(DeltaHost, WrongBaseIsDetected) {
  const Case c{.rows = 40, .cols = 256, .src_stride = 256, .dst_stride = 256};
  Harness h({c});
  std::mt19937_64 rng(2);
  for (std::int64_t e = 0; e < 40 * 256; ++e) h.src(0).set(e, random_bf16(rng));
  const HostWorkers w = HostWorkers::inline_only();
  const std::uint64_t base = h.full_refit(w);
  h.src(0).set(77, df::add_ordered(h.src(0).get(77), 1, 16));
  move_bf16(h, 0, c, 0.02, 0.0, rng);
  auto enc = h.encode(w, base);
  ASSERT_TRUE(enc.ok());
  const std::vector<std::byte> before = h.param(0).bytes;
  auto other = h.apply(w, enc->stream_bytes, base ^ 1);
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find("exact base"), std::string::npos)
      << other.status().message();
  EXPECT_TRUE(h.param(0).bytes == before);
  // The engine's element 77 is not what the trainer sent last time.
  h.param(0).set(77, h.param(0).get(77) ^ 0x40);
  auto wrong = h.apply(w, enc->stream_bytes, base);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("tensor-100"), std::string::npos)
      << wrong.status().message();
  EXPECT_NE(wrong.status().message().find("base differs"), std::string::npos)
      << wrong.status().message();
}

// Peer access: the trainer patches the engine's memory in place with what changed.
TEST(DeltaHost, PatchWritesOnlyWhatChanged) {
  const Case c{
      .rows = 100, .cols = 300, .src_dtype = DType::kFloat32, .src_stride = 300, .dst_stride = 512};
  Harness h({c});
  std::mt19937_64 rng(4);
  std::uniform_real_distribution<float> u(-0.1f, 0.1f);
  std::vector<float> master(30000);
  for (float& x : master) x = u(rng);
  std::memcpy(h.src(0).data(), master.data(), master.size() * 4);
  const HostWorkers w = thread_workers(3);
  h.options().parallel_min_elements = 0;
  h.options().chunk_log2 = 7;
  const std::uint64_t base = h.full_refit(w);
  for (float& x : master) x *= 1.0001f;
  std::memcpy(h.src(0).data(), master.data(), master.size() * 4);
  // Mark an element outside every route and one unchanged element: patch must not write them.
  auto p = delta_patch_host(h.routes(), h.kept().data(), h.options(), w);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_GT(p->changed, 0);
  EXPECT_LT(p->changed, 30000);
  h.expect_engine_holds_cast(0);
  EXPECT_EQ(base + p->digest_delta, h.engine_digest());
  auto again = delta_patch_host(h.routes(), h.kept().data(), h.options(), w);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->changed, 0);
}

// The prediction behind `auto` against measured streams of +-1-ulp changes.
TEST(DeltaHost, PredictedSizeMatchesMeasured) {
  const Case c{.rows = 256, .cols = 4096, .src_stride = 4096, .dst_stride = 4096};
  for (double density : {0.01, 0.03, 0.1}) {
    Harness h({c});
    std::mt19937_64 rng(6);
    for (std::int64_t e = 0; e < c.rows * c.cols; ++e) h.src(0).set(e, random_bf16(rng));
    const HostWorkers w = HostWorkers::inline_only();
    const std::uint64_t base = h.full_refit(w);
    move_bf16(h, 0, c, density, 0.05, rng);
    auto enc = h.encode(w, base);
    ASSERT_TRUE(enc.ok());
    const std::int64_t predicted = predict_delta_bytes(c.rows * c.cols, 2, 1, density, 0.05, 13);
    EXPECT_NEAR(static_cast<double>(predicted), static_cast<double>(enc->stream_bytes),
                0.08 * static_cast<double>(enc->stream_bytes))
        << density;
  }
  // On a 1 Gbit/s link with free encode and apply, bf16 delta wins up to far past 20 %.
  EXPECT_GT(break_even_density(100'000'000, 2, 300, 125e6, 0, 0), 0.5);
  // With encode at 1e9 elements/s on a 400 Gbit/s link, full wins at every density.
  EXPECT_EQ(break_even_density(100'000'000, 2, 300, 50e9, 1e9, 1e9), 0.0);
  const DeltaChoice ch = choose_delta(100'000'000, 2, 300, 0.01, 125e6, 2e9, 1e9);
  EXPECT_TRUE(ch.use_delta);
  EXPECT_LT(ch.delta_bytes, ch.full_bytes / 50);
}

// Around the break-even density: changes of random size (so exceptions with wide magnitudes)
// from a third of the elements of the route's first half to all of them, the second half at 3 %.
// The first half's chunks switch from coded to raw somewhere in between while the route stays
// sparse; at the end every element changes and the route goes dense. Every step round-trips.
TEST(DeltaHost, BreakEvenDensitySwitchesChunksAndRoutesToRaw) {
  const Case c{.rows = 64, .cols = 1024, .src_stride = 1024, .dst_stride = 1024};
  Harness h({c});
  h.options().chunk_log2 = 10;
  std::mt19937_64 rng(12);
  for (std::int64_t i = 0; i < c.rows * c.cols; ++i) h.src(0).set(i, random_bf16(rng));
  const HostWorkers w = HostWorkers::inline_only();
  std::uint64_t base = h.full_refit(w);
  int coded_chunks = 0, raw_chunks = 0, dense_routes = 0;
  for (double density = 0.3; density <= 1.2001; density += 0.05) {
    SCOPED_TRACE(density);
    const bool all = density > 1.0001;  // the last steps: every element, across the route
    std::bernoulli_distribution pick(std::min(density, 1.0)), few(all ? 1.0 : 0.03);
    std::uniform_int_distribution<int> steps(1, 3000);
    const std::int64_t half = c.rows * c.cols / 2;
    for (std::int64_t i = 0; i < c.rows * c.cols; ++i)
      if (i < half ? pick(rng) : few(rng))
        h.src(0).set(i, df::add_ordered(h.src(0).get(i), (rng() & 1 ? 1 : -1) * steps(rng), 16));
    auto enc = h.encode(w, base);
    ASSERT_TRUE(enc.ok()) << enc.status().to_string();
    df::RouteEntry e;
    std::memcpy(&e, h.stream() + df::kHeaderBytes, sizeof(e));
    if (e.mode == df::kDense) {
      ++dense_routes;
    } else if (e.mode == df::kSparse) {
      for (std::uint64_t k = 0; k < df::chunk_count(e.elements, e.chunk_log2); ++k) {
        df::ChunkEntry ce;
        std::memcpy(&ce, h.stream() + e.offset + k * sizeof(ce), sizeof(ce));
        ((ce.info & df::kChunkDense) ? raw_chunks : coded_chunks) += df::info_count(ce.info) > 0;
      }
    }
    EXPECT_LE(enc->stream_bytes,
              df::align8(df::kHeaderBytes + sizeof(df::RouteEntry) + c.rows * c.cols * 2));
    auto app = h.apply(w, enc->stream_bytes, base);
    ASSERT_TRUE(app.ok()) << app.status().to_string();
    base += app->digest_delta;
    h.expect_engine_holds_cast(0);
  }
  EXPECT_GT(coded_chunks, 0);
  EXPECT_GT(raw_chunks, 0);
  EXPECT_GT(dense_routes, 0);
}

// The same through the CPU data plane's methods and its worker pool.
TEST(DeltaHost, CpuPlaneMethodsRunOnItsWorkers) {
  Config cfg;
  auto plane = make_data_plane(cfg, 0);
  ASSERT_TRUE(plane.ok()) << plane.status().to_string();
  const std::vector<Case> cases = {{.rows = 700,
                                    .cols = 896,
                                    .src_dtype = DType::kFloat32,
                                    .src_stride = 896,
                                    .dst_stride = 896},
                                   {.rows = 300,
                                    .cols = 448,
                                    .src_dtype = DType::kFloat32,
                                    .src_stride = 896,
                                    .dst_stride = 448}};
  Harness h(cases);
  h.options().parallel_min_elements = 0;
  h.options().chunk_log2 = 8;
  std::mt19937_64 rng(13);
  std::uniform_real_distribution<float> u(-0.1f, 0.1f);
  std::vector<std::vector<float>> master;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    master.emplace_back(h.src(i).bytes.size() / 4);
    for (float& x : master.back()) x = u(rng);
    std::memcpy(h.src(i).data(), master.back().data(), master.back().size() * 4);
  }
  std::uint64_t base = h.full_refit(HostWorkers::inline_only());
  for (int step = 0; step < 3; ++step) {
    for (std::size_t i = 0; i < cases.size(); ++i) {
      for (float& x : master[i]) x += (rng() & 1 ? 2e-5f : -2e-5f);
      std::memcpy(h.src(i).data(), master[i].data(), master[i].size() * 4);
    }
    auto enc = (*plane)->delta_encode(h.routes(), h.kept().data(), h.stream(),
                                      delta_stream_capacity(h.routes()), base, h.options());
    ASSERT_TRUE(enc.ok()) << enc.status().to_string();
    EXPECT_GT(enc->changed, 0);
    auto app = (*plane)->delta_apply(h.routes(), h.stream(), enc->stream_bytes, base, h.options());
    ASSERT_TRUE(app.ok()) << app.status().to_string();
    base += app->digest_delta;
    h.expect_engine_holds_cast(0);
    auto held = (*plane)->delta_digest(h.routes());
    ASSERT_TRUE(held.ok());
    EXPECT_EQ(*held, base);
  }
  auto cap = (*plane)->delta_capture(h.routes(), h.kept().data(), h.options());
  ASSERT_TRUE(cap.ok());
  EXPECT_EQ(cap->digest_delta, base);
  auto patch = (*plane)->delta_patch(h.routes(), h.kept().data(), h.options());
  ASSERT_TRUE(patch.ok());
  EXPECT_EQ(patch->changed, 0);
}

TEST(DeltaHost, BadListsAreRefusedNamingTheRoute) {
  Harness h({Case{.rows = 2, .cols = 3, .src_stride = 3, .dst_stride = 3}});
  h.routes()[0].kept = 8;
  auto r = h.encode(HostWorkers::inline_only(), 0);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tensor-100"), std::string::npos);
  h.routes()[0].kept = 0;
  h.options().chunk_log2 = 3;
  EXPECT_FALSE(h.encode(HostWorkers::inline_only(), 0).ok());
  h.options().chunk_log2 = 8;
  h.options().dense_ratio = 1.5;  // a chunk could code longer than its raw bytes
  auto ratio = h.encode(HostWorkers::inline_only(), 0);
  ASSERT_FALSE(ratio.ok());
  EXPECT_NE(ratio.status().message().find("dense_ratio 1.5"), std::string::npos)
      << ratio.status().message();
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

// refit.delta auto's prediction per pair: a delta where its bytes over the link plus its encode
// beat the full refit; full past the break-even density; and "never" where the encode alone
// takes 1.5 x the full refit or longer (the same device, or a link as fast as memory), whatever
// the density: the pair then stops keeping a copy.
TEST(DeltaAuto, PredictsDeltaFullOrNeverFromTheMeasuredRates) {
  // qwen3-8b's one pair across a 10 Gbit/s link: 16.4 GB in full, 0.15 GB as a delta, encoded
  // at 1.7e11 elements/s.
  AutoMeasures slow{.elements = 8'190'735'360,
                    .full_bytes = 16'381'470'720,
                    .last_wire_bytes = 153'209'336,
                    .encode_elems_per_s = 1.7e11,
                    .link_bytes_per_s = 1.25e9};
  AutoPrediction p = predict_auto(slow);
  EXPECT_EQ(p.choice, AutoChoice::kDelta);
  EXPECT_NEAR(p.full_s, 13.1, 0.05);
  EXPECT_NEAR(p.delta_s, 0.123 + 0.048, 0.005);
  // Past break-even: a delta as large as the full refit.
  AutoMeasures dense = slow;
  dense.last_wire_bytes = slow.full_bytes;
  EXPECT_EQ(predict_auto(dense).choice, AutoChoice::kFull);
  // The same pair on one GPU: its full refit takes 13 ms at 1.26 TB/s, the encode alone 48 ms.
  AutoMeasures local = slow;
  local.link_bytes_per_s = 1.26e12;
  p = predict_auto(local);
  EXPECT_EQ(p.choice, AutoChoice::kNever);
  EXPECT_GT(p.encode_s, p.full_s);
  // An encode only a little longer than the full refit (one slow sample) is not "never".
  AutoMeasures close = local;
  close.encode_elems_per_s = static_cast<double>(close.elements) / (1.2 * p.full_s);
  EXPECT_EQ(predict_auto(close).choice, AutoChoice::kFull);
  // Whatever the density: even a delta of nothing.
  local.last_wire_bytes = 0;
  EXPECT_EQ(predict_auto(local).choice, AutoChoice::kNever);
  // No encode measured yet: never "never".
  local.encode_elems_per_s = 0;
  EXPECT_EQ(predict_auto(local).choice, AutoChoice::kDelta);
}

}  // namespace
}  // namespace refit
