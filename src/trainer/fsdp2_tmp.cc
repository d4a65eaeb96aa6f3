// TEMPORARY stand-ins for src/trainer/fsdp2_layout.cc (built on another branch) so that the
// megatron branch links on its own. DELETE THIS FILE when merging the fsdp2 layout.
#include <algorithm>

#include "trainer/trainer_layout.h"

namespace refit {

void TrainerShardLayout::index_owned(std::size_t num_hf_tensors) {
  owned_by_hf.assign(num_hf_tensors, {});
  for (std::uint32_t t = 0; t < tensors.size(); ++t)
    for (std::uint32_t i : tensors[t].owned)
      owned_by_hf[tensors[t].pieces[i].hf_tensor].emplace_back(t, i);
  for (auto& list : owned_by_hf)
    std::sort(list.begin(), list.end(), [&](const auto& a, const auto& b) {
      const Piece& pa = tensors[a.first].pieces[a.second];
      const Piece& pb = tensors[b.first].pieces[b.second];
      return std::tie(pa.src_row, pa.src_col) < std::tie(pb.src_row, pb.src_col);
    });
}

RowRange fsdp2_rows(std::int64_t rows, int world_size, int rank) {
  const std::int64_t chunk = (rows + world_size - 1) / world_size;
  const std::int64_t begin = std::min(rows, rank * chunk);
  return {begin, std::min(rows, begin + chunk)};
}

TrainerShardLayout fsdp2_layout(const ModelSpec& spec, int world_size, int rank) {
  TrainerShardLayout out;
  out.rank = rank;
  out.world_size = world_size;
  const auto& ts = spec.tensors();
  for (std::uint32_t h = 0; h < ts.size(); ++h) {
    const RowRange r = fsdp2_rows(ts[h].rows(), world_size, rank);
    LocalTensor t;
    t.name = ts[h].name;
    t.shape = ts[h].shape;
    if (!t.shape.empty()) t.shape[0] = r.size();
    if (r.size() > 0) {
      Piece p;
      p.hf_tensor = h;
      if (ts[h].shape.size() == 1) {
        p.src_col = r.begin, p.rows = 1, p.cols = r.size();
      } else {
        p.src_row = r.begin, p.rows = r.size(), p.cols = matrix_shape(ts[h].shape).cols;
      }
      t.pieces.push_back(p);
      t.owned.push_back(0);
    }
    out.tensors.push_back(std::move(t));
  }
  out.index_owned(ts.size());
  return out;
}

}  // namespace refit
