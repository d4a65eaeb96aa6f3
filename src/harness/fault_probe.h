// Fault injection (harness/fault.h, `refit run --fault`) on the library's Trainer and Engine: a
// RefitProbe (executor/probe.h) handed in with the rank's services, which kills, stops, stalls or
// corrupts at the probe points of a chosen refit step, and alters the hello for the setup
// mismatches. Nothing of it runs in the library beyond the probe calls.
#pragma once

#include <memory>

#include "executor/probe.h"
#include "harness/fault.h"
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
//  - stall-trainer / stall-engine: sleeps fault.stall_ms (alive: its heartbeat goes on);
//  - plan-mismatch / version-mismatch (engine ranks): the hello announces another plan hash or
//    refit version;
//  - forget-base / forget-kept (refit.delta): the engine rank forgets the base it holds from one
//    trainer rank, or the trainer rank what it kept for one engine rank, before that refit;
//  - fail-pause / slow-pause act in the harness's pause hook, not here.
std::shared_ptr<RefitProbe> make_fault_probe(const Fault& fault, bool trainer, int rank);

// A Trainer / Engine with `fault` armed, on the default components: the probe is handed in at
// creation, since some faults act during setup. Stalls last 2.5 x refit.timeout_s.
Result<std::unique_ptr<Trainer>> create_trainer_with_fault(const Config& config, int rank,
                                                           const Endpoint& endpoint,
                                                           const Fault& fault);
Result<std::unique_ptr<Engine>> create_engine_with_fault(const Config& config, int engine_rank,
                                                         const Endpoint& endpoint,
                                                         const Fault& fault);

}  // namespace refit
