// Fault injection for tests (`refit run --fault`): what fires where, applied in step 1 of a run by
// the trainer and engine ranks (harness/fault_probe.h) and the executors.
#pragma once

#include <string_view>

#include "refit/status.h"

namespace refit {

struct Fault {
  enum class Kind {
    kNone,
    kCorrupt,
    kKillTrainer,
    kKillEngine,
    kPlanMismatch,
    kVersionMismatch,
    kFailPause,  // engine rank `rank`'s pause hook fails in refit `step`
    kSlowPause,  // engine rank `rank`'s pause hook takes 1.5 x refit.timeout_s in refit `step`
    // Trainer rank `rank` stalls for 2.5 x refit.timeout_s (alive: its heartbeat goes on) before
    // the first bytes it moves in refit `step`; engine rank `rank` before its commit.
    kStallTrainer,
    kStallEngine,
    // refit.delta: before refit `step`, engine rank `rank` forgets the base it holds from trainer
    // rank `peer` (as a restarted engine holds none), or trainer rank `rank` what it kept for
    // engine rank `peer`.
    kForgetBase,
    kForgetKept,
  };
  Kind kind = Kind::kNone;
  int rank = -1;    // trainer rank / engine rank the fault hits
  int peer = -1;    // forget-*: the other rank of the pair
  // Bucket (executor gather) or round (transfer plan) at which it fires; kill and stop kinds may
  // fire at setup or at the commit instead.
  static constexpr int kAtSetup = -2;   // "…:setup": once the rank joined the control plane
  static constexpr int kAtCommit = -3;  // "…:commit": every byte moved, before the commit
  int bucket = -1;
  bool stop = false;  // kill kinds: SIGSTOP instead of SIGKILL ("stop-trainer", "stop-engine")
  // corrupt, fail-pause, slow-pause, stall-*: the refit step it fires in ("corrupt:K:S",
  // "fail-pause:R:S"; the others: step 1)
  int step = 1;
  // stall-*: how long, in ms (the runtime sets 2.5 x refit.timeout_s)
  int stall_ms = 0;
};

// "corrupt:K" | "corrupt:K:S" (in step S) | K of the kill and stop kinds may be "setup" or
// "commit" | "kill-trainer:R:K" | "kill-engine:R:K" | "stop-trainer:R:K" | "stop-engine:R:K" |
// "fail-pause:R[:S]" | "slow-pause:R[:S]" | "stall-trainer:R[:S]" | "stall-engine:R[:S]" |
// "forget-base:R:T:S" (engine rank R, trainer rank T) | "forget-kept:R:G:S" (trainer rank R,
// engine rank G) | "plan-mismatch" | "version-mismatch" | "" (none).
Result<Fault> parse_fault(std::string_view text);

}  // namespace refit
