// One check macro per CUDA library (STYLE: "every external call wrapped in one check macro"):
// a failed call becomes a refit::Status naming the call, the current device and CUDA's error name
// and text. Internal to the CUDA translation units (*.cu, *_cuda.cc); CPU code includes
// device/device.h instead.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

#include "refit/status.h"

namespace refit {

// "<call> failed on device <d>: <cudaErrorName> (<text>)". Clears CUDA's sticky last error for
// non-sticky errors so the next call does not report it again.
Status cuda_status(cudaError_t err, const char* call);
Status cu_status(CUresult err, const char* call);

}  // namespace refit

// Returns a Status from the enclosing function when the CUDA runtime call fails.
#define REFIT_CUDA_CHECK(call)                                                               \
  do {                                                                                       \
    const cudaError_t refit_cuda_err_ = (call);                                              \
    if (refit_cuda_err_ != cudaSuccess) return ::refit::cuda_status(refit_cuda_err_, #call); \
  } while (0)

// Same for the CUDA driver API.
#define REFIT_CU_CHECK(call)                                                            \
  do {                                                                                  \
    const CUresult refit_cu_err_ = (call);                                              \
    if (refit_cu_err_ != CUDA_SUCCESS) return ::refit::cu_status(refit_cu_err_, #call); \
  } while (0)

// After a kernel launch: the launch error (bad configuration, no kernel image), if any.
#define REFIT_CUDA_CHECK_LAUNCH(what)                                                       \
  do {                                                                                      \
    const cudaError_t refit_cuda_err_ = cudaGetLastError();                                 \
    if (refit_cuda_err_ != cudaSuccess) return ::refit::cuda_status(refit_cuda_err_, what); \
  } while (0)
