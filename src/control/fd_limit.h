// File descriptors: every socket of the control plane takes one, and the store's host holds one
// per connection of every rank (docs/runtime.md, "Limits"). A process raises its own soft limit
// to what a run needs, refuses at setup when the hard limit is lower, and names the limit when it
// runs out anyway.
#pragma once

#include <cstdint>
#include <string>

#include "refit/status.h"

namespace refit {

// RLIMIT_NOFILE of this process: the soft limit (what it may open now) and the hard one (what the
// soft limit may be raised to without privileges).
struct FdLimit {
  std::int64_t soft = 0;
  std::int64_t hard = 0;
};
FdLimit fd_limit();

// Makes sure this process may hold `needed` descriptors: raises the soft limit to `needed` when it
// is lower (never above the hard limit, never lowering it). When the hard limit is lower, an
// InvalidArgument: "<who>: <why> needs about N file descriptors, but RLIMIT_NOFILE is S (hard
// limit H); raise it (ulimit -n) ...".
Status ensure_fd_limit(std::int64_t needed, const std::string& who, const std::string& why);

// strerror(err); for EMFILE / ENFILE with the limit the process ran into ("too many open files:
// this process's RLIMIT_NOFILE is 1024 (ulimit -n)").
std::string errno_text(int err);

}  // namespace refit
