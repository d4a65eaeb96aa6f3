// Page-aligned host memory owned by one object (RAII, move-only). Pages are faulted in at
// allocation (populate_pages): buffers are registered at setup, and a refit must not pay for
// first-touch page faults.
#pragma once

#include <cstddef>

namespace refit {

// Faults in every page of [data, data + bytes) of a mapping this process just made, writable,
// without changing its contents, in chunks of kPopulateChunk. Not MAP_POPULATE: that holds the
// process's memory-map lock for the whole range (seconds for gigabytes on a slow host), and every
// other thread that maps, unmaps or grows its heap meanwhile waits, the heartbeat and the store
// server among them; between chunks they get their turn. `shared`: the mapping is MAP_SHARED
// (another process may already write it). Returns 0, or the errno of a page that cannot be had
// (ENOMEM, or EFAULT when the file system behind a shared mapping is full): unlike MAP_POPULATE,
// which ignores it until a later write dies of SIGBUS, the caller can say so.
inline constexpr std::size_t kPopulateChunk = std::size_t{16} << 20;
int populate_pages(std::byte* data, std::size_t bytes, bool shared);
// munmap of [data, data + bytes), in chunks of kPopulateChunk for the same reason.
void unmap_pages(std::byte* data, std::size_t bytes);

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
