// Where an engine rank's parameters can be mapped by the trainer ranks on its host (peer access,
// executor/routes.h): the one region Engine::allocate_params made, or, on CUDA, an IPC handle per
// registered parameter. Built with its digest once per registration, not per refit.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "control/messages.h"
#include "plane/data_plane.h"
#include "runtime/slots.h"

namespace refit {

class ExportCache {
 public:
  // Allocates exported memory named `name` for every slot of `params` (zero-filled, each 256-byte
  // aligned) and places the slots there. Once per engine.
  Status allocate(DataPlane& plane, Registry& params, const std::string& name,
                  const std::string& who);
  bool allocated() const { return region_ != nullptr; }
  // The registration changed: exports of registered storage are built anew.
  void invalidate();
  // The export of `params` now, built at the first call after a registration; nullptr when the
  // storage cannot be shared (host memory the caller allocated; a registered parameter the plane
  // cannot export, logged once): point-to-point serves then.
  const ExportedParams* get(DataPlane& plane, const Registry& params, const std::string& who);
  // Every peer mapped the region: its name may go (nothing is left behind by a crash).
  void release_name();

 private:
  std::unique_ptr<PlaneBuffer> region_;  // allocate()
  std::string region_handle_;
  std::vector<std::string> handles_;  // CUDA: one per registered parameter
  std::optional<ExportedParams> export_;
  bool failed_ = false;  // a registered parameter cannot be exported, until the next registration
};

}  // namespace refit
