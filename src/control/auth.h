// Authentication of the control plane (docs/security.md): ZeroMQ CURVE with keys derived from one
// secret per run.
//
// Every process of a run holds the run secret (REFIT_SECRET, or REFIT_SECRET_FILE naming a file
// that holds it; `refit run` generates one for its ranks). From it each derives the same two
// CURVE key pairs:
//   - the server pair, used by the store server and by every mailbox's receiving socket: only a
//     holder of the secret knows the server's public key, so only it can connect;
//   - the member pair, used by store clients: the store server's ZAP handler accepts that key and
//     no other.
// A mailbox's sending sockets use a key pair of their own, made at random when the mailbox opens.
// Its public key is registered in the store under "auth/key/<mailbox id>", which can be set only
// once. A receiving mailbox learns the key of every connection from its ZAP handler (the message
// property "User-Id"). It drops a message whose claimed sender registered another key, so a
// holder of the secret cannot speak for another rank.
//
// Without a secret the control plane is unauthenticated; that is allowed only while every socket
// listens on a loopback address (check_listen_address).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "refit/status.h"

namespace refit::log {
class Throttle;
}  // namespace refit::log

namespace refit {

class ControlAuth {
 public:
  // From a secret of at least 16 bytes (any bytes).
  static Result<ControlAuth> from_secret(std::string_view secret);
  // A new secret: 64 hex digits from the OS's random source.
  static std::string generate_secret();

  // Z85 text, 40 characters each (ZMQ_CURVE_* options).
  const std::string& server_public() const { return server_public_; }
  const std::string& server_secret() const { return server_secret_; }
  const std::string& member_public() const { return member_public_; }
  const std::string& member_secret() const { return member_secret_; }

 private:
  std::string server_public_, server_secret_, member_public_, member_secret_;
};

// The run's credentials from REFIT_SECRET / REFIT_SECRET_FILE, read once per process; nullptr when
// neither is set. Errors name the variable or the file (unreadable, empty, shorter than 16 bytes,
// readable by other users).
Result<std::shared_ptr<const ControlAuth>> process_control_auth();

// Refuses to listen on `host` without authentication unless it is a loopback address.
Status check_listen_address(const std::string& host, const ControlAuth* auth, const std::string& who);

// A fresh CURVE key pair (Z85 public, Z85 secret) for a mailbox's sending sockets.
std::pair<std::string, std::string> curve_keypair();

// The store key holding the registered sending key of mailbox `id`.
std::string auth_key_name(const std::string& id);
// Whether `key` may be set only once (the server refuses to overwrite it).
bool is_set_once_key(std::string_view key);
// Whether a member may erase `key` (under any group's prefix): only what a run writes per export
// or per refit (export/, outcome/); never an address, a heartbeat or a recorded failure, whose
// loss would hang a peer or misattribute a failure.
bool is_erasable_key(std::string_view key);

// A ZAP handler (RFC 27) for one ZeroMQ context: answers the handshakes of that context's CURVE
// server sockets. `accept` sees the client's public key (Z85); an accepted connection gets the
// key as its User-Id. Stops (and joins its thread) on destruction, which must come before the
// context's. A refused key is logged through `throttle`, the rate limit of the socket's owner (one
// per store server or mailbox), which must outlive the handler.
class ZapHandler {
 public:
  static Result<std::unique_ptr<ZapHandler>> start(void* zmq_context,
                                                   std::function<bool(const std::string&)> accept,
                                                   std::string who, log::Throttle& throttle);
  virtual ~ZapHandler() = default;
  // How many times its thread woke so far (a request each, while it has a wake-up descriptor).
  virtual std::uint64_t wakeups() const = 0;
};

}  // namespace refit
