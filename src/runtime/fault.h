// Fault injection (common/fault.h) on the library's Trainer and Engine: a RefitProbe
// (executor/executor.h) that kills this process or corrupts bytes at the probe points of step 1.
// Nothing of it runs in the executors' code beyond the probe calls.
#pragma once

#include <memory>

#include "common/fault.h"
#include "executor/executor.h"
#include "refit/session.h"
#include "refit/status.h"

namespace refit {

// The probe that injects `fault` on trainer rank `rank` (trainer) or engine rank `rank`:
//  - kill-trainer:R:K / kill-engine:R:K: SIGKILL before the first round >= K that rank R moves
//    (immediately when one copy moves every round: peer access); K = setup: once the rank joined
//    the control plane; K = commit: once every byte of step 1 moved, before the commit;
//  - corrupt:K[:S] (trainer ranks that write engine-bound bytes): flips a byte of round K's first
//    written run after it was written (peer access: of the K-th run, or the last), in step S
//    (default 1);
//  - other kinds act at setup, not here: the probe does nothing.
std::unique_ptr<RefitProbe> make_fault_probe(const Fault& fault, bool trainer, int rank);

// A Trainer / Engine with `fault` armed: it is passed at creation, since some faults act during
// setup (kill/stop at setup; plan-mismatch and version-mismatch on the engine).
Result<std::unique_ptr<Trainer>> create_trainer_with_fault(const Config& config, int rank,
                                                           const Endpoint& endpoint,
                                                           const Fault& fault);
Result<std::unique_ptr<Engine>> create_engine_with_fault(const Config& config, int engine_rank,
                                                         const Endpoint& endpoint,
                                                         const Fault& fault);

}  // namespace refit
