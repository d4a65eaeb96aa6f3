// What ZeroMQ reports about a socket's connections (zmq_socket_monitor), read the same way by the
// store server, the store client and the mailbox: which connections were refused, and why.
// Internal to src/control.
#pragma once

#include <cstdint>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "refit/status.h"

namespace refit {

// The events watch_connections() asks for.
inline constexpr int kConnectionEvents =
    ZMQ_EVENT_CONNECTED | ZMQ_EVENT_ACCEPT_FAILED | ZMQ_EVENT_DISCONNECTED |
    ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
    ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;

struct ConnectionEvent {
  std::uint16_t event = 0;
  std::uint32_t value = 0;  // errno, a ZMQ_PROTOCOL_ERROR_* code or a ZAP status code
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
