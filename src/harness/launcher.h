// Starts every rank of a refit as a process on this machine and watches them (`refit run`).
//
// Children run this same executable (`refit trainer` / `refit engine`) with a torchrun-style
// environment. They die with the launcher (PR_SET_PDEATHSIG). When one exits non-zero the others
// get refit.timeout_s (+ a grace period) to exit on their own — which they do, since failures
// propagate — and are then killed, so no process outlives the launcher in any outcome.
#pragma once

#include <functional>
#include <chrono>
#include <string>
#include <vector>

#include "refit/status.h"

namespace refit {

struct ChildSpec {
  std::string name;               // "trainer rank 1", "engine 0 tp rank 1"
  std::vector<std::string> args;  // argv[1..]
  std::vector<std::pair<std::string, std::string>> env;
  // Hosts the control plane's store (trainer rank 0). Once it is dead or stopped after a failure,
  // nothing can make progress: the others get kStoreLossGrace, not the timeout, to exit.
  bool hosts_store = false;
};

// How long the other children may take to exit once a failure happened and the store's host is
// dead or stopped: a rank connected to the store notices within 5.5 s (runtime/failure.h); one
// still connecting would wait its timeout, and is killed instead.
inline constexpr std::chrono::milliseconds kStoreLossGrace{8000};
// The store's host stopped (SIGSTOP) this long with no failure yet is the run's failure itself:
// long enough for every rank connected to the store to name it and exit on its own (5.5 s, then
// its teardown), short of the first-contact deadline (refit.timeout_s) of the ranks still
// connecting, which cannot tell a stopped store from one not up yet.
inline constexpr std::chrono::milliseconds kStoppedStoreHostFails{15000};

struct LaunchResult {
  bool ok = false;
  std::string summary;  // which process failed first, and how
  // The first child that exited abnormally (index into the children; -1: none), how ("was
  // killed by signal 9 (Killed)", "exited with code 1"), and whether a signal ended it.
  int first_failed = -1;
  std::string first_how;
  bool first_killed = false;
  // SIGINT, SIGTERM or SIGHUP reached the launcher (from catch_interrupts() on): every child was
  // killed and reaped (none started, when it came before), and the caller cleans up and re-raises
  // it (0: not interrupted).
  int interrupted = 0;
};

// Unlinks every POSIX shared-memory segment of run `run_id` (/dev/shm/refit-<run_id>-*) that is
// still there — what ranks killed before they unlinked their names leave behind. Returns how
// many it removed.
int remove_run_segments(const std::string& run_id);

// From now on SIGINT, SIGTERM and SIGHUP are noted instead of ending the process, and
// launch_and_wait acts on them: a caller that makes something to clean up (a run directory) calls
// this first. launch_and_wait calls it too, and restores the default actions when it returns.
void catch_interrupts();

// Runs all children to completion. `timeout_s` bounds how long the others may take to follow a
// failed child before they are killed (kStoreLossGrace when the store's host is gone). `on_failure(child, how)` runs once, for the first child
// that exits abnormally (the runtime records it as the run's first failure, so the other ranks
// stop within their liveness-check interval instead of their timeout). `deadline_s` (> 0) bounds
// the whole run: past it every child still running is killed and the run fails, saying so.
Result<LaunchResult> launch_and_wait(
    const std::string& executable, const std::vector<ChildSpec>& children, double timeout_s,
    const std::function<void(const std::string&, const std::string&)>& on_failure = {},
    double deadline_s = 0);

// Makes sure this user may run `ranks` more processes with their threads (RLIMIT_NPROC, about
// kThreadsPerRank each): raises the soft limit up to the hard one, or refuses naming both.
inline constexpr int kThreadsPerRank = 32;
Status ensure_process_limit(int ranks);

// Path of the running executable.
std::string self_executable();

}  // namespace refit
