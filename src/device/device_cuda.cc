// CUDA implementation of device/device.h.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <thread>
#include <utility>

#include "device/copy_kernels.h"
#include "device/cuda_check.h"
#include "device/device.h"

namespace refit {

Status cuda_status(cudaError_t err, const char* call) {
  int device = -1;
  (void)cudaGetDevice(&device);
  // Non-sticky errors stay in cudaGetLastError until read; consume them so they do not leak into
  // the next unrelated check.
  (void)cudaGetLastError();
  return Status::IOError(fmt::format("{} failed on device {}: {} ({})", call, device,
                                     cudaGetErrorName(err), cudaGetErrorString(err)));
}

Status cu_status(CUresult err, const char* call) {
  int device = -1;
  (void)cudaGetDevice(&device);
  // No cuGetErrorName: refit does not link libcuda (see cuda_ipc_cuda.cc).
  return Status::IOError(
      fmt::format("{} failed on device {}: CUresult {}", call, device, static_cast<int>(err)));
}

bool cuda_built() { return true; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

Status set_device(int device) {
  const int n = device_count();
  if (device < 0 || device >= n)
    return Status::InvalidArgument(
        fmt::format("device {} does not exist: this process sees {} CUDA device(s)", device, n));
  REFIT_CUDA_CHECK(cudaSetDevice(device));
  // Once per device and process: does this binary have kernels for it? set_device() runs before
  // every data-plane operation, so the checked case is one atomic load, without a lock.
  // Devices past the table are checked every time.
  static std::array<std::atomic<bool>, 64> checked{};
  const auto slot = static_cast<std::size_t>(device);
  if (slot < checked.size() && checked[slot].load(std::memory_order_acquire)) return Status::Ok();
  REFIT_RETURN_IF_ERROR(check_kernel_image(device));  // idempotent: a race checks twice
  if (slot < checked.size()) checked[slot].store(true, std::memory_order_release);
  return Status::Ok();
}

// ---- DeviceBuffer ----

Result<DeviceBuffer> DeviceBuffer::allocate(std::size_t bytes, int device) {
  REFIT_RETURN_IF_ERROR(set_device(device));
  DeviceBuffer b;
  b.device_ = device;
  if (bytes == 0) return b;
  const cudaError_t err = cudaMalloc(&b.data_, bytes);
  if (err != cudaSuccess)
    return cuda_status(err, fmt::format("cudaMalloc({} bytes)", bytes).c_str());
  b.size_ = bytes;
  return b;
}

void DeviceBuffer::reset() {
  if (data_ != nullptr) {
    int cur = 0;
    (void)cudaGetDevice(&cur);
    if (cur != device_) (void)cudaSetDevice(device_);
    (void)cudaFree(data_);
    if (cur != device_) (void)cudaSetDevice(cur);
  }
  data_ = nullptr;
  size_ = 0;
}

DeviceBuffer::~DeviceBuffer() { reset(); }
DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      device_(o.device_) {}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    device_ = o.device_;
  }
  return *this;
}

// ---- DeviceStream ----

Result<DeviceStream> DeviceStream::create(int device) {
  REFIT_RETURN_IF_ERROR(set_device(device));
  DeviceStream s;
  s.device_ = device;
  cudaStream_t st = nullptr;
  REFIT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  s.stream_ = st;
  return s;
}

void DeviceStream::reset() {
  if (stream_ != nullptr) (void)cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  stream_ = nullptr;
}
DeviceStream::~DeviceStream() { reset(); }
DeviceStream::DeviceStream(DeviceStream&& o) noexcept
    : stream_(std::exchange(o.stream_, nullptr)), device_(o.device_) {}
DeviceStream& DeviceStream::operator=(DeviceStream&& o) noexcept {
  if (this != &o) {
    reset();
    stream_ = std::exchange(o.stream_, nullptr);
    device_ = o.device_;
  }
  return *this;
}

// ---- DeviceEvent ----

Result<DeviceEvent> DeviceEvent::create(int device, bool timing) {
  REFIT_RETURN_IF_ERROR(set_device(device));
  DeviceEvent e;
  e.device_ = device;
  cudaEvent_t ev = nullptr;
  REFIT_CUDA_CHECK(
      cudaEventCreateWithFlags(&ev, timing ? cudaEventDefault : cudaEventDisableTiming));
  e.event_ = ev;
  return e;
}

