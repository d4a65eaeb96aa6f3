// A POSIX shared-memory segment mapped into this process (RAII, move-only).
//
// The creator (a trainer rank) makes the segment once at setup and unlinks its name as soon as the
// engine rank on the same device has mapped it (or when destroyed); neither remaps per bucket.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "refit/status.h"

namespace refit {

// 16 hex digits from the system's random source, appended to segment names so that no other
// process can guess a name and create it first (segments are created exclusively, mode 0600).
// The names still start with /refit-<run id>- (the run's cleanup finds them by that prefix).
std::string unguessable_suffix();

class SharedMemory {
 public:
  static Result<std::unique_ptr<SharedMemory>> create(const std::string& name, std::size_t bytes);
  static Result<std::unique_ptr<SharedMemory>> open(const std::string& name, std::size_t bytes);
  ~SharedMemory();
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;

  std::byte* data() { return data_; }
  std::size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  // Removes the name (the creator's job; idempotent). The mappings stay valid and the memory is
  // freed when the last process unmaps it — so once the peer has mapped the segment, unlinking
  // means nothing is left in /dev/shm even if both processes are killed.
  void unlink();

 private:
  SharedMemory(std::string name, std::byte* data, std::size_t size, bool owner)
      : name_(std::move(name)), data_(data), size_(size), owner_(owner) {}
  std::string name_;
  std::byte* data_;
  std::size_t size_;
  bool owner_;
};

}  // namespace refit
