// GPU copy/cast and weights kernels (device/copy_kernels.h) against the CPU code they mirror:
// common/convert.h and weights/weights.h, bit for bit. Skips without a GPU (and in CPU builds,
// where it checks that launches report kUnsupported instead).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "common/convert.h"
#include "device/copy_kernels.h"
#include "device/device.h"
#include "engine/engine_layout.h"
#include "plane/data_plane.h"
#include "test_util.h"
#include "weights/weights.h"

namespace refit {
namespace {

constexpr DType kAll[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3};

// Random element bits with the special values of each format mixed in: NaNs (both signs,
// signalling and quiet payloads), infinities, zeros, subnormals, the largest finites and
// rounding ties.
std::vector<std::byte> random_elements(DType dt, std::size_t n, std::mt19937_64& rng) {
  const std::size_t es = dtype_size(dt);
  std::vector<std::byte> out(n * es);
  std::vector<std::uint32_t> specials;
  switch (dt) {
    case DType::kFloat32:
      specials = {0x7FC00000u, 0xFFC00001u, 0x7F800001u, 0xFF812345u, 0x7F800000u,
                  0xFF800000u, 0x00000000u, 0x80000000u, 0x00000001u, 0x807FFFFFu,
                  0x7F7FFFFFu, 0x3F808000u, 0x3F818000u, 0x477FF000u, 0x477FEFFFu,
                  0x43E00000u, 0x43DFFFFFu, 0x3C800000u, 0x3B000000u, 0x33800000u};
      break;
    case DType::kBFloat16:
    case DType::kFloat16:
      specials = {0x7FC0, 0xFFC1, 0x7F81, 0x7F80, 0xFF80, 0x7C00, 0xFC00, 0x7E00,
                  0x7C01, 0x0000, 0x8000, 0x0001, 0x83FF, 0x7BFF, 0x7F7F};
      break;
    case DType::kFloat8E4M3:
      specials = {0x7F, 0xFF, 0x7E, 0xFE, 0x00, 0x80, 0x01, 0x87, 0x08};
      break;
  }
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t v = static_cast<std::uint32_t>(rng());
    if (rng() % 8 == 0) v = specials[rng() % specials.size()];
    std::memcpy(out.data() + i * es, &v, es);  // little endian: the low bytes
  }
  return out;
}

struct GpuBuffer {
  DeviceBuffer buf;
  explicit GpuBuffer(std::size_t bytes) {
    auto b = DeviceBuffer::allocate(bytes, 0);
    EXPECT_TRUE(b.ok()) << b.status().to_string();
    if (b.ok()) buf = std::move(b).value();
  }
  std::byte* data() { return buf.bytes(); }
};

void upload(GpuBuffer& g, const std::vector<std::byte>& host) {
  ASSERT_TRUE(copy_to_device(g.data(), host.data(), host.size()).ok());
}
std::vector<std::byte> download(GpuBuffer& g, std::size_t bytes) {
  std::vector<std::byte> host(bytes);
  EXPECT_TRUE(copy_to_host(host.data(), g.data(), bytes).ok());
  return host;
}
void sync() {
  const Status st = synchronize_stream(nullptr, std::chrono::seconds(30), "test kernels");
  ASSERT_TRUE(st.ok()) << st.to_string();
}

// Index of the first differing element, or -1.
long first_difference(const std::vector<std::byte>& a, const std::vector<std::byte>& b,
                      std::size_t es) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return static_cast<long>(i / es);
  return -1;
}

TEST(CudaKernels, LaunchesReportUnsupportedWithoutCuda) {
  if (cuda_built()) GTEST_SKIP() << "CUDA build";
  EXPECT_EQ(device_count(), 0);
  const Status st =
      launch_flat_convert(nullptr, DType::kFloat32, nullptr, DType::kBFloat16, 8, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("without CUDA"), std::string::npos) << st.message();
}

