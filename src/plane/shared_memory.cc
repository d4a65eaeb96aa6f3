#include "plane/shared_memory.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <cstdint>
#include <random>

#include "common/host_buffer.h"

namespace refit {

std::string unguessable_suffix() {
  std::random_device rd;
  const std::uint64_t v = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  return fmt::format("{:016x}", v);
}
namespace {

// Every page is faulted in at setup, not during the first refit (populate_pages).
Result<std::byte*> map_fd(int fd, const std::string& name, std::size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED)
    return Status::IOError(fmt::format("ipc: mmap of shared memory {} ({} bytes) failed: {}", name,
                                       bytes, std::strerror(errno)));
  if (const int err = populate_pages(static_cast<std::byte*>(p), bytes, /*shared=*/true);
      err != 0) {
    unmap_pages(static_cast<std::byte*>(p), bytes);
    return Status::IOError(fmt::format(
        "ipc: shared memory {} ({} bytes): cannot fault its pages in: {}; the file system behind "
        "/dev/shm is full or too small (`df -h /dev/shm`; a container's default is 64 MB: raise "
        "it with docker run --shm-size)",
        name, bytes, std::strerror(err)));
  }
  return static_cast<std::byte*>(p);
}

}  // namespace

Result<std::unique_ptr<SharedMemory>> SharedMemory::create(const std::string& name,
                                                           std::size_t bytes) {
  // Exclusive: an existing segment of that name (someone else's) is never opened or replaced.
  // Names carry an unguessable suffix, so a stale segment of a crashed run cannot collide.
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0)
    return Status::IOError(fmt::format("ipc: shm_open({}) failed: {}{}", name, std::strerror(errno),
                                       errno == EEXIST ? " (a segment of that name exists already)"
                                                       : ""));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    return Status::IOError(
        fmt::format("ipc: sizing shared memory {} to {} bytes failed: {} "
                    "(is /dev/shm large enough?)",
                    name, bytes, std::strerror(err)));
  }
  auto mapped = map_fd(fd, name, bytes);
  close(fd);
  if (!mapped.ok()) {
    shm_unlink(name.c_str());
    return mapped.status();
  }
  return std::unique_ptr<SharedMemory>(new SharedMemory(name, *mapped, bytes, true));
}

Result<std::unique_ptr<SharedMemory>> SharedMemory::open(const std::string& name,
                                                         std::size_t bytes) {
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0)
    return Status::IOError(
        fmt::format("ipc: shm_open({}) failed: {} (the trainer rank on this "
                    "device creates it at setup)",
                    name, std::strerror(errno)));
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) < bytes) {
    close(fd);
    return Status::IOError(fmt::format("ipc: shared memory {} is {} bytes, expected {}", name,
                                       static_cast<long long>(st.st_size), bytes));
  }
  // Only memory a rank of this user created (create() makes it 0600) is ever written into.
  if (st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
    close(fd);
    return Status::InvalidArgument(fmt::format(
        "ipc: shared memory {} belongs to uid {} with mode {:o}; refit maps only segments its "
        "own user created with mode 600",
        name, static_cast<long long>(st.st_uid), st.st_mode & 0777));
  }
  auto mapped = map_fd(fd, name, bytes);
  close(fd);
  if (!mapped.ok()) return mapped.status();
  return std::unique_ptr<SharedMemory>(new SharedMemory(name, *mapped, bytes, false));
}

void SharedMemory::unlink() {
  if (owner_) shm_unlink(name_.c_str());
  owner_ = false;
}

SharedMemory::~SharedMemory() {
  if (data_ != nullptr) unmap_pages(data_, size_);
  if (owner_) shm_unlink(name_.c_str());
}

}  // namespace refit
