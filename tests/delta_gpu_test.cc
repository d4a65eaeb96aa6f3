// The delta kernels of the CUDA plane (device/delta_kernels.h) against the CPU plane's loops
// (delta/delta_cpu.h): the same route lists on both planes give the same stream byte for byte,
// the same kept copy and digests, and the GPU's apply leaves the engine's parameters where the
// CPU's does; corrupted streams and wrong bases are refused on the GPU too, naming the route.
// Needs a GPU (runs on the device machine: bench/gpu/delta_gpu.sh); skips elsewhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "common/convert.h"
#include "delta/delta.h"
#include "delta/delta_cpu.h"
#include "delta/format.h"
#include "device/device.h"
#include "plane/data_plane.h"
#include "refit/config.h"
#include "test_util.h"

namespace refit {
namespace {

namespace df = delta_format;

struct Shape {
  std::int64_t rows, cols, src_stride, dst_stride, src_offset, dst_offset;
  DType src, wire;
};

// One list of routes living twice: on the CPU plane and on the CUDA plane, same bytes.
class Twin {
 public:
  Twin(DataPlane& cpu, DataPlane& gpu, const std::vector<Shape>& shapes, int chunk_log2)
      : cpu_(cpu), gpu_(gpu), shapes_(shapes) {
    std::uint32_t tag = 7;
    for (const Shape& s : shapes) {
      DeltaRoute r;
      r.block = {.src_offset = s.src_offset,
                 .src_stride = s.src_stride,
                 .dst_offset = s.dst_offset,
                 .dst_stride = s.dst_stride,
                 .rows = s.rows,
                 .cols = s.cols};
      r.src_dtype = s.src;
      r.wire_dtype = s.wire;
      r.key = 5000 + routes_[0].size() * 77777;
      r.key_stride = s.dst_stride;
      r.tag = tag++;
      routes_[0].push_back(r);
      src_bytes_.push_back(static_cast<std::size_t>(
                               s.src_offset + std::max<std::int64_t>(s.rows, 1) * s.src_stride) *
                           dtype_size(s.src));
      dst_bytes_.push_back(static_cast<std::size_t>(
                               s.dst_offset + std::max<std::int64_t>(s.rows, 1) * s.dst_stride) *
                           dtype_size(s.wire));
    }
    kept_bytes_ = static_cast<std::size_t>(assign_kept_offsets(routes_[0]));
    routes_[1] = routes_[0];
    capacity_ = delta_stream_capacity(routes_[0]);
    for (int p = 0; p < 2; ++p) {
      DataPlane& plane = p == 0 ? cpu_ : gpu_;
      for (std::size_t i = 0; i < shapes.size(); ++i) {
        src_[p].push_back(std::move(plane.allocate(src_bytes_[i] + 16)).value());
        dst_[p].push_back(std::move(plane.allocate(dst_bytes_[i] + 16)).value());
        routes_[p][i].src = src_[p][i]->data();
        routes_[p][i].dst = dst_[p][i]->data();
      }
      kept_[p] = std::move(plane.allocate(kept_bytes_ + 16)).value();
      out_[p] = std::move(plane.allocate(capacity_ + 16)).value();
    }
    options_.chunk_log2 = chunk_log2;
    options_.parallel_min_elements = 0;
    options_.describe = [](std::uint32_t tag) { return "tensor-" + std::to_string(tag); };
  }

  DataPlane& plane(int p) { return p == 0 ? cpu_ : gpu_; }
  std::vector<DeltaRoute>& routes(int p) { return routes_[p]; }
  DeltaOptions& options() { return options_; }
  PlaneBuffer& stream(int p) { return *out_[p]; }
  std::size_t capacity() const { return capacity_; }
  std::size_t kept_bytes() const { return kept_bytes_; }
  std::byte* kept(int p) { return kept_[p]->data(); }

