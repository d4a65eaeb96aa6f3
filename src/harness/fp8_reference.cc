#include "harness/fp8_reference.h"

#include <fmt/format.h>

#include <cstring>

#include "common/quantize.h"
#include "weights/materialize.h"

namespace refit {

Result<const std::vector<std::byte>*> Fp8Reference::tensor(std::uint32_t t) {
  if (auto it = cache_.find(t); it != cache_.end()) return &it->second;
  // Tensors are asked for in layout order: keep the cache to the tensors of a few parameters.
  if (cache_.size() > 16) cache_.clear();
  const Fp8Table& f = *wire_.fp8;
  const std::uint32_t weight = f.is_scale(t) ? static_cast<std::uint32_t>(f.weight_of[t]) : t;
  const TensorSpec& ts = wire_.spec.tensors()[weight];
  const MatrixShape m = matrix_shape(ts.shape);
  std::vector<float> x(static_cast<std::size_t>(m.numel()));
  materialize_pieces(model_.spec, {Piece{.hf_tensor = weight, .rows = m.rows, .cols = m.cols}},
                     ts.shape, *model_.weights, step_, policy_, DType::kFloat32,
                     reinterpret_cast<std::byte*>(x.data()));
  if (!f.quantized(weight)) {
    std::vector<std::byte> out(x.size() * dtype_size(wire_.dtype[weight]));
    convert(x.data(), DType::kFloat32, out.data(), wire_.dtype[weight], x.size());
    return &cache_.emplace(t, std::move(out)).first->second;
  }
  const MatrixShape block = f.block(wire_.spec, weight);
  const MatrixShape grid = matrix_shape(wire_.spec.tensors()[static_cast<std::size_t>(f.scale_of[weight])].shape);
  std::vector<std::byte> codes(x.size());
  std::vector<std::byte> scales(static_cast<std::size_t>(grid.numel()) * 4);
  std::int64_t bad = -1;
  if (!quantize_fp8_blocks(x.data(), m.rows, m.cols, block.rows, block.cols,
                           reinterpret_cast<std::uint8_t*>(codes.data()),
                           reinterpret_cast<float*>(scales.data()), &bad))
    return Status::InvalidArgument(fmt::format("fp8 reference: {} holds NaN or inf in block {}",
                                               ts.name, bad));
  cache_[weight] = std::move(codes);
  cache_[static_cast<std::uint32_t>(f.scale_of[weight])] = std::move(scales);
  return &cache_.at(t);
}

Result<std::vector<std::byte>> Fp8Reference::param(const EngineParam& p) {
  const std::size_t esize = dtype_size(p.dtype);
  const MatrixShape pm = matrix_shape(p.shape);
  std::vector<std::byte> out(static_cast<std::size_t>(pm.numel()) * esize, std::byte{0});
  for (const Piece& pc : p.pieces) {
    REFIT_ASSIGN_OR_RETURN(const std::vector<std::byte>* src, tensor(pc.hf_tensor));
    const std::int64_t src_cols = matrix_shape(wire_.spec.tensors()[pc.hf_tensor].shape).cols;
    for (std::int64_t r = 0; r < pc.rows; ++r)
      std::memcpy(out.data() + ((pc.dst_row + r) * pm.cols + pc.dst_col) * static_cast<std::int64_t>(esize),
                  src->data() + ((pc.src_row + r) * src_cols + pc.src_col) * static_cast<std::int64_t>(esize),
                  static_cast<std::size_t>(pc.cols) * esize);
  }
  return out;
}

std::string Fp8Reference::source(const EngineParam& p, std::int64_t row, std::int64_t col) const {
  for (const Piece& pc : p.pieces) {
    if (row < pc.dst_row || row >= pc.dst_row + pc.rows || col < pc.dst_col ||
        col >= pc.dst_col + pc.cols)
      continue;
    const std::int64_t r = pc.src_row + row - pc.dst_row, c = pc.src_col + col - pc.dst_col;
    const Fp8Table& f = *wire_.fp8;
    if (f.is_scale(pc.hf_tensor))
      return fmt::format("the scale of block ({}, {}) of {}", r, c,
                         wire_.spec.tensors()[static_cast<std::size_t>(f.weight_of[pc.hf_tensor])].name);
    return fmt::format("{}[{}, {}]", wire_.spec.tensors()[pc.hf_tensor].name, r, c);
  }
  return "vocabulary padding (must be zero)";
}

}  // namespace refit
