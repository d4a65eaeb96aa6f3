// CUDA implementation of device/cuda_ipc.h.
#include <fmt/format.h>

#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "device/cuda_check.h"
#include "device/cuda_ipc.h"
#include "device/device.h"

namespace refit {
namespace {

// Wire format of an exported memory range:
//   "RFTM" | cudaIpcMemHandle_t | offset | size | UUID of the GPU that holds it.
constexpr char kMemMagic[4] = {'R', 'F', 'T', 'M'};
constexpr char kEventMagic[4] = {'R', 'F', 'T', 'E'};
constexpr std::size_t kUuidBytes = sizeof(cudaUUID_t);
constexpr std::size_t kMemWire = 4 + sizeof(cudaIpcMemHandle_t) + 16 + kUuidBytes;
constexpr std::size_t kEventWire = 4 + sizeof(cudaIpcEventHandle_t);

template <typename T>
void put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// cuMemGetAddressRange through the runtime's driver entry point: refit links the static CUDA
// runtime and never libcuda directly, so its binaries start (and report no device) on machines
// without a driver.
Status allocation_range(void* ptr, CUdeviceptr& base, std::size_t& size) {
  using Fn = CUresult (*)(CUdeviceptr*, std::size_t*, CUdeviceptr);
  static Fn fn = nullptr;
  if (fn == nullptr) {
    void* sym = nullptr;
    cudaDriverEntryPointQueryResult found{};
    REFIT_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &sym, 12000,
                                                      cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || sym == nullptr)
      return Status::IOError("the CUDA driver has no cuMemGetAddressRange entry point");
    fn = reinterpret_cast<Fn>(sym);
  }
  REFIT_CU_CHECK(fn(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)));
  return Status::Ok();
}

// The UUID of GPU `device` as this process numbers it (cached: the properties call is slow).
Result<std::string> device_uuid(int device) {
  static std::mutex mu;
  static std::map<int, std::string> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  cudaDeviceProp p{};
  REFIT_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  return cache.emplace(device, std::string(p.uuid.bytes, kUuidBytes)).first->second;
}

}  // namespace

Result<std::string> export_device_memory(void* ptr, std::size_t bytes) {
  CUdeviceptr base = 0;
  std::size_t alloc_size = 0;
  REFIT_RETURN_IF_ERROR(allocation_range(ptr, base, alloc_size));
  const std::size_t offset = reinterpret_cast<CUdeviceptr>(ptr) - base;
  if (offset + bytes > alloc_size)
    return Status::InvalidArgument(fmt::format(
        "export_device_memory: range of {} bytes at offset {} runs past its allocation of {} "
        "bytes",
        bytes, offset, alloc_size));
  cudaIpcMemHandle_t h;
  REFIT_CUDA_CHECK(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base)));
  cudaPointerAttributes a{};
  REFIT_CUDA_CHECK(cudaPointerGetAttributes(&a, ptr));
  REFIT_ASSIGN_OR_RETURN(const std::string uuid, device_uuid(a.device));
  std::string out(kMemMagic, 4);
  put(out, h);
  put(out, static_cast<std::uint64_t>(offset));
  put(out, static_cast<std::uint64_t>(bytes));
  out += uuid;
  return out;
}

Result<IpcMemory> IpcMemory::open(const std::string& handle, int device) {
  if (handle.size() != kMemWire || std::memcmp(handle.data(), kMemMagic, 4) != 0)
    return Status::Corruption(fmt::format(
        "IpcMemory::open: not an exported memory handle ({} bytes; expected {} bytes starting "
        "with RFTM)",
        handle.size(), kMemWire));
  REFIT_RETURN_IF_ERROR(set_device(device));
  cudaIpcMemHandle_t h;
  std::uint64_t offset = 0, size = 0;
  std::memcpy(&h, handle.data() + 4, sizeof(h));
  std::memcpy(&offset, handle.data() + 4 + sizeof(h), 8);
  std::memcpy(&size, handle.data() + 12 + sizeof(h), 8);
  REFIT_ASSIGN_OR_RETURN(const std::string here, device_uuid(device));
  IpcMemory m;
  m.on_this_device_ = handle.compare(kMemWire - kUuidBytes, kUuidBytes, here) == 0;
  void* base = nullptr;
  REFIT_CUDA_CHECK(cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess));
  m.base_ = static_cast<std::byte*>(base);
  m.offset_ = offset;
  m.size_ = size;
  m.device_ = device;
  return m;
}

