// The FP8 reference quantizer's arithmetic, written plainly for host and device (docs/fp8.md,
// "Semantics"): what --verify checks the sender's quantize kernels against on the GPU
// (harness/fp8_reference_device.h). It shares no code with the kernels it checks
// (device/quant_kernels.cu) nor with the CPU quantizer (common/quantize.h): the e4m3 code comes
// from frexp and rint instead of bit tricks, the quotient from an IEEE division.
// tests/fp8_reference_test.cc checks it on the host against common/quantize.h, and
// tests/cuda_fp8_reference_test.cc checks the device kernels against the CPU quantizer, bit for
// bit.
//
// Included by a .cu file, so C++17 and no refit headers.
#pragma once

#include <math.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define REFIT_FP8_REF_FN __host__ __device__ inline
#else
#define REFIT_FP8_REF_FN inline
#endif

namespace refit::fp8ref {

// |x| as float32 bits: magnitudes compare as unsigned integers, NaN above +inf.
REFIT_FP8_REF_FN std::uint32_t magnitude_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x) & 0x7FFFFFFFu;
#else
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u & 0x7FFFFFFFu;
#endif
}

REFIT_FP8_REF_FN float bits_to_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// One IEEE float32 division, rounded to nearest even.
REFIT_FP8_REF_FN float divide(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// Whether the amax bits belong to a finite value.
REFIT_FP8_REF_FN bool finite_amax(std::uint32_t amax_bits) { return amax_bits < 0x7F800000u; }

// The block's scale from its amax (finite, non-negative): amax / 448, or 1 where that is zero.
REFIT_FP8_REF_FN float scale_of_amax(std::uint32_t amax_bits) {
  const float s = divide(bits_to_float(amax_bits), 448.0f);
  return s == 0.0f ? 1.0f : s;
}

// float8 e4m3fn code of q, rounded to nearest even, saturated at ±448 (NaN: 0x7F with q's sign).
// e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; codes 0x01..0x07 are the subnormals
// k * 2^-9, 0x7E is 448, 0x7F NaN.
REFIT_FP8_REF_FN std::uint8_t e4m3_code(float q) {
#if defined(__CUDA_ARCH__)
  const bool negative = signbit(q);
  const float a = fabsf(q);
  const bool nan = isnan(a);
#else
  const bool negative = std::signbit(q);
  const float a = std::fabs(q);
  const bool nan = std::isnan(a);
#endif
  const std::uint8_t sign = negative ? 0x80 : 0x00;
  if (nan) return static_cast<std::uint8_t>(sign | 0x7F);
  if (a >= 448.0f) return static_cast<std::uint8_t>(sign | 0x7E);
  if (a < 0.015625f) {  // below 2^-6: multiples of 2^-9 (8 of them is the smallest normal, 0x08)
    const float units = rintf(a * 512.0f);
    return static_cast<std::uint8_t>(sign | static_cast<std::uint8_t>(units));
  }
  int e = 0;
  const float m = frexpf(a, &e);                 // a = m * 2^e, m in [0.5, 1)
  float frac = rintf((2.0f * m - 1.0f) * 8.0f);  // the 3 mantissa bits; 8 is a carry
  int exponent = e - 1;                          // a in [2^exponent, 2^(exponent + 1))
  if (frac == 8.0f) {
    frac = 0.0f;
    exponent += 1;
  }
  return static_cast<std::uint8_t>(sign | ((exponent + 7) << 3) | static_cast<int>(frac));
}

// The code of element x of a block whose scale is `scale`.
REFIT_FP8_REF_FN std::uint8_t quantize(float x, float scale) { return e4m3_code(divide(x, scale)); }

}  // namespace refit::fp8ref
