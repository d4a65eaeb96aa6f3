// refit/dtype.h — element types refit moves. Plain value types; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace refit {

enum class DType : std::uint8_t {
  kFloat32,
  kBFloat16,
  kFloat16,
  kFloat8E4M3,  // OCP e4m3fn: no infinities, one NaN pattern per sign, max 448
};

std::size_t dtype_size(DType dtype);
// Config/CLI spelling: "float32", "bfloat16", "float16", "float8_e4m3".
std::string_view dtype_name(DType dtype);
// Safetensors spelling: "F32", "BF16", "F16", "F8_E4M3".
std::string_view dtype_safetensors_name(DType dtype);
// Accepts both spellings above and the short forms "fp32", "bf16", "fp16", "fp8".
std::optional<DType> parse_dtype(std::string_view text);

}  // namespace refit
