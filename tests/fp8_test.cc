// FP8 refits (docs/fp8.md): the quantizer against an independent nearest-even search, the scale
// tensors each engine layout derives (checked block by block against the weights they scale), the
// setup-time rejections, the checkpoint's quantization_config, and every cell of the support
// matrix refitting an FP8 engine across real processes, verified against the reference quantizer.
// tests/python/test_fp8.py checks the same runs' dumps against a NumPy quantizer.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <vector>

#include "common/convert.h"
#include "device/device.h"
#include "plane/data_plane.h"
#include "common/quantize.h"
#include "engine/engine_layout.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "spec/fp8.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::run_cli;
using testing::TempDir;

// The e4m3fn code nearest to y (ties to the even code), saturating at ±448: a search over the
// 127 finite magnitudes, written independently of common/convert.cc's bit arithmetic.
std::uint8_t nearest_e4m3(float y) {
  const bool neg = std::signbit(y);
  const double a = std::min(std::fabs(static_cast<double>(y)), 448.0);
  int best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int code = 0; code <= 126; ++code) {
    const int e = code >> 3, m = code & 7;
    const double v = e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
    const double d = std::fabs(v - a);
    if (d < best_d || (d == best_d && code % 2 == 0)) {
      best = code;
      best_d = d;
    }
  }
  return static_cast<std::uint8_t>(best | (neg ? 0x80 : 0));
}

TEST(Fp8Quantizer, MatchesAnIndependentNearestEvenSearch) {
  // 4 x 2 blocks of 4 x 4: zeros, huge values, subnormal codes, exact ties, saturation, signs.
  const std::int64_t rows = 16, cols = 8, br = 4, bc = 4;
  std::vector<float> x(static_cast<std::size_t>(rows * cols), 0.0f);
  auto at = [&](std::int64_t r, std::int64_t c) -> float& {
    return x[static_cast<std::size_t>(r * cols + c)];
  };
  for (std::int64_t r = 0; r < 4; ++r)
    for (std::int64_t c = 4; c < 8; ++c) at(r, c) = 3.0e38f * (c % 2 ? -1.0f : 1.0f) / float(r + 1);
  // Block (1, 0): amax 448 gives scale 1, so the values land unchanged: ties between codes
  // (1.0625 sits between 1.0 and 1.125; 1.5 * 2^-9 between the first two subnormals) and the
  // smallest subnormals.
  const float ties[] = {448.0f, 1.0625f, -1.0625f, 1.1875f, 0.0029296875f, 0.001953125f,
                        0.0009765625f, -0.0f, 240.0f, 232.0f, 3.0e-4f, 1.0e-6f, -448.0f, 0.5f,
                        0.75f, 0.875f};
  for (int i = 0; i < 16; ++i) at(4 + i / 4, i % 4) = ties[i];
  // Block (2, 1): a wide exponent range, so small values become subnormal codes.
  for (int i = 0; i < 16; ++i) at(8 + i / 4, 4 + i % 4) = std::ldexp(1.37f, 6 - 3 * i) * (i % 3 ? 1.0f : -1.0f);
  // Block (3, 0..1): ordinary values.
  for (int i = 0; i < 32; ++i) at(12 + i / 8, i % 8) = std::sin(0.7f * static_cast<float>(i)) * 0.02f;

  std::vector<std::uint8_t> codes(x.size());
  std::vector<float> scales(8);
  ASSERT_TRUE(quantize_fp8_blocks(x.data(), rows, cols, br, bc, codes.data(), scales.data()));
  int subnormal = 0, saturated = 0;
  for (std::int64_t b = 0; b < 8; ++b) {
    const std::int64_t r0 = b / 2 * br, c0 = b % 2 * bc;
    float amax = 0.0f;
    for (std::int64_t r = r0; r < r0 + br; ++r)
      for (std::int64_t c = c0; c < c0 + bc; ++c) amax = std::max(amax, std::fabs(at(r, c)));
    const float want_scale = amax == 0.0f ? 1.0f : amax / 448.0f;
    EXPECT_EQ(scales[static_cast<std::size_t>(b)], want_scale) << "block " << b;
    for (std::int64_t r = r0; r < r0 + br; ++r)
      for (std::int64_t c = c0; c < c0 + bc; ++c) {
        const std::uint8_t want = nearest_e4m3(at(r, c) / want_scale);
        const std::uint8_t got = codes[static_cast<std::size_t>(r * cols + c)];
        EXPECT_EQ(got, want) << "element (" << r << ", " << c << ") = " << at(r, c);
        subnormal += (got & 0x78) == 0 && (got & 7) != 0;
        saturated += (got & 0x7F) == 0x7E;
      }
  }
  EXPECT_EQ(scales[0], 1.0f);  // all-zero block
  EXPECT_EQ(codes[static_cast<std::size_t>(4 * cols + 1)], 0x38);  // 1.0625 -> 1.0 (even)
  EXPECT_EQ(codes[static_cast<std::size_t>(5 * cols + 0)], 0x02);  // 1.5 * 2^-9 -> 2^-8 (even)
  EXPECT_GT(subnormal, 3);
  EXPECT_GT(saturated, 3);
  // Saturation when rounding x / scale lands past 448: every e4m3 value times a scale and back.
  for (float scale : {1.0f, 3.0e-3f, 7.7e33f})
    EXPECT_EQ(quantize_fp8(448.0f * scale * 1.01f, scale), 0x7E);
}

