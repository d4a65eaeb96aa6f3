#include "common/file_io.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace refit {
namespace {

const char* file_type(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

}  // namespace

Result<int> open_regular_file(const std::string& path, const char* what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    const std::string msg =
        fmt::format("{} {} cannot be opened: {} (errno {})", what, path, std::strerror(err), err);
    if (err == ENOENT) return Status::NotFound(msg);
    if (err == EISDIR) return Status::InvalidArgument(fmt::format("{} {} is a directory", what, path));
    return Status::IOError(msg);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return Status::IOError(fmt::format("fstat {}: {} (errno {})", path, std::strerror(err), err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(fmt::format(
        "{} {} is {}; refit reads only regular files (a FIFO or device could block it)", what,
        path, file_type(st.st_mode)));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) (void)::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

Result<std::string> read_regular_file(const std::string& path, const char* what,
                                      std::size_t max_bytes) {
  REFIT_ASSIGN_OR_RETURN(const int fd, open_regular_file(path, what));
  std::string text;
  char buf[65536];
  Status st;
  while (true) {
    const ssize_t r = ::read(fd, buf, sizeof(buf));
    if (r < 0) {
      if (errno == EINTR) continue;
      st = Status::IOError(fmt::format("read {}: {} (errno {})", path, std::strerror(errno), errno));
      break;
    }
    if (r == 0) break;
    if (text.size() + static_cast<std::size_t>(r) > max_bytes) {
      st = Status::InvalidArgument(fmt::format("{} {} is larger than {} bytes; refusing to read it",
                                               what, path, max_bytes));
      break;
    }
    text.append(buf, static_cast<std::size_t>(r));
  }
  ::close(fd);
  if (!st.ok()) return st;
  return text;
}

}  // namespace refit
