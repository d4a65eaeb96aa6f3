// What each engine protocol publishes per refit (docs/design.md §4). The SGLang bucket metadata
// lives with the gather executor (executor/bucket_meta.h).
#pragma once

#include <string>

#include "refit/config.h"

namespace refit {

// The weight_version string a refit of `step` publishes: "step-<n>" (SGLang), "<n>" (vLLM).
std::string weight_version(EngineProtocol protocol, int step);

}  // namespace refit
