// The parts a mailbox (control/mailbox.cc) is made of, each with one job: the senders' registered
// keys, the sending side, and the receiving side of its same-host lanes. Internal to src/control.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>
#include <zmq.hpp>

#include "common/log_throttle.h"
#include "control/lane.h"
#include "control/lane_gate.h"
#include "control/mailbox.h"

namespace refit::mailbox_parts {

bool is_known_type(std::uint8_t type);

// The sending keys mailboxes registered under "auth/key/<id>" (Z85), each read from the store
// once and kept. Thread-safe: the lane gate's thread and the receiving thread both ask.
class SenderKeys {
 public:
  // A key found is kept for the mailbox's life. A lookup that finds none costs a store request
  // that anyone who can reach the mailbox can cause (a hello naming a sender that never
  // registered), so at most kMissBudget of them are made per kMissWindow; past it, an id not yet
  // known is refused without a lookup (a real sender then falls back to ZeroMQ for that peer).
  static constexpr int kMissBudget = 8;
  static constexpr std::chrono::seconds kMissWindow{1};
  explicit SenderKeys(Store& store) : store_(store) {}
  // The Z85 key `id` registered; an error naming why there is none. `budgeted`: a lookup that
  // anyone who can reach the mailbox can cause (a lane's hello), subject to the budget; the
  // ZeroMQ socket's messages come only from CURVE clients of the run and are not. (A key is set
  // once per id in the store, so a key found stays right.)
  Result<std::string> z85_of(const std::string& id, bool budgeted);

 private:
  Store& store_;
  std::mutex mu_;
  std::unordered_map<std::string, std::string> keys_;  // guarded by mu_
  std::chrono::steady_clock::time_point window_start_{};  // guarded by mu_
  int misses_ = 0;                                        // in this window; guarded by mu_
};

// The sending side: one path per peer, chosen at the first message to it and kept, so one peer's
// messages stay in order — its same-host lane when it published one for this host identity,
// else a ZeroMQ PUSH socket (ZMQ_IMMEDIATE: a message is queued only on a live connection).
// Thread-safe (one lock: sends to one mailbox are serialised).
class Outbox {
 public:
  // `send_public` / `send_secret`: the mailbox's sending key pair (Z85; empty without auth).
  Outbox(Store& store, const MailboxOptions& options, zmq::context_t& ctx, std::string send_public,
         std::string send_secret, bool lanes);
  ~Outbox();
  Outbox(const Outbox&) = delete;
  Outbox& operator=(const Outbox&) = delete;
  Status send(const std::string& to, MessageType type, std::uint32_t epoch,
              const std::string& payload);
  // Once a peer's address is known, a live peer takes a message at once. One that has not after
  // send_timeout() is probed: a port that refuses connections (the peer exited) fails the send
  // then, so a process whose peer died does not sit out the whole timeout; a port that accepts
  // (a peer slow to complete its handshake or to read) is waited for up to the whole timeout.
  std::chrono::milliseconds send_timeout() const;
  // The mailbox's liveness check (Mailbox::set_liveness_check): a send waiting for a slow peer
  // past send_timeout() asks it between slices and stops when it fails.
  void set_liveness_check(std::function<Status()> check);

 private:
  static Status probe_peer(const std::string& address);
  struct Peer {
    std::string address;
    zmq::socket_t socket;
    std::optional<lane::Outgoing> lane;  // set: messages go over the peer's lane
  };
  std::optional<lane::Outgoing> open_lane(const std::string& to);
  Status open_zmq(Peer& peer, const std::string& what);

  Store& store_;
  const MailboxOptions options_;
  zmq::context_t& ctx_;
  const std::string send_public_, send_secret_;
  const bool lanes_;
  std::mutex mu_;
  std::unordered_map<std::string, Peer> peers_;  // guarded by mu_
  std::function<Status()> liveness_;              // guarded by mu_
};

// The receiving side of the mailbox's same-host lane: its gate (the handshake, on a thread of
// its own) and the lanes the gate proved, one per sender, read by the receiving thread.
class LaneInbox {
 public:
  // `throttle`: the mailbox's rate limit for lines peers can cause (it must outlive the inbox).
  static Result<std::unique_ptr<LaneInbox>> open(const MailboxOptions& options, SenderKeys* keys,
                                                 log::Throttle& throttle);
  const std::string& address() const { return gate_->address(); }
  // Takes proved lanes from the gate and every whole frame the ready lanes hold into `out`. A
  // lane that ends, breaks the framing or fails a tag is closed (the latter two, and a lane cut
  // mid-frame, logged and counted). Only lanes with something to read are read: the cost is
  // that of the lanes that are ready, not of every lane (a rank of a large run holds one per
  // peer it ever talked to).
  void pump(std::deque<Message>& out);
  // What receive() polls: one descriptor, readable while the gate or any lane is (an epoll set
  // of the gate's ready descriptor and every lane).
  int poll_fd() const { return ready_.get(); }
  // Connections refused or closed: by the gate, or after their hello.
  std::int64_t dropped() const { return gate_->refused() + closed_.load(); }
  std::int64_t messages() const { return messages_.load(); }
  int pending_high_water() const { return gate_->pending_high_water(); }

 private:
  struct Lane {
    lane::Reader reader;
    std::string from;
  };
  LaneInbox(std::string who, std::unique_ptr<lane::Gate> gate, lane::Fd ready,
            log::Throttle& throttle)
      : who_(std::move(who)),
        gate_(std::move(gate)),
        gate_fd_(gate_->ready_fd()),
        ready_(std::move(ready)),
        throttle_(throttle) {}
  // Reads `lane`'s frames into `out`; false when it is to be closed.
  bool read(Lane& lane, std::deque<Message>& out);
  bool close_lane(const Lane& lane, const std::string& why);
  // Takes the lanes the gate proved; each joins the epoll set.
  void take_accepted(std::deque<Message>& out);

  const std::string who_;
  std::unique_ptr<lane::Gate> gate_;
  const int gate_fd_;          // the gate's ready descriptor, in the epoll set
  lane::Fd ready_;             // the epoll set (poll_fd)
  std::map<int, Lane> lanes_;  // by descriptor; receive thread
  std::atomic<std::int64_t> closed_{0};
  std::atomic<std::int64_t> messages_{0};
  log::Throttle& throttle_;  // the mailbox's
};

}  // namespace refit::mailbox_parts
