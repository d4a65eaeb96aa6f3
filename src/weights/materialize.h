// Builds tensors from pieces of the deterministic trainer weights: a trainer rank's local shards
// (in the policy dtype) and, for verification, what an engine parameter must hold (in the target
// dtype, cast through the policy dtype exactly as the trainer's values are).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/piece.h"
#include "refit/dtype.h"
#include "refit/model_spec.h"
#include "weights/weights.h"

namespace refit {

// Writes every piece of a tensor of `shape` into `out` (dtype `out_dtype`): HF values at `step`,
// rounded to `via` first. Elements no piece covers are left untouched.
void materialize_pieces(const ModelSpec& spec, const std::vector<Piece>& pieces,
                        const std::vector<std::int64_t>& shape, const WeightSource& weights,
                        int step, DType via, DType out_dtype, std::byte* out);

}  // namespace refit
