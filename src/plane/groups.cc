#include "plane/groups.h"

#include "comm/nccl/nccl_communicator.h"

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
      g.liveness = o.liveness;
      g.peers = o.peers;
      g.connect_on_first_use = o.peers.has_value();
      return make_gloo_communicator(store, g);
    }
    case Device::kCuda: {
      NcclOptions n;
      n.name = o.name;
      n.rank = o.rank;
      n.size = o.size;
      n.device = plane.ordinal();
      n.timeout = o.timeout;
      n.liveness = o.liveness;
      REFIT_ASSIGN_OR_RETURN(auto comm, make_nccl_communicator(store, n));
      return std::unique_ptr<Communicator>(std::move(comm));
    }
  }
  return Status::Internal("unknown device");
}

}  // namespace refit
