// FP8 quantization with scales (refit.target_precision: fp8; docs/fp8.md).
//
// The semantics every path of refit implements bit for bit (CPU loops here, CUDA kernels in
// device/quant_kernels.cu), and the reference tests check against (NumPy in CI, torch's
// float8_e4m3fn on the device). x is the trainer's value in the policy dtype, widened to float32
// exactly (bf16 and fp16 widen exactly); every operation is one float32 operation:
//   amax      = max |x| over the block
//   scale     = amax / 448            (1 where that is zero: an all-zero block, or
//                                       amax < 448 * 2^-150, whose quotient underflows)
//   quantized = saturate(round_to_nearest_even(x / scale))  as float8 e4m3fn
// The scale is the dequantization multiplier: x ≈ quantized * scale. Vllm and SGLang call it
// `weight_scale_inv` for block scales (DeepSeek-V3's name) and `weight_scale` per tensor.
// A block holding NaN or ±inf has no scale: refit refuses it (fp8_scale_from_amax).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common/convert.h"

namespace refit {

inline constexpr float kFp8E4M3Max = 448.0f;

// |x| as float32 bits compare like the magnitudes they encode, NaN above +inf; amax arrays are
// combined as unsigned integers (max over ranks), so a NaN anywhere survives the combination.
inline std::uint32_t abs_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return u & 0x7FFFFFFFu;
}
inline float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The scale of a block whose amax (non-negative float32, or NaN / inf) is `amax`: amax / 448, or
// 1 for an all-zero block. Non-finite amax: NaN (the caller reports the block).
inline float fp8_scale_from_amax(float amax) {
  if (!(amax <= std::numeric_limits<float>::max())) return std::numeric_limits<float>::quiet_NaN();
  const float s = amax / kFp8E4M3Max;
  return s == 0.0f ? 1.0f : s;
}

// One element: saturate(rne(x / scale)). f32_to_fp8e4m3 rounds to nearest even and saturates.
inline std::uint8_t quantize_fp8(float x, float scale) { return f32_to_fp8e4m3(x / scale); }

// A 2-D tensor [rows, cols] of float32 values quantized with blocks of block_rows x block_cols
// (ragged at the ends): codes[rows * cols] and scales[ceil(rows / br) * ceil(cols / bc)],
// row-major. Returns false (and leaves the outputs undefined) when a block holds NaN or ±inf;
// `bad_block` then receives its index.
bool quantize_fp8_blocks(const float* x, std::int64_t rows, std::int64_t cols,
                         std::int64_t block_rows, std::int64_t block_cols, std::uint8_t* codes,
                         float* scales, std::int64_t* bad_block = nullptr);

}  // namespace refit
