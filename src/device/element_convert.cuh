// Element conversions of the CUDA kernels: the device twins of common/convert.h, bit for bit
// (round to nearest even, NaN quiet with its sign and top payload bits, fp8 e4m3fn saturating).
// Storage types are raw bits, so copies never touch NaN payloads. Included by the .cu files of
// device/ only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "refit/dtype.h"

namespace refit::elem {

struct F32 {
  using T = std::uint32_t;
};
struct BF16 {
  using T = std::uint16_t;
};
struct F16 {
  using T = std::uint16_t;
};
struct FP8 {
  using T = std::uint8_t;
};

__device__ __forceinline__ std::uint32_t subnormal_units(std::uint32_t a, int unit_exp) {
  const int e = static_cast<int>(a >> 23);
  if (e == 0) return 0;
  const std::uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const int shift = unit_exp + 150 - e;
  if (shift > 24) return 0;
  const std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  return q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
}

// float32 bits -> narrow bits (round to nearest even; see common/convert.h).
template <class D>
__device__ __forceinline__ typename D::T from_f32(std::uint32_t u) {
  if constexpr (std::is_same_v<D, F32>) {
    return u;
  } else if constexpr (std::is_same_v<D, BF16>) {
    const std::uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
    const std::uint32_t quiet_nan = (u >> 16) | 0x0040u;
    const bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    return static_cast<std::uint16_t>(is_nan ? quiet_nan : (rounded >> 16));
  } else if constexpr (std::is_same_v<D, F16>) {
    const std::uint32_t sign = (u >> 16) & 0x8000u;
    const std::uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
    if (a >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);
    if (a >= 0x38800000u) {
      const std::uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);
      return static_cast<std::uint16_t>(sign | ((r >> 13) - (112u << 10)));
    }
    return static_cast<std::uint16_t>(sign | subnormal_units(a, -24));
  } else {
    static_assert(std::is_same_v<D, FP8>);
    const std::uint32_t sign = (u >> 24) & 0x80u;
    const std::uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return static_cast<std::uint8_t>(sign | 0x7Fu);
    if (a >= 0x43E00000u) return static_cast<std::uint8_t>(sign | 0x7Eu);
    if (a >= 0x3C800000u) {
      const std::uint32_t r = a + 0x7FFFFu + ((a >> 20) & 1u);
      return static_cast<std::uint8_t>(sign | ((r >> 20) - (120u << 3)));
    }
    return static_cast<std::uint8_t>(sign | subnormal_units(a, -9));
  }
}

// narrow bits -> float32 bits (exact).
template <class S>
__device__ __forceinline__ std::uint32_t to_f32(typename S::T h) {
  if constexpr (std::is_same_v<S, F32>) {
    return h;
  } else if constexpr (std::is_same_v<S, BF16>) {
    return std::uint32_t{h} << 16;
  } else if constexpr (std::is_same_v<S, F16>) {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t e = (h >> 10) & 0x1Fu;
    const std::uint32_t m = h & 0x3FFu;
    if (e == 31) return sign | 0x7F800000u | (m << 13);
    if (e == 0) return sign | __float_as_uint(__fmul_rn(__uint2float_rn(m), 0x1p-24f));
    return sign | ((e + 112) << 23) | (m << 13);
  } else {
    static_assert(std::is_same_v<S, FP8>);
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x80) << 24;
    const std::uint32_t e = (h >> 3) & 0xF;
    const std::uint32_t m = h & 0x7;
    if ((h & 0x7F) == 0x7F) return sign | 0x7FC00000u;
    if (e == 0) return sign | __float_as_uint(__fmul_rn(__uint2float_rn(m), 0x1p-9f));
    return sign | ((e + 120) << 23) | (m << 20);
  }
}

template <class S, class D>
__device__ __forceinline__ typename D::T convert_elem(typename S::T x) {
  if constexpr (std::is_same_v<S, D>) {
    return x;
  } else {
    return from_f32<D>(to_f32<S>(x));
  }
}

// A dtype as the kernels' runtime switches name it: float32 0, bfloat16 1, float16 2, fp8 3.
inline int dtype_code(DType d) {
  switch (d) {
    case DType::kFloat32:
      return 0;
    case DType::kBFloat16:
      return 1;
    case DType::kFloat16:
      return 2;
    case DType::kFloat8E4M3:
      return 3;
  }
  return 0;
}

}  // namespace refit::elem
