// The device API of a build without CUDA (REFIT_HAVE_CUDA undefined): no devices, and every
// call that would touch one returns kUnsupported, so CPU code links unchanged and `device: cuda`
// fails with a clear message instead of a missing symbol.
#ifndef REFIT_HAVE_CUDA

#include <utility>

#include "device/copy_kernels.h"
#include "device/cuda_ipc.h"
#include "device/delta_kernels.h"
#include "device/device.h"
#include "device/quant_kernels.h"

namespace refit {
namespace {
Status no_cuda(const char* what) {
  return Status::Unsupported(std::string(what) +
                             ": refit was built without CUDA (configure where /usr/local/cuda "
                             "holds nvcc and NCCL, e.g. cmake --preset default)");
}
}  // namespace

bool cuda_built() { return false; }

struct DeviceDelta::Impl {};
Result<std::unique_ptr<DeviceDelta>> DeviceDelta::create(const std::vector<DeltaRoute>&, int, int) {
  return no_cuda("DeviceDelta::create");
}
DeviceDelta::~DeviceDelta() = default;
Result<DeltaResult> DeviceDelta::encode(std::byte*, std::byte*, std::size_t, std::uint64_t, double,
                                        void*, std::chrono::milliseconds, DeviceDeltaScratch&) {
  return no_cuda("DeviceDelta::encode");
}
Status DeviceDeltaScratch::reserve(std::size_t, std::size_t, int) {
  return no_cuda("DeviceDeltaScratch::reserve");
}
Result<DeltaResult> DeviceDelta::capture(std::byte*, void*, std::chrono::milliseconds) {
  return no_cuda("DeviceDelta::capture");
}
Result<DeltaResult> DeviceDelta::patch(std::byte*, void*, std::chrono::milliseconds) {
  return no_cuda("DeviceDelta::patch");
}
Result<DeltaResult> DeviceDelta::apply(const std::vector<delta_format::RouteEntry>&,
                                       const std::byte*, std::size_t, void*,
                                       std::chrono::milliseconds, ApplyFailure*) {
  return no_cuda("DeviceDelta::apply");
}

Result<DeviceQuantTable> DeviceQuantTable::upload(const std::vector<DeviceQuantRun>&, DType, int) {
  return no_cuda("DeviceQuantTable::upload");
}
Status launch_fp8_amax(const DeviceQuantTable&, DType, void*) { return no_cuda("launch_fp8_amax"); }
Status launch_fp8_quantize(const DeviceQuantTable&, DType, void*) {
  return no_cuda("launch_fp8_quantize");
}
int device_count() { return 0; }
Status set_device(int) { return no_cuda("set_device"); }

Result<DeviceBuffer> DeviceBuffer::allocate(std::size_t, int) {
  return no_cuda("DeviceBuffer::allocate");
}
void DeviceBuffer::reset() {}
DeviceBuffer::~DeviceBuffer() = default;
DeviceBuffer::DeviceBuffer(DeviceBuffer&&) noexcept {}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&&) noexcept { return *this; }

Result<DeviceStream> DeviceStream::create(int) { return no_cuda("DeviceStream::create"); }
void DeviceStream::reset() {}
DeviceStream::~DeviceStream() = default;
DeviceStream::DeviceStream(DeviceStream&&) noexcept {}
DeviceStream& DeviceStream::operator=(DeviceStream&&) noexcept { return *this; }

Result<DeviceEvent> DeviceEvent::create(int, bool) { return no_cuda("DeviceEvent::create"); }
void DeviceEvent::reset() {}
DeviceEvent::~DeviceEvent() = default;
DeviceEvent::DeviceEvent(DeviceEvent&&) noexcept {}
DeviceEvent& DeviceEvent::operator=(DeviceEvent&&) noexcept { return *this; }
Status DeviceEvent::record(void*) { return no_cuda("DeviceEvent::record"); }
Status DeviceEvent::wait_on(void*) const { return no_cuda("DeviceEvent::wait_on"); }
Result<float> DeviceEvent::elapsed_ms(const DeviceEvent&, const DeviceEvent&) {
  return no_cuda("DeviceEvent::elapsed_ms");
}

Status synchronize_stream(void*, std::chrono::milliseconds, const char*) {
  return no_cuda("synchronize_stream");
}
Status synchronize_event(void*, std::chrono::milliseconds, const char*) {
  return no_cuda("synchronize_event");
}
Status copy_to_device(void*, const void*, std::size_t) { return no_cuda("copy_to_device"); }
Status copy_to_host(void*, const void*, std::size_t) { return no_cuda("copy_to_host"); }
Status copy_device_async(void*, const void*, std::size_t, void*) {
  return no_cuda("copy_device_async");
}
Status fill_bytes_async(void*, std::uint8_t, std::size_t, void*) {
  return no_cuda("fill_bytes_async");
}
Result<int> device_of(const void*) { return no_cuda("device_of"); }
Status enable_peer_access(int) { return no_cuda("enable_peer_access"); }
Status copy_peer_async(void*, int, const void*, int, std::size_t, void*) {
  return no_cuda("copy_peer_async");
}
Result<DeviceMemoryInfo> device_memory_info() { return no_cuda("device_memory_info"); }

Status launch_block_copy(const DeviceBlockTable&, std::size_t, const void*, DType, void*, DType,
                         void*) {
  return no_cuda("launch_block_copy");
}
Status launch_block_copy(const DeviceBlockTable&, const void*, DType, void*, DType, void*) {
  return no_cuda("launch_block_copy");
}
Status launch_flat_convert(const void*, DType, void*, DType, std::size_t, void*) {
  return no_cuda("launch_flat_convert");
}
Status launch_generate(const DeviceBlockTable&, std::size_t, const WeightsParams&, void*, DType,
                       void*) {
  return no_cuda("launch_generate");
}
Status launch_generate(const DeviceBlockTable&, const WeightsParams&, void*, DType, void*) {
  return no_cuda("launch_generate");
}
Result<VerifyResult> verify_generated(const DeviceBlockTable&, const WeightsParams&, const void*,
                                      DType, void*, std::chrono::milliseconds) {
  return no_cuda("verify_generated");
}

Result<std::uint64_t> block_checksum(const DeviceBlockTable&, const void*, DType, DType, void*,
                                     std::chrono::milliseconds) {
  return no_cuda("block_checksum");
}

Result<std::string> export_device_memory(void*, std::size_t) {
  return no_cuda("export_device_memory");
}
Result<IpcMemory> IpcMemory::open(const std::string&, int) { return no_cuda("IpcMemory::open"); }
void IpcMemory::reset() {}
IpcMemory::~IpcMemory() = default;
IpcMemory::IpcMemory(IpcMemory&&) noexcept {}
IpcMemory& IpcMemory::operator=(IpcMemory&&) noexcept { return *this; }
Result<IpcEvent> IpcEvent::create(int) { return no_cuda("IpcEvent::create"); }
Result<IpcEvent> IpcEvent::open(const std::string&, int) { return no_cuda("IpcEvent::open"); }
Result<std::string> IpcEvent::handle() const { return no_cuda("IpcEvent::handle"); }
Status IpcEvent::record(void*) { return no_cuda("IpcEvent::record"); }
Status IpcEvent::wait_on(void*) const { return no_cuda("IpcEvent::wait_on"); }
void IpcEvent::reset() {}
IpcEvent::~IpcEvent() = default;
IpcEvent::IpcEvent(IpcEvent&&) noexcept {}
IpcEvent& IpcEvent::operator=(IpcEvent&&) noexcept { return *this; }

}  // namespace refit

#endif  // REFIT_HAVE_CUDA
