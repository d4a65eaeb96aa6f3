#include "plan/gather_schedule.h"

namespace refit {

std::vector<BucketGather> build_gather_schedule(const ModelSpec& spec, const BucketPlan& plan,
                                                const std::vector<TrainerShardLayout>& layouts) {
  const std::size_t esize = dtype_size(plan.dtype);
  const std::size_t world = layouts.size();
  std::vector<BucketGather> out(plan.buckets.size());
  std::vector<Block2D> blocks;
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    BucketGather& g = out[b];
    g.runs.resize(world);
    g.counts.assign(world, 0);
    for (std::size_t r = 0; r < world; ++r) {
      const TrainerShardLayout& lay = layouts[r];
      for (const BucketEntry& e : plan.buckets[b].entries) {
        const TensorSpec& t = spec.tensors()[e.tensor];
        const std::int64_t hf_cols = matrix_shape(t.shape).cols;
        const std::int64_t entry_elem = e.offset / static_cast<std::int64_t>(esize);
        for (const auto& [local, piece] : lay.owned_by_hf[e.tensor]) {
          const LocalTensor& lt = lay.tensors[local];
          blocks.clear();
          intersect_piece(lt.pieces[piece], hf_cols, matrix_shape(lt.shape).cols, e.elem_begin,
                          e.elem_begin + e.elem_count, blocks);
          for (const Block2D& blk : blocks) {  // intersect_piece: src = HF/bucket, dst = local
            g.runs[r].push_back(GatherRun{.local = local,
                                          .block = {.src_offset = blk.dst_offset,
                                                    .src_stride = blk.dst_stride,
                                                    .dst_offset = blk.src_offset + entry_elem,
                                                    .dst_stride = blk.src_stride,
                                                    .rows = blk.rows,
                                                    .cols = blk.cols}});
            g.counts[r] += static_cast<std::size_t>(blk.numel()) * esize;
          }
        }
      }
    }
    int owners = 0;
    for (std::size_t r = 0; r < world; ++r) owners += g.counts[r] > 0 ? 1 : 0;
    g.single_owner = owners <= 1;
  }
  return out;
}

std::vector<ApplyRun> build_apply_runs(const ModelSpec& spec, const EngineShardLayout& layout,
                                       const std::vector<BucketEntry>& entries, DType dtype) {
  const std::int64_t esize = static_cast<std::int64_t>(dtype_size(dtype));
  std::vector<ApplyRun> runs;
  std::vector<Block2D> blocks;
  for (const BucketEntry& e : entries) {
    const TensorSpec& t = spec.tensors()[e.tensor];
    const std::int64_t hf_cols = matrix_shape(t.shape).cols;
    for (const auto& [param, piece] : layout.pieces_by_hf[e.tensor]) {
      const EngineParam& p = layout.params[param];
      blocks.clear();
      intersect_piece(p.pieces[piece], hf_cols, matrix_shape(p.shape).cols, e.elem_begin,
                      e.elem_begin + e.elem_count, blocks);
      for (Block2D blk : blocks) {
        blk.src_offset += e.offset / esize;
        runs.push_back(ApplyRun{param, blk});
      }
    }
  }
  return runs;
}

}  // namespace refit
