// TEMPORARY stand-in for check_engine_tp (owned by src/engine/tp_check.cc on another branch).
// Delete this file when tp_check.cc is merged.
#include <fmt/format.h>

#include "engine/engine_layout.h"

namespace refit {

Status check_engine_tp(const ModelSpec& spec, int tp) {
  const ModelConfig& c = spec.config();
  if (tp < 1) return Status::InvalidArgument(fmt::format("generation.tp_size: {} < 1", tp));
  if (c.num_heads % tp != 0)
    return Status::InvalidArgument(fmt::format(
        "generation.tp_size: {} does not divide num_attention_heads {}", tp, c.num_heads));
  if (tp <= c.num_kv_heads ? c.num_kv_heads % tp != 0 : tp % c.num_kv_heads != 0)
    return Status::InvalidArgument(fmt::format(
        "generation.tp_size: {} neither divides nor is a multiple of num_key_value_heads {}", tp,
        c.num_kv_heads));
  bool dense = false, moe = false;
  for (std::int64_t i = 0; i < c.num_layers; ++i) (c.is_moe_layer(i) ? moe : dense) = true;
  if (dense && c.intermediate_size % tp != 0)
    return Status::InvalidArgument(fmt::format(
        "generation.tp_size: {} does not divide intermediate_size {}", tp, c.intermediate_size));
  if (moe && c.moe_intermediate_size % tp != 0)
    return Status::InvalidArgument(
        fmt::format("generation.tp_size: {} does not divide moe_intermediate_size {}", tp,
                    c.moe_intermediate_size));
  return Status::Ok();
}

}  // namespace refit