TEST(Fp8Quantizer, NonFiniteBlocksHaveNoScale) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> x(32, 1.0f);
    x[21] = bad;  // row 2, col 5: block (1, 1) of 2 x 4 blocks
    std::vector<std::uint8_t> codes(32);
    std::vector<float> scales(4);
    std::int64_t block = -1;
    EXPECT_FALSE(quantize_fp8_blocks(x.data(), 4, 8, 2, 4, codes.data(), scales.data(), &block));
    EXPECT_EQ(block, 3);
  }
  EXPECT_TRUE(std::isnan(fp8_scale_from_amax(std::numeric_limits<float>::infinity())));
  EXPECT_EQ(fp8_scale_from_amax(0.0f), 1.0f);
  // amax / 448 underflows to 0 below 448 * 2^-150: scale 1 too (not 0, which would turn the
  // block's zeros into NaN codes), and every code is a signed zero.
  EXPECT_EQ(fp8_scale_from_amax(1e-44f), 1.0f);
  EXPECT_EQ(fp8_scale_from_amax(3.1e-43f), 1.0f);
  EXPECT_GT(fp8_scale_from_amax(3.2e-43f), 0.0f);
  EXPECT_NE(fp8_scale_from_amax(3.2e-43f), 1.0f);
  const float tiny[4] = {1e-44f, -1e-44f, 0.0f, -0.0f};
  std::uint8_t codes[4];
  float scale = 0;
  ASSERT_TRUE(quantize_fp8_blocks(tiny, 1, 4, 1, 4, codes, &scale));
  EXPECT_EQ(scale, 1.0f);
  EXPECT_EQ(codes[0], 0x00);
  EXPECT_EQ(codes[1], 0x80);
  EXPECT_EQ(codes[2], 0x00);
  EXPECT_EQ(codes[3], 0x80);
}

// The planes' amax and quantize (CPU loops; CUDA kernels where a GPU is visible) against the
// reference over whole tensors: runs that each cover part of a block (as FSDP2 chunks and routes
// cut them), several source dtypes, zero, huge, tiny and tie values.
struct PlaneCase {
  std::int64_t rows, cols, br, bc;
  std::vector<std::int64_t> row_cuts, col_cuts;  // run boundaries, 0 and the end included
};

// Zero, huge, tiny and tie values over a PlaneCase's shape.
std::vector<float> plane_case_values(DType src_dtype, const PlaneCase& pc) {
  const std::int64_t rows = pc.rows, cols = pc.cols;
  std::vector<float> x(static_cast<std::size_t>(rows * cols));
  for (std::int64_t i = 0; i < rows * cols; ++i)
    x[static_cast<std::size_t>(i)] = std::ldexp(std::sin(0.37f * static_cast<float>(i)),
                                                static_cast<int>(i % 23) - 11);
  for (std::int64_t r = 0; r < 8; ++r)
    for (std::int64_t c = 0; c < 16; ++c) x[static_cast<std::size_t>(r * cols + c)] = 0.0f;
  for (std::int64_t r = 8; r < 16; ++r)
    for (std::int64_t c = 16; c < 32; ++c) x[static_cast<std::size_t>(r * cols + c)] =
          (src_dtype == DType::kFloat16 ? 6.0e4f : 2.5e38f) * (c % 2 ? -1.0f : 1.0f);
  x[static_cast<std::size_t>(20 * cols + 3)] = 448.0f;
  x[static_cast<std::size_t>(20 * cols + 4)] = 1.0625f;
  return x;
}