void IpcMemory::reset() {
  if (base_ != nullptr) {
    int cur = 0;
    (void)cudaGetDevice(&cur);
    if (cur != device_) (void)cudaSetDevice(device_);
    (void)cudaIpcCloseMemHandle(base_);
    if (cur != device_) (void)cudaSetDevice(cur);
  }
  base_ = nullptr;
  offset_ = size_ = 0;
}
IpcMemory::~IpcMemory() { reset(); }
IpcMemory::IpcMemory(IpcMemory&& o) noexcept
    : base_(std::exchange(o.base_, nullptr)),
      offset_(o.offset_),
      size_(o.size_),
      device_(o.device_),
      on_this_device_(o.on_this_device_) {}
IpcMemory& IpcMemory::operator=(IpcMemory&& o) noexcept {
  if (this != &o) {
    reset();
    base_ = std::exchange(o.base_, nullptr);
    offset_ = o.offset_;
    size_ = o.size_;
    device_ = o.device_;
    on_this_device_ = o.on_this_device_;
  }
  return *this;
}

Result<IpcEvent> IpcEvent::create(int device) {
  REFIT_RETURN_IF_ERROR(set_device(device));
  IpcEvent e;
  cudaEvent_t ev = nullptr;
  REFIT_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming));
  e.event_ = ev;
  e.device_ = device;
  return e;
}

Result<IpcEvent> IpcEvent::open(const std::string& handle, int device) {
  if (handle.size() != kEventWire || std::memcmp(handle.data(), kEventMagic, 4) != 0)
    return Status::Corruption(fmt::format(
        "IpcEvent::open: not an exported event handle ({} bytes; expected {} bytes starting with "
        "RFTE)",
        handle.size(), kEventWire));
  REFIT_RETURN_IF_ERROR(set_device(device));
  cudaIpcEventHandle_t h;
  std::memcpy(&h, handle.data() + 4, sizeof(h));
  IpcEvent e;
  cudaEvent_t ev = nullptr;
  REFIT_CUDA_CHECK(cudaIpcOpenEventHandle(&ev, h));
  e.event_ = ev;
  e.imported_ = true;
  e.device_ = device;
  return e;
}

Result<std::string> IpcEvent::handle() const {
  if (imported_ || event_ == nullptr)
    return Status::InvalidArgument("IpcEvent::handle: only an event created here can be exported");
  cudaIpcEventHandle_t h;
  REFIT_CUDA_CHECK(cudaIpcGetEventHandle(&h, static_cast<cudaEvent_t>(event_)));
  std::string out(kEventMagic, 4);
  put(out, h);
  return out;
}

Status IpcEvent::record(void* stream) {
  if (imported_)
    return Status::InvalidArgument(
        "IpcEvent::record: a peer's event is only waited on; record your own exported event");
  REFIT_CUDA_CHECK(
      cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

Status IpcEvent::wait_on(void* stream) const {
  REFIT_CUDA_CHECK(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event_), 0));
  return Status::Ok();
}

void IpcEvent::reset() {
  if (event_ != nullptr) (void)cudaEventDestroy(static_cast<cudaEvent_t>(event_));
  event_ = nullptr;
}
IpcEvent::~IpcEvent() { reset(); }
IpcEvent::IpcEvent(IpcEvent&& o) noexcept
    : event_(std::exchange(o.event_, nullptr)), imported_(o.imported_), device_(o.device_) {}
IpcEvent& IpcEvent::operator=(IpcEvent&& o) noexcept {
  if (this != &o) {
    reset();
    event_ = std::exchange(o.event_, nullptr);
    imported_ = o.imported_;
    device_ = o.device_;
  }
  return *this;
}

}  // namespace refit
