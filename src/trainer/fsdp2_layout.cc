// FSDP2 / DTensor Shard(0) layout (docs/design.md §6.2): every rank holds a torch.chunk slice along dim 0
// of every HF tensor, under the HF name, and is the unshard source of all of it (no replicas).
#include <algorithm>

#include "trainer/trainer_layout.h"

namespace refit {

void TrainerShardLayout::index_owned(std::size_t num_hf_tensors) {
  owned_by_hf.build(num_hf_tensors, [&](auto&& add) {
    for (std::uint32_t t = 0; t < tensors.size(); ++t)
      for (std::uint32_t p : tensors[t].owned) {
        const Piece& piece = tensors[t].pieces[p];
        if (piece.hf_tensor < num_hf_tensors) add(piece.hf_tensor, PiecesByTensor::Entry(t, p));
      }
  });
  for (std::size_t h = 0; h < num_hf_tensors; ++h) {
    const std::span<PiecesByTensor::Entry> list = owned_by_hf.mutable_list(h);
    if (list.size() < 2) continue;
    std::sort(list.begin(), list.end(), [&](const auto& a, const auto& b) {
      const Piece& pa = tensors[a.first].pieces[a.second];
      const Piece& pb = tensors[b.first].pieces[b.second];
      if (pa.src_row != pb.src_row) return pa.src_row < pb.src_row;
      return pa.src_col < pb.src_col;
    });
  }
}

RowRange fsdp2_rows(std::int64_t rows, int world_size, int rank) {
  if (rows <= 0 || world_size <= 0 || rank < 0 || rank >= world_size) return {};
  const std::int64_t chunk = (rows + world_size - 1) / world_size;
  const std::int64_t begin = std::min(rows, chunk * rank);
  const std::int64_t end = std::min(rows, begin + chunk);
  return {begin, end};
}

Piece fsdp2_piece(const std::vector<std::int64_t>& hf_shape, std::uint32_t t, int world_size,
                  int rank) {
  // A 0-d tensor is treated as one row: rank 0 holds it whole.
  const RowRange r = fsdp2_rows(hf_shape.empty() ? 1 : hf_shape[0], world_size, rank);
  Piece piece;
  piece.hf_tensor = t;
  if (hf_shape.size() <= 1) {
    // Matrix view [1, n]: a dim-0 chunk is a column range of the single row.
    piece.src_row = 0;
    piece.rows = 1;
    piece.src_col = r.begin;
    piece.cols = r.size();
  } else {
    // Matrix view [shape[0] * inner, last]: one dim-0 row spans `inner` matrix rows.
    std::int64_t inner = 1;
    for (std::size_t k = 1; k + 1 < hf_shape.size(); ++k) inner *= hf_shape[k];
    piece.src_row = r.begin * inner;
    piece.rows = r.size() * inner;
    piece.src_col = 0;
    piece.cols = hf_shape.back();
  }
  if (piece.rows <= 0 || piece.cols <= 0) piece.rows = piece.cols = 0;
  return piece;
}

TrainerShardLayout fsdp2_layout(const ModelSpec& spec, int world_size, int rank) {
  TrainerShardLayout layout;
  layout.rank = rank;
  layout.world_size = world_size;
  const auto& hf = spec.tensors();
  layout.tensors.reserve(hf.size());
  for (std::uint32_t i = 0; i < hf.size(); ++i) {
    const TensorSpec& t = hf[i];
    LocalTensor local;
    local.name = t.name;
    // A 0-d tensor is one row: shape [1] on rank 0 (kept 0-d), [0] on the others.
    const RowRange r = fsdp2_rows(t.shape.empty() ? 1 : t.shape[0], world_size, rank);
    local.shape = t.shape.empty() ? std::vector<std::int64_t>{1} : t.shape;
    local.shape[0] = r.size();
    if (t.shape.empty() && r.size() == 1) local.shape.clear();
    const Piece piece = fsdp2_piece(t.shape, i, world_size, rank);
    if (piece.rows > 0) {
      local.pieces.push_back(piece);
      local.owned.push_back(0);
    }
    layout.tensors.push_back(std::move(local));
  }
  layout.index_owned(hf.size());
  return layout;
}

}  // namespace refit
