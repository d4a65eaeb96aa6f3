#include "runtime/groups.h"

namespace refit {

Result<std::unique_ptr<Communicator>> make_group(Store& store, const GroupOptions& o,
                                                 DataPlane& plane) {
  switch (plane.device()) {
    case Device::kCpu: {
      GlooOptions g;
      g.name = o.name;
      g.rank = o.rank;
      g.size = o.size;
      g.hostname = o.host;
      g.timeout = o.timeout;
      return make_gloo_communicator(store, g);
    }
    case Device::kCuda:
      return Status::Unsupported("group " + o.name + ": NCCL groups are not part of this runtime");
  }
  return Status::Internal("unknown device");
}

}  // namespace refit
