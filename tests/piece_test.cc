#include <gtest/gtest.h>

#include <map>
#include <random>

#include "common/piece.h"

namespace refit {
namespace {

TEST(PieceMatrixShape, LastDimIsColumns) {
  auto eq = [](std::vector<std::int64_t> shape, std::int64_t rows, std::int64_t cols) {
    const MatrixShape m = matrix_shape(shape);
    EXPECT_EQ(m.rows, rows) << "shape of rank " << shape.size();
    EXPECT_EQ(m.cols, cols) << "shape of rank " << shape.size();
  };
  eq({}, 1, 1);
  eq({5}, 1, 5);
  eq({3, 4}, 3, 4);
  eq({2, 3, 4}, 6, 4);
  eq({0, 4}, 0, 4);
  eq({4, 0}, 0, 0);
  eq({2, 0, 4}, 0, 4);
  eq({0}, 0, 0);
  EXPECT_EQ(matrix_shape({2, 3, 4}).numel(), 24);
}

TEST(PieceIntersect, WholeRowsInAlignedRangeIsOneBlock) {
  // HF [6, 4]; piece = rows 2..5, all columns, to local row 0 of a [4, 4] tensor.
  const Piece p{0, 2, 0, 4, 4, 0, 0};
  std::vector<Block2D> out;
  intersect_piece(p, 4, 4, 8, 24, out);  // elements of rows 2..5 exactly
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].src_offset, 0);
  EXPECT_EQ(out[0].dst_offset, 0);
  EXPECT_EQ(out[0].rows, 4);
  EXPECT_EQ(out[0].cols, 4);
  out.clear();
  intersect_piece(p, 4, 4, 0, 8, out);  // rows 0..1: outside the piece
  EXPECT_TRUE(out.empty());
}

// Every (piece, element range) of small matrices against an element-by-element reference.
TEST(PieceIntersect, MatchesElementwiseReference) {
  std::mt19937 rng(1234);
  auto uni = [&](std::int64_t lo, std::int64_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  int checked = 0;
  for (int trial = 0; trial < 150; ++trial) {
    const std::int64_t R = uni(1, 6), C = uni(1, 6);
    Piece p;
    p.src_row = uni(0, R - 1);
    p.rows = uni(1, R - p.src_row);
    p.src_col = uni(0, C - 1);
    p.cols = uni(1, C - p.src_col);
    const std::int64_t dst_cols = p.cols + uni(0, 3);
    p.dst_col = uni(0, dst_cols - p.cols);
    p.dst_row = uni(0, 2);
    for (std::int64_t b = 0; b < R * C; ++b) {
      for (std::int64_t e = b + 1; e <= R * C; ++e) {
        // Expected: dst flat index -> src flat index, for piece elements with src in [b, e).
        std::map<std::int64_t, std::int64_t> expected;
        for (std::int64_t i = 0; i < p.rows; ++i)
          for (std::int64_t j = 0; j < p.cols; ++j) {
            const std::int64_t src = (p.src_row + i) * C + p.src_col + j;
            if (src < b || src >= e) continue;
            expected[(p.dst_row + i) * dst_cols + p.dst_col + j] = src;
          }
        std::vector<Block2D> blocks;
        intersect_piece(p, C, dst_cols, b, e, blocks);
        ASSERT_LE(blocks.size(), 3u);
        std::map<std::int64_t, std::int64_t> got;
        for (const Block2D& k : blocks) {
          ASSERT_GT(k.rows, 0);
          ASSERT_GT(k.cols, 0);
          for (std::int64_t i = 0; i < k.rows; ++i)
            for (std::int64_t j = 0; j < k.cols; ++j) {
              const std::int64_t s = k.src_offset + i * k.src_stride + j;
              ASSERT_GE(s, 0);
              ASSERT_LT(s, e - b);
              const std::int64_t dpos = k.dst_offset + i * k.dst_stride + j;
              ASSERT_TRUE(got.emplace(dpos, s + b).second) << "destination written twice";
            }
        }
        ASSERT_EQ(got, expected) << "R=" << R << " C=" << C << " range [" << b << ", " << e << ")";
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 1000);
}

TEST(PieceIntersect, EmptyPieceOrRangeYieldsNothing) {
  std::vector<Block2D> out;
  intersect_piece(Piece{0, 0, 0, 0, 4, 0, 0}, 4, 4, 0, 16, out);
  intersect_piece(Piece{0, 0, 0, 2, 4, 0, 0}, 4, 4, 5, 5, out);
  EXPECT_TRUE(out.empty());
}

}  // namespace
}  // namespace refit
