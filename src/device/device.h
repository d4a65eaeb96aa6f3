// The GPU runtime pieces refit needs (docs/design.md §2 stages 4–7 on `device: cuda`): device discovery,
// RAII device buffers, streams and events, bounded waits.
//
// This header has no CUDA includes, so CPU code (the runtime, the CLI, tests) can include it in
// every build. Stream and event handles travel as `void*` (a cudaStream_t / cudaEvent_t); a null
// stream means the legacy default stream. In a build without CUDA (REFIT_HAVE_CUDA undefined)
// device_count() is 0 and every other call returns kUnsupported.
//
// Errors name the CUDA call, the device and CUDA's error name and text, e.g.
//   "cudaMalloc(4294967296 bytes) failed on device 0: cudaErrorMemoryAllocation (out of memory)".
// Objects are move-only RAII owners; destructors release on the device they were made on. Not
// thread-safe: one thread uses an object at a time; distinct objects may be used concurrently.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

#include "refit/status.h"

namespace refit {

// True when refit was compiled with the CUDA data plane.
bool cuda_built();
// Number of CUDA devices this process can use; 0 without CUDA, without a driver or without a GPU.
// Never fails (a driver error counts as no device).
int device_count();
// Makes `device` current for the calling thread.
Status set_device(int device);

// Device memory from cudaMalloc (never managed memory), owned by one object.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // `bytes` of uninitialised device memory on `device` (0 bytes gives an empty buffer).
  static Result<DeviceBuffer> allocate(std::size_t bytes, int device);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  std::byte* bytes() const { return static_cast<std::byte*>(data_); }
  std::size_t size() const { return size_; }
  int device() const { return device_; }

 private:
  void reset();
  void* data_ = nullptr;
  std::size_t size_ = 0;
  int device_ = 0;
};

// A non-blocking CUDA stream (does not synchronise with the legacy default stream).
class DeviceStream {
 public:
  DeviceStream() = default;
  static Result<DeviceStream> create(int device);
  ~DeviceStream();
  DeviceStream(DeviceStream&& other) noexcept;
  DeviceStream& operator=(DeviceStream&& other) noexcept;
  DeviceStream(const DeviceStream&) = delete;
  DeviceStream& operator=(const DeviceStream&) = delete;

  void* handle() const { return stream_; }  // cudaStream_t
  int device() const { return device_; }

 private:
  void reset();
  void* stream_ = nullptr;
  int device_ = 0;
};

// A CUDA event. `timing` events can measure elapsed time; others are cheaper to wait on.
class DeviceEvent {
 public:
  DeviceEvent() = default;
  static Result<DeviceEvent> create(int device, bool timing);
  ~DeviceEvent();
  DeviceEvent(DeviceEvent&& other) noexcept;
  DeviceEvent& operator=(DeviceEvent&& other) noexcept;
  DeviceEvent(const DeviceEvent&) = delete;
  DeviceEvent& operator=(const DeviceEvent&) = delete;

  void* handle() const { return event_; }  // cudaEvent_t
  Status record(void* stream);
  // Makes `stream` wait on the GPU for the work this event last recorded (no host wait).
  Status wait_on(void* stream) const;
  // Milliseconds between two recorded timing events (both must have completed).
  static Result<float> elapsed_ms(const DeviceEvent& start, const DeviceEvent& end);

 private:
  void reset();
  void* event_ = nullptr;
  int device_ = 0;
};

// Bounded host waits: poll until the stream / event completed, or fail with kTimeout naming
// `what` after `timeout`. A CUDA error raised by the awaited work is returned as such.
Status synchronize_stream(void* stream, std::chrono::milliseconds timeout, const char* what);
Status synchronize_event(void* event, std::chrono::milliseconds timeout, const char* what);

// Copies. The *_async ones are ordered on `stream`; the others complete before returning.
Status copy_to_device(void* dst, const void* src, std::size_t bytes);
Status copy_to_host(void* dst, const void* src, std::size_t bytes);
Status copy_device_async(void* dst, const void* src, std::size_t bytes, void* stream);
Status fill_bytes_async(void* dst, std::uint8_t value, std::size_t bytes, void* stream);
// The GPU whose memory holds `ptr` (device memory, or memory mapped from another process through
// CUDA IPC), or -1 for host or unregistered memory.
Result<int> device_of(const void* ptr);
// Lets the current device access `peer`'s memory (idempotent); errors name both devices.
Status enable_peer_access(int peer);
// Copies `bytes` from device memory on `src_device` to device memory on `dst_device`, on `stream`
// (copy engines; cudaMemcpyPeerAsync).
Status copy_peer_async(void* dst, int dst_device, const void* src, int src_device,
                       std::size_t bytes, void* stream);

// Free and total memory of the current device (cudaMemGetInfo).
struct DeviceMemoryInfo {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};
Result<DeviceMemoryInfo> device_memory_info();

}  // namespace refit
