// Element-type conversions between the dtypes refit moves (float32, bfloat16, float16,
// float8 e4m3fn), as scalar helpers and as bulk loops.
//
// Every conversion is a pure function of the input bits; all functions are thread-safe and
// allocation-free. Rounding is round-to-nearest-even everywhere. Conversions between two narrow
// types go through float32, which is exact for every narrow source, so they round once.
//
// NaN: stays NaN with its sign; a NaN produced by a narrowing is quiet (the top mantissa bit is
// set) and keeps the top bits of the payload that fit.
// Infinity: float32/float16/bfloat16 keep it; float8 e4m3fn has none (see below).
//
// float8 e4m3fn (OCP "E4M3"): bias 7, no infinities, 0x7F/0xFF are NaN, max finite ±448,
// subnormals down to 2^-9. Out-of-range inputs SATURATE: every finite or infinite value whose
// magnitude exceeds 448 becomes ±448. This matches CUDA's __nv_cvt_float_to_fp8(...,
// __NV_SATFINITE,
// __NV_E4M3) (what a GPU kernel of refit uses, so CPU and GPU casts agree bit for bit) and the
// clamp-then-cast of vLLM / Transformer Engine quantisation. It differs from PyTorch's CPU
// `tensor.to(torch.float8_e4m3fn)`, which returns NaN for |x| >= 480 and for ±inf (values in
// (448, 480) round to ±448 in both).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "refit/dtype.h"

namespace refit {

// Branch-free bit-level kernels, inline so that bulk loops vectorise.
inline std::uint16_t f32_bits_to_bf16(std::uint32_t u) {
  const std::uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  const std::uint32_t quiet_nan = (u >> 16) | 0x0040u;
  const bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<std::uint16_t>(is_nan ? quiet_nan : (rounded >> 16));
}
inline std::uint32_t bf16_to_f32_bits(std::uint16_t h) { return std::uint32_t{h} << 16; }

inline std::uint16_t f32_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return f32_bits_to_bf16(u);
}
inline float bf16_to_f32(std::uint16_t h) {
  const std::uint32_t u = bf16_to_f32_bits(h);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE 754 binary16: RNE, subnormals, magnitudes >= 65520 become ±inf.
std::uint16_t f32_to_f16(float f);
float f16_to_f32(std::uint16_t h);

// OCP float8 e4m3fn; saturating, see the header comment.
std::uint8_t f32_to_fp8e4m3(float f);
float fp8e4m3_to_f32(std::uint8_t b);

// Converts n elements from src (dtype src_dtype) to dst (dtype dst_dtype). Same dtype is a
// memcpy. src and dst need no alignment and must not overlap.
void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::size_t n);

// Strided 2-D variant (see Block2D in common/piece.h): for r in [0, rows) converts the `cols`
// elements at src element src_offset + r*src_stride to dst element dst_offset + r*dst_stride.
// Offsets and strides count elements of the respective dtype. Blocks must not overlap.
void convert_block(const void* src, DType src_dtype, std::int64_t src_offset,
                   std::int64_t src_stride, void* dst, DType dst_dtype, std::int64_t dst_offset,
                   std::int64_t dst_stride, std::int64_t rows, std::int64_t cols);

}  // namespace refit
