// Point-to-point control messages between refit processes (begin, bucket metadata, commit, acks),
// on ZeroMQ. Failures travel through the store, not as messages (runtime/failure.h).
//
// Every process owns one Mailbox: a socket bound to an ephemeral port on `host`, whose address
// it publishes in the store under "mailbox/<id>". send() connects lazily to a peer's published
// address, or, for a peer on the same host, to its same-host lane ("lane/<id>", control/lane.h;
// REFIT_CONTROL_LANES=0 turns lanes off). Messages from one sender to one receiver arrive in order.
// receive() waits at most `timeout`. A Mailbox is driven by one thread at a time; send() and
// receive() may be used from two different threads concurrently.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "control/message_types.h"
#include "refit/status.h"

namespace refit {

class ControlAuth;
class Store;

struct Message {
  MessageType type = MessageType::kHello;
  std::string from;  // sender id, e.g. "trainer/0", "engine/1/0"
  std::string payload;
  std::uint32_t epoch = 0;  // the sender's refit epoch when it sent it (set_epoch)
};

class Mailbox {
 public:
  // Binds, and publishes the address under "mailbox/<id>" in `store` (which must outlive it).
  // With `auth` (control/auth.h) every connection is CURVE-authenticated, this mailbox registers
  // its sending key under "auth/key/<id>" (once per run: a second mailbox of the same id is
  // refused), and receive() drops every message whose claimed sender registered another key.
  // Malformed messages are dropped and logged with their origin, never returned.
  static Result<std::unique_ptr<Mailbox>> open(Store& store, const std::string& id,
                                               const std::string& host,
                                               std::chrono::milliseconds timeout,
                                               std::shared_ptr<const ControlAuth> auth);
  // Messages received so far that were dropped (malformed, or not from their claimed sender), and
  // refused same-host lane connections (another user's, or a hello without the sender's key).
  virtual std::int64_t dropped() const = 0;
  // Messages received so far over same-host lanes (control/lane.h) rather than ZeroMQ.
  virtual std::int64_t lane_messages() const = 0;
  virtual ~Mailbox() = default;
  virtual const std::string& id() const = 0;
  // Sends to the mailbox published as "mailbox/<to>" (waiting for it up to the timeout).
  virtual Status send(const std::string& to, MessageType type, const std::string& payload) = 0;
  // The next message, or kTimeout. Messages of an earlier refit epoch than this mailbox's are
  // dropped (a refit that failed in flight; docs/runtime.md). A message of a later epoch ends the
  // wait with kAborted and is kept: until set_epoch() reached its epoch, receive() reads nothing
  // more and answers kAborted again; then it returns that message first.
  virtual Result<Message> receive(std::chrono::milliseconds timeout) = 0;
  // The refit epoch: stamped on every message sent from now on, and the oldest accepted.
  virtual void set_epoch(std::uint32_t epoch) = 0;
  virtual std::uint32_t epoch() const = 0;
  // The epoch of the message kept for later (0 when none is kept).
  virtual std::uint32_t kept_epoch() const = 0;
  // While receive() waits, `check` runs every `interval`; a non-ok Status ends the wait with it.
  // (The runtime checks that the store is reachable and that no other rank has failed.)
  virtual void set_liveness_check(std::function<Status()> check,
                                  std::chrono::milliseconds interval) = 0;
};

}  // namespace refit
