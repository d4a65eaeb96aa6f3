// Page-aligned host memory owned by one object (RAII, move-only). Pages are faulted in at
// allocation (MAP_POPULATE): buffers are registered at setup, and a refit must not pay for
// first-touch page faults.
#pragma once

#include <cstddef>

namespace refit {

class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(std::size_t bytes);  // zero-filled; throws std::bad_alloc on failure
  ~HostBuffer();
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace refit
