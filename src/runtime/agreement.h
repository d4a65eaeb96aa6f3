// What every rank of a refit must agree on, checked at setup: engines send their settings in the
// hello, trainer ranks in their version stamp in the store. A mismatch — ranks launched
// separately with different configs — is a setup error naming the config key and both values,
// instead of a timeout, a collective error or "corruption" at the first refit.
#pragma once

#include <map>
#include <string>

#include "refit/config.h"
#include "refit/model_spec.h"
#include "refit/status.h"

namespace refit {

// By config key, in canonical text: the model's tensor table (a hash of every name and shape,
// key "model"), device, seed, the policy's backend, world size, dtype and Megatron split, the
// generation protocol, placement, transfer mode, engine count and TP size, and the refit's
// target precision, buffer size and count, executor, checksum, delta and staged. (timeout_s may
// differ.)
std::map<std::string, std::string> agreed_settings(const Config& config, const ModelSpec& spec);

// `theirs` (announced by `from`) against `ours` (of `self`): InvalidArgument naming the first key
// whose values differ, or that one side lacks, with both values.
Status check_agreed_settings(const std::map<std::string, std::string>& ours,
                             const std::map<std::string, std::string>& theirs,
                             const std::string& from, const std::string& self);

}  // namespace refit