// Every dtype pair, flat, at start offsets that force the scalar head/tail and the
// never-co-aligned fallback.
// Every kernel variant (CopyKernelTuning) must give the same bits.
const CopyKernelTuning kTunings[] = {{false}, {true}};

struct TuningScope {
  explicit TuningScope(const CopyKernelTuning& t) : saved(copy_kernel_tuning()) {
    set_copy_kernel_tuning(t);
  }
  ~TuningScope() { set_copy_kernel_tuning(saved); }
  CopyKernelTuning saved;
};

TEST(CudaKernels, FlatConvertMatchesCpuForEveryDtypePair) {
  REFIT_REQUIRE_GPU();
  std::mt19937_64 rng(7);
  const std::size_t n = 200003;
  for (const CopyKernelTuning& tuning : kTunings)
    for (DType s : kAll)
      for (DType d : kAll)
        for (std::size_t soff : {0, 1, 3})
          for (std::size_t doff : {0, 5}) {
            const std::size_t ss = dtype_size(s), ds = dtype_size(d);
            const auto src = random_elements(s, n + soff, rng);
            std::vector<std::byte> want(ds * (n + doff), std::byte{0x5A});
            convert(src.data() + soff * ss, s, want.data() + doff * ds, d, n);
            GpuBuffer gs(src.size()), gd(want.size());
            upload(gs, src);
            ASSERT_TRUE(fill_bytes_async(gd.data(), 0x5A, want.size(), nullptr).ok());
            TuningScope scope(tuning);
            const Status st =
                launch_flat_convert(gs.data() + soff * ss, s, gd.data() + doff * ds, d, n, nullptr);
            ASSERT_TRUE(st.ok()) << st.to_string();
            sync();
            const auto got = download(gd, want.size());
            EXPECT_EQ(first_difference(got, want, ds), -1)
                << dtype_name(s) << " -> " << dtype_name(d) << " src offset " << soff
                << " dst offset " << doff << " bulk " << tuning.bulk_same_dtype;
          }
}

// Runs of every kind the tiler produces: contiguous (collapsed and split into many tiles),
// strided short rows (vectorised and not), long strided rows split into column chunks, and
// single rows at odd offsets. dst regions are disjoint; everything else must stay poisoned.
std::vector<Block2D> mixed_runs(std::int64_t& src_elems, std::int64_t& dst_elems) {
  struct Shape {
    std::int64_t rows, cols, src_pad, dst_pad, src_skew, dst_skew;
  };
  const Shape shapes[] = {
      {1, 3 * kTileElems + 77, 0, 0, 0, 0},  // long single row over 4 tiles
      {300, 256, 0, 0, 0, 0},                // contiguous matrix: collapsed
      {513, 64, 64, 8, 0, 0},                // strided, aligned: vector path
      {77, 40, 24, 16, 8, 8},                // strided, aligned after skew
      {129, 13, 5, 2, 1, 3},                 // odd everything: scalar path
      {2, kTileElems + 9, 16, 8, 0, 0},      // long strided rows: column chunks
      {5000, 7, 1, 9, 3, 1},                 // many short rows per tile
      {1, 1, 0, 0, 11, 13},                  // a single element
  };
  std::vector<Block2D> runs;
  src_elems = dst_elems = 0;
  for (const Shape& s : shapes) {
    Block2D b;
    b.rows = s.rows;
    b.cols = s.cols;
    b.src_stride = s.cols + s.src_pad;
    b.dst_stride = s.cols + s.dst_pad;
    b.src_offset = src_elems + s.src_skew;
    b.dst_offset = dst_elems + s.dst_skew;
    src_elems = b.src_offset + b.rows * b.src_stride;
    dst_elems = b.dst_offset + b.rows * b.dst_stride;
    runs.push_back(b);
  }
  return runs;
}

