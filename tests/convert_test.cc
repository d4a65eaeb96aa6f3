#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/convert.h"

namespace refit {
namespace {

std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- Reference decoders written from the format definitions with ldexp (no bit tricks) ----

double ref_decode(std::uint32_t code, int exp_bits, int man_bits, int bias, bool has_inf) {
  const bool neg = (code >> (exp_bits + man_bits)) & 1;
  const int e = static_cast<int>((code >> man_bits) & ((1u << exp_bits) - 1));
  const int m = static_cast<int>(code & ((1u << man_bits) - 1));
  const int e_max = (1 << exp_bits) - 1;
  double v;
  if (has_inf && e == e_max) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (!has_inf && e == e_max && m == (1 << man_bits) - 1) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), 1 - bias - man_bits);
  } else {
    v = std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -man_bits), e - bias);
  }
  return neg ? -v : v;
}
double ref_f16(std::uint16_t h) { return ref_decode(h, 5, 10, 15, true); }
double ref_fp8(std::uint8_t b) { return ref_decode(b, 4, 3, 7, false); }

// Round-to-nearest-even by search over the sorted table of every finite non-negative value of a
// type: the nearest entry wins, a tie goes to the even code. `overflow_code` is returned for
// magnitudes at or beyond `overflow_from`.
struct RefTable {
  std::vector<std::pair<double, std::uint32_t>> values;  // (value, code), ascending
  double overflow_from;
  std::uint32_t overflow_code;
  std::uint32_t sign_bit;

  std::uint32_t encode(float x) const {
    const double ax = std::fabs(static_cast<double>(x));
    const std::uint32_t sign = std::signbit(x) ? sign_bit : 0;
    if (ax >= overflow_from) return sign | overflow_code;
    auto it = std::lower_bound(values.begin(), values.end(), std::make_pair(ax, 0u));
    if (it == values.end()) return sign | values.back().second;  // below overflow_from
    if (it->first == ax || it == values.begin()) return sign | it->second;
    auto lo = std::prev(it);
    const double dlo = ax - lo->first, dhi = it->first - ax;
    if (dlo < dhi) return sign | lo->second;
    if (dhi < dlo) return sign | it->second;
    return sign | ((lo->second & 1) == 0 ? lo->second : it->second);
  }
};

RefTable f16_table() {
  RefTable t;
  for (std::uint32_t c = 0; c < 0x7C00; ++c) t.values.emplace_back(ref_f16(c), c);
  t.overflow_from = 65520.0;  // halfway between 65504 and 2^16: ties to the "even" infinity
  t.overflow_code = 0x7C00;
  t.sign_bit = 0x8000;
  return t;
}

RefTable fp8_table() {
  RefTable t;
  for (std::uint32_t c = 0; c < 0x7F; ++c) t.values.emplace_back(ref_fp8(c), c);
  t.overflow_from = std::numeric_limits<double>::infinity();  // saturates: table ends at 448
  t.overflow_code = 0x7E;
  t.sign_bit = 0x80;
  return t;
}

// f32 -> bf16 by comparing the distances to the two bf16 neighbours in double arithmetic.
std::uint16_t ref_f32_to_bf16(float x) {
  const std::uint32_t u = bits(x);
  if (std::isnan(x)) return static_cast<std::uint16_t>((u >> 16) | 0x40);
  const std::uint32_t lo = u & 0xFFFF0000u;  // toward zero
  const std::uint32_t hi = lo + 0x10000u;    // away from zero (may be inf)
  if (lo == u || std::isinf(x)) return static_cast<std::uint16_t>(u >> 16);
  const double ax = std::fabs(static_cast<double>(x));
  const double vlo = std::fabs(static_cast<double>(from_bits(lo)));
  const double vhi =
      (hi & 0x7FFFFFFFu) == 0x7F800000u ? std::ldexp(1.0, 128) : std::fabs(double(from_bits(hi)));
  const double dlo = ax - vlo, dhi = vhi - ax;
  if (dlo < dhi) return static_cast<std::uint16_t>(lo >> 16);
  if (dhi < dlo) return static_cast<std::uint16_t>(hi >> 16);
  return static_cast<std::uint16_t>(((lo >> 16) & 1) == 0 ? lo >> 16 : hi >> 16);
}