// `x` (pc.rows x pc.cols, rounded to src_dtype here) through the plane: scales from the grid
// (block_amax, then quantize), then in one pass; then a NaN in a block scaled in the pass.
void expect_plane_matches_reference(DataPlane& plane, DType src_dtype, const PlaneCase& pc,
                                    std::vector<float> x) {
  const std::int64_t rows = pc.rows, cols = pc.cols, br = pc.br, bc = pc.bc;
  const std::int64_t nbr = (rows + br - 1) / br, nbc = (cols + bc - 1) / bc;
  // The source as the plane reads it (rounded to src_dtype, as a trainer of that dtype holds it).
  std::vector<std::byte> src(x.size() * dtype_size(src_dtype));
  convert(x.data(), DType::kFloat32, src.data(), src_dtype, x.size());
  convert(src.data(), src_dtype, x.data(), DType::kFloat32, x.size());
  std::vector<std::uint8_t> want(x.size());
  std::vector<float> want_scales(static_cast<std::size_t>(nbr * nbc));
  ASSERT_TRUE(quantize_fp8_blocks(x.data(), rows, cols, br, bc, want.data(), want_scales.data()));

  const std::size_t grid_bytes = want_scales.size() * 4;
  auto s_buf = plane.allocate(src.size());
  auto grid = plane.allocate(grid_bytes);
  auto out = plane.allocate(x.size());
  ASSERT_TRUE(s_buf.ok() && grid.ok() && out.ok());
  ASSERT_TRUE(plane.write((*s_buf)->data(), src.data(), src.size()).ok());
  std::vector<std::uint32_t> zeros(want_scales.size(), 0);
  ASSERT_TRUE(plane.write((*grid)->data(), zeros.data(), grid_bytes).ok());
  std::vector<QuantRun> runs;
  for (std::size_t i = 0; i + 1 < pc.row_cuts.size(); ++i)
    for (std::size_t j = 0; j + 1 < pc.col_cuts.size(); ++j) {
      const std::int64_t r0 = pc.row_cuts[i], r1 = pc.row_cuts[i + 1];
      const std::int64_t c0 = pc.col_cuts[j], c1 = pc.col_cuts[j + 1];
      runs.push_back(QuantRun{.run = {.src = (*s_buf)->data(),
                                      .dst = (*out)->data(),
                                      .block = {.src_offset = r0 * cols + c0,
                                                .src_stride = cols,
                                                .dst_offset = r0 * cols + c0,
                                                .dst_stride = cols,
                                                .rows = r1 - r0,
                                                .cols = c1 - c0}},
                              .grid = (*grid)->data(),
                              .hf_row = r0,
                              .hf_col = c0,
                              .block_rows = br,
                              .block_cols = bc,
                              .scale_cols = nbc});
    }
  ASSERT_TRUE(plane.block_amax(runs, src_dtype).ok());
  std::vector<std::uint32_t> amax(want_scales.size());
  ASSERT_TRUE(plane.read(amax.data(), (*grid)->data(), grid_bytes).ok());
  std::vector<float> scales(amax.size());
  for (std::size_t b = 0; b < amax.size(); ++b) scales[b] = fp8_scale_from_amax(from_bits(amax[b]));
  EXPECT_EQ(scales, want_scales) << dtype_name(src_dtype);
  ASSERT_TRUE(plane.write((*grid)->data(), scales.data(), grid_bytes).ok());
  ASSERT_TRUE(plane.quantize(runs, src_dtype).ok());
  std::vector<std::uint8_t> got(x.size());
  ASSERT_TRUE(plane.read(got.data(), (*out)->data(), got.size()).ok());
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(got[i], want[i]) << dtype_name(src_dtype) << " element " << i << " = " << x[i];

  // In one pass: the blocks that lie whole in a run get their scale from the quantizing call
  // itself (their grid entries hold garbage before it); the others come from the grid.
  std::vector<std::uint8_t> from_grid(want_scales.size(), 1);
  for (const QuantRun& q : runs)
    for (std::int64_t kr = 0; kr < nbr; ++kr)
      for (std::int64_t kc = 0; kc < nbc; ++kc)
        if (kr * br >= q.hf_row && std::min((kr + 1) * br, rows) <= q.hf_row + q.run.block.rows &&
            kc * bc >= q.hf_col && std::min((kc + 1) * bc, cols) <= q.hf_col + q.run.block.cols)
          from_grid[static_cast<std::size_t>(kr * nbc + kc)] = 0;
  ASSERT_GT(std::count(from_grid.begin(), from_grid.end(), 0), 2);
  std::vector<float> seeded = want_scales;
  for (std::size_t b = 0; b < seeded.size(); ++b)
    if (from_grid[b] == 0) seeded[b] = 12345.0f;
  auto bad = plane.allocate(16);
  ASSERT_TRUE(bad.ok());
  const std::uint64_t clean[2] = {0, ~std::uint64_t{0}};
  ASSERT_TRUE(plane.write((*bad)->data(), clean, 16).ok());
  for (QuantRun& q : runs) {
    q.from_grid = from_grid.data();
    q.bad = (*bad)->data();
    q.tag = 5;
  }
  ASSERT_TRUE(plane.write((*grid)->data(), seeded.data(), grid_bytes).ok());
  std::vector<std::uint8_t> zero(x.size(), 0);
  ASSERT_TRUE(plane.write((*out)->data(), zero.data(), zero.size()).ok());
  ASSERT_TRUE(plane.quantize(runs, src_dtype).ok());
  ASSERT_TRUE(plane.read(got.data(), (*out)->data(), got.size()).ok());
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(got[i], want[i]) << "one pass: " << dtype_name(src_dtype) << " element " << i;
  ASSERT_TRUE(plane.read(scales.data(), (*grid)->data(), grid_bytes).ok());
  EXPECT_EQ(scales, want_scales) << "one pass: " << dtype_name(src_dtype);
  std::uint64_t counted[2] = {1, 1};
  ASSERT_TRUE(plane.read(counted, (*bad)->data(), 16).ok());
  EXPECT_EQ(counted[0], 0u);

  // A NaN in a block scaled in the pass is counted, naming the tensor and the block.
  std::int64_t nan_block = -1;
  for (std::size_t b = 0; b < from_grid.size() && nan_block < 0; ++b)
    if (from_grid[b] == 0) nan_block = static_cast<std::int64_t>(b);
  const std::int64_t at = (nan_block / nbc * br + std::min<std::int64_t>(br - 1, 1)) * cols +
                         nan_block % nbc * bc + std::min<std::int64_t>(bc - 1, 2);
  x[static_cast<std::size_t>(at)] = std::numeric_limits<float>::quiet_NaN();
  convert(x.data(), DType::kFloat32, src.data(), src_dtype, x.size());
  ASSERT_TRUE(plane.write((*s_buf)->data(), src.data(), src.size()).ok());
  ASSERT_TRUE(plane.quantize(runs, src_dtype).ok());
  ASSERT_TRUE(plane.read(counted, (*bad)->data(), 16).ok());
  EXPECT_EQ(counted[0], 1u) << dtype_name(src_dtype);
  EXPECT_EQ(counted[1], (std::uint64_t{5} << 32) | static_cast<std::uint64_t>(nan_block));
}

