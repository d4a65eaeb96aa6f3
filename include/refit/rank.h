// refit/rank.h — which process of a refit: a trainer rank or an engine rank.
//
// Every process of a refit is one rank (docs/design.md §3): trainer rank r of policy.world_size,
// or engine rank g = engine index * generation.tp_size + TP rank. RankId is that identity as a
// value; its two spellings — the name in messages ("engine 1 tp rank 0") and the control plane's
// mailbox id ("engine/2") — are formatted and parsed here and nowhere else. A plain value type:
// copy it freely, from any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace refit {

enum class Role : std::uint8_t { kTrainer, kEngine };

// "trainer" | "engine" (the JSON report's `role`).
const char* role_name(Role role);

struct RankId {
  Role role = Role::kTrainer;
  int rank = 0;     // trainer rank, or global engine rank (engine index * tp_size + TP rank)
  int tp_size = 1;  // engine ranks: generation.tp_size, so that the id names engine and TP rank

  static RankId trainer(int rank) { return {Role::kTrainer, rank, 1}; }
  static RankId engine(int global_rank, int tp_size) {
    return {Role::kEngine, global_rank, tp_size};
  }

  bool is_trainer() const { return role == Role::kTrainer; }
  int engine_index() const { return rank / tp_size; }
  int tp_rank() const { return rank % tp_size; }

  // "trainer rank 3" | "engine 1 tp rank 0": how errors and logs name the process.
  std::string name() const;
  // "trainer/3" | "engine/2": the process's mailbox on the control plane.
  std::string mailbox() const;

  // The inverses, for ids that arrive from elsewhere (a message's sender): nullopt for anything
  // that is not exactly such a name. `tp_size` completes an engine id.
  static std::optional<RankId> from_name(std::string_view name, int tp_size);
  static std::optional<RankId> from_mailbox(std::string_view id, int tp_size);

  bool operator==(const RankId& o) const {
    return role == o.role && rank == o.rank && tp_size == o.tp_size;
  }
  bool operator!=(const RankId& o) const { return !(*this == o); }
};

}  // namespace refit
