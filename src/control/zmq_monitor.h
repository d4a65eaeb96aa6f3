// What ZeroMQ reports about a socket's connections (zmq_socket_monitor), read the same way by the
// store server, the store client and the mailbox: which connections were refused, and why.
// Internal to src/control.
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <unordered_set>
#include <vector>
#include <zmq.hpp>

#include "common/log_throttle.h"
#include "refit/status.h"

namespace refit {

// The events watch_connections() asks for.
inline constexpr int kConnectionEvents =
    ZMQ_EVENT_CONNECTED | ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_ACCEPT_FAILED | ZMQ_EVENT_DISCONNECTED |
    ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
    ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;

struct ConnectionEvent {
  std::uint16_t event = 0;
  // errno, a ZMQ_PROTOCOL_ERROR_* code, a ZAP status code, or the connection's descriptor
  // (ZMQ_EVENT_ACCEPTED, ZMQ_EVENT_DISCONNECTED)
  std::uint32_t value = 0;
  std::string address;      // the socket's endpoint
  // A connection refused or cut before it was authenticated: a failed handshake or accept.
  bool refused() const;
  // The handshake failed because the two sides do not hold the same run secret: a CURVE
  // cryptographic failure, a security mechanism mismatch (one side has a secret, the other none),
  // or the ZAP handler refused the key. Not for a connection closed mid-handshake.
  bool authentication_failed() const;
  // A reason for a log line: "the handshake failed: ...", "accept failed: too many open files ...".
  std::string describe() const;
};

// The connections a listening ZeroMQ socket accepted that have not completed their handshake
// (docs/security.md, "Bounds and malformed input"), read from its monitor's events, and a cap on
// them: over `cap`, the oldest is shut down (shutdown(2) on its descriptor: ZeroMQ itself then
// closes it as a connection that ended during its handshake, so no descriptor is closed behind
// ZeroMQ's back). Used by the thread that reads the monitor.
//
// ZeroMQ's events do not say which connection completed its handshake, so the count is
// accepted - succeeded - failed, never more than the connections accepted within the handshake
// interval that are still open and sent no message (ZeroMQ closes any older one that has not
// completed it). A connection is shut down only while the count is over the cap, and only one of
// those.
class PendingHandshakes {
 public:
  explicit PendingHandshakes(int cap) : cap_(cap) {}
  // Once the socket is bound: `who` names it in log lines ("store server tcp://127.0.0.1:29500"),
  // `port` is the port it listens on (only connections to it are ever shut down), `max_frame` its
  // ZMQ_MAXMSGSIZE.
  void listening(std::string who, int port, std::int64_t max_frame) {
    who_ = std::move(who);
    port_ = port;
    max_frame_ = max_frame;
  }
  // Every event read from the socket's monitor, in order. True when `e` ended a connection before
  // its handshake without ZeroMQ reporting a failure: ZeroMQ reports none when a frame breaks its
  // framing (one longer than ZMQ_MAXMSGSIZE) before the handshake, only the disconnection. The
  // caller counts such a connection as refused (silent_refusal() words it).
  bool see(const ConnectionEvent& e);
  std::string silent_refusal() const;
  // A message arrived on descriptor `fd` (ZMQ_SRCFD): that connection completed its handshake.
  void authenticated(int fd);
  // Shuts down the oldest waiting connections while more than the cap wait; logs each (through
  // `throttle`). Returns how many it shut down.
  int enforce(log::Throttle& throttle);
  // Whether the refused connection `e` (ConnectionEvent::refused) is one that enforce() shut down:
  // the caller counts it, but its line was written already.
  bool caused(const ConnectionEvent& e);
  // Connections waiting for their handshake now, and the most that waited at once.
  int pending() const;
  int high_water() const { return high_water_; }
  // Connections shut down so far.
  std::int64_t shut_down() const { return shut_down_; }
  int cap() const { return cap_; }

 private:
  int young() const;  // open, accepted within the handshake interval, no message seen
  struct Open {
    std::uint64_t order = 0;  // in the order accepted
    std::chrono::steady_clock::time_point when;
    sockaddr_storage peer{};
    socklen_t peer_len = 0;
  };
  std::string who_;
  const int cap_;
  int port_ = 0;
  std::int64_t max_frame_ = 0;
  std::uint64_t accepted_ = 0, succeeded_ = 0, failed_ = 0, silent_ = 0;
  bool after_failure_ = false;  // the last event was a failed handshake (its disconnection follows)
  std::map<int, Open> open_;    // by descriptor: accepted, not yet disconnected
  std::unordered_set<int> spoke_;  // descriptors a message arrived on
  int closing_ = 0;                // shut down, their refusal not yet seen
  int high_water_ = 0;
  std::int64_t shut_down_ = 0;
};

// A PAIR socket receiving `socket`'s connection events (kConnectionEvents). Destroy it before
// `socket`'s context.
Result<zmq::socket_t> watch_connections(zmq::context_t& ctx, zmq::socket_t& socket);
// The events waiting on `monitor` (never blocks).
std::vector<ConnectionEvent> read_connection_events(zmq::socket_t& monitor);

// Whether a ZeroMQ peer listens at host:port: a plain TCP connection, on which a ZeroMQ socket
// sends its greeting's 10-byte signature at once. kOk: it does; kNotFound: nothing listens
// (connection refused); kUnsupported: something else listens (it closed the connection or sent
// something else: another server holds the port); kTimeout: it accepted the connection and sent
// nothing within `wait` (a server that waits for its clients to speak first, such as
// torch.distributed's store, or a ZeroMQ process that is stopped or hung: the kernel accepts for
// it); kIOError: the address cannot be reached.
Status probe_zmtp(const std::string& host, int port, int wait_ms);

}  // namespace refit
