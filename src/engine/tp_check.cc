// check_engine_tp: can an engine with TP size t shard this model the way vLLM/SGLang do (§6.4)?
#include <fmt/format.h>

#include <string>

#include "engine/engine_layout.h"

namespace refit {
namespace {

// TP sizes listed as alternatives in error messages.
constexpr int kMaxListedTp = 64;

bool has_dense_mlp(const ModelConfig& c) {
  for (std::int64_t i = 0; i < c.num_layers; ++i)
    if (!c.is_moe_layer(i)) return true;
  return false;
}

bool has_moe_mlp(const ModelConfig& c) {
  for (std::int64_t i = 0; i < c.num_layers; ++i)
    if (c.is_moe_layer(i)) return true;
  return false;
}

// Why TP size t cannot shard `c`, or "" when it can. The vocabulary is padded to a multiple of
// 64 and split in contiguous ranges, so it never constrains t.
std::string engine_tp_problem(const ModelConfig& c, std::int64_t t) {
  if (c.num_heads % t != 0)
    return fmt::format("num_attention_heads ({}) is not divisible by {}", c.num_heads, t);
  const std::int64_t nkv = c.num_kv_heads > 0 ? c.num_kv_heads : c.num_heads;
  if (t <= nkv && nkv % t != 0)
    return fmt::format("num_key_value_heads ({}) is not divisible by {}", nkv, t);
  if (t > nkv && t % nkv != 0)
    return fmt::format(
        "{} exceeds num_key_value_heads ({}) but is not a multiple of it (kv heads are "
        "replicated only when tp_size is a multiple of num_key_value_heads)",
        t, nkv);
  if (has_dense_mlp(c) && c.intermediate_size % t != 0)
    return fmt::format("intermediate_size ({}) is not divisible by {}", c.intermediate_size, t);
  if (has_moe_mlp(c) && c.moe_intermediate_size % t != 0)
    return fmt::format("moe_intermediate_size ({}) is not divisible by {}", c.moe_intermediate_size,
                       t);
  if (has_moe_mlp(c) && c.shared_expert_intermediate_size % t != 0)
    return c.n_shared_experts > 0
               ? fmt::format("moe_intermediate_size * n_shared_experts ({}) is not divisible by {}",
                             c.shared_expert_intermediate_size, t)
               : fmt::format("shared_expert_intermediate_size ({}) is not divisible by {}",
                             c.shared_expert_intermediate_size, t);
  // SGLang's DeepSeek-V3 and GLM-4.5 MoE layers refuse a TP size above the number of routed
  // experts (models/deepseek_v2.py, glm4_moe.py); vLLM's accept it, but one table serves both.
  if (has_moe_mlp(c) && c.n_shared_experts > 0 && t > c.num_experts)
    return fmt::format("{} exceeds n_routed_experts ({})", t, c.num_experts);
  return {};
}

}  // namespace

Status check_engine_tp(const ModelSpec& spec, int tp) {
  const ModelConfig& c = spec.config();
  std::string valid;
  for (int t = 1; t <= kMaxListedTp; ++t)
    if (engine_tp_problem(c, t).empty()) valid += (valid.empty() ? "" : ", ") + std::to_string(t);
  const std::string allowed =
      fmt::format("{} (TP sizes up to {} that shard {})", valid, kMaxListedTp,
                  spec.source().empty() ? std::string(c.architecture) : spec.source());
  if (tp < 1)
    return Status::InvalidArgument(
        fmt::format("generation.tp_size: must be >= 1; got {}; allowed: {}", tp, allowed));
  const std::string problem = engine_tp_problem(c, tp);
  if (problem.empty()) return Status::Ok();
  return Status::InvalidArgument(
      fmt::format("generation.tp_size: {}; got {}; allowed: {}", problem, tp, allowed));
}

}  // namespace refit
