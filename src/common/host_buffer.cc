#include "common/host_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <new>
#include <utility>

namespace refit {

int populate_pages(std::byte* data, std::size_t bytes, bool shared) {
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  for (std::size_t at = 0; at < bytes; at += kPopulateChunk) {
    const std::size_t n = std::min(kPopulateChunk, bytes - at);
    if (::madvise(data + at, n, MADV_POPULATE_WRITE) == 0) continue;
    if (errno != EINVAL) return errno;
    // A kernel before 5.14 (EINVAL): one fault per page. A read maps a shared page without
    // writing it; a private anonymous page is zero, so writing zero keeps it.
    for (std::size_t p = at; p < at + n; p += page) {
      volatile std::byte* b = data + p;
      if (shared)
        (void)*b;
      else
        *b = std::byte{0};
    }
  }
  return 0;
}

void unmap_pages(std::byte* data, std::size_t bytes) {
  for (std::size_t at = 0; at < bytes; at += kPopulateChunk)
    (void)::munmap(data + at, std::min(kPopulateChunk, bytes - at));
}

HostBuffer::HostBuffer(std::size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  if (populate_pages(static_cast<std::byte*>(p), bytes, /*shared=*/false) != 0) {
    unmap_pages(static_cast<std::byte*>(p), bytes);
    throw std::bad_alloc();
  }
  data_ = static_cast<std::byte*>(p);
}

HostBuffer::~HostBuffer() {
  if (data_ != nullptr) unmap_pages(data_, size_);
}

HostBuffer::HostBuffer(HostBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) unmap_pages(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

}  // namespace refit