bool bf16_is_nan(std::uint16_t h) { return (h & 0x7F80) == 0x7F80 && (h & 0x7F) != 0; }
bool f16_is_nan(std::uint16_t h) { return (h & 0x7C00) == 0x7C00 && (h & 0x3FF) != 0; }

// ---- bfloat16 ----

TEST(Convert, Bf16AllPatternsRoundTrip) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_to_f32(static_cast<std::uint16_t>(h));
    ASSERT_EQ(bits(f), h << 16);
    const std::uint16_t back = f32_to_bf16(f);
    if (bf16_is_nan(static_cast<std::uint16_t>(h))) {
      ASSERT_TRUE(bf16_is_nan(back)) << std::hex << h;
      ASSERT_EQ(back & 0x8000, h & 0x8000) << "NaN keeps its sign";
      ASSERT_NE(back & 0x40, 0) << "NaN becomes quiet";
    } else {
      ASSERT_EQ(back, h) << std::hex << h;
    }
  }
}

TEST(Convert, Bf16RoundsToNearestEven) {
  auto r = [](std::uint32_t u) { return f32_to_bf16(from_bits(u)); };
  EXPECT_EQ(r(0x3F808000u), 0x3F80);  // tie, even stays
  EXPECT_EQ(r(0x3F818000u), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(r(0x3F808001u), 0x3F81);  // above the tie
  EXPECT_EQ(r(0x3F807FFFu), 0x3F80);  // below the tie
  EXPECT_EQ(r(0xBF818000u), 0xBF82);  // negative ties too
  EXPECT_EQ(r(0x3FFF8000u), 0x4000);  // carry into the exponent
  EXPECT_EQ(r(0x00018000u), 0x0002);  // subnormals round the same way
  EXPECT_EQ(r(0x00008000u), 0x0000);
  EXPECT_EQ(r(0x80008001u), 0x8001);
}

TEST(Convert, Bf16OverflowInfinityAndNan) {
  auto r = [](std::uint32_t u) { return f32_to_bf16(from_bits(u)); };
  EXPECT_EQ(r(0x7F7FFFFFu), 0x7F80) << "FLT_MAX rounds to inf";
  EXPECT_EQ(r(0x7F7F7FFFu), 0x7F7F);
  EXPECT_EQ(r(0x7F7F8000u), 0x7F80) << "tie at the top goes to even = inf";
  EXPECT_EQ(r(0x7F800000u), 0x7F80);
  EXPECT_EQ(r(0xFF800000u), 0xFF80);
  EXPECT_EQ(r(0x7F800001u), 0x7FC0) << "a NaN with only low payload bits stays NaN";
  EXPECT_EQ(r(0xFF80FFFFu), 0xFFC0);
  EXPECT_EQ(r(0x7FC00000u), 0x7FC0);
  EXPECT_EQ(r(0x7FFFFFFFu), 0x7FFF) << "all-ones NaN must not carry into the sign";
  EXPECT_EQ(r(0x80000000u), 0x8000);
}

TEST(Convert, Bf16MatchesReferenceOnRandomFloats) {
  std::mt19937 rng(42);
  std::uniform_int_distribution<std::uint32_t> any;
  std::vector<float> xs;
  for (int i = 0; i < 1'000'000; ++i) xs.push_back(from_bits(any(rng)));
  // Near-ties and values next to them, at every exponent.
  for (int i = 0; i < 200'000; ++i) {
    const std::uint32_t hi = any(rng) & 0xFFFF0000u;
    for (std::uint32_t low : {0x8000u, 0x7FFFu, 0x8001u, 0xFFFFu, 0x0001u})
      xs.push_back(from_bits(hi | low));
  }
  std::vector<std::uint16_t> bulk(xs.size());
  convert(xs.data(), DType::kFloat32, bulk.data(), DType::kBFloat16, xs.size());
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const std::uint16_t want = ref_f32_to_bf16(xs[i]);
    ASSERT_EQ(f32_to_bf16(xs[i]), want) << std::hex << bits(xs[i]);
    ASSERT_EQ(bulk[i], want) << std::hex << bits(xs[i]);
  }
}