TEST(Fp8Plane, AmaxAndQuantizeMatchTheReferenceAcrossCutBlocks) {
  std::vector<Device> devices = {Device::kCpu};
  if (device_count() > 0) devices.push_back(Device::kCuda);
  for (Device d : devices) {
    Config cfg;
    cfg.device = d;
    auto plane = make_data_plane(cfg, 0);
    ASSERT_TRUE(plane.ok()) << plane.status().to_string();
    // Runs cut at rows 11 and 26 and column 21 (no run holds a whole block; ragged blocks at both
    // ends), and a shape whose runs take the kernels' 8-element vector paths.
    const PlaneCase scalar{37, 45, 8, 16, {0, 11, 26, 37}, {0, 21, 45}};
    const PlaneCase vector{40, 64, 8, 16, {0, 11, 26, 40}, {0, 16, 48, 64}};
    for (const PlaneCase& pc : {scalar, vector})
      for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
        expect_plane_matches_reference(**plane, dt, pc, plane_case_values(dt, pc));
    if (d == Device::kCuda) std::printf("[fp8] the CUDA kernels matched the reference\n");
  }
}

// The CUDA kernels divide without a division instruction (quant_kernels.cu, Divisor): each
// quotient must round as IEEE float division does wherever that decides the FP8 code. Blocks of
// one row, each with its own scale:
//  - bfloat16: amax every 7th positive finite bfloat16, and in its block every bfloat16 under
//    the amax whose quotient is at least 2^-13 (both signs), the 8 below those and the 8
//    smallest subnormals (the smaller ones quantize like these);
//  - float32: amax over every binade and at the scale's edges (subnormal, underflowing to zero,
//    either side of 2^-90 and of 2^100, powers of two, the largest), and values whose quotient
//    lies within 3 ulps of each FP8 rounding boundary, where the float32 rounding decides the
//    code.
// Scaled from the grid and in the pass. The CPU plane divides with the reference itself.
TEST(Fp8Plane, CudaDivisionRoundsAsIeee) {
  if (device_count() == 0) GTEST_SKIP() << "no GPU: the CPU plane divides with the reference";
  Config cfg;
  cfg.device = Device::kCuda;
  auto plane = make_data_plane(cfg, 0);
  ASSERT_TRUE(plane.ok()) << plane.status().to_string();
  const auto round8 = [](std::size_t n) { return static_cast<std::int64_t>((n + 7) / 8 * 8); };
  {  // bfloat16
    std::vector<float> magnitudes;  // every positive finite bfloat16, ascending
    for (std::uint32_t b = 1; b < 0x7F80; ++b) magnitudes.push_back(from_bits(b << 16));
    std::vector<std::vector<float>> blocks;
    std::size_t width = 0;
    for (std::size_t a = 0; a < magnitudes.size(); a += 7) {
      // Every value whose quotient is at least 2^-13 (codes start at 2^-10), the 8 below those
      // and the 8 smallest subnormals: the others quantize like these.
      const float floor = magnitudes[a] * 0x1p-22f;
      std::size_t lo = static_cast<std::size_t>(
          std::lower_bound(magnitudes.begin(), magnitudes.begin() + static_cast<std::ptrdiff_t>(a), floor) -
          magnitudes.begin());
      lo = lo > 8 ? lo - 8 : 0;
      std::vector<float> blk = {magnitudes[a], -0.0f, 0.0f};
      for (std::size_t v = 0; v < a; ++v)
        if (v >= lo || v < 8) {
          blk.push_back(magnitudes[v]);
          blk.push_back(-magnitudes[v]);
        }
      width = std::max(width, blk.size());
      blocks.push_back(std::move(blk));
    }
    const std::int64_t w = round8(width), n = static_cast<std::int64_t>(blocks.size());
    std::vector<float> x(static_cast<std::size_t>(w * n), 0.0f);
    for (std::size_t b = 0; b < blocks.size(); ++b)
      std::copy(blocks[b].begin(), blocks[b].end(),
                x.begin() + static_cast<std::ptrdiff_t>(b) * w);
    expect_plane_matches_reference(**plane, DType::kBFloat16, {n, w, 1, w, {0, n}, {0, w}},
                                   std::move(x));
  }
  {  // float32 near the FP8 rounding boundaries
    std::vector<float> boundaries;  // midpoints between consecutive e4m3 magnitudes, and 448
    for (int code = 0; code < 126; ++code) {
      const float lo = fp8e4m3_to_f32(static_cast<std::uint8_t>(code));
      boundaries.push_back(lo + (fp8e4m3_to_f32(static_cast<std::uint8_t>(code + 1)) - lo) / 2);
    }
    boundaries.push_back(448.0f);
    std::vector<float> amaxes = {1e-44f, 6.3e-43f, 0x1p-126f * 448, 0x1p-90f * 448,
                                 0x1p-90f * 448 * 0.999f, 0x1p100f * 448, 0x1p100f * 448 * 1.001f,
                                 448.0f, 0x1p-20f * 448, std::numeric_limits<float>::max()};
    for (int e = -120; e <= 127; e += 1) amaxes.push_back(std::ldexp(1.0f + static_cast<float>(e & 7) / 7.3f, e));
    const std::int64_t w = round8(boundaries.size() * 14 + 1);
    std::vector<float> x;
    for (float a : amaxes) {
      const float s = fp8_scale_from_amax(a);
      std::vector<float> blk = {a};
      for (float m : boundaries) {
        // x near m * s, both signs, clamped to the amax.
        const auto centre = static_cast<float>(static_cast<double>(m) * static_cast<double>(s));
        float v = centre;
        for (int k = 0; k < 3; ++k) v = std::nextafter(v, 0.0f);
        for (int k = 0; k < 7; ++k, v = std::nextafter(v, std::numeric_limits<float>::max())) {
          blk.push_back(std::min(v, a));
          blk.push_back(-std::min(v, a));
        }
      }
      blk.resize(static_cast<std::size_t>(w), 0.0f);
      x.insert(x.end(), blk.begin(), blk.end());
    }
    const auto n = static_cast<std::int64_t>(amaxes.size());
    expect_plane_matches_reference(**plane, DType::kFloat32, {n, w, 1, w, {0, n}, {0, w}},
                                   std::move(x));
  }
  std::printf("[fp8] the CUDA division matched IEEE division on every case\n");
}

