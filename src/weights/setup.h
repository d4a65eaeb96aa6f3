// What every process of a refit derives from the config alone, identically: the model spec, the
// optional checkpoint, the deterministic weight source and the bucket plan.
#pragma once

#include <memory>
#include <string>

#include "io/safetensors.h"
#include "plan/bucket_plan.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "weights/weights.h"

namespace refit {

struct RankModel {
  ModelSpec spec;
  std::unique_ptr<Checkpoint> checkpoint;  // null when the model has no safetensors
  std::unique_ptr<WeightSource> weights;   // refers to spec and checkpoint
  BucketPlan plan;
};

// Loads and validates (validate_config) the model of `config` and builds its plan. Heap-held
// because the weight source refers to the spec and checkpoint beside it.
Result<std::unique_ptr<RankModel>> load_rank_model(const Config& config);

// Name prefix of trainer rank `rank`'s shared-memory slots in run `run_id`.
std::string ipc_segment_prefix(const std::string& run_id, int rank);

}  // namespace refit