// ---- float16 ----

TEST(Convert, F16AllPatternsDecodeAndRoundTrip) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const auto h16 = static_cast<std::uint16_t>(h);
    const float f = f16_to_f32(h16);
    const double want = ref_f16(h16);
    if (f16_is_nan(h16)) {
      ASSERT_TRUE(std::isnan(f));
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0);
      const std::uint16_t back = f32_to_f16(f);
      ASSERT_TRUE(f16_is_nan(back)) << std::hex << h;
      ASSERT_EQ(back & 0x8000, h & 0x8000);
    } else {
      ASSERT_EQ(static_cast<double>(f), want) << std::hex << h;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << "signed zero";
      ASSERT_EQ(f32_to_f16(f), h16) << std::hex << h;
    }
  }
}

TEST(Convert, F16SubnormalsOverflowAndTies) {
  EXPECT_EQ(f32_to_f16(0x1p-24f), 0x0001);
  EXPECT_EQ(f32_to_f16(0x1p-25f), 0x0000) << "half the smallest subnormal ties to even (0)";
  EXPECT_EQ(f32_to_f16(0x1.000002p-25f), 0x0001);
  EXPECT_EQ(f32_to_f16(0x1.8p-24f), 0x0002) << "1.5 units ties to 2";
  EXPECT_EQ(f32_to_f16(0x1.ffcp-15f), 0x0400) << "rounds up into the smallest normal";
  EXPECT_EQ(f32_to_f16(-0x1p-14f), 0x8400);
  EXPECT_EQ(f32_to_f16(1e-10f), 0x0000);
  EXPECT_EQ(f32_to_f16(-1e-10f), 0x8000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7BFF);
  EXPECT_EQ(f32_to_f16(65519.996f), 0x7BFF);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7C00);
  EXPECT_EQ(f32_to_f16(1e9f), 0x7C00);
  EXPECT_EQ(f32_to_f16(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_EQ(f32_to_f16(1.0f + 0x1p-11f), 0x3C00) << "tie to even";
  EXPECT_EQ(f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3C02);
}

TEST(Convert, F16MatchesReferenceOnRandomFloats) {
  const RefTable table = f16_table();
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> any;
  std::uniform_real_distribution<float> exp_dist(-30.0f, 17.0f);
  for (int i = 0; i < 400'000; ++i) {
    float x = (i % 2 == 0) ? from_bits(any(rng)) : std::exp2(exp_dist(rng)) * ((i & 2) ? -1 : 1);
    if (std::isnan(x)) continue;
    ASSERT_EQ(f32_to_f16(x), table.encode(x)) << std::hexfloat << x;
  }
}

// ---- float8 e4m3fn ----

TEST(Convert, Fp8AllPatterns) {
  for (std::uint32_t b = 0; b < 256; ++b) {
    const auto b8 = static_cast<std::uint8_t>(b);
    const float f = fp8e4m3_to_f32(b8);
    if ((b & 0x7F) == 0x7F) {
      ASSERT_TRUE(std::isnan(f)) << b;
      ASSERT_EQ(f32_to_fp8e4m3(f), b8) << "NaN keeps its sign";
      continue;
    }
    ASSERT_FALSE(std::isinf(f));
    ASSERT_EQ(static_cast<double>(f), ref_fp8(b8)) << b;
    ASSERT_EQ(std::signbit(f), (b & 0x80) != 0);
    ASSERT_EQ(f32_to_fp8e4m3(f), b8) << b;
  }
  EXPECT_EQ(fp8e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(fp8e4m3_to_f32(0x01), 0x1p-9f);
  EXPECT_EQ(fp8e4m3_to_f32(0x08), 0x1p-6f);
  EXPECT_EQ(fp8e4m3_to_f32(0x38), 1.0f);
}

TEST(Convert, Fp8SaturatesRoundsAndHandlesSubnormals) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(f32_to_fp8e4m3(448.0f), 0x7E);
  EXPECT_EQ(f32_to_fp8e4m3(464.0f), 0x7E);
  EXPECT_EQ(f32_to_fp8e4m3(500.0f), 0x7E) << "saturates (torch would give NaN)";
  EXPECT_EQ(f32_to_fp8e4m3(1e30f), 0x7E);
  EXPECT_EQ(f32_to_fp8e4m3(inf), 0x7E);
  EXPECT_EQ(f32_to_fp8e4m3(-inf), 0xFE);
  EXPECT_EQ(f32_to_fp8e4m3(-1000.0f), 0xFE);
  EXPECT_EQ(f32_to_fp8e4m3(std::nanf("")), 0x7F);
  EXPECT_EQ(f32_to_fp8e4m3(-std::nanf("")), 0xFF);
  EXPECT_EQ(f32_to_fp8e4m3(1.0625f), 0x38) << "tie 1 + 1/16 goes to even (1.0)";
  EXPECT_EQ(f32_to_fp8e4m3(1.1875f), 0x3A) << "tie 1 + 3/16 goes to even (1.25)";
  EXPECT_EQ(f32_to_fp8e4m3(0x1p-10f), 0x00) << "half the smallest subnormal ties to 0";
  EXPECT_EQ(f32_to_fp8e4m3(0x1.8p-9f), 0x02);
  EXPECT_EQ(f32_to_fp8e4m3(0x1.fp-7f), 0x08) << "rounds up into the smallest normal";
  EXPECT_EQ(f32_to_fp8e4m3(-0.0f), 0x80);
}

TEST(Convert, Fp8MatchesReferenceOnRandomFloats) {
  const RefTable table = fp8_table();
  std::mt19937 rng(9);
  std::uniform_int_distribution<std::uint32_t> any;
  std::uniform_real_distribution<float> exp_dist(-12.0f, 10.0f);
  for (int i = 0; i < 300'000; ++i) {
    float x = (i % 2 == 0) ? from_bits(any(rng)) : std::exp2(exp_dist(rng)) * ((i & 2) ? -1 : 1);
    if (std::isnan(x)) continue;
    ASSERT_EQ(f32_to_fp8e4m3(x), table.encode(x)) << std::hexfloat << x;
  }
}

// ---- bulk conversions ----

constexpr DType kAll[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3};

float decode_one(const std::byte* p, DType dt) {
  switch (dt) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBFloat16: {
      std::uint16_t h;
      std::memcpy(&h, p, 2);
      return bf16_to_f32(h);
    }
    case DType::kFloat16: {
      std::uint16_t h;
      std::memcpy(&h, p, 2);
      return f16_to_f32(h);
    }
    case DType::kFloat8E4M3:
      return fp8e4m3_to_f32(static_cast<std::uint8_t>(*p));
  }
  return 0;
}