Config fp8_config(const std::string& model, int tp, const std::string& fp8_yaml) {
  auto c = parse_config(fmt::format("model: {}\ngeneration: {{backend: vllm, tp_size: {}}}\n"
                                    "refit: {{target_precision: fp8, fp8: {}}}\n",
                                    model, tp, fp8_yaml));
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return *c;
}

// Every scale element of every engine parameter names the block of the weight it scales: block
// (i, j) of the engine's scale parameter is the scale of the HF block that the weight parameter's
// element (i * 128, j * 128) comes from.
void expect_scales_follow_weights(const ModelSpec& spec, const WireModel& wire,
                                  const EngineShardLayout& L, const std::string& what) {
  const Fp8Table& f = *wire.fp8;
  int checked = 0;
  for (std::size_t p = 0; p < L.params.size(); ++p) {
    const EngineParam& w = L.params[p];
    if (w.dtype != DType::kFloat8E4M3) {
      for (const Piece& pc : w.pieces) EXPECT_FALSE(f.quantized(pc.hf_tensor)) << w.name;
      continue;
    }
    ASSERT_LT(p + 1, L.params.size());
    const EngineParam& s = L.params[p + 1];
    EXPECT_EQ(s.name, w.name + "_scale_inv") << what;
    EXPECT_EQ(s.dtype, DType::kFloat32);
    const std::int64_t n = w.shape[w.shape.size() - 2];
    const std::int64_t sn = s.shape[s.shape.size() - 2];
    for (const Piece& sp : s.pieces)
      for (std::int64_t i = sp.dst_row; i < sp.dst_row + sp.rows; ++i)
        for (std::int64_t j = sp.dst_col; j < sp.dst_col + sp.cols; ++j) {
          // The weight element at the block's corner, in the parameter's matrix view.
          const std::int64_t row = i / sn * n + i % sn * f.block_rows, col = j * f.block_cols;
          const Piece* wp = nullptr;
          for (const Piece& pc : w.pieces)
            if (row >= pc.dst_row && row < pc.dst_row + pc.rows && col >= pc.dst_col &&
                col < pc.dst_col + pc.cols)
              wp = &pc;
          ASSERT_NE(wp, nullptr) << what << " " << s.name << " block (" << i << ", " << j << ")";
          EXPECT_EQ(static_cast<std::int32_t>(sp.hf_tensor), f.scale_of[wp->hf_tensor]) << s.name;
          EXPECT_EQ(sp.src_row + (i - sp.dst_row), (wp->src_row + row - wp->dst_row) / f.block_rows);
          EXPECT_EQ(sp.src_col + (j - sp.dst_col), (wp->src_col + col - wp->dst_col) / f.block_cols);
          ++checked;
        }
  }
  EXPECT_GT(checked, 0) << what;
  (void)spec;
}

TEST(Fp8Layout, BlockScalesFollowTheirWeightsThroughEveryTpSlice) {
  for (const auto& [model, tps] : std::map<std::string, std::vector<int>>{
           {"qwen3-8b", {1, 2, 4, 8}}, {"qwen3-30b-a3b", {1, 2}}}) {
    auto spec = load_model_spec(model);
    ASSERT_TRUE(spec.ok()) << spec.status().to_string();
    for (int tp : tps) {
      const Config c = fp8_config(model, tp, "{scheme: block, block: [128, 128]}");
      ASSERT_TRUE(validate_config(c, *spec).ok()) << model << " tp " << tp;
      auto wire = wire_model(c, *spec);
      ASSERT_TRUE(wire.ok()) << wire.status().to_string();
      for (int r = 0; r < tp; ++r) {
        auto L = engine_wire_layout(c, *spec, *wire, r);
        ASSERT_TRUE(L.ok()) << L.status().to_string();
        expect_scales_follow_weights(*spec, *wire, *L, fmt::format("{} tp {} rank {}", model, tp, r));
        if (model == "qwen3-8b" && r == 0) {  // hidden 4096, 32 q / 8 kv heads of 128, I 12288
          for (const EngineParam& p : L->params) {
            if (p.name == "model.layers.0.self_attn.qkv_proj.weight_scale_inv") {
              EXPECT_EQ(p.shape, (std::vector<std::int64_t>{48 / tp, 32}));
            }
            if (p.name == "model.layers.0.self_attn.o_proj.weight_scale_inv") {
              EXPECT_EQ(p.shape, (std::vector<std::int64_t>{32, 32 / tp}));
            }
            if (p.name == "model.embed_tokens.weight" || p.name == "model.norm.weight" ||
                p.name == "lm_head.weight") {
              EXPECT_EQ(p.dtype, DType::kBFloat16) << p.name;
            }
          }
        }
      }
    }
  }
  // Qwen3-30B-A3B's experts (moe_intermediate_size 768) at TP 4: 192 rows per rank cut a block,
  // as vLLM's and SGLang's block-FP8 MoE layers refuse too.
  auto spec = load_model_spec("qwen3-30b-a3b");
  ASSERT_TRUE(spec.ok());
  const Config c = fp8_config("qwen3-30b-a3b", 4, "{block: [128, 128]}");
  Status st = validate_config(c, *spec);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("w13_weight takes rows [0, 192)"), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find("experts.0.gate_proj.weight [768, 2048]"), std::string::npos)
      << st.to_string();
  EXPECT_NE(st.message().find("cuts a 128 x 128 block"), std::string::npos);
}

