// The FP8 reference quantizer's plain arithmetic (harness/fp8_reference_math.h), which the GPU
// reference of --verify runs, against the CPU quantizer (common/quantize.h) and values worked out
// by hand. tests/cuda_fp8_reference_test.cc checks the device kernels built on it.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/convert.h"
#include "common/quantize.h"
#include "harness/fp8_reference_math.h"

namespace refit {
namespace {

float bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST(Fp8ReferenceMath, CodesWorkedOutByHand) {
  struct Case {
    float q;
    std::uint8_t code;
  };
  const Case cases[] = {
      {0.0f, 0x00},
      {-0.0f, 0x80},
      {1.0f, 0x38},  // exponent 0 + bias 7 = 7: 0b0111'000
      {-1.0f, 0xB8},
      {1.125f, 0x39},   // 1 + 1/8
      {1.0625f, 0x38},  // halfway between 1 and 1.125: the even code
      {1.1875f, 0x3A},  // halfway between 1.125 and 1.25: the even code 1.25
      {448.0f, 0x7E},   // the largest finite: 2^8 * 1.75
      {447.0f, 0x7E},   // nearest is 448 (416 is the next below)
      {432.0f, 0x7E},   // halfway between 416 (0x7D) and 448 (0x7E): even is 0x7E
      {431.0f, 0x7D},
      {449.0f, 0x7E},  // saturated
      {1.0e30f, 0x7E},
      {-3.0e38f, 0xFE},
      {0.015625f, 0x08},      // 2^-6, the smallest normal
      {0.013671875f, 0x07},   // 7 * 2^-9, the largest subnormal
      {0.001953125f, 0x01},   // 2^-9, the smallest subnormal
      {0.0009765625f, 0x00},  // 2^-10, halfway between 0 and 2^-9: even is 0
      {0.0009765626f, 0x01},  // just above that half
      {0.0029296875f, 0x02},  // 1.5 * 2^-9, halfway between codes 1 and 2: even 2
      {0.0048828125f, 0x02},  // 2.5 * 2^-9: even 2
      {0.0146484375f, 0x08},  // 7.5 * 2^-9, halfway between 0x07 and 2^-6 (0x08): even 0x08
      {1.0e-40f, 0x00},       // a subnormal float
      {std::numeric_limits<float>::quiet_NaN(), 0x7F},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(fp8ref::e4m3_code(c.q), c.code) << c.q;
    EXPECT_EQ(f32_to_fp8e4m3(c.q), c.code) << c.q << " (the CPU quantizer)";
  }
}

TEST(Fp8ReferenceMath, CodesMatchTheCpuQuantizerAroundEveryRoundingBoundary) {
  // Every midpoint between two neighbouring e4m3 magnitudes (and 448 + 16, where rounding would
  // leave the format), with the 64 float32 values either side, both signs.
  std::vector<float> magnitudes;
  for (int code = 0; code <= 126; ++code)
    magnitudes.push_back(fp8e4m3_to_f32(static_cast<std::uint8_t>(code)));
  magnitudes.push_back(480.0f);
  int checked = 0;
  for (std::size_t i = 0; i + 1 < magnitudes.size(); ++i) {
    const float mid = (magnitudes[i] + magnitudes[i + 1]) / 2;  // exact: one more bit
    const std::uint32_t m = float_bits(mid);
    for (std::uint32_t u = m - 64; u <= m + 64; ++u)
      for (const float q : {bits(u), -bits(u)}) {
        ASSERT_EQ(fp8ref::e4m3_code(q), f32_to_fp8e4m3(q)) << q;
        ++checked;
      }
  }
  EXPECT_EQ(checked, 127 * 129 * 2);
}

TEST(Fp8ReferenceMath, CodesMatchTheCpuQuantizerOverTheFloatRange) {
  // Every 4099th float32 bit pattern from 0 to +inf, both signs: about 2 million values over
  // every exponent.
  int checked = 0;
  for (std::uint64_t u = 0; u <= 0x7F800000u; u += 4099) {
    const float q = bits(static_cast<std::uint32_t>(u));
    ASSERT_EQ(fp8ref::e4m3_code(q), f32_to_fp8e4m3(q)) << q;
    ASSERT_EQ(fp8ref::e4m3_code(-q), f32_to_fp8e4m3(-q)) << -q;
    ++checked;
  }
  EXPECT_GT(checked, 500'000);
}

TEST(Fp8ReferenceMath, ScalesMatchTheCpuQuantizer) {
  EXPECT_EQ(fp8ref::scale_of_amax(float_bits(448.0f)), 1.0f);
  EXPECT_EQ(fp8ref::scale_of_amax(float_bits(0.0f)), 1.0f);  // an all-zero block
  EXPECT_EQ(fp8ref::scale_of_amax(float_bits(896.0f)), 2.0f);
  EXPECT_EQ(fp8ref::scale_of_amax(1u), 1.0f);  // 2^-149 / 448 underflows to zero
  EXPECT_FALSE(fp8ref::finite_amax(0x7F800000u));
  EXPECT_FALSE(fp8ref::finite_amax(0x7FC00000u));
  EXPECT_TRUE(fp8ref::finite_amax(0x7F7FFFFFu));
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    const std::uint32_t a = rng() % 0x7F800000u;
    ASSERT_EQ(float_bits(fp8ref::scale_of_amax(a)), float_bits(fp8_scale_from_amax(bits(a)))) << a;
  }
}

// The block quantizer written with the plain arithmetic, as the GPU kernels run it, against
// quantize_fp8_blocks on ragged blocks of values spanning 2^-40 ... 2^20.
TEST(Fp8ReferenceMath, BlocksMatchTheCpuQuantizer) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-40, 20);
  for (const auto [rows, cols, br, bc] :
       {std::array<std::int64_t, 4>{37, 53, 16, 16}, std::array<std::int64_t, 4>{64, 64, 64, 64},
        std::array<std::int64_t, 4>{5, 300, 128, 128},
        std::array<std::int64_t, 4>{33, 17, 33, 17}}) {
    std::vector<float> x(static_cast<std::size_t>(rows * cols));
    for (float& v : x) v = std::ldexp(mant(rng), expo(rng));
    const std::int64_t nbr = (rows + br - 1) / br, nbc = (cols + bc - 1) / bc;
    std::vector<std::uint8_t> codes(x.size());
    std::vector<float> scales(static_cast<std::size_t>(nbr * nbc));
    ASSERT_TRUE(quantize_fp8_blocks(x.data(), rows, cols, br, bc, codes.data(), scales.data()));
    std::vector<std::uint32_t> amax(scales.size(), 0);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c) {
        std::uint32_t& a = amax[static_cast<std::size_t>((r / br) * nbc + c / bc)];
        a = std::max(a, fp8ref::magnitude_bits(x[static_cast<std::size_t>(r * cols + c)]));
      }
    for (std::size_t b = 0; b < amax.size(); ++b)
      ASSERT_EQ(float_bits(fp8ref::scale_of_amax(amax[b])), float_bits(scales[b])) << b;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c) {
        const auto i = static_cast<std::size_t>(r * cols + c);
        ASSERT_EQ(fp8ref::quantize(x[i], scales[static_cast<std::size_t>((r / br) * nbc + c / bc)]),
                  codes[i])
            << rows << "x" << cols << " at " << r << ", " << c;
      }
  }
}

}  // namespace
}  // namespace refit
