// refit.staged: a second copy of an engine rank's parameters that a refit's bytes land in while
// the engine keeps generating on the first (docs/runtime.md, "Staged apply"). It is exported
// memory laid out as Engine::allocate_params lays out parameters, so that trainer ranks on the
// same host write it by peer access whatever memory the caller registered; point-to-point pairs
// receive into it, and a delta applies onto the base it holds. Once generation paused the
// parameters take it: a copy (apply()), or only what the refit's deltas changed, written by the
// executor from its applies' logs (EngineWeights::apply_staged). Costs one more copy of the rank's
// parameters in its memory.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "control/messages.h"
#include "plane/data_plane.h"
#include "runtime/export_cache.h"
#include "runtime/slots.h"

namespace refit {

class Staging {
 public:
  // Where a refit's bytes land: the staging slots, allocated at the first call after a
  // registration and seeded with the parameters' bytes, with the copy of each into its parameter.
  Result<const Registry*> area(DataPlane& plane, const Registry& params, const std::string& name,
                               const std::string& who);
  // The staging area's export (peer access).
  const ExportedParams* exported(DataPlane& plane, const std::string& who);
  void release_export_name() { exports_.release_name(); }
  // Copies every staging slot into its parameter. Returns when the copy is complete.
  Status apply(DataPlane& plane, const std::string& who) const;
  // The registration changed: the area is allocated anew (and holds no version).
  void invalidate();

  // The complete weight version the area holds, the base a delta applies onto; nullopt while a
  // refit may have written part of it and after one that did not publish.
  const std::optional<std::string>& holds() const { return holds_; }
  void set_holds(std::optional<std::string> version) { holds_ = std::move(version); }

 private:
  ExportCache exports_;
  std::unique_ptr<Registry> slots_;  // the staging slots, placed in exports_' region
  std::vector<CopyRun> to_params_;
  std::optional<std::string> holds_;
};

}  // namespace refit
