// Fault injection for tests (`refit run --fault`), applied in step 1 of a run.
#pragma once

#include <memory>
#include <string_view>

#include "refit/session.h"
#include "refit/status.h"

namespace refit {

struct Fault {
  enum class Kind { kNone, kCorrupt, kKillTrainer, kKillEngine, kPlanMismatch };
  Kind kind = Kind::kNone;
  int rank = -1;    // trainer rank / engine rank the fault hits
  int bucket = -1;  // bucket index at which it fires
};

// "corrupt:K" | "kill-trainer:R:K" | "kill-engine:R:K" | "plan-mismatch" | "" (none).
Result<Fault> parse_fault(std::string_view text);

// Arms `fault` on a Trainer / Engine made by this library.
void set_trainer_fault(Trainer& trainer, const Fault& fault);
// The engine's part (kill-engine, plan-mismatch) must be known before it announces itself, so it
// is passed at creation.
Result<std::unique_ptr<Engine>> create_engine_with_fault(const Config& config, int engine_rank,
                                                         const Endpoint& endpoint,
                                                         const Fault& fault);

}  // namespace refit
