// The SGLang protocol's bucket metadata (executor gather; docs/design.md §4): names, dtypes,
// shapes, byte offsets and, for a tensor split over buckets, its element range travel with every
// bucket, and the engine applies what they say. (The vLLM protocol agrees on a manifest at setup
// instead: per refit only raw bucket bytes flow.)
#pragma once

#include <string>
#include <vector>

#include "plan/bucket_plan.h"
#include "refit/model_spec.h"
#include "refit/status.h"

namespace refit {

std::string encode_sglang_meta(const ModelSpec& spec, const Bucket& bucket, DType dtype);
// Resolves the names against `spec`; errors name the bucket and the offending tensor. Every
// entry must lie within the `buffer_bytes` of the slot the bucket arrives in.
Result<std::vector<BucketEntry>> decode_sglang_meta(const ModelSpec& spec, const std::string& meta,
                                                    DType dtype, int bucket,
                                                    std::int64_t buffer_bytes);

}  // namespace refit