TEST(CudaKernels, BlockCopyMatchesConvertBlockForEveryDtypePair) {
  REFIT_REQUIRE_GPU();
  std::mt19937_64 rng(11);
  std::int64_t src_elems = 0, dst_elems = 0;
  const auto runs = mixed_runs(src_elems, dst_elems);
  auto table = DeviceBlockTable::upload({runs}, 0);
  ASSERT_TRUE(table.ok()) << table.status().to_string();
  EXPECT_GT(table->num_tiles(), static_cast<std::int64_t>(runs.size()));
  for (const CopyKernelTuning& tuning : kTunings)
    for (DType s : kAll)
      for (DType d : kAll) {
        const std::size_t ds = dtype_size(d);
        const auto src = random_elements(s, static_cast<std::size_t>(src_elems), rng);
        std::vector<std::byte> want(ds * static_cast<std::size_t>(dst_elems), std::byte{0xC3});
        for (const Block2D& b : runs)
          convert_block(src.data(), s, b.src_offset, b.src_stride, want.data(), d, b.dst_offset,
                        b.dst_stride, b.rows, b.cols);
        GpuBuffer gs(src.size()), gd(want.size());
        upload(gs, src);
        ASSERT_TRUE(fill_bytes_async(gd.data(), 0xC3, want.size(), nullptr).ok());
        TuningScope scope(tuning);
        const Status st = launch_block_copy(*table, gs.data(), s, gd.data(), d, nullptr);
        ASSERT_TRUE(st.ok()) << st.to_string();
        sync();
        EXPECT_EQ(first_difference(download(gd, want.size()), want, ds), -1)
            << dtype_name(s) << " -> " << dtype_name(d) << " bulk " << tuning.bulk_same_dtype;
      }
}

// The checksum kernel computes common/checksum.h's sum bit for bit, like the CPU plane, for every
// source dtype and every dtype it is taken as (special values included).
TEST(CudaKernels, ChecksumMatchesTheCpuPlaneForEveryDtypePair) {
  REFIT_REQUIRE_GPU();
  std::mt19937_64 rng(13);
  std::int64_t src_elems = 0, dst_elems = 0;
  const auto runs = mixed_runs(src_elems, dst_elems);
  auto table = DeviceBlockTable::upload({runs}, 0);
  ASSERT_TRUE(table.ok()) << table.status().to_string();
  Config cpu_cfg;
  auto cpu = make_data_plane(cpu_cfg);
  ASSERT_TRUE(cpu.ok());
  for (DType s : kAll)
    for (DType d : kAll) {
      const auto src = random_elements(s, static_cast<std::size_t>(src_elems), rng);
      std::vector<CopyRun> host_runs;
      for (const Block2D& b : runs) host_runs.push_back({src.data(), nullptr, b});
      auto want = (*cpu)->checksum(host_runs, s, d);
      ASSERT_TRUE(want.ok());
      GpuBuffer gs(src.size());
      upload(gs, src);
      auto got = block_checksum(*table, gs.data(), s, d, nullptr, std::chrono::seconds(30));
      ASSERT_TRUE(got.ok()) << got.status().to_string();
      EXPECT_EQ(*got, *want) << dtype_name(s) << " as " << dtype_name(d);
    }
}

TEST(CudaKernels, GroupLaunchWritesOnlyItsGroup) {
  REFIT_REQUIRE_GPU();
  std::mt19937_64 rng(3);
  const std::int64_t n = 4096;
  std::vector<std::vector<Block2D>> groups(3);
  for (int g = 0; g < 3; ++g) groups[g].push_back(Block2D{g * n, n, g * n, n, 1, n});
  auto table = DeviceBlockTable::upload(groups, 0);
  ASSERT_TRUE(table.ok()) << table.status().to_string();
  ASSERT_EQ(table->num_groups(), 3u);
  EXPECT_EQ(table->group_numel(1), n);
  const auto src = random_elements(DType::kFloat32, 3 * n, rng);
  GpuBuffer gs(src.size()), gd(3 * n * 2);
  upload(gs, src);
  ASSERT_TRUE(fill_bytes_async(gd.data(), 0xEE, 3 * n * 2, nullptr).ok());
  ASSERT_TRUE(
      launch_block_copy(*table, 1, gs.data(), DType::kFloat32, gd.data(), DType::kBFloat16, nullptr)
          .ok());
  sync();
  std::vector<std::byte> want(3 * n * 2, std::byte{0xEE});
  convert(src.data() + n * 4, DType::kFloat32, want.data() + n * 2, DType::kBFloat16, n);
  EXPECT_EQ(first_difference(download(gd, want.size()), want, 2), -1);
  EXPECT_EQ(
      launch_block_copy(*table, 3, gs.data(), DType::kFloat32, gd.data(), DType::kBFloat16, nullptr)
          .code(),
      StatusCode::kInvalidArgument);
}

