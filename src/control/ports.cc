#include "control/ports.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>

namespace refit {
namespace {

// Below this, ports belong to well-known services more often than not.
constexpr int kLowestPicked = 20000;
// torchrun's default store port (29500) and refit's (29501), with room around them.
constexpr int kReservedLow = 29400;
constexpr int kReservedHigh = 29599;
constexpr int kAttempts = 64;

// Binds `port` (0: any) on every address, without SO_REUSEADDR, so that any socket holding the
// port fails it; returns the bound port, or 0 when it is taken.
int try_bind(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  socklen_t len = sizeof addr;
  int bound = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
    bound = ntohs(addr.sin_port);
  else if (errno != EADDRINUSE && errno != EACCES)
    bound = -errno;
  ::close(fd);
  return bound;
}

}  // namespace

PortRange ephemeral_ports() {
  PortRange r{32768, 60999};
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0, high = 0;
  if (in >> low >> high && low > 0 && low <= high && high <= 65535) r = {low, high};
  return r;
}

Result<int> pick_free_port() {
  const PortRange ephemeral = ephemeral_ports();
  std::mt19937 gen(std::random_device{}());
  if (ephemeral.low > kLowestPicked) {
    std::uniform_int_distribution<int> below(kLowestPicked, ephemeral.low - 1);
    for (int i = 0; i < kAttempts; ++i) {
      const int port = below(gen);
      if (port >= kReservedLow && port <= kReservedHigh) continue;
      const int got = try_bind(port);
      if (got > 0) return got;
      if (got < 0) break;  // not a taken port: binding itself fails
    }
  }
  const int any = try_bind(0);
  if (any > 0) return any;
  return Status::IOError(
      fmt::format("cannot find a free port: {}", std::strerror(any < 0 ? -any : EADDRINUSE)));
}

}  // namespace refit
