// trainer_layout: the one entry point that picks the trainer backend's layout.
#include <fmt/format.h>

#include "trainer/trainer_layout.h"

namespace refit {

Result<TrainerShardLayout> trainer_layout(const ModelSpec& spec, const PolicyConfig& policy,
                                          int rank) {
  switch (policy.backend) {
    case PolicyBackend::kFsdp2:
      if (policy.world_size < 1)
        return Status::InvalidArgument(
            fmt::format("policy.world_size: {} must be >= 1", policy.world_size));
      if (rank < 0 || rank >= policy.world_size)
        return Status::InvalidArgument(
            fmt::format("fsdp2 layout: trainer rank {} is outside policy.world_size {}", rank,
                        policy.world_size));
      return fsdp2_layout(spec, policy.world_size, rank);
    case PolicyBackend::kMegatron:
      return megatron_layout(spec, policy.megatron, policy.world_size, rank);
  }
  return Status::Internal(
      fmt::format("trainer layout: unknown policy backend {}", static_cast<int>(policy.backend)));
}

}  // namespace refit