TEST(Fp8Layout, TensorScalesHaveTheEnginesShapes) {
  auto spec = load_model_spec("tiny-moe");
  ASSERT_TRUE(spec.ok());
  const Config c = fp8_config("tiny-moe", 2, "{scheme: tensor}");
  auto wire = wire_model(c, *spec);
  ASSERT_TRUE(wire.ok()) << wire.status().to_string();
  auto L = engine_wire_layout(c, *spec, *wire, 1);
  ASSERT_TRUE(L.ok()) << L.status().to_string();
  const std::int64_t E = spec->config().num_experts;
  std::map<std::string, std::vector<std::int64_t>> want = {
      {"model.layers.0.self_attn.qkv_proj.weight_scale", {3}},
      {"model.layers.0.self_attn.o_proj.weight_scale", {1}},
      {"model.layers.0.mlp.experts.w13_weight_scale", {E, 2}},
      {"model.layers.0.mlp.experts.w2_weight_scale", {E}}};
  int found = 0;
  for (const EngineParam& p : L->params) {
    EXPECT_NE(p.name, "model.layers.0.mlp.gate.weight_scale");  // the router stays bf16
    if (p.name == "model.layers.0.mlp.gate.weight") {
      EXPECT_EQ(p.dtype, DType::kBFloat16);
    }
    auto it = want.find(p.name);
    if (it == want.end()) continue;
    ++found;
    EXPECT_EQ(p.shape, it->second) << p.name;
    EXPECT_EQ(p.dtype, DType::kFloat32);
    // Each scale element is one HF tensor's scale: q, k, v in order; expert e's gate then up.
    for (const Piece& pc : p.pieces) {
      const std::string& weight =
          wire->spec.tensors()[static_cast<std::size_t>(wire->fp8->weight_of[pc.hf_tensor])].name;
      if (p.name.find("qkv") != std::string::npos) {
        EXPECT_NE(weight.find(pc.dst_col == 0 ? "q_proj" : pc.dst_col == 1 ? "k_proj" : "v_proj"),
                  std::string::npos);
      }
      if (p.name.find("w13") != std::string::npos) {
        EXPECT_EQ(weight, fmt::format("model.layers.0.mlp.experts.{}.{}.weight", pc.dst_row,
                                      pc.dst_col == 0 ? "gate_proj" : "up_proj"));
      }
    }
  }
  EXPECT_EQ(found, 4);
}

TEST(Fp8Layout, HfLayoutSendsEachScaleAfterItsWeightUnderTheCheckpointName) {
  auto spec = load_model_spec("tiny-qwen3");
  ASSERT_TRUE(spec.ok());
  auto parsed = parse_config("model: tiny-qwen3\ngeneration: {layout: hf, tp_size: 2}\n"
                             "refit: {target_precision: fp8}\n");
  ASSERT_TRUE(parsed.ok());
  ASSERT_TRUE(validate_config(*parsed, *spec).ok());  // whole tensors: any block fits any TP
  auto wire = wire_model(*parsed, *spec);
  ASSERT_TRUE(wire.ok());
  auto L = engine_wire_layout(*parsed, *spec, *wire, 1);
  ASSERT_TRUE(L.ok());
  for (std::size_t i = 0; i < L->params.size(); ++i) {
    const EngineParam& p = L->params[i];
    if (p.name == "model.layers.1.self_attn.k_proj.weight") {
      EXPECT_EQ(p.dtype, DType::kFloat8E4M3);
      EXPECT_EQ(L->params[i + 1].name, "model.layers.1.self_attn.k_proj.weight_scale_inv");
      EXPECT_EQ(L->params[i + 1].shape, (std::vector<std::int64_t>{1, 1}));  // [32, 64] in one block
    }
    if (p.name.find("norm") != std::string::npos) {
      EXPECT_EQ(p.dtype, DType::kBFloat16) << p.name;
    }
  }
}

// A model directory of tiny-qwen3's shapes whose config.json carries `quantization`.
std::string fp8_model_dir(const TempDir& dir, const std::string& name, const std::string& quantization) {
  const std::string json = fmt::format(
      R"({{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "intermediate_size": 96, "vocab_size": 1000, "tie_word_embeddings": false,
          "quantization_config": {}}})",
      quantization);
  dir.write(name + "/config.json", json);
  return dir.path() + "/" + name;
}

