// File-descriptor limits (control/fd_limit.h).
#include "control/fd_limit.h"

#include <fmt/format.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>

namespace refit {

FdLimit fd_limit() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return {};
  const auto as_int = [](rlim_t v) {
    return v == RLIM_INFINITY ? INT64_MAX : static_cast<std::int64_t>(v);
  };
  return FdLimit{as_int(r.rlim_cur), as_int(r.rlim_max)};
}

Status ensure_fd_limit(std::int64_t needed, const std::string& who, const std::string& why) {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0)
    return Status::IOError(
        fmt::format("{}: cannot read RLIMIT_NOFILE: {}", who, std::strerror(errno)));
  const FdLimit now = fd_limit();
  if (now.soft >= needed) return Status::Ok();
  if (now.hard < needed)
    return Status::InvalidArgument(fmt::format(
        "{}: {} needs about {} file descriptors, but RLIMIT_NOFILE is {} (hard limit {}); raise "
        "it (ulimit -n {}, or LimitNOFILE= / nofile in limits.conf) or run fewer ranks against "
        "one store (docs/runtime.md, \"Limits\")",
        who, why, needed, now.soft, now.hard, needed));
  r.rlim_cur = static_cast<rlim_t>(needed);
  if (::setrlimit(RLIMIT_NOFILE, &r) != 0)
    return Status::IOError(fmt::format(
        "{}: {} needs about {} file descriptors; raising RLIMIT_NOFILE from {} failed: {}", who,
        why, needed, now.soft, std::strerror(errno)));
  return Status::Ok();
}

std::string errno_text(int err) {
  if (err == EMFILE)
    return fmt::format("too many open files: this process's RLIMIT_NOFILE is {} (ulimit -n)",
                       fd_limit().soft);
  if (err == ENFILE) return "too many open files in the system (fs.file-max)";
  return std::strerror(err);
}

}  // namespace refit
