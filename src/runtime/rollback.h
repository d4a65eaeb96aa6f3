// refit.keep_previous: a copy of an engine rank's parameters while they hold a complete version,
// taken before a refit writes them, so that a refit that fails at its end (a checksum mismatch,
// a failed verification) or in flight can be undone (docs/runtime.md).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "plane/data_plane.h"
#include "runtime/slots.h"

namespace refit {

class Rollback {
 public:
  // Copies `params` (holding complete version `version`) aside; the buffer is allocated at the
  // first call and kept.
  Status keep(DataPlane& plane, const Registry& params, const std::string& version,
              const std::string& who);
  // The version kept for the refit in flight; nullopt when none (the weights were incomplete
  // before it, or the copy was given up).
  const std::optional<std::string>& kept() const { return kept_; }
  // Copies the kept bytes back; kept() stays.
  Status restore(DataPlane& plane) const;
  // Gives up the kept copy for this refit (a feeder may still be writing in place).
  void forget() { kept_.reset(); }
  // The registration changed: the copy lists are built anew at the next keep().
  void invalidate() {
    copy_.reset();
    kept_.reset();
  }

 private:
  struct Copy {
    std::unique_ptr<PlaneBuffer> buffer;
    std::vector<CopyRun> save, restore;
  };
  std::unique_ptr<Copy> copy_;
  std::optional<std::string> kept_;
};

}  // namespace refit