// What launch_generate must write for `runs`, computed with the CPU WeightSource.
std::vector<std::byte> cpu_generate(const WeightSource& ws, const std::vector<Block2D>& runs,
                                    const std::vector<std::uint32_t>& tags, int step, DType via,
                                    DType out, std::int64_t dst_elems) {
  const std::size_t os = dtype_size(out);
  std::vector<std::byte> dst(static_cast<std::size_t>(dst_elems) * os, std::byte{0x77});
  for (std::size_t k = 0; k < runs.size(); ++k) {
    const Block2D& b = runs[k];
    std::vector<float> f(static_cast<std::size_t>(b.cols));
    std::vector<std::byte> mid(static_cast<std::size_t>(b.cols) * 4);
    for (std::int64_t r = 0; r < b.rows; ++r) {
      ws.values(tags[k], b.src_offset + r * b.src_stride, b.cols, step, f.data());
      convert(f.data(), DType::kFloat32, mid.data(), via, static_cast<std::size_t>(b.cols));
      convert(mid.data(), via, dst.data() + (b.dst_offset + r * b.dst_stride) * os, out,
              static_cast<std::size_t>(b.cols));
    }
  }
  return dst;
}

// Engine TP 2, rank 1 of a tiny Qwen3: strided pieces (fused qkv, split o_proj columns).
struct EngineRuns {
  ModelSpec spec;
  std::vector<Block2D> runs;
  std::vector<std::uint32_t> tags;
  std::int64_t elems = 0;
};
EngineRuns engine_runs() {
  EngineRuns e;
  auto spec = load_model_spec("tiny-qwen3");
  EXPECT_TRUE(spec.ok());
  e.spec = *spec;
  auto layout = engine_layout(e.spec, 2, 1, EngineLayout::kFused, EngineProtocol::kVllm);
  EXPECT_TRUE(layout.ok());
  for (const EngineParam& p : layout->params) {
    append_piece_runs(e.spec, p.pieces, p.shape, e.elems, nullptr, e.runs, e.tags);
    e.elems += matrix_shape(p.shape).numel() + 3;  // odd gaps between parameters
  }
  return e;
}