void DeviceEvent::reset() {
  if (event_ != nullptr) (void)cudaEventDestroy(static_cast<cudaEvent_t>(event_));
  event_ = nullptr;
}
DeviceEvent::~DeviceEvent() { reset(); }
DeviceEvent::DeviceEvent(DeviceEvent&& o) noexcept
    : event_(std::exchange(o.event_, nullptr)), device_(o.device_) {}
DeviceEvent& DeviceEvent::operator=(DeviceEvent&& o) noexcept {
  if (this != &o) {
    reset();
    event_ = std::exchange(o.event_, nullptr);
    device_ = o.device_;
  }
  return *this;
}

Status DeviceEvent::record(void* stream) {
  REFIT_CUDA_CHECK(
      cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

Status DeviceEvent::wait_on(void* stream) const {
  REFIT_CUDA_CHECK(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event_), 0));
  return Status::Ok();
}

Result<float> DeviceEvent::elapsed_ms(const DeviceEvent& start, const DeviceEvent& end) {
  float ms = 0;
  REFIT_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.event_),
                                        static_cast<cudaEvent_t>(end.event_)));
  return ms;
}

// ---- bounded waits ----

namespace {

// Polls `query` (returns cudaSuccess when done, cudaErrorNotReady while pending). Spins briefly,
// then sleeps in growing steps up to 20 us: a refit waits milliseconds, and a coarser nap would
// add its length to every acknowledgement.
template <typename Query>
Status poll(Query query, std::chrono::milliseconds timeout, const char* call, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::chrono::microseconds nap{0};
  for (int spins = 0;; ++spins) {
    const cudaError_t err = query();
    if (err == cudaSuccess) return Status::Ok();
    if (err != cudaErrorNotReady)
      return cuda_status(err, fmt::format("{} ({})", call, what).c_str());
    if (std::chrono::steady_clock::now() >= deadline)
      return Status::Timeout(
          fmt::format("{} did not complete within {} ms", what, timeout.count()));
    if (spins > 1000) {
      nap = std::min(std::chrono::microseconds{20}, nap + std::chrono::microseconds{2});
      std::this_thread::sleep_for(nap);
    }
  }
}

}  // namespace

Status synchronize_stream(void* stream, std::chrono::milliseconds timeout, const char* what) {
  return poll([&] { return cudaStreamQuery(static_cast<cudaStream_t>(stream)); }, timeout,
              "cudaStreamQuery", what);
}

Status synchronize_event(void* event, std::chrono::milliseconds timeout, const char* what) {
  return poll([&] { return cudaEventQuery(static_cast<cudaEvent_t>(event)); }, timeout,
              "cudaEventQuery", what);
}

// ---- copies ----

Status copy_to_device(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return Status::Ok();
  REFIT_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  // From pageable memory cudaMemcpy may return once the bytes are staged, before the DMA lands;
  // kernels on non-blocking streams are not ordered after it. Wait for the legacy stream.
  REFIT_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  return Status::Ok();
}

Status copy_to_host(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return Status::Ok();
  REFIT_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  return Status::Ok();
}

Status copy_device_async(void* dst, const void* src, std::size_t bytes, void* stream) {
  if (bytes == 0) return Status::Ok();
  REFIT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                   static_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

Result<int> device_of(const void* ptr) {
  cudaPointerAttributes a{};
  REFIT_CUDA_CHECK(cudaPointerGetAttributes(&a, ptr));
  return a.type == cudaMemoryTypeDevice ? a.device : -1;
}

Status enable_peer_access(int peer) {
  int current = 0;
  REFIT_CUDA_CHECK(cudaGetDevice(&current));
  if (peer == current) return Status::Ok();
  int can = 0;
  REFIT_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, current, peer));
  if (can == 0)
    return Status::Unsupported(
        fmt::format("device {} cannot access device {}'s memory (no peer access)", current, peer));
  const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
    return Status::Ok();
  }
  REFIT_CUDA_CHECK(e);
  return Status::Ok();
}

Status copy_peer_async(void* dst, int dst_device, const void* src, int src_device,
                       std::size_t bytes, void* stream) {
  if (bytes == 0) return Status::Ok();
  REFIT_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_device, src, src_device, bytes,
                                       static_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

Status fill_bytes_async(void* dst, std::uint8_t value, std::size_t bytes, void* stream) {
  if (bytes == 0) return Status::Ok();
  REFIT_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

Result<DeviceMemoryInfo> device_memory_info() {
  DeviceMemoryInfo info;
  REFIT_CUDA_CHECK(cudaMemGetInfo(&info.free_bytes, &info.total_bytes));
  return info;
}

}  // namespace refit
