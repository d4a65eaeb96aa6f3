// Connection events of ZeroMQ sockets (control/zmq_monitor.h).
#include "control/zmq_monitor.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <zmq_addon.hpp>

#include "common/log.h"
#include "control/fd_limit.h"
#include "control/store.h"

namespace refit {
namespace {

std::atomic<std::uint64_t> g_monitors{0};

std::string protocol_error(std::uint32_t code) {
  switch (code) {
    case ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
      return "the CURVE handshake failed (the peer does not hold this run's keys)";
    case ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
      return "the peer uses another security mechanism (one side holds a run secret, the other "
             "none)";
    default:
      break;
  }
  if ((code & 0xF0000000u) == 0x20000000u)
    return fmt::format("the authentication handler's answer was malformed (0x{:x})", code);
  return fmt::format("the peer broke the ZeroMQ protocol (0x{:x}; not a refit process?)", code);
}

int local_port(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return -1;
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&a)->sin_port);
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&a)->sin6_port);
  return -1;
}

bool is_handshake_failure(std::uint16_t event) {
  return event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL ||
         event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL || event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;
}

// How long after its accept a connection may still be in its handshake: ZeroMQ closes it at the
// handshake interval; the second covers the events' way to the reader.
constexpr std::chrono::milliseconds kMayBePending = kZmqHandshakeIvl + std::chrono::seconds(1);

}  // namespace

bool PendingHandshakes::see(const ConnectionEvent& e) {
  const int fd = static_cast<int>(e.value);
  const bool after_failure = after_failure_;
  after_failure_ = is_handshake_failure(e.event);
  bool silent = false;
  switch (e.event) {
    case ZMQ_EVENT_ACCEPTED: {
      ++accepted_;
      spoke_.erase(fd);
      Open o;
      o.order = accepted_;
      o.when = std::chrono::steady_clock::now();
      o.peer_len = sizeof o.peer;
      // The events alone say which connections are open. Its peer is noted when the descriptor
      // is still a connection to this socket's port (it may have been closed, and its number
      // reused, since the event was sent): only such a connection is ever shut down.
      if ((port_ != 0 && local_port(fd) != port_) ||
          ::getpeername(fd, reinterpret_cast<sockaddr*>(&o.peer), &o.peer_len) != 0)
        o.peer_len = 0;
      open_[fd] = o;
      high_water_ = std::max(high_water_, pending());
      break;
    }
    case ZMQ_EVENT_HANDSHAKE_SUCCEEDED:
      ++succeeded_;
      break;
    case ZMQ_EVENT_DISCONNECTED: {
      // A failed handshake's disconnection follows its failure at once (one I/O thread emits
      // both). Any other of a connection that may still be in its handshake ended it silently
      // when every such connection is counted as waiting (else it may be one that completed it).
      const auto it = open_.find(fd);
      if (!after_failure && it != open_.end() && spoke_.count(fd) == 0 &&
          std::chrono::steady_clock::now() - it->second.when < kMayBePending) {
        const std::uint64_t ended = succeeded_ + failed_ + silent_;
        const std::uint64_t counted = accepted_ > ended ? accepted_ - ended : 0;
        if (counted >= static_cast<std::uint64_t>(young())) {
          ++silent_;
          silent = true;
        }
      }
      open_.erase(fd);
      spoke_.erase(fd);
      break;
    }
    default:
      if (is_handshake_failure(e.event)) ++failed_;
      break;
  }
  return silent;
}

std::string PendingHandshakes::silent_refusal() const {
  return fmt::format(
      "it broke the framing before its handshake completed (a frame longer than the {} bytes "
      "this socket reads, or a malformed one)",
      max_frame_);
}

void PendingHandshakes::authenticated(int fd) {
  if (fd >= 0 && open_.count(fd) != 0) spoke_.insert(fd);
}

int PendingHandshakes::young() const {
  // Every open connection spoke (spoke_ holds open ones only): none can be waiting, whatever the
  // time. A mailbox's receive loop asks after every message, so this case reads no clock.
  if (spoke_.size() == open_.size()) return 0;
  const auto now = std::chrono::steady_clock::now();
  int n = 0;
  for (const auto& [fd, o] : open_)
    if (now - o.when < kMayBePending && spoke_.count(fd) == 0) ++n;
  return n;
}

int PendingHandshakes::pending() const {
  const std::uint64_t ended = succeeded_ + failed_ + silent_ + static_cast<std::uint64_t>(closing_);
  const std::uint64_t counted = accepted_ > ended ? accepted_ - ended : 0;
  return static_cast<int>(std::min<std::uint64_t>(counted, static_cast<std::uint64_t>(young())));
}

