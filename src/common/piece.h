// Pieces: the one vocabulary every layout speaks.
//
// Every tensor refit handles is viewed as a 2-D row-major matrix [rows, cols] with
// cols = the last dimension (a 1-D tensor of n elements is [1, n]; a 3-D MoE tensor
// [E, R, C] is [E*R, C]). A layout (FSDP2 shard, Megatron shard, engine TP shard) describes each
// of its local tensors as a list of Pieces: rectangular blocks of one full HF tensor placed at a
// position of the local tensor. Unshard, pack and apply are all "copy these pieces", so one
// copy engine (CPU loops, and the CUDA kernels of device/copy_kernels.h) serves every backend.
#pragma once

#include <cstdint>
#include <vector>

namespace refit {

// [rows, cols] view of a shape: cols = last dim (1 for scalars), rows = numel / cols.
struct MatrixShape {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t numel() const { return rows * cols; }
};
MatrixShape matrix_shape(const std::vector<std::int64_t>& shape);

// Copies HF tensor `hf_tensor`'s block [src_row, src_row+rows) x [src_col, src_col+cols) to the
// local tensor's block starting at (dst_row, dst_col).
struct Piece {
  std::uint32_t hf_tensor = 0;  // index into ModelSpec::tensors()
  std::int64_t src_row = 0, src_col = 0;
  std::int64_t rows = 0, cols = 0;
  std::int64_t dst_row = 0, dst_col = 0;
};

// A strided 2-D element copy: rows x cols elements, from src_offset (row stride src_stride) to
// dst_offset (row stride dst_stride). Offsets and strides count elements.
struct Block2D {
  std::int64_t src_offset = 0, src_stride = 0;
  std::int64_t dst_offset = 0, dst_stride = 0;
  std::int64_t rows = 0, cols = 0;
  std::int64_t numel() const { return rows * cols; }
};

// The part of `piece` whose *source* elements (flat index into the HF tensor of row length
// `hf_cols`) fall in [elem_begin, elem_end), as at most 3 blocks, appended to `out`.
// Block src offsets are relative to elem_begin (i.e. positions inside a bucket entry that holds
// HF elements [elem_begin, elem_end)); dst offsets are flat indices into the local tensor of row
// length `dst_cols`.
void intersect_piece(const Piece& piece, std::int64_t hf_cols, std::int64_t dst_cols,
                     std::int64_t elem_begin, std::int64_t elem_end, std::vector<Block2D>& out);

}  // namespace refit
