// make_nccl_communicator in a build without CUDA/NCCL.
#ifndef REFIT_HAVE_CUDA

#include "comm/nccl/nccl_communicator.h"

namespace refit {

void set_nccl_environment() {}

Result<std::unique_ptr<NcclCommunicator>> make_nccl_communicator(Store&,
                                                                 const NcclOptions& options) {
  return Status::Unsupported("nccl group '" + options.name +
                             "': refit was built without CUDA and NCCL (configure where "
                             "/usr/local/cuda holds nvcc and NCCL, e.g. cmake --preset default)");
}

}  // namespace refit

#endif  // REFIT_HAVE_CUDA
