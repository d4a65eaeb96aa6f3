#include "common/quantize.h"

#include <algorithm>
#include <vector>

namespace refit {

bool quantize_fp8_blocks(const float* x, std::int64_t rows, std::int64_t cols,
                         std::int64_t block_rows, std::int64_t block_cols, std::uint8_t* codes,
                         float* scales, std::int64_t* bad_block) {
  const std::int64_t nbr = (rows + block_rows - 1) / block_rows;
  const std::int64_t nbc = (cols + block_cols - 1) / block_cols;
  std::vector<std::uint32_t> amax(static_cast<std::size_t>(nbr * nbc), 0);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      std::uint32_t& a = amax[static_cast<std::size_t>((r / block_rows) * nbc + c / block_cols)];
      a = std::max(a, abs_bits(x[r * cols + c]));
    }
  for (std::size_t b = 0; b < amax.size(); ++b) {
    scales[b] = fp8_scale_from_amax(from_bits(amax[b]));
    if (std::isnan(scales[b])) {
      if (bad_block) *bad_block = static_cast<std::int64_t>(b);
      return false;
    }
  }
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      codes[r * cols + c] = quantize_fp8(
          x[r * cols + c], scales[static_cast<std::size_t>((r / block_rows) * nbc + c / block_cols)]);
  return true;
}

}  // namespace refit