void encode_one(float f, DType dt, std::byte* p) {
  switch (dt) {
    case DType::kFloat32:
      std::memcpy(p, &f, 4);
      return;
    case DType::kBFloat16: {
      const std::uint16_t h = f32_to_bf16(f);
      std::memcpy(p, &h, 2);
      return;
    }
    case DType::kFloat16: {
      const std::uint16_t h = f32_to_f16(f);
      std::memcpy(p, &h, 2);
      return;
    }
    case DType::kFloat8E4M3:
      *p = static_cast<std::byte>(f32_to_fp8e4m3(f));
      return;
  }
}

// Random bytes of `dt` (any bit pattern, so NaN/inf/subnormals appear).
std::vector<std::byte> random_bytes(std::size_t n, DType dt, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> v(n * dtype_size(dt));
  for (auto& b : v) b = static_cast<std::byte>(rng() & 0xFF);
  return v;
}

TEST(Convert, EveryPairMatchesScalarHelpersIncludingUnalignedBuffers) {
  const std::size_t n = 5003;  // more than one staging chunk, odd for vector tails
  for (DType s : kAll) {
    for (DType d : kAll) {
      const std::size_t ss = dtype_size(s), ds = dtype_size(d);
      auto src = random_bytes(n + 1, s, 11 + static_cast<int>(s));
      for (std::size_t mis : {std::size_t{0}, std::size_t{1}}) {
        std::vector<std::byte> dst(n * ds + 1, std::byte{0xAB});
        const std::byte* sp = src.data() + mis;
        std::byte* dp = dst.data() + mis;
        convert(sp, s, dp, d, n);
        for (std::size_t i = 0; i < n; ++i) {
          std::byte want[4];
          encode_one(decode_one(sp + i * ss, s), d, want);
          if (s == d) std::memcpy(want, sp + i * ss, ss);  // same dtype is a bit copy
          ASSERT_EQ(std::memcmp(dp + i * ds, want, ds), 0)
              << dtype_name(s) << " -> " << dtype_name(d) << " element " << i;
        }
        EXPECT_EQ(dst[mis == 0 ? n * ds : 0], std::byte{0xAB}) << "wrote outside the range";
      }
    }
  }
}