  // Host copies of route i's source, to change and write to both planes.
  std::vector<std::byte>& host_src(std::size_t i) {
    if (host_src_.size() < shapes_.size()) host_src_.resize(shapes_.size());
    host_src_[i].resize(src_bytes_[i]);
    return host_src_[i];
  }
  void push_sources() {
    for (std::size_t i = 0; i < shapes_.size(); ++i)
      for (int p = 0; p < 2; ++p)
        ASSERT_TRUE(plane(p).write(src_[p][i]->data(), host_src_[i].data(), src_bytes_[i]).ok());
  }
  std::vector<std::byte> read(int p, PlaneBuffer& b, std::size_t n) {
    std::vector<std::byte> v(n);
    EXPECT_TRUE(plane(p).read(v.data(), b.data(), n).ok());
    return v;
  }
  void expect_same_params() {
    for (std::size_t i = 0; i < shapes_.size(); ++i)
      EXPECT_TRUE(read(0, *dst_[0][i], dst_bytes_[i]) == read(1, *dst_[1][i], dst_bytes_[i]))
          << "route " << i;
  }
  void expect_same_kept() {
    EXPECT_TRUE(read(0, *kept_[0], kept_bytes_) == read(1, *kept_[1], kept_bytes_));
  }
  std::vector<std::byte> params(int p, std::size_t i) {
    return read(p, *dst_[p][i], dst_bytes_[i]);
  }
  // The full refit's capture on both planes: each plane's kept copy becomes the cast of its source;
  // base[p] is the digest it returns.
  void capture(std::uint64_t (&base)[2]) {
    for (int p = 0; p < 2; ++p) {
      auto cap = plane(p).delta_capture(routes(p), kept(p), options());
      ASSERT_TRUE(cap.ok()) << cap.status().to_string();
      base[p] = cap->digest_delta;
    }
  }