TEST(CudaKernels, GenerateMatchesWeightSource) {
  REFIT_REQUIRE_GPU();
  const EngineRuns e = engine_runs();
  const std::vector<std::vector<std::uint32_t>> tags{e.tags};
  auto table = DeviceBlockTable::upload({e.runs}, 0, &tags);
  ASSERT_TRUE(table.ok()) << table.status().to_string();
  const WeightSource ws(e.spec, 1234, nullptr);
  struct Case {
    DType via, out;
    int step;
  };
  for (const Case c :
       {Case{DType::kFloat32, DType::kFloat32, 0}, Case{DType::kFloat32, DType::kBFloat16, 3},
        Case{DType::kBFloat16, DType::kBFloat16, 2}, Case{DType::kBFloat16, DType::kFloat32, 5},
        Case{DType::kFloat32, DType::kFloat8E4M3, 1}}) {
    const auto want = cpu_generate(ws, e.runs, e.tags, c.step, c.via, c.out, e.elems);
    GpuBuffer gd(want.size());
    ASSERT_TRUE(fill_bytes_async(gd.data(), 0x77, want.size(), nullptr).ok());
    const WeightsParams p{1234, c.step, c.via};
    ASSERT_TRUE(launch_generate(*table, p, gd.data(), c.out, nullptr).ok());
    sync();
    EXPECT_EQ(first_difference(download(gd, want.size()), want, dtype_size(c.out)), -1)
        << "via " << dtype_name(c.via) << " out " << dtype_name(c.out) << " step " << c.step;
  }
  // --update adam:LR (weights/weights.h): the same values on the GPU.
  WeightSource adam(e.spec, 1234, nullptr);
  adam.set_update(WeightUpdate{.kind = WeightUpdate::Kind::kAdam, .lr = 1e-5f});
  for (const Case c :
       {Case{DType::kFloat32, DType::kBFloat16, 3}, Case{DType::kFloat32, DType::kFloat32, 7},
        Case{DType::kBFloat16, DType::kBFloat16, 2}}) {
    const auto want = cpu_generate(adam, e.runs, e.tags, c.step, c.via, c.out, e.elems);
    GpuBuffer gd(want.size());
    ASSERT_TRUE(fill_bytes_async(gd.data(), 0x77, want.size(), nullptr).ok());
    const WeightsParams p{.seed = 1234, .step = c.step, .via = c.via, .adam_lr = 1e-5f};
    ASSERT_TRUE(launch_generate(*table, p, gd.data(), c.out, nullptr).ok());
    sync();
    EXPECT_EQ(first_difference(download(gd, want.size()), want, dtype_size(c.out)), -1)
        << "adam: via " << dtype_name(c.via) << " out " << dtype_name(c.out) << " step " << c.step;
  }
}

TEST(CudaKernels, VerifyCountsExactlyTheCorruptedElements) {
  REFIT_REQUIRE_GPU();
  const EngineRuns e = engine_runs();
  const std::vector<std::vector<std::uint32_t>> tags{e.tags};
  auto table = DeviceBlockTable::upload({e.runs}, 0, &tags);
  ASSERT_TRUE(table.ok());
  const WeightsParams p{99, 4, DType::kFloat32};
  GpuBuffer gd(static_cast<std::size_t>(e.elems) * 2);
  ASSERT_TRUE(launch_generate(*table, p, gd.data(), DType::kBFloat16, nullptr).ok());
  auto clean =
      verify_generated(*table, p, gd.data(), DType::kBFloat16, nullptr, std::chrono::seconds(30));
  ASSERT_TRUE(clean.ok()) << clean.status().to_string();
  EXPECT_EQ(clean->mismatches, 0u);
  EXPECT_EQ(clean->first_dst_offset, -1);
  // A different step is a different tensor.
  auto other = verify_generated(*table, WeightsParams{99, 5, DType::kFloat32}, gd.data(),
                                DType::kBFloat16, nullptr, std::chrono::seconds(30));
  ASSERT_TRUE(other.ok());
  EXPECT_GT(other->mismatches, static_cast<std::uint64_t>(e.runs.size()));
  // Flip three covered elements.
  const std::int64_t at[] = {e.runs[3].dst_offset + 1, e.runs[0].dst_offset,
                             e.runs.back().dst_offset};
  for (std::int64_t a : at) {
    std::uint16_t v = 0;
    ASSERT_TRUE(copy_to_host(&v, gd.data() + a * 2, 2).ok());
    v ^= 0x0100;
    ASSERT_TRUE(copy_to_device(gd.data() + a * 2, &v, 2).ok());
  }
  auto bad =
      verify_generated(*table, p, gd.data(), DType::kBFloat16, nullptr, std::chrono::seconds(30));
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ(bad->mismatches, 3u);
  EXPECT_EQ(bad->first_dst_offset, std::min({at[0], at[1], at[2]}));
}

}  // namespace
}  // namespace refit
