// Arming fault injection (common/fault.h) on the library's Trainer and Engine.
#pragma once

#include <memory>

#include "common/fault.h"
#include "refit/session.h"
#include "refit/status.h"

namespace refit {

// Arms `fault` on a Trainer / Engine made by this library.
void set_trainer_fault(Trainer& trainer, const Fault& fault);
// The engine's part (kill-engine, plan-mismatch) must be known before it announces itself, so it
// is passed at creation.
Result<std::unique_ptr<Engine>> create_engine_with_fault(const Config& config, int engine_rank,
                                                         const Endpoint& endpoint,
                                                         const Fault& fault);

}  // namespace refit
