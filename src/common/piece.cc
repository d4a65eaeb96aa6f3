#include "common/piece.h"

#include <algorithm>

namespace refit {

MatrixShape matrix_shape(const std::vector<std::int64_t>& shape) {
  if (shape.empty()) return {1, 1};
  const std::int64_t cols = shape.back();
  if (cols == 0) return {0, 0};
  std::int64_t rows = 1;  // numel / cols
  for (std::size_t k = 0; k + 1 < shape.size(); ++k) rows *= shape[k];
  return {rows, cols};
}

void intersect_piece(const Piece& p, std::int64_t hf_cols, std::int64_t dst_cols,
                     std::int64_t elem_begin, std::int64_t elem_end, std::vector<Block2D>& out) {
  if (p.rows <= 0 || p.cols <= 0 || elem_begin >= elem_end) return;
  // Rows of the piece that the range touches at all.
  const std::int64_t first_row = std::max(p.src_row, elem_begin / hf_cols);
  const std::int64_t last_row = std::min(p.src_row + p.rows - 1, (elem_end - 1) / hf_cols);
  if (first_row > last_row) return;
  auto emit = [&](std::int64_t row_lo, std::int64_t row_hi, std::int64_t col_lo,
                  std::int64_t col_hi) {  // rows [row_lo, row_hi], cols [col_lo, col_hi)
    if (row_lo > row_hi || col_lo >= col_hi) return;
    Block2D b;
    b.src_offset = row_lo * hf_cols + col_lo - elem_begin;
    b.src_stride = hf_cols;
    b.dst_offset = (p.dst_row + row_lo - p.src_row) * dst_cols + p.dst_col + (col_lo - p.src_col);
    b.dst_stride = dst_cols;
    b.rows = row_hi - row_lo + 1;
    b.cols = col_hi - col_lo;
    out.push_back(b);
  };
  const std::int64_t c0 = p.src_col, c1 = p.src_col + p.cols;
  // Column window of a row clipped to the range.
  auto clip = [&](std::int64_t row, std::int64_t& lo, std::int64_t& hi) {
    lo = std::max(c0, elem_begin - row * hf_cols);
    hi = std::min(c1, elem_end - row * hf_cols);
  };
  std::int64_t lo, hi;
  std::int64_t mid_lo = first_row, mid_hi = last_row;
  clip(first_row, lo, hi);
  if (lo != c0 || hi != c1) {  // first row partial
    emit(first_row, first_row, lo, hi);
    mid_lo = first_row + 1;
  }
  if (last_row >= mid_lo) {
    clip(last_row, lo, hi);
    if (lo != c0 || hi != c1) {  // last row partial
      emit(last_row, last_row, lo, hi);
      mid_hi = last_row - 1;
    }
  }
  if (mid_lo <= mid_hi) emit(mid_lo, mid_hi, c0, c1);
}

}  // namespace refit
