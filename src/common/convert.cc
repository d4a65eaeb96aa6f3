#include "common/convert.h"

// The build uses -O2, whose "very cheap" vectoriser cost model skips the bulk loops below (they
// need a scalar epilogue). These loops are the hot path of every refit cast: vectorise them.
#pragma GCC optimize("tree-vectorize", "vect-cost-model=dynamic")

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace refit {
namespace {

std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float32 -> narrow subnormal: `a` is |x| as bits, below the narrow type's smallest normal.
// Returns x / 2^unit_exp rounded to the nearest integer, ties to even. The result may equal the
// implicit-bit value (1 << mantissa bits), which is the encoding of the smallest normal.
std::uint32_t subnormal_units(std::uint32_t a, int unit_exp) {
  const int e = static_cast<int>(a >> 23);
  if (e == 0) return 0;  // float32 subnormals are far below every narrow type's subnormals
  const std::uint32_t m = (a & 0x7FFFFFu) | 0x800000u;  // x = m * 2^(e - 150)
  const int shift = unit_exp + 150 - e;                 // x / 2^unit_exp = m >> shift
  if (shift > 24) return 0;  // x < 2^(unit_exp - 1): below half a unit (m < 2^24)
  const std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  return q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
}

// ---- bulk kernels over unaligned byte buffers; memcpy loads/stores vectorise cleanly ----

// The hot path of a refit. Long runs are written with non-temporal stores: the destination
// (a bucket or an engine parameter) is not read again soon, and skipping the read-for-ownership
// of every destination line cuts the memory traffic of the cast from 8 to 6 bytes per element.
void f32_to_bf16_scalar(const std::byte* __restrict s, std::byte* __restrict d, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t u;
    std::memcpy(&u, s + 4 * i, 4);
    const std::uint16_t h = f32_bits_to_bf16(u);
    std::memcpy(d + 2 * i, &h, 2);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) void f32_to_bf16_avx2_stream(const std::byte* s, std::byte* d,
                                                             std::size_t n) {
  // Scalar head until the destination is 32-byte aligned.
  std::size_t head = ((32 - (reinterpret_cast<std::uintptr_t>(d) & 31)) & 31) / 2;
  if ((reinterpret_cast<std::uintptr_t>(d) & 1) != 0) head = n;  // odd address: no streaming
  head = std::min(head, n);
  f32_to_bf16_scalar(s, d, head);
  s += 4 * head;
  d += 2 * head;
  n -= head;
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
  const __m256i quiet = _mm256_set1_epi32(0x0040);
  auto convert8 = [&](__m256i u) {
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(hi, one)), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
    return _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, quiet), nan);
  };
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i a = convert8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 4 * i)));
    const __m256i b =
        convert8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 4 * i + 32)));
    // packus interleaves 128-bit lanes: [a0-3 b0-3 a4-7 b4-7] -> reorder to [a b].
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 2 * i), packed);
  }
  _mm_sfence();
  f32_to_bf16_scalar(s + 4 * i, d + 2 * i, n - i);
}
#endif

void f32_to_bf16_n(const std::byte* __restrict s, std::byte* __restrict d, std::size_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && n >= (1u << 16)) return f32_to_bf16_avx2_stream(s, d, n);
#endif
  f32_to_bf16_scalar(s, d, n);
}

void bf16_to_f32_n(const std::byte* __restrict s, std::byte* __restrict d, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    std::uint16_t h;
    std::memcpy(&h, s + 2 * i, 2);
    const std::uint32_t u = bf16_to_f32_bits(h);
    std::memcpy(d + 4 * i, &u, 4);
  }
}

void f32_to_f16_n(const std::byte* s, std::byte* d, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    float f;
    std::memcpy(&f, s + 4 * i, 4);
    const std::uint16_t h = f32_to_f16(f);
    std::memcpy(d + 2 * i, &h, 2);
  }
}

void f16_to_f32_n(const std::byte* s, std::byte* d, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    std::uint16_t h;
    std::memcpy(&h, s + 2 * i, 2);
    const float f = f16_to_f32(h);
    std::memcpy(d + 4 * i, &f, 4);
  }
}

void f32_to_fp8_n(const std::byte* s, std::byte* d, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    float f;
    std::memcpy(&f, s + 4 * i, 4);
    d[i] = static_cast<std::byte>(f32_to_fp8e4m3(f));
  }
}

std::array<float, 256> make_fp8_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80) << 24;
    const std::uint32_t e = (b >> 3) & 0xF;
    const std::uint32_t m = b & 0x7;
    float v;
    if ((b & 0x7F) == 0x7F) {
      v = bits_float(sign | 0x7FC00000u);
    } else if (e == 0) {
      v = bits_float(sign | float_bits(static_cast<float>(m) * 0x1p-9f));
    } else {
      v = bits_float(sign | ((e + 120) << 23) | (m << 20));
    }
    t[b] = v;
  }
  return t;
}
const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = make_fp8_table();
  return table;
}

