// CUDA IPC between the processes of one host (docs/design.md §2 stage 6, `ipc` on `device: cuda`):
// device memory and events exported once at setup and opened once by the peer — never a handle
// per bucket.
//
// Handles travel as opaque byte strings (send them through the control-plane store or mailbox).
// A memory handle records the exported range's offset inside its cudaMalloc allocation, so any
// sub-range of an allocation (one slot of a slot arena, an engine's parameter arena) can be
// exported; the importer gets a pointer to exactly that range.
//
// Per-bucket synchronisation without a host round trip on the GPU's critical path: the producer
// records its exported event after enqueueing the work that fills a slot and then tells the peer
// (one control message); the peer makes its stream wait on the opened event
// (cudaStreamWaitEvent), enqueues its work, records its own event and answers at once — neither
// host ever waits for the GPU inside a refit. The message must follow the record: a wait enqueued
// before the matching record waits on the previous one. Each side records only events it created
// and waits only on events it opened.
//
// RAII: IpcMemory closes the mapping (cudaIpcCloseMemHandle), IpcEvent destroys its event. The
// exporter must keep the memory and events alive until every importer closed them. Move-only;
// not thread-safe.
#pragma once

#include <cstddef>
#include <string>

#include "refit/status.h"

namespace refit {

// Exports [ptr, ptr + bytes), which must lie inside one cudaMalloc allocation of this process.
Result<std::string> export_device_memory(void* ptr, std::size_t bytes);

// A peer's exported memory, opened once in this process.
class IpcMemory {
 public:
  IpcMemory() = default;
  // Opens `handle` on `device` (the device the exporter allocated on, as this process numbers
  // it). Errors name the call and device; a handle from this same process is refused by CUDA.
  static Result<IpcMemory> open(const std::string& handle, int device);
  ~IpcMemory();
  IpcMemory(IpcMemory&& other) noexcept;
  IpcMemory& operator=(IpcMemory&& other) noexcept;
  IpcMemory(const IpcMemory&) = delete;
  IpcMemory& operator=(const IpcMemory&) = delete;

  std::byte* data() const { return base_ == nullptr ? nullptr : base_ + offset_; }
  std::size_t size() const { return size_; }
  // Whether the memory is on the GPU it was opened on (the handle names its GPU by UUID); false:
  // another GPU's memory, reached over NVLink / PCIe.
  bool on_this_device() const { return on_this_device_; }

 private:
  void reset();
  std::byte* base_ = nullptr;  // what cudaIpcOpenMemHandle returned (the allocation's start)
  std::size_t offset_ = 0;
  std::size_t size_ = 0;
  int device_ = 0;
  bool on_this_device_ = true;
};

// An inter-process event (cudaEventInterprocess | cudaEventDisableTiming).
class IpcEvent {
 public:
  IpcEvent() = default;
  // A new event owned by this process, to export with handle().
  static Result<IpcEvent> create(int device);
  // A peer's event.
  static Result<IpcEvent> open(const std::string& handle, int device);
  ~IpcEvent();
  IpcEvent(IpcEvent&& other) noexcept;
  IpcEvent& operator=(IpcEvent&& other) noexcept;
  IpcEvent(const IpcEvent&) = delete;
  IpcEvent& operator=(const IpcEvent&) = delete;

  Result<std::string> handle() const;     // only for created events
  void* event() const { return event_; }  // cudaEvent_t
  bool imported() const { return imported_; }
  // Records this (created) event on `stream`.
  Status record(void* stream);
  // Makes `stream` wait on the GPU for the last record of this event.
  Status wait_on(void* stream) const;

 private:
  void reset();
  void* event_ = nullptr;
  bool imported_ = false;
  int device_ = 0;
};

}  // namespace refit