TEST(Fp8Checkpoint, QuantizationConfigDecidesTheSchemeAndTheIgnoredModules) {
  TempDir dir;
  const std::string model = fp8_model_dir(
      dir, "m",
      R"({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 32],
          "modules_to_not_convert": ["lm_head", "model.layers.0.mlp"]})");
  auto spec = load_model_spec(model);
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  auto c = parse_config("model: " + model + "\ngeneration: {backend: vllm, tp_size: 1}\n"
                        "refit: {target_precision: fp8}\n");
  ASSERT_TRUE(c.ok());
  Status st = validate_config(*c, *spec);
  ASSERT_TRUE(st.ok()) << st.to_string();
  auto wire = wire_model(*c, *spec);
  ASSERT_TRUE(wire.ok());
  EXPECT_EQ(wire->fp8->block_rows, 16);
  EXPECT_EQ(wire->fp8->block_cols, 32);
  EXPECT_NE(wire->fp8->source.find("config.json quantization_config"), std::string::npos);
  for (std::size_t t = 0; t < spec->tensors().size(); ++t) {
    const std::string& n = spec->tensors()[t].name;
    const bool want = n.find("_proj.weight") != std::string::npos &&
                      n.find("layers.0.mlp") == std::string::npos;
    EXPECT_EQ(wire->fp8->quantized(static_cast<std::uint32_t>(t)), want) << n;
  }
  // refit.fp8 that contradicts the checkpoint, and other quantization methods, are refused.
  auto other = parse_config("model: " + model +
                            "\ngeneration: {tp_size: 2}\nrefit: {target_precision: fp8, fp8: "
                            "{block: [16, 16]}}\n");
  ASSERT_TRUE(other.ok());
  st = validate_config(*other, *spec);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("got block [16, 16]"), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find("says block [16, 32]"), std::string::npos) << st.to_string();
  auto bf16 = parse_config("model: " + model + "\ngeneration: {tp_size: 2}\n");
  ASSERT_TRUE(bf16.ok());
  st = validate_config(*bf16, *spec);
  EXPECT_NE(st.message().find("its engines hold FP8 weights"), std::string::npos) << st.to_string();

  const std::string awq = fp8_model_dir(dir, "awq", R"({"quant_method": "awq"})");
  auto awq_spec = load_model_spec(awq);
  ASSERT_TRUE(awq_spec.ok());
  auto a = parse_config("model: " + awq + "\ngeneration: {tp_size: 1}\nrefit: {target_precision: fp8}\n");
  ASSERT_TRUE(a.ok());
  st = validate_config(*a, *awq_spec);
  EXPECT_NE(st.message().find("quant_method \"awq\""), std::string::npos) << st.to_string();

  // An ignore list that splits a fused engine parameter (q_proj left bf16, k/v quantized).
  const std::string split = fp8_model_dir(
      dir, "split", R"({"quant_method": "fp8", "modules_to_not_convert": ["self_attn.q_proj"]})");
  auto split_spec = load_model_spec(split);
  ASSERT_TRUE(split_spec.ok());
  auto s = parse_config("model: " + split +
                        "\ngeneration: {tp_size: 1}\nrefit: {target_precision: fp8}\n");
  ASSERT_TRUE(s.ok());
  st = validate_config(*s, *split_spec);
  EXPECT_NE(st.message().find("qkv_proj.weight fuses"), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find("modules_to_not_convert"), std::string::npos);
}

// ---- every cell, across real processes ----

struct Fp8Cell {
  std::string policy = "backend: fsdp2, world_size: 3";
  std::string generation = "backend: vllm, tp_size: 2";
  std::string refit = "fp8: {block: [16, 16]}";
  std::string model = "tiny-qwen3";
};

void expect_fp8_verified(const Fp8Cell& c) {
  TempDir dir;
  const std::string cfg = dir.write(
      "c.yaml", fmt::format("model: {}\nseed: 3\npolicy: {{{}}}\ngeneration: {{{}}}\n"
                            "refit: {{target_precision: fp8, buffer_size_bytes: 4096, timeout_s: 20, {}}}\n",
                            c.model, c.policy, c.generation, c.refit));
  auto r = run_cli({"run", cfg, "--steps", "2", "--verify"}, 180);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verified bit-exact on every engine rank"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("weights quantized at the sender"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("verified bit-exact against the FP8 reference quantizer (step 2)"),
            std::string::npos)
      << r.output;
}

