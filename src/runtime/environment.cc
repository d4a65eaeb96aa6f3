// torchrun's variables for the library's callers (refit/session.h): read on each call, so that
// the Python API sees what the process set last.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "common/env.h"
#include "refit/session.h"

namespace refit {
namespace {

template <typename T>
Result<T> required(Result<std::optional<T>> value, const char* what) {
  if (!value.ok()) return value.status();
  if (!value->has_value())
    return Status::InvalidArgument(fmt::format("{} was not given and is not set", what));
  return **value;
}

// The local address of the route to `addr`: a UDP socket "connected" to it sends nothing but
// makes the kernel pick the source address.
Result<std::string> local_address_towards(const std::string& addr, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || res == nullptr)
    return Status::InvalidArgument(
        fmt::format("MASTER_ADDR={} is not an IPv4 address or a host name this host resolves", addr));
  const bool loopback =
      (ntohl(reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr.s_addr) >> 24) == 127;
  std::string out = "127.0.0.1";
  if (!loopback) {
    const int fd = socket(AF_INET, SOCK_DGRAM, 0);
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    const bool ok = fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0 &&
                    getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
    if (fd >= 0) close(fd);
    if (!ok) {
      freeaddrinfo(res);
      return Status::InvalidArgument(fmt::format(
          "no route from this host to MASTER_ADDR={}; set REFIT_HOST to the address peers reach "
          "this process at",
          addr));
    }
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text));
    out = text;
  }
  freeaddrinfo(res);
  return out;
}

}  // namespace

Result<Endpoint> endpoint_from_environment(std::optional<std::string> master_addr,
                                           std::optional<int> master_port,
                                           std::optional<std::string> host) {
  Endpoint ep;
  ep.master_addr = master_addr ? *master_addr : env::read("MASTER_ADDR").value_or("127.0.0.1");
  if (master_port) {
    ep.master_port = *master_port;
  } else {
    const std::optional<std::string> refit = env::read("REFIT_PORT");
    const std::optional<std::string> torch = env::read("MASTER_PORT");
    REFIT_ASSIGN_OR_RETURN(ep.master_port,
                           env::parse_store_port(refit ? env::Text(*refit) : env::Text(),
                                                 torch ? env::Text(*torch) : env::Text()));
  }
  if (host) {
    ep.host = *host;
  } else if (auto from_env = env::read("REFIT_HOST")) {
    ep.host = *from_env;
  } else {
    REFIT_ASSIGN_OR_RETURN(ep.host,
                           local_address_towards(ep.master_addr, std::max(ep.master_port, 1)));
  }
  return ep;
}

Result<int> trainer_rank_from_environment() {
  return required(env::parse_rank(env::read("RANK")), "the trainer rank (RANK)");
}

Result<int> engine_rank_from_environment() {
  REFIT_ASSIGN_OR_RETURN(auto engine, env::parse_engine_rank(env::read("ENGINE_RANK")));
  if (engine) return *engine;
  return required(env::parse_rank(env::read("RANK")), "the engine rank (ENGINE_RANK or RANK)");
}

}  // namespace refit
