// How a failure on one process reaches every other one.
//
// The failing process records its cause once per run under the store key "error/first" (the
// first writer wins) and closes its collectives. Every process checks that key (and that the
// store, hosted by trainer rank 0, is still there) while it waits on its mailbox, and processes
// that fail because a peer vanished look it up, so every process stops within a second of the
// first failure and reports the same root cause. (No abort messages: a send to a dead peer would
// block for the send timeout.)
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "refit/status.h"

namespace refit {

class Store;

void announce_failure(Store* store, const std::string& who, const Status& status);

// A liveness check for mailbox waits: fails when the store (hosted by trainer rank 0) is gone or
// another process recorded the run's first failure.
std::function<Status()> liveness_check(Store& store, const std::string& who);

// `status`, prefixed with the run's first recorded failure when that came from elsewhere.
Status with_root_cause(Store* store, const std::string& who, const Status& status);

// The process a failure is blamed on (the JSON report's `error`, docs/runtime.md): the run's first
// failure as recorded under "error/first" — "<process>: <error>".
struct Blame {
  std::string process;  // "trainer rank 1", "engine 0 tp rank 1"
  std::string role;     // "trainer" | "engine"
  int rank = -1;        // trainer rank, or global engine rank (engine index * tp_size + tp rank)
  std::string message;  // "<process>: <error>", as recorded under "error/first"
};

// `name` ("trainer rank R" or "engine I tp rank T") as a Blame without message; nullopt for any
// other text.
std::optional<Blame> blame_process(const std::string& name, int tp_size);

// The root cause of a failure that process `self` reported as `status`: the process named by
// with_root_cause's "aborted because <process>: <error>" when the status carries one, else `self`
// itself.
Blame blame_failure(const std::string& self, const Status& status, int tp_size);

// The first failure of a rank, latched: guard() runs a step of the rank; when it fails, the
// cause is traced to the run's root cause, recorded in the store, the rank's collectives are
// closed (peers blocked on us fail now instead of at their timeout), and every later guard()
// returns the same Status without running anything — a rank never runs half a refit after a
// failure.
class FailureLatch {
 public:
  // `store` is read after `step` ran, so a failure during setup is announced once the store
  // connection exists.
  Status guard(const std::function<Status()>& step, const std::unique_ptr<Store>& store,
               const std::string& who, const std::function<void()>& close_collectives);
  const Status& status() const { return failed_; }

 private:
  Status failed_;
};

}  // namespace refit