TEST(Fp8Cells, Fsdp2VllmNonColocatedChunksCutBlocks) { expect_fp8_verified({}); }
// One trainer rank: blocks that every route holds whole are scaled in the quantizing pass, those
// that rounds of 768 bytes per pair split (12 rows of 64; a buffer of 1536 bytes over 2 engine
// ranks) are scaled before the refit; no collective.
TEST(Fp8Cells, OneTrainerRankScalesWholeBlocksInThePass) {
  TempDir dir;
  const std::string cfg = dir.write(
      "c.yaml",
      "model: tiny-qwen3\npolicy: {world_size: 1}\ngeneration: {backend: vllm, tp_size: 2}\n"
      "refit: {target_precision: fp8, buffer_size_bytes: 1536, fp8: {block: [16, 16]}}\n");
  auto r = run_cli({"run", cfg, "--steps", "2", "--verify"}, 180);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verified bit-exact against the FP8 reference quantizer (step 2)"),
            std::string::npos) << r.output;
  const auto at = r.output.find("blocks, ");
  ASSERT_NE(at, std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(", 0 scaled in the quantizing pass"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(", 0 before the refit"), std::string::npos) << r.output;
  // Colocated, default buffers: every block in the pass.
  const std::string colo = dir.write(
      "d.yaml", "model: tiny-moe\npolicy: {world_size: 1, dtype: bfloat16}\n"
                "generation: {backend: sglang, colocated: true, tp_size: 1}\n"
                "refit: {target_precision: fp8, fp8: {block: [8, 8]}}\n");
  r = run_cli({"run", colo, "--steps", "2", "--verify"}, 180);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(" 0 before the refit"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("verified bit-exact against the FP8 reference quantizer (step 2)"),
            std::string::npos) << r.output;
}
TEST(Fp8Cells, Fsdp2SglangNonColocatedP2p) {
  expect_fp8_verified({.generation = "backend: sglang, tp_size: 2",
                       .refit = "executor: p2p, fp8: {block: [16, 16]}"});
}
TEST(Fp8Cells, Fsdp2VllmColocated) {
  expect_fp8_verified({.policy = "backend: fsdp2, world_size: 2",
                       .generation = "backend: vllm, colocated: true, tp_size: 2"});
}
TEST(Fp8Cells, Fsdp2SglangColocatedBf16Trainer) {
  expect_fp8_verified({.policy = "backend: fsdp2, world_size: 2, dtype: bfloat16",
                       .generation = "backend: sglang, colocated: true, tp_size: 2"});
}
TEST(Fp8Cells, MegatronVllmNonColocatedTpSlicesCutNothing) {
  expect_fp8_verified({.policy = "backend: megatron, world_size: 2, megatron: {tp: 2}",
                       .generation = "backend: vllm, tp_size: 4",
                       .refit = "fp8: {block: [8, 8]}"});
}
TEST(Fp8Cells, MegatronSglangNonColocatedP2p) {
  expect_fp8_verified({.policy = "backend: megatron, world_size: 2, megatron: {tp: 2}",
                       .generation = "backend: sglang, tp_size: 2",
                       .refit = "executor: p2p, fp8: {block: [8, 8]}"});
}
TEST(Fp8Cells, MegatronVllmColocatedMoeExperts) {
  expect_fp8_verified({.policy = "backend: megatron, world_size: 2, dtype: bfloat16, megatron: {tp: 2}",
                       .generation = "backend: vllm, colocated: true, tp_size: 2",
                       .refit = "fp8: {block: [4, 4]}",
                       .model = "tiny-moe"});
}
TEST(Fp8Cells, MegatronSglangColocated) {
  expect_fp8_verified({.policy = "backend: megatron, world_size: 2, megatron: {tp: 2}",
                       .generation = "backend: sglang, colocated: true, tp_size: 2",
                       .refit = "fp8: {block: [8, 8]}"});
}
TEST(Fp8Cells, TensorSchemeMoeTwoEngines) {
  expect_fp8_verified({.policy = "backend: fsdp2, world_size: 3",
                       .generation = "backend: vllm, num_engines: 2, tp_size: 2",
                       .refit = "fp8: {scheme: tensor}",
                       .model = "tiny-moe"});
}
TEST(Fp8Cells, HfLayoutLoadWeightsTakesScalesWithTheirWeights) {
  expect_fp8_verified({.policy = "backend: fsdp2, world_size: 2",
                       .generation = "backend: sglang, tp_size: 2, layout: hf",
                       .refit = "fp8: {block: [16, 16]}"});
}
// The engines' forward on their dequantized FP8 weights (TP 2, fused, and the HF-name layout)
// against a single-process forward on the reference quantizer's dequantized weights.
TEST(Fp8Cells, CheckLogitsOnDequantizedWeights) {
  for (const char* generation : {"backend: vllm, tp_size: 2", "backend: sglang, tp_size: 2, layout: hf"}) {
    TempDir dir;
    const std::string cfg = dir.write(
        "c.yaml", fmt::format("model: tiny-qwen3\npolicy: {{world_size: 3}}\ngeneration: {{{}}}\n"
                              "refit: {{target_precision: fp8, fp8: {{block: [16, 16]}}}}\n",
                              generation));
    auto r = run_cli({"run", cfg, "--steps", "2", "--verify", "--check-logits"}, 180);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("engine logits match the reference forward"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("verified bit-exact against the FP8 reference quantizer (step 2)"),
              std::string::npos)
        << r.output;
  }
}

TEST(Fp8Cells, KeepPreviousRollsBackFp8Weights) {
  TempDir dir;
  const std::string cfg = dir.write(
      "c.yaml",
      "model: tiny-qwen3\npolicy: {world_size: 2}\ngeneration: {backend: vllm, tp_size: 2}\n"
      "refit: {target_precision: fp8, keep_previous: true, timeout_s: 10, fp8: {block: [16, 16]}}\n");
  // A corrupted byte in step 2 fails verification; the kept step-1 weights are restored and
  // verified again against the reference quantizer.
  auto r = run_cli({"run", cfg, "--steps", "2", "--verify", "--fault", "corrupt:0:2"}, 180);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("the reference quantizer of docs/fp8.md"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rolled back"), std::string::npos) << r.output;
  // Step 1 verified on both engine ranks, then again after each rank's rollback.
  std::size_t verified = 0;
  const std::string line = "verified bit-exact against the FP8 reference quantizer (step 1)";
  for (auto at = r.output.find(line); at != std::string::npos; at = r.output.find(line, at + 1))
    ++verified;
  EXPECT_EQ(verified, 4u) << r.output;
}

}  // namespace
}  // namespace refit
