// The GPU reference quantizer in a build without CUDA: every call says so
// (harness/fp8_reference_device.h).
#ifndef REFIT_HAVE_CUDA

#include <string>

#include "harness/fp8_reference_device.h"

namespace refit {
namespace {
Status no_cuda(const char* what) {
  return Status::Unsupported(std::string(what) + ": refit was built without CUDA");
}
}  // namespace

Status fp8_ref_reset_status(std::uint64_t*, void*) { return no_cuda("fp8_ref_reset_status"); }
Status fp8_ref_quantize(const float*, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                        std::uint32_t*, float*, std::uint8_t*, std::uint32_t, std::uint64_t*,
                        void*) {
  return no_cuda("fp8_ref_quantize");
}
Status fp8_ref_copy_rect(void*, std::size_t, const void*, std::size_t, std::size_t, std::size_t,
                         void*) {
  return no_cuda("fp8_ref_copy_rect");
}
Status fp8_ref_compare(const void*, const void*, std::size_t, std::uint64_t*, void*) {
  return no_cuda("fp8_ref_compare");
}

}  // namespace refit

#endif  // REFIT_HAVE_CUDA
