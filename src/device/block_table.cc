// CPU side of device/copy_kernels.h: tiling Block2D runs, uploading tables, runs from pieces.
#include <fmt/format.h>

#include <limits>

#include "device/copy_kernels.h"

namespace refit {
namespace {

CopyKernelTuning g_tuning;

constexpr std::int64_t kMaxI32 = std::numeric_limits<std::int32_t>::max();

DeviceTile make_tile(std::int64_t src_offset, std::int64_t src_stride, std::int64_t dst_offset,
                     std::int64_t dst_stride, std::int64_t rows, std::int64_t cols,
                     std::uint32_t tag) {
  DeviceTile t;
  t.src_offset = src_offset;
  t.dst_offset = dst_offset;
  t.src_stride = static_cast<std::int32_t>(src_stride);
  t.dst_stride = static_cast<std::int32_t>(dst_stride);
  t.rows = static_cast<std::int32_t>(rows);
  t.cols = static_cast<std::int32_t>(cols);
  t.tag = tag;
  return t;
}

}  // namespace

void set_copy_kernel_tuning(const CopyKernelTuning& tuning) { g_tuning = tuning; }
CopyKernelTuning copy_kernel_tuning() { return g_tuning; }

Status tile_run(const Block2D& run, std::uint32_t tag, std::vector<DeviceTile>& out) {
  if (run.rows < 0 || run.cols < 0 || run.src_offset < 0 || run.dst_offset < 0 ||
      run.src_stride < 0 || run.dst_stride < 0)
    return Status::InvalidArgument(fmt::format(
        "block copy run (src {} stride {}, dst {} stride {}, {}x{}): offsets, strides and sizes "
        "must be non-negative",
        run.src_offset, run.src_stride, run.dst_offset, run.dst_stride, run.rows, run.cols));
  if (run.rows == 0 || run.cols == 0) return Status::Ok();
  const bool contiguous =
      run.rows == 1 || (run.src_stride == run.cols && run.dst_stride == run.cols);
  if (contiguous) {  // one long row, cut into column chunks
    const std::int64_t n = run.rows * run.cols;
    for (std::int64_t c = 0; c < n; c += kTileElems)
      out.push_back(make_tile(run.src_offset + c, 0, run.dst_offset + c, 0, 1,
                              std::min(kTileElems, n - c), tag));
    return Status::Ok();
  }
  if (run.src_stride > kMaxI32 || run.dst_stride > kMaxI32)
    return Status::InvalidArgument(fmt::format(
        "block copy run (src stride {}, dst stride {}): row strides above 2^31-1 elements are "
        "not supported",
        run.src_stride, run.dst_stride));
  if (run.cols >= kTileElems) {  // long rows: each row in column chunks
    for (std::int64_t r = 0; r < run.rows; ++r)
      for (std::int64_t c = 0; c < run.cols; c += kTileElems)
        out.push_back(make_tile(run.src_offset + r * run.src_stride + c, 0,
                                run.dst_offset + r * run.dst_stride + c, 0, 1,
                                std::min(kTileElems, run.cols - c), tag));
    return Status::Ok();
  }
  const std::int64_t rows_per_tile = kTileElems / run.cols;
  for (std::int64_t r = 0; r < run.rows; r += rows_per_tile)
    out.push_back(make_tile(run.src_offset + r * run.src_stride, run.src_stride,
                            run.dst_offset + r * run.dst_stride, run.dst_stride,
                            std::min(rows_per_tile, run.rows - r), run.cols, tag));
  return Status::Ok();
}

Result<DeviceBlockTable> DeviceBlockTable::upload(
    const std::vector<std::vector<Block2D>>& groups, int device,
    const std::vector<std::vector<std::uint32_t>>* tags) {
  if (tags != nullptr && tags->size() != groups.size())
    return Status::InvalidArgument(
        fmt::format("block table: {} tag groups for {} run groups", tags->size(), groups.size()));
  DeviceBlockTable t;
  std::vector<DeviceTile> tiles;
  t.group_begin_.push_back(0);
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (tags != nullptr && (*tags)[g].size() != groups[g].size())
      return Status::InvalidArgument(fmt::format("block table: group {} has {} runs but {} tags", g,
                                                 groups[g].size(), (*tags)[g].size()));
    std::int64_t numel = 0;
    for (std::size_t i = 0; i < groups[g].size(); ++i) {
      const std::uint32_t tag = tags != nullptr ? (*tags)[g][i] : 0;
      Status st = tile_run(groups[g][i], tag, tiles);
      if (!st.ok()) return st.with_context(fmt::format("block table group {} run {}", g, i));
      numel += groups[g][i].numel();
    }
    t.group_begin_.push_back(static_cast<std::int64_t>(tiles.size()));
    t.group_numel_.push_back(numel);
  }
  REFIT_ASSIGN_OR_RETURN(t.tiles_,
                         DeviceBuffer::allocate(tiles.size() * sizeof(DeviceTile), device));
  REFIT_RETURN_IF_ERROR(
      copy_to_device(t.tiles_.data(), tiles.data(), tiles.size() * sizeof(DeviceTile)));
  return t;
}

std::int64_t DeviceBlockTable::numel() const {
  std::int64_t n = 0;
  for (std::int64_t g : group_numel_) n += g;
  return n;
}

void append_piece_runs(const ModelSpec& spec, const std::vector<Piece>& pieces,
                       const std::vector<std::int64_t>& dst_shape, std::int64_t dst_base,
                       const std::vector<std::int64_t>* src_base, std::vector<Block2D>& runs,
                       std::vector<std::uint32_t>& tags) {
  const std::int64_t dst_cols = matrix_shape(dst_shape).cols;
  for (const Piece& p : pieces) {
    if (p.rows <= 0 || p.cols <= 0) continue;
    const std::int64_t hf_cols = matrix_shape(spec.tensors()[p.hf_tensor].shape).cols;
    Block2D b;
    b.src_offset =
        (src_base != nullptr ? (*src_base)[p.hf_tensor] : 0) + p.src_row * hf_cols + p.src_col;
    b.src_stride = hf_cols;
    b.dst_offset = dst_base + p.dst_row * dst_cols + p.dst_col;
    b.dst_stride = dst_cols;
    b.rows = p.rows;
    b.cols = p.cols;
    runs.push_back(b);
    tags.push_back(p.hf_tensor);
  }
}

}  // namespace refit