void fp8_to_f32_n(const std::byte* s, std::byte* d, std::size_t n) {
  const float* table = fp8_table().data();
  for (std::size_t i = 0; i < n; ++i) {
    const float f = table[static_cast<std::uint8_t>(s[i])];
    std::memcpy(d + 4 * i, &f, 4);
  }
}

void from_f32(const std::byte* s, DType dst, std::byte* d, std::size_t n) {
  switch (dst) {
    case DType::kFloat32:
      std::memcpy(d, s, n * 4);
      return;
    case DType::kBFloat16:
      f32_to_bf16_n(s, d, n);
      return;
    case DType::kFloat16:
      f32_to_f16_n(s, d, n);
      return;
    case DType::kFloat8E4M3:
      f32_to_fp8_n(s, d, n);
      return;
  }
}

void to_f32(const std::byte* s, DType src, std::byte* d, std::size_t n) {
  switch (src) {
    case DType::kFloat32:
      std::memcpy(d, s, n * 4);
      return;
    case DType::kBFloat16:
      bf16_to_f32_n(s, d, n);
      return;
    case DType::kFloat16:
      f16_to_f32_n(s, d, n);
      return;
    case DType::kFloat8E4M3:
      fp8_to_f32_n(s, d, n);
      return;
  }
}

}  // namespace

std::uint16_t f32_to_f16(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // >= 65520: inf
  if (a >= 0x38800000u) {                                                   // >= 2^-14: normal
    const std::uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);
    return static_cast<std::uint16_t>(sign | ((r >> 13) - (112u << 10)));
  }
  return static_cast<std::uint16_t>(sign | subnormal_units(a, -24));
}

float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1Fu;
  const std::uint32_t m = h & 0x3FFu;
  if (e == 31) return bits_float(sign | 0x7F800000u | (m << 13));
  if (e == 0) return bits_float(sign | float_bits(static_cast<float>(m) * 0x1p-24f));
  return bits_float(sign | ((e + 112) << 23) | (m << 13));
}

std::uint8_t f32_to_fp8e4m3(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t sign = (u >> 24) & 0x80u;
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<std::uint8_t>(sign | 0x7Fu);
  if (a >= 0x43E00000u) return static_cast<std::uint8_t>(sign | 0x7Eu);  // >= 448: saturate
  if (a >= 0x3C800000u) {                                                // >= 2^-6: normal
    const std::uint32_t r = a + 0x7FFFFu + ((a >> 20) & 1u);
    return static_cast<std::uint8_t>(sign | ((r >> 20) - (120u << 3)));
  }
  return static_cast<std::uint8_t>(sign | subnormal_units(a, -9));
}

float fp8e4m3_to_f32(std::uint8_t b) { return fp8_table()[b]; }

void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::size_t n) {
  const auto* s = static_cast<const std::byte*>(src);
  auto* d = static_cast<std::byte*>(dst);
  if (n == 0) return;
  if (src_dtype == dst_dtype) {
    std::memcpy(d, s, n * dtype_size(src_dtype));
    return;
  }
  if (src_dtype == DType::kFloat32) return from_f32(s, dst_dtype, d, n);
  if (dst_dtype == DType::kFloat32) return to_f32(s, src_dtype, d, n);
  // Narrow -> narrow through a float32 staging chunk (the widening is exact: one rounding).
  constexpr std::size_t kChunk = 2048;
  alignas(64) std::byte staging[kChunk * 4];
  const std::size_t ssize = dtype_size(src_dtype);
  const std::size_t dsize = dtype_size(dst_dtype);
  for (std::size_t i = 0; i < n; i += kChunk) {
    const std::size_t m = std::min(kChunk, n - i);
    to_f32(s + i * ssize, src_dtype, staging, m);
    from_f32(staging, dst_dtype, d + i * dsize, m);
  }
}

void convert_block(const void* src, DType src_dtype, std::int64_t src_offset,
                   std::int64_t src_stride, void* dst, DType dst_dtype, std::int64_t dst_offset,
                   std::int64_t dst_stride, std::int64_t rows, std::int64_t cols) {
  if (rows <= 0 || cols <= 0) return;
  const auto ssize = static_cast<std::int64_t>(dtype_size(src_dtype));
  const auto dsize = static_cast<std::int64_t>(dtype_size(dst_dtype));
  const auto* s = static_cast<const std::byte*>(src) + src_offset * ssize;
  auto* d = static_cast<std::byte*>(dst) + dst_offset * dsize;
  if (rows == 1 || (src_stride == cols && dst_stride == cols)) {
    convert(s, src_dtype, d, dst_dtype, static_cast<std::size_t>(rows * cols));
    return;
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    convert(s + r * src_stride * ssize, src_dtype, d + r * dst_stride * dsize, dst_dtype,
            static_cast<std::size_t>(cols));
  }
}

}  // namespace refit
