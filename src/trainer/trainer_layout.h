// What each trainer rank holds at setup, under the trainer's own names (docs/design.md §2 stage 2).
//
// A TrainerShardLayout lists the rank's local tensors (FSDP2: HF names, dim-0 chunks; Megatron:
// Megatron names, TP/PP/EP shards with fused QKV and gate/up), each built from Pieces of full HF
// tensors. `owner` says, for every HF tensor, which pieces are the designated source of its
// elements during unshard: exactly one rank owns each element (replicas — data-parallel copies,
// TP-replicated norms, shared embeddings — own nothing), so the union of owned pieces over all
// ranks tiles every HF tensor exactly once.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/piece.h"
#include "common/pieces_by_tensor.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "refit/status.h"

namespace refit {

struct LocalTensor {
  std::string name;                 // trainer name (HF for FSDP2, Megatron for Megatron)
  std::vector<std::int64_t> shape;  // local shape; may have zero rows
  std::vector<Piece> pieces;        // HF blocks placed into this tensor (dst = this tensor)
  // Indices into `pieces` that this rank is the unshard source of.
  std::vector<std::uint32_t> owned;
};

struct TrainerShardLayout {
  int rank = 0;
  int world_size = 1;
  std::vector<LocalTensor> tensors;
  // For each HF tensor index: (local tensor index, piece index) of the pieces this rank owns,
  // ordered by (src_row, src_col). Empty when the rank owns nothing of that tensor.
  PiecesByTensor owned_by_hf;

  // Fills owned_by_hf from tensors[*].owned. Layout builders call this last.
  void index_owned(std::size_t num_hf_tensors);
};

// FSDP2 / DTensor Shard(0) with torch.chunk semantics (docs/design.md §6.2): chunk = ceil(n / W) rows,
// rank r holds rows [r*chunk, min((r+1)*chunk, n)), possibly none.
struct RowRange {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const { return end - begin; }
};
RowRange fsdp2_rows(std::int64_t rows, int world_size, int rank);
// The one piece of HF tensor `t` (of `shape`) that FSDP2 rank `rank` of `world_size` holds, placed
// at (0, 0) of its local tensor; rows == 0 when the rank's chunk is empty.
Piece fsdp2_piece(const std::vector<std::int64_t>& shape, std::uint32_t t, int world_size,
                  int rank);
TrainerShardLayout fsdp2_layout(const ModelSpec& spec, int world_size, int rank);

// Megatron-Core GPT layout (docs/design.md §6.3) of trainer rank `rank`; errors name the parallel size
// that does not divide the model.
Result<TrainerShardLayout> megatron_layout(const ModelSpec& spec, const MegatronParallel& par,
                                           int world_size, int rank);

// Dispatches on config.policy.backend.
Result<TrainerShardLayout> trainer_layout(const ModelSpec& spec, const PolicyConfig& policy,
                                          int rank);

}  // namespace refit
