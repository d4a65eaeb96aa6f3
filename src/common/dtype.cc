#include "refit/dtype.h"

#include <string>

namespace refit {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
      return 2;
    case DType::kFloat16:
      return 2;
    case DType::kFloat8E4M3:
      return 1;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kFloat8E4M3:
      return "float8_e4m3";
  }
  return "?";
}

std::string_view dtype_safetensors_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "F32";
    case DType::kBFloat16:
      return "BF16";
    case DType::kFloat16:
      return "F16";
    case DType::kFloat8E4M3:
      return "F8_E4M3";
  }
  return "?";
}

std::optional<DType> parse_dtype(std::string_view text) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3}) {
    if (text == dtype_name(d) || text == dtype_safetensors_name(d)) return d;
  }
  if (text == "fp32") return DType::kFloat32;
  if (text == "bf16") return DType::kBFloat16;
  if (text == "fp16") return DType::kFloat16;
  if (text == "fp8" || text == "fp8_e4m3") return DType::kFloat8E4M3;
  return std::nullopt;
}

}  // namespace refit
