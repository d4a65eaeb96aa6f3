// Point-to-point control messages between refit processes (begin, bucket metadata, commit, acks),
// on ZeroMQ. Failures travel through the store, not as messages (runtime/failure.h).
//
// Every process owns one Mailbox: a socket bound to an ephemeral port on `host`, whose address
// it publishes in the store under "mailbox/<id>". send() connects lazily to a peer's published
// address, or, for a peer on the same host, to its same-host lane ("lane/<id>", control/lane.h;
// ControlSettings::lanes false turns lanes off). Messages from one sender to one receiver arrive
// in order. receive() waits at most `timeout`. A Mailbox is driven by one thread at a time; send()
// and receive() may be used from two different threads concurrently. Its settings come in through
// MailboxOptions: a mailbox reads no environment variable, so one process can hold mailboxes of
// several ranks with different settings (tests run whole sessions on threads this way).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "control/lane.h"
#include "control/message_types.h"
#include "refit/status.h"

namespace refit {

class ControlAuth;
class Store;

// How a rank's mailbox talks to the others, read once at the edge (the CLI, Trainer::create,
// Engine::create: control_settings_from_environment) and passed in.
struct ControlSettings {
  // REFIT_CONTROL_LANES: same-host lanes to and from mailboxes of the same host identity.
  bool lanes = true;
  // REFIT_CONTROL_SPIN_US: how long receive() polls without blocking after the mailbox's last
  // message (0: it blocks at once).
  std::chrono::microseconds spin{0};
  // REFIT_HOST_ID, else the kernel's boot id and the IPC namespace (env::host_identity()): lanes
  // join mailboxes whose identities are equal. Empty: no lanes.
  std::string host_identity;
};
// The process's REFIT_CONTROL_LANES, REFIT_CONTROL_SPIN_US and host identity (bad values are an
// InvalidArgument naming the variable).
Result<ControlSettings> control_settings_from_environment();

// The most bytes a mailbox message's payload may have, and the most its ZeroMQ socket reads of
// any one frame (ZMQ_MAXMSGSIZE), so that a connection that has not completed its handshake makes
// a mailbox hold at most this much. The largest messages of a run are a few kilobytes to tens of
// them (the routes a trainer rank sends an engine rank: 25 KB for qwen3-235b-a22b; paused answers
// carry their exports' digest, the exports lie in the store); a larger payload is refused when it
// is sent, naming its size (docs/security.md, "Bounds and malformed input").
inline constexpr std::int64_t kMaxMailboxMessageBytes = std::int64_t{1} << 20;

struct MailboxOptions {
  std::string id;                            // "trainer/0", "engine/3": 1 to 255 bytes
  std::string host = "127.0.0.1";            // the address its ZeroMQ socket binds
  std::chrono::milliseconds timeout{60000};  // waits for peers and the store (refit.timeout_s)
  // With auth (control/auth.h) every connection is CURVE-authenticated, this mailbox registers
  // its sending key under "auth/key/<id>" (once per run: a second mailbox of the same id is
  // refused), and it accepts only messages and lanes their claimed sender's key proves.
  // nullptr: unauthenticated, loopback addresses only.
  std::shared_ptr<const ControlAuth> auth;
  ControlSettings settings;
  lane::Limits lane_limits;  // what its lane holds before a hello proves the sender
  // ZeroMQ connections that may wait for their handshake at once (0: kZmqMaxPendingHandshakes).
  int max_pending_handshakes = 0;
};

struct Message {
  MessageType type = MessageType::kHello;
  std::string from;  // sender id, e.g. "trainer/0", "engine/1/0"
  std::string payload;
  std::uint32_t epoch = 0;  // the sender's refit epoch when it sent it (set_epoch)
};

class Mailbox {
 public:
  // Binds, and publishes the address under "mailbox/<id>" in `store` (which must outlive it).
  // Malformed messages, and messages or lanes their claimed sender did not send, are dropped and
  // logged with their origin, never returned.
  static Result<std::unique_ptr<Mailbox>> open(Store& store, MailboxOptions options);
  // Messages dropped so far (malformed, not from their claimed sender; not those of an earlier
  // refit epoch, which receive() drops as part of the protocol) and connections refused or closed
  // (a same-host lane of another user, without a valid hello, cut mid-frame, or with a frame that
  // fails its tag; a ZeroMQ connection whose handshake failed or that was shut down because too
  // many waited for theirs).
  virtual std::int64_t dropped() const = 0;
  // Messages received so far over same-host lanes (control/lane.h) rather than ZeroMQ.
  virtual std::int64_t lane_messages() const = 0;
  // Messages this mailbox sent so far (each send() that returned ok).
  virtual std::int64_t sent() const = 0;
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
  // A send still waiting for a live but slow peer after its first few seconds asks it too.
  // (The runtime checks that the store is reachable and that no other rank has failed.)
  virtual void set_liveness_check(std::function<Status()> check,
                                  std::chrono::milliseconds interval) = 0;
};

}  // namespace refit