TEST(Convert, ZeroElementsTouchNothing) {
  std::uint16_t dst = 0x1234;
  convert(nullptr, DType::kFloat32, &dst, DType::kBFloat16, 0);
  EXPECT_EQ(dst, 0x1234);
}

TEST(Convert, BlockCopiesStridedRectangle) {
  // src: 7x9 float32 matrix, value r*100+c. Copy the 3x4 block at (1,2) into a 5x6 bf16 matrix
  // at (2,1).
  const std::int64_t srows = 7, scols = 9, drows = 5, dcols = 6;
  std::vector<float> src(srows * scols);
  for (std::int64_t r = 0; r < srows; ++r)
    for (std::int64_t c = 0; c < scols; ++c) src[r * scols + c] = static_cast<float>(r * 100 + c);
  std::vector<std::uint16_t> dst(drows * dcols, 0xFFFF);
  convert_block(src.data(), DType::kFloat32, 1 * scols + 2, scols, dst.data(), DType::kBFloat16,
                2 * dcols + 1, dcols, 3, 4);
  for (std::int64_t r = 0; r < drows; ++r) {
    for (std::int64_t c = 0; c < dcols; ++c) {
      const bool inside = r >= 2 && r < 5 && c >= 1 && c < 5;
      const std::uint16_t got = dst[r * dcols + c];
      if (inside) {
        EXPECT_EQ(got, f32_to_bf16(src[(r - 2 + 1) * scols + (c - 1 + 2)])) << r << "," << c;
      } else {
        EXPECT_EQ(got, 0xFFFF) << "outside the block at " << r << "," << c;
      }
    }
  }
}

TEST(Convert, BlockContiguousAndNarrowToNarrow) {
  // Full-width rows (strides == cols) take the single-call path; check it and a bf16 -> fp8
  // block with distinct strides.
  std::vector<std::uint16_t> src(4 * 8);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = f32_to_bf16(0.25f * static_cast<float>(i));
  std::vector<float> full(4 * 8, -1.0f);
  convert_block(src.data(), DType::kBFloat16, 0, 8, full.data(), DType::kFloat32, 0, 8, 4, 8);
  for (std::size_t i = 0; i < full.size(); ++i) EXPECT_EQ(full[i], 0.25f * static_cast<float>(i));

  std::vector<std::uint8_t> fp8(3 * 5, 0x11);
  convert_block(src.data(), DType::kBFloat16, 8 + 3, 8, fp8.data(), DType::kFloat8E4M3, 5, 5, 2, 4);
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < 5; ++c) {
      const std::uint8_t got = fp8[r * 5 + c];
      if (r >= 1 && c < 4) {
        EXPECT_EQ(got, f32_to_fp8e4m3(bf16_to_f32(src[(r - 1 + 1) * 8 + 3 + c])));
      } else {
        EXPECT_EQ(got, 0x11);
      }
    }
  }
  // Empty blocks are no-ops.
  convert_block(nullptr, DType::kFloat32, 0, 0, nullptr, DType::kBFloat16, 0, 0, 0, 5);
  convert_block(nullptr, DType::kFloat32, 0, 0, nullptr, DType::kBFloat16, 0, 0, 5, 0);
}

}  // namespace
}  // namespace refit
