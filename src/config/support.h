// Internal to the config module and the CLI: what the support matrix says beyond its cells.
//
// The public table is refit::support_matrix() (refit/config.h): policy backend x engine protocol
// x transfer mode. Target precision is a property of the engine protocol alone, so it has its own
// small table here; validate_config() and `refit matrix` both read it. Plain static data,
// thread-safe.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "refit/config.h"

namespace refit {

// Whether engine protocol `engine` accepts target precision `precision`.
struct PrecisionSupport {
  EngineProtocol engine;
  DType precision;
  bool supported;
  std::string note;  // why not, or a remark
};
const std::vector<PrecisionSupport>& precision_support();

// The target precisions the config accepts at parse time, in table order (bf16, fp8).
const std::vector<DType>& parseable_target_precisions();

// "colocated (ipc)" / "non-colocated (broadcast)": the column label of a transfer mode.
std::string transfer_mode_label(TransferMode mode);

// "vLLM" / "SGLang", "fsdp2 (DTensor)" / "megatron": display names of the matrix headers.
std::string_view engine_protocol_display_name(EngineProtocol engine);
std::string_view policy_backend_display_name(PolicyBackend policy);

// Range rules of single integer keys, shared by parse_config (which adds the line) and
// validate_config (which re-checks configs built in code).
struct IntRule {
  std::int64_t min;
  std::int64_t max;
  std::string_view problem;  // what is wrong when the value is outside [min, max]
  std::string_view allowed;
};
inline constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();
inline constexpr IntRule kAtLeastOneRule{1, kIntMax, "must be >= 1", "an integer >= 1"};
// Process counts (policy.world_size, generation.num_engines, generation.tp_size, Megatron's
// tp/pp/ep): every rank derives the whole transfer plan, so an absurd count would exhaust memory
// instead of failing; 16384 is far beyond any RL deployment refit serves today.
inline constexpr std::int64_t kMaxRanks = 16384;
inline constexpr IntRule kRankCountRule{1, kMaxRanks, "must be between 1 and 16384",
                                        "an integer from 1 to 16384"};
inline constexpr IntRule kBufferSizeRule{
    kBucketAlignment, std::numeric_limits<std::int64_t>::max(),
    "must be at least 256 bytes (the bucket alignment, kBucketAlignment)",
    "an integer >= 256, e.g. 268435456 (256 MiB)"};
inline constexpr IntRule kNumBuffersRule{1, 16, "must be between 1 and 16",
                                         "an integer from 1 to 16"};
inline constexpr IntRule kFp8BlockRule{1, std::int64_t{1} << 20,
                                       "must be between 1 and 1048576 elements",
                                       "two positive integers [rows, cols], e.g. [128, 128]"};
// Upper bound of refit.timeout_s: larger values are a typo and overflow clock arithmetic.
inline constexpr double kMaxTimeoutS = 1e6;
inline constexpr std::string_view kTimeoutAllowed = "a number of seconds > 0 and <= 1000000";

// "<key>: <problem>; got <value><where>; allowed: <allowed>" when `value` breaks `rule`.
Status check_int_rule(std::string_view key, std::int64_t value, const IntRule& rule,
                      std::string_view where = {});
Status check_timeout(std::string_view key, double value, std::string_view where = {});

// The cell of support_matrix() for (policy, engine, mode); nullptr when the table has none.
const MatrixCell* find_matrix_cell(PolicyBackend policy, EngineProtocol engine, TransferMode mode);

}  // namespace refit
