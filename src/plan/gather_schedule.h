// The static transfer schedule of a refit, computed once at setup from metadata alone.
//
// For every bucket of the plan:
//  - unshard: what each trainer rank contributes (its owned pieces of the bucket's entries, as
//    strided blocks of its local tensors, cast to the target dtype and laid end to end) and where
//    each contributed block lands in the packed bucket;
//  - apply: for one engine rank, which blocks of the packed bucket go where in its parameters.
// The same schedule serves FSDP2 and Megatron (their layouts differ only in their pieces) and
// both engine protocols (vLLM derives bucket entries from the plan, SGLang from the metadata that
// travels with each bucket).
#pragma once

#include <cstdint>
#include <vector>

#include "common/piece.h"
#include "engine/engine_layout.h"
#include "plan/bucket_plan.h"
#include "refit/model_spec.h"
#include "trainer/trainer_layout.h"

namespace refit {

// One strided block of a trainer rank's local tensor `local` that lands in the bucket, in the
// direction of the copy: block.src_* address the local tensor (policy dtype); block.dst_* address
// the bucket (elements from the start of the bucket, target dtype).
struct GatherRun {
  std::uint32_t local = 0;
  Block2D block;
};

struct BucketGather {
  // runs[r]: rank r's contribution, in the order it is laid out in r's send buffer.
  std::vector<std::vector<GatherRun>> runs;
  std::vector<std::size_t> counts;  // bytes each rank contributes (target dtype)
  bool single_owner = false;        // one rank owns everything: no collective payload needed
};

// Builds the unshard schedule of every bucket for every trainer rank.
// `layouts` holds every trainer rank's layout (index = rank).
std::vector<BucketGather> build_gather_schedule(const ModelSpec& spec, const BucketPlan& plan,
                                                const std::vector<TrainerShardLayout>& layouts);

// One strided block from the packed bucket into engine parameter `param`.
// block.src_* address the bucket (elements, target dtype); block.dst_* address the parameter.
struct ApplyRun {
  std::uint32_t param = 0;
  Block2D block;
};

// Apply runs of one bucket for one engine rank.
std::vector<ApplyRun> build_apply_runs(const ModelSpec& spec, const EngineShardLayout& layout,
                                       const std::vector<BucketEntry>& entries, DType dtype);

}  // namespace refit