 private:
  DataPlane& cpu_;
  DataPlane& gpu_;
  std::vector<Shape> shapes_;
  std::vector<DeltaRoute> routes_[2];
  std::vector<std::size_t> src_bytes_, dst_bytes_;
  std::size_t kept_bytes_ = 0, capacity_ = 0;
  std::vector<std::unique_ptr<PlaneBuffer>> src_[2], dst_[2];
  std::unique_ptr<PlaneBuffer> kept_[2], out_[2];
  std::vector<std::vector<std::byte>> host_src_;
  DeltaOptions options_;
};

std::unique_ptr<DataPlane> plane_of(Device d) {
  Config cfg;
  cfg.device = d;
  auto p = make_data_plane(cfg, 0);
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  return p.ok() ? std::move(p).value() : nullptr;
}

// Fills route i's source with values of its dtype: weights of magnitude ~0.02 (float32 / 16-bit),
// finite codes (fp8), scales near 2^-10 (float32 sent as float32).
void fill_source(Twin& t, std::size_t i, const Shape& s, std::mt19937_64& rng) {
  std::vector<std::byte>& b = t.host_src(i);
  const std::size_t n = b.size() / dtype_size(s.src);
  std::normal_distribution<float> w(0.0f, 0.02f);
  for (std::size_t k = 0; k < n; ++k) {
    if (s.src == DType::kFloat8E4M3) {
      b[k] = static_cast<std::byte>(rng() & 0x7E);
    } else if (s.src == DType::kFloat32) {
      const float v = s.wire == DType::kFloat32
                          ? std::ldexp(1.0f + static_cast<float>(rng() % 1000) / 1000, -10)
                          : w(rng);
      std::memcpy(b.data() + 4 * k, &v, 4);
    } else {
      const std::uint16_t v = f32_to_bf16(w(rng));
      std::memcpy(b.data() + 2 * k, &v, 2);
    }
  }
}

// Moves a fraction of route i's source: 16-bit and fp8 sources by +-1 (sometimes a few) in
// ordered space, float32 by a relative 1e-5 (which moves the bf16 cast of some).
void move_source(Twin& t, std::size_t i, const Shape& s, double density, std::mt19937_64& rng) {
  std::vector<std::byte>& b = t.host_src(i);
  const std::size_t es = dtype_size(s.src), n = b.size() / es;
  std::bernoulli_distribution pick(density), big(0.1);
  for (std::size_t k = 0; k < n; ++k) {
    if (!pick(rng)) continue;
    std::uint32_t v = 0;
    std::memcpy(&v, b.data() + k * es, es);
    if (s.src == DType::kFloat32 && s.wire != DType::kFloat32) {
      float f;
      std::memcpy(&f, &v, 4);
      f *= (rng() & 1) ? 1.004f : 0.996f;
      std::memcpy(&v, &f, 4);
    } else {
      const std::int64_t d =
          (big(rng) ? 2 + static_cast<std::int64_t>(rng() % 30) : 1) * ((rng() & 1) ? 1 : -1);
      v = df::add_ordered(v, d, static_cast<int>(8 * es));
      if (s.src == DType::kFloat8E4M3 && (v & 0x7F) == 0x7F) v ^= 1;  // keep codes finite
    }
    std::memcpy(b.data() + k * es, &v, es);
  }
}

const std::vector<Shape> kShapes = {
    {.rows = 300,
     .cols = 896,
     .src_stride = 896,
     .dst_stride = 896,
     .src_offset = 0,
     .dst_offset = 0,
     .src = DType::kFloat32,
     .wire = DType::kBFloat16},
    {.rows = 512,
     .cols = 448,
     .src_stride = 896,
     .dst_stride = 448,
     .src_offset = 448,
     .dst_offset = 0,
     .src = DType::kFloat32,
     .wire = DType::kBFloat16},
    {.rows = 0,
     .cols = 8,
     .src_stride = 8,
     .dst_stride = 8,
     .src_offset = 0,
     .dst_offset = 0,
     .src = DType::kBFloat16,
     .wire = DType::kBFloat16},
    {.rows = 77,
     .cols = 1000,
     .src_stride = 1003,
     .dst_stride = 1500,
     .src_offset = 2,
     .dst_offset = 5,
     .src = DType::kBFloat16,
     .wire = DType::kBFloat16},
    {.rows = 128,
     .cols = 512,
     .src_stride = 512,
     .dst_stride = 512,
     .src_offset = 0,
     .dst_offset = 0,
     .src = DType::kFloat8E4M3,
     .wire = DType::kFloat8E4M3},
    {.rows = 3,
     .cols = 1111,
     .src_stride = 1111,
     .dst_stride = 1111,
     .src_offset = 0,
     .dst_offset = 0,
     .src = DType::kFloat32,
     .wire = DType::kFloat32},
    {.rows = 1,
     .cols = 5,
     .src_stride = 5,
     .dst_stride = 5,
     .src_offset = 0,
     .dst_offset = 0,
     .src = DType::kFloat32,
     .wire = DType::kBFloat16},
};

// The most data bytes of one sparse chunk in a stream (format.h): past 2 KB the CUDA encode codes
// the chunk with a block (pack_kernel) instead of a warp (pack_warp_kernel).
std::uint64_t largest_sparse_chunk(const std::vector<std::byte>& stream) {
  df::StreamHeader h;
  std::memcpy(&h, stream.data(), sizeof h);
  std::uint64_t most = 0;
  for (std::uint32_t i = 0; i < h.routes; ++i) {
    df::RouteEntry e;
    std::memcpy(&e, stream.data() + df::kHeaderBytes + i * sizeof e, sizeof e);
    if (e.mode != df::kSparse) continue;
    const std::uint64_t nchunks = df::chunk_count(e.elements, e.chunk_log2);
    const std::uint64_t data = e.bytes - nchunks * sizeof(df::ChunkEntry);
    std::vector<df::ChunkEntry> table(nchunks);
    std::memcpy(table.data(), stream.data() + e.offset, nchunks * sizeof(df::ChunkEntry));
    for (std::uint64_t k = 0; k < nchunks; ++k) {  // (a chunk without data ends where it starts)
      if ((table[k].info & df::kChunkDense) != 0) continue;
      const std::uint64_t end = k + 1 < nchunks ? table[k + 1].offset : data;
      most = std::max<std::uint64_t>(most, end - table[k].offset);
    }
  }
  return most;
}

TEST(DeltaGpu, SameStreamsAndEnginesAsTheCpuAtEveryDensity) {
  REFIT_REQUIRE_GPU();
  auto cpu = plane_of(Device::kCpu);
  auto gpu = plane_of(Device::kCuda);
  ASSERT_TRUE(cpu && gpu);
  for (int chunk_log2 : {10, 13}) {
    Twin t(*cpu, *gpu, kShapes, chunk_log2);
    std::mt19937_64 rng(static_cast<std::uint64_t>(chunk_log2));
    for (std::size_t i = 0; i < kShapes.size(); ++i) fill_source(t, i, kShapes[i], rng);
    t.push_sources();
    // The full refit: capture writes the kept copy; the parameters get the cast below (a patch
    // against an all-zero kept copy).
    std::uint64_t base[2];
    ASSERT_NO_FATAL_FAILURE(t.capture(base));
    EXPECT_EQ(base[0], base[1]);
    t.expect_same_kept();
    // The parameters: patch from zero (a patch writes every element that differs from the kept
    // copy, and the kept copy is the cast now, so patch against a zeroed kept copy).
    for (int p = 0; p < 2; ++p) {
      auto zero_kept = t.plane(p).allocate(t.kept_bytes() + 16);
      ASSERT_TRUE(zero_kept.ok());
      auto patched = t.plane(p).delta_patch(t.routes(p), (*zero_kept)->data(), t.options());
      ASSERT_TRUE(patched.ok()) << patched.status().to_string();
      EXPECT_GT(patched->changed, 0);
      auto held = t.plane(p).delta_digest(t.routes(p));
      ASSERT_TRUE(held.ok());
      EXPECT_EQ(*held, base[p]);
    }
    t.expect_same_params();
    std::uint64_t largest = 0;  // of a sparse chunk, over the densities
    for (double density : {0.0, 0.00001, 0.01, 0.05, 0.3, 0.5, 1.0}) {
      SCOPED_TRACE(::testing::Message() << "chunk 2^" << chunk_log2 << " density " << density);
      for (std::size_t i = 0; i < kShapes.size(); ++i) move_source(t, i, kShapes[i], density, rng);
      t.push_sources();
      DeltaResult enc[2];
      for (int p = 0; p < 2; ++p) {
        auto e = t.plane(p).delta_encode(t.routes(p), t.kept(p), t.stream(p).data(), t.capacity(),
                                         base[p], t.options());
        ASSERT_TRUE(e.ok()) << e.status().to_string();
        enc[p] = *e;
      }
      EXPECT_EQ(enc[0].stream_bytes, enc[1].stream_bytes);
      EXPECT_GT(enc[0].elements, 0);  // what refit.delta: auto measures its density against
      EXPECT_EQ(enc[0].elements, enc[1].elements);
      EXPECT_EQ(enc[0].changed, enc[1].changed);
      EXPECT_EQ(enc[0].digest_delta, enc[1].digest_delta);
      EXPECT_EQ(enc[0].routes_dense, enc[1].routes_dense);
      const std::vector<std::byte> cpu_stream = t.read(0, t.stream(0), enc[0].stream_bytes);
      EXPECT_TRUE(cpu_stream == t.read(1, t.stream(1), enc[1].stream_bytes))
          << "the CUDA stream differs from the CPU's";
      largest = std::max(largest, largest_sparse_chunk(cpu_stream));
      t.expect_same_kept();
      for (int p = 0; p < 2; ++p) {
        auto a = t.plane(p).delta_apply(t.routes(p), t.stream(p).data(), enc[p].stream_bytes,
                                        base[p], t.options());
        ASSERT_TRUE(a.ok()) << a.status().to_string();
        EXPECT_EQ(a->changed, enc[p].changed);
        EXPECT_EQ(a->digest_delta, enc[p].digest_delta);
        base[p] += a->digest_delta;
        auto held = t.plane(p).delta_digest(t.routes(p));
        ASSERT_TRUE(held.ok());
        EXPECT_EQ(*held, base[p]);
      }
      t.expect_same_params();
    }
    // Both of the CUDA encode's coders ran: a warp's for the small chunks, and, with the largest
    // chunks at 2^13 elements, a block's.
    if (chunk_log2 == 13) {
      EXPECT_GT(largest, 2048u);
    }
  }
}

TEST(DeltaGpu, CorruptedStreamAndWrongBaseAreRefusedNamingTheTensor) {
  REFIT_REQUIRE_GPU();
  auto cpu = plane_of(Device::kCpu);
  auto gpu = plane_of(Device::kCuda);
  ASSERT_TRUE(cpu && gpu);
  Twin t(*cpu, *gpu, kShapes, 13);
  std::mt19937_64 rng(3);
  for (std::size_t i = 0; i < kShapes.size(); ++i) fill_source(t, i, kShapes[i], rng);
  t.push_sources();
  auto cap = gpu->delta_capture(t.routes(1), t.kept(1), t.options());
  ASSERT_TRUE(cap.ok());
  for (std::size_t i = 0; i < kShapes.size(); ++i) move_source(t, i, kShapes[i], 0.02, rng);
  t.push_sources();
  auto e = gpu->delta_encode(t.routes(1), t.kept(1), t.stream(1).data(), t.capacity(),
                             cap->digest_delta, t.options());
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  const std::vector<std::byte> good = t.read(1, t.stream(1), e->stream_bytes);
  const std::vector<std::byte> before = t.params(1, 3);
  df::RouteEntry r3;
  std::memcpy(&r3, good.data() + df::kHeaderBytes + 3 * sizeof(df::RouteEntry), sizeof(r3));
  ASSERT_EQ(r3.mode, df::kSparse);
  ASSERT_TRUE(gpu->diagnostics()->corrupt_byte(t.stream(1).data() + r3.offset + r3.bytes / 2).ok());
  auto bad = gpu->delta_apply(t.routes(1), t.stream(1).data(), e->stream_bytes, cap->digest_delta,
                              t.options());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("tensor-10"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("nothing was applied"), std::string::npos)
      << bad.status().message();
  EXPECT_TRUE(t.params(1, 3) == before);
  ASSERT_TRUE(gpu->write(t.stream(1).data(), good.data(), good.size()).ok());
  auto other = gpu->delta_apply(t.routes(1), t.stream(1).data(), e->stream_bytes,
                                cap->digest_delta + 1, t.options());
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find("exact base"), std::string::npos)
      << other.status().message();
  // The engine's bytes differ from the base where a change lands: detected after the apply.
  auto ok = gpu->delta_apply(t.routes(1), t.stream(1).data(), e->stream_bytes, cap->digest_delta,
                             t.options());
  EXPECT_FALSE(ok.ok()) << "the parameters were never set to the base (all zero): every changed "
                           "element's old value differs";
  if (!ok.ok()) {
    EXPECT_NE(ok.status().message().find("base differs"), std::string::npos)
        << ok.status().message();
  }
}

// Codes that are malformed although every checksum holds (a broken encoder, or bytes forged with
// their checksums) are refused on both planes naming the tensor, and nothing outside the chunk
// that holds them is written. Only chunk 1 of route 0 changes; its codes are broken two ways:
// every bit of its Elias-Fano upper array cleared (too few positions: nothing of it is written),
// and every position's low bits set (positions repeat).
TEST(DeltaGpu, MalformedCodesUnderValidChecksumsAreRefusedInsideTheirChunk) {
  REFIT_REQUIRE_GPU();
  auto cpu = plane_of(Device::kCpu);
  auto gpu = plane_of(Device::kCuda);
  ASSERT_TRUE(cpu && gpu);
  const std::vector<Shape> shapes = {kShapes[0]};
  constexpr int kLog2 = 13;
  Twin t(*cpu, *gpu, shapes, kLog2);
  std::mt19937_64 rng(11);
  fill_source(t, 0, shapes[0], rng);
  t.push_sources();
  std::uint64_t base[2];
  ASSERT_NO_FATAL_FAILURE(t.capture(base));
  const std::size_t chunk_first = std::size_t{1} << kLog2, chunk_elems = chunk_first;
  std::vector<std::byte>& src = t.host_src(0);
  for (std::size_t k = chunk_first; k < chunk_first + chunk_elems; k += 7) {
    float f;
    std::memcpy(&f, src.data() + 4 * k, 4);
    f *= 1.004f;
    std::memcpy(src.data() + 4 * k, &f, 4);
  }
  t.push_sources();
  auto enc = gpu->delta_encode(t.routes(1), t.kept(1), t.stream(1).data(), t.capacity(), base[1],
                               t.options());
  ASSERT_TRUE(enc.ok()) << enc.status().to_string();
  const std::vector<std::byte> good = t.read(1, t.stream(1), enc->stream_bytes);
  df::RouteEntry entry;
  std::memcpy(&entry, good.data() + df::kHeaderBytes, sizeof(entry));
  ASSERT_EQ(entry.mode, df::kSparse);
  const auto* payload = reinterpret_cast<const unsigned char*>(good.data() + entry.offset);
  const std::uint64_t nchunks = df::chunk_count(entry.elements, kLog2);
  const df::ChunkView view =
      df::check_chunk(payload, entry.bytes, nchunks, 1, static_cast<std::uint32_t>(chunk_elems), 2);
  ASSERT_EQ(view.error, df::kChunkOk);
  ASSERT_FALSE(view.dense);
  ASSERT_GT(view.n, 100u);
  ASSERT_GT(view.f.L, 0);
  ASSERT_EQ(
      df::check_chunk(payload, entry.bytes, nchunks, 0, static_cast<std::uint32_t>(chunk_elems), 2)
          .n,
      0u);
  const std::uint64_t data = entry.offset + nchunks * sizeof(df::ChunkEntry) + view.offset;
  const std::uint64_t upper_bits =
      df::ef_bits(view.n, chunk_elems, view.f.L) - static_cast<std::uint64_t>(view.n) * view.f.L;
  auto set_bits = [&](std::vector<std::byte>& s, std::uint64_t from, std::uint64_t count, bool on) {
    for (std::uint64_t b = from; b < from + count; ++b) {
      auto& byte = s[data + b / 8];
      const auto mask = static_cast<std::byte>(1u << (b % 8));
      byte = on ? (byte | mask) : (byte & ~mask);
    }
  };
  // Re-signs a stream: the route's payload checksum, then the header's.
  auto reseal = [](std::vector<std::byte>& s) {
    df::RouteEntry e;
    std::memcpy(&e, s.data() + df::kHeaderBytes, sizeof(e));
    e.payload_checksum = delta_words_checksum(s.data() + e.offset, e.bytes, 0);
    std::memcpy(s.data() + df::kHeaderBytes, &e, sizeof(e));
    df::StreamHeader h;
    std::memcpy(&h, s.data(), sizeof(h));
    h.header_checksum = 0;
    std::memcpy(s.data(), &h, sizeof(h));
    h.header_checksum = delta_words_checksum(s.data(), df::kHeaderChecksumWords * 4, 0) +
                        delta_words_checksum(s.data() + df::kHeaderBytes,
                                             sizeof(df::RouteEntry) * h.routes, df::kDirectoryKey0);
    std::memcpy(s.data(), &h, sizeof(h));
  };
  const std::size_t lo = 2 * chunk_first, hi = lo + 2 * chunk_elems;  // chunk 1's bytes at dst
  for (const bool clear_upper : {true, false}) {
    SCOPED_TRACE(clear_upper ? "upper array cleared" : "low bits all set");
    std::vector<std::byte> bad = good;
    if (clear_upper)
      set_bits(bad, view.f.high, upper_bits, false);
    else
      set_bits(bad, view.f.low, static_cast<std::uint64_t>(view.n) * view.f.L, true);
    reseal(bad);
    for (int p = 0; p < 2; ++p) {
      SCOPED_TRACE(p == 0 ? "cpu" : "cuda");
      ASSERT_TRUE(t.plane(p).write(t.stream(p).data(), bad.data(), bad.size()).ok());
      const std::vector<std::byte> before = t.params(p, 0);
      auto app =
          t.plane(p).delta_apply(t.routes(p), t.stream(p).data(), bad.size(), base[p], t.options());
      ASSERT_FALSE(app.ok());
      EXPECT_EQ(app.status().code(), StatusCode::kCorruption);
      EXPECT_NE(app.status().message().find("tensor-7"), std::string::npos)
          << app.status().message();
      EXPECT_NE(app.status().message().find("malformed"), std::string::npos)
          << app.status().message();
      const std::vector<std::byte> after = t.params(p, 0);
      ASSERT_EQ(after.size(), before.size());
      EXPECT_TRUE(std::equal(after.begin(), after.begin() + lo, before.begin()));
      EXPECT_TRUE(std::equal(after.begin() + hi, after.end(), before.begin() + hi));
      if (clear_upper) {
        EXPECT_TRUE(after == before) << "no position decoded, none written";
      }
    }
  }
}

TEST(DeltaGpu, LargeListSpreadsOverTheGrid) {
  REFIT_REQUIRE_GPU();
  auto cpu = plane_of(Device::kCpu);
  auto gpu = plane_of(Device::kCuda);
  ASSERT_TRUE(cpu && gpu);
  const std::vector<Shape> big = {{.rows = 151936 / 8,
                                   .cols = 896,
                                   .src_stride = 896,
                                   .dst_stride = 896,
                                   .src_offset = 0,
                                   .dst_offset = 0,
                                   .src = DType::kFloat32,
                                   .wire = DType::kBFloat16},
                                  {.rows = 4864,
                                   .cols = 896,
                                   .src_stride = 896,
                                   .dst_stride = 896,
                                   .src_offset = 0,
                                   .dst_offset = 0,
                                   .src = DType::kFloat32,
                                   .wire = DType::kBFloat16}};
  Twin t(*cpu, *gpu, big, 13);
  std::mt19937_64 rng(8);
  for (std::size_t i = 0; i < big.size(); ++i) fill_source(t, i, big[i], rng);
  t.push_sources();
  std::uint64_t base[2];
  for (int p = 0; p < 2; ++p)
    base[p] = t.plane(p).delta_capture(t.routes(p), t.kept(p), t.options())->digest_delta;
  ASSERT_EQ(base[0], base[1]);
  for (std::size_t i = 0; i < big.size(); ++i) move_source(t, i, big[i], 0.03, rng);
  t.push_sources();
  std::size_t bytes[2];
  for (int p = 0; p < 2; ++p) {
    auto e = t.plane(p).delta_encode(t.routes(p), t.kept(p), t.stream(p).data(), t.capacity(),
                                     base[p], t.options());
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    bytes[p] = e->stream_bytes;
  }
  ASSERT_EQ(bytes[0], bytes[1]);
  EXPECT_TRUE(t.read(0, t.stream(0), bytes[0]) == t.read(1, t.stream(1), bytes[1]));
  t.expect_same_kept();
}

}  // namespace
}  // namespace refit