int PendingHandshakes::enforce(log::Throttle& throttle) {
  // Nothing accepted is in its handshake any more: every connection shut down has ended.
  if (young() == 0) closing_ = 0;
  int now_shut = 0;
  for (int waiting = pending(); waiting > cap_; waiting = pending()) {
    const auto now = std::chrono::steady_clock::now();
    // The oldest connection still waiting, that this socket accepted: a member's handshake takes
    // milliseconds, so the one that waited longest is the likeliest to be a flood's (which holds
    // each connection silent for as long as the handshake interval allows). Closing the newest
    // instead closed every member connecting while the flood held its connections open.
    auto oldest = open_.end();
    for (auto it = open_.begin(); it != open_.end(); ++it)
      if (now - it->second.when < kMayBePending && spoke_.count(it->first) == 0 &&
          (oldest == open_.end() || it->second.order < oldest->second.order))
        oldest = it;
    if (oldest == open_.end()) break;
    const int fd = oldest->first;
    sockaddr_storage peer{};
    socklen_t len = sizeof peer;
    const bool same = oldest->second.peer_len != 0 && (port_ == 0 || local_port(fd) == port_) &&
                      ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) == 0 &&
                      len == oldest->second.peer_len &&
                      std::memcmp(&peer, &oldest->second.peer, len) == 0;
    open_.erase(oldest);
    if (!same || ::shutdown(fd, SHUT_RDWR) != 0) continue;
    ++closing_;
    ++shut_down_;
    ++now_shut;
    if (throttle.allow()) {
      std::string line = fmt::format(
          "{}: closed a connection before its handshake: {} connections were waiting for theirs, "
          "more than the {} it lets wait (docs/security.md)",
          who_, waiting, cap_);
      if (const std::int64_t held = throttle.suppressed(); held > 0)
        line += fmt::format(" ({} more such line(s) were held back by the log's rate limit)", held);
      log::warn("{}", line);
    }
  }
  return now_shut;
}

bool PendingHandshakes::caused(const ConnectionEvent& e) {
  if (!is_handshake_failure(e.event) || closing_ == 0) return false;
  --closing_;
  return true;
}

bool ConnectionEvent::refused() const {
  return event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL ||
         event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL || event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH ||
         event == ZMQ_EVENT_ACCEPT_FAILED;
}

bool ConnectionEvent::authentication_failed() const {
  if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) return true;
  return event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL &&
         (value == ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC ||
          value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH);
}

std::string ConnectionEvent::describe() const {
  switch (event) {
    case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL:
      return fmt::format(
          "the connection ended during its handshake ({}; a peer without this "
          "run's keys, or one that exited)",
          value != 0 ? errno_text(static_cast<int>(value)) : "closed");
    case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
      return "the handshake failed: " + protocol_error(value);
    case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
      return fmt::format("the authentication handler refused its key (status {})", value);
    case ZMQ_EVENT_ACCEPT_FAILED:
      return "accept failed: " + errno_text(static_cast<int>(value));
    default:
      return fmt::format("event 0x{:x}", event);
  }
}

Result<zmq::socket_t> watch_connections(zmq::context_t& ctx, zmq::socket_t& socket) {
  const std::string address = fmt::format("inproc://refit-connections-{}", g_monitors.fetch_add(1));
  if (zmq_socket_monitor(socket.handle(), address.c_str(), kConnectionEvents) != 0)
    return Status::IOError(
        fmt::format("cannot monitor a ZeroMQ socket: {}", zmq_strerror(zmq_errno())));
  try {
    zmq::socket_t monitor(ctx, zmq::socket_type::pair);
    monitor.set(zmq::sockopt::linger, 0);
    monitor.connect(address);
    return monitor;
  } catch (const zmq::error_t& e) {
    return Status::IOError(fmt::format("cannot monitor a ZeroMQ socket: {}", e.what()));
  }
}

std::vector<ConnectionEvent> read_connection_events(zmq::socket_t& monitor) {
  std::vector<ConnectionEvent> out;
  for (int k = 0; k < 1000; ++k) {
    std::vector<zmq::message_t> frames;
    if (!zmq::recv_multipart(monitor, std::back_inserter(frames), zmq::recv_flags::dontwait)) break;
    if (frames.empty() || frames[0].size() < 6) continue;
    ConnectionEvent e;
    std::memcpy(&e.event, frames[0].data(), sizeof e.event);
    std::memcpy(&e.value, static_cast<const char*>(frames[0].data()) + 2, sizeof e.value);
    if (frames.size() > 1) e.address = frames[1].to_string();
    out.push_back(std::move(e));
  }
  return out;
}

Status probe_zmtp(const std::string& host, int port, int wait_ms) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string h =
      host.size() > 2 && host.front() == '[' ? host.substr(1, host.size() - 2) : host;
  if (getaddrinfo(h.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || res == nullptr)
    return Status::IOError(fmt::format("{} does not resolve", host));
  const int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    return Status::IOError(errno_text(errno));
  }
  int rc = ::connect(fd, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
  const auto left = [&] {
    return static_cast<int>(std::max<long long>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                 std::chrono::steady_clock::now())
               .count()));
  };
  Status out = Status::Unsupported("no ZeroMQ greeting");
  if (rc != 0 && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    rc = ::poll(&p, 1, left()) == 1 ? 0 : -1;
    int err = 0;
    socklen_t len = sizeof err;
    if (rc == 0 && (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0)) {
      errno = err;
      rc = -1;
    } else if (rc != 0) {
      errno = ETIMEDOUT;
    }
  }
  if (rc != 0) {
    out = errno == ECONNREFUSED ? Status::NotFound("nothing listens there")
                                : Status::IOError(errno_text(errno));
  } else {
    // A ZeroMQ socket's greeting starts with 0xFF, 8 bytes, 0x7F, sent as soon as it connects.
    unsigned char sig[10];
    std::size_t got = 0;
    bool silent = false;  // the connection stayed open with nothing to read
    while (got < sizeof sig) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, left()) != 1) {
        silent = got == 0;
        break;
      }
      const ssize_t n = ::recv(fd, sig + got, sizeof sig - got, 0);
      if (n <= 0) break;
      got += static_cast<std::size_t>(n);
    }
    if (got == sizeof sig && sig[0] == 0xFF && sig[9] == 0x7F)
      out = Status::Ok();
    else if (silent)
      out = Status::Timeout(fmt::format("it accepted the connection but sent nothing within {} ms",
                                        wait_ms));
  }
  ::close(fd);
  return out;
}

}  // namespace refit
