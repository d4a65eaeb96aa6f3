// The two engine protocols (docs/design.md §4).
//  - sglang: the metadata of every bucket (names, dtypes, shapes, byte offsets and, for a tensor
//    split over buckets, its element range) travels with the bucket; the engine applies what the
//    metadata says. bf16 only; a weight_version string per refit.
//  - vllm: a manifest (names, shapes, dtypes, bucket plan) is agreed once at setup by comparing
//    the plan hash; per refit only raw bucket bytes flow.
#pragma once

#include <string>
#include <vector>

#include "plan/bucket_plan.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "refit/status.h"

namespace refit {

std::string encode_sglang_meta(const ModelSpec& spec, const Bucket& bucket, DType dtype);
// Resolves the names against `spec`; errors name the bucket and the offending tensor.
Result<std::vector<BucketEntry>> decode_sglang_meta(const ModelSpec& spec, const std::string& meta,
                                                    DType dtype, int bucket);

// The weight_version string a refit of `step` publishes.
std::string weight_version(EngineProtocol protocol, int step);

}  // namespace refit
