// Mailbox on ZeroMQ: one PULL socket to receive, one PUSH socket per peer to send; between
// mailboxes on one host, a lane (control/lane.h) instead of the PUSH socket.
//
// Wire: a 3-frame message [type: 1 byte, refit epoch: 4 bytes little-endian][sender id][payload].
// PUSH sockets are created with ZMQ_IMMEDIATE, so a message is queued only on a live connection:
// a send to a peer that is not (or no longer) connected fails after the send timeout instead of
// queueing forever. On close a PUSH socket lingers for at most kSendLinger so the last messages
// (commit, shutdown) still leave.
#include "control/mailbox.h"

#include <fmt/format.h>

#include <sodium.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "common/env.h"
#include "common/log.h"
#include "control/auth.h"
#include "control/lane.h"
#include "control/store.h"

namespace refit {

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kSendLinger{2000};

bool is_known_type(std::uint8_t t) { return is_message_type(t); }

std::string mailbox_key(const std::string& id) { return "mailbox/" + id; }
std::string lane_key(const std::string& id) { return "lane/" + id; }

class ZmqMailbox final : public Mailbox {
 public:
  ZmqMailbox(Store& store, std::string id, std::chrono::milliseconds timeout,
             std::shared_ptr<const ControlAuth> auth)
      : store_(store),
        id_(std::move(id)),
        timeout_(timeout),
        auth_(std::move(auth)),
        // A bad value was refused at setup (env::check); here it only turns the spin off.
        spin_(env::control_spin_us().ok() ? *env::control_spin_us() : 0),
        pull_(ctx_, zmq::socket_type::pull) {}
  ~ZmqMailbox() override {
    if (spin_.count() > 0)
      log::debug("mailbox '{}': {} message(s) arrived while it spun (REFIT_CONTROL_SPIN_US={})",
                 id_, spun_.load(), spin_.count());
    if (lane_)
      log::debug("mailbox '{}': {} message(s) arrived over same-host lanes", id_,
                 lane_messages_.load());
    // Sockets before the context (whose destruction waits for the PUSH linger).
    peers_.clear();
    pull_.close();
    zap_.reset();
  }
  ZmqMailbox(const ZmqMailbox&) = delete;
  ZmqMailbox& operator=(const ZmqMailbox&) = delete;

  Status bind_and_publish(const std::string& host) {
    const std::string requested = fmt::format("tcp://{}:*", host);
    REFIT_RETURN_IF_ERROR(check_listen_address(host, auth_.get(), fmt::format("mailbox '{}'", id_)));
    if (auth_) {
      // Any CURVE client that knows the server key (only holders of the secret do) may connect;
      // who it speaks for is checked per message against the registered keys.
      REFIT_ASSIGN_OR_RETURN(zap_, ZapHandler::start(ctx_.handle(),
                                                     [](const std::string&) { return true; },
                                                     fmt::format("mailbox '{}'", id_)));
      std::tie(send_public_, send_secret_) = curve_keypair();
      Status registered = store_.set(auth_key_name(id_), send_public_);
      if (!registered.ok())
        return registered.with_context(fmt::format(
            "mailbox '{}': registering its key (is another process running as '{}'?)", id_, id_));
    }
    try {
      pull_.set(zmq::sockopt::linger, 0);
      pull_.set(zmq::sockopt::maxmsgsize, kMaxControlFrameBytes);
      if (auth_) {
        pull_.set(zmq::sockopt::curve_server, 1);
        pull_.set(zmq::sockopt::curve_secretkey, auth_->server_secret());
      }
      pull_.bind(requested);
      endpoint_ = pull_.get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      return Status::IOError(
          fmt::format("mailbox '{}': cannot bind {}: {}", id_, requested, e.what()));
    }
    // The lane first: a sender that finds the mailbox finds its lane too.
    if (env::control_lanes().ok() && *env::control_lanes()) {  // bad values were refused at setup
      Result<lane::Listener> l = lane::Listener::open(fmt::format("mailbox '{}'", id_));
      if (l.ok()) {
        lane_.emplace(std::move(l).value());
        REFIT_RETURN_IF_ERROR(
            store_.set(lane_key(id_), lane_->address())
                .with_context(fmt::format("mailbox '{}': publishing its lane", id_)));
      } else {
        log::warn("mailbox '{}': no same-host lane, ZeroMQ carries every message: {}", id_,
                  l.status().message());
      }
    }
    return store_.set(mailbox_key(id_), endpoint_)
        .with_context(fmt::format("mailbox '{}': publishing its address {}", id_, endpoint_));
  }

  const std::string& id() const override { return id_; }

  // Once a peer's address is known, a live peer takes a message at once (the connection is made
  // in milliseconds and nothing else queues on it); one that has not after a few seconds is gone.
  // Bounding this separately keeps a process whose peer died from sitting out the whole timeout.
  std::chrono::milliseconds send_timeout() const {
    return std::min(timeout_, std::chrono::milliseconds(3000));
  }

  Status send(const std::string& to, MessageType type, const std::string& payload) override {
    const std::string what =
        fmt::format("mailbox '{}': send {} to '{}'", id_, message_type_name(type), to);
    std::lock_guard<std::mutex> lock(send_mu_);
    auto it = peers_.find(to);
    if (it == peers_.end()) {
      auto address = store_.get(mailbox_key(to), timeout_);
      if (!address.ok()) {
        return address.status().with_context(
            fmt::format("{}: the peer did not publish its mailbox within {} ms (has it started?)",
                        what, timeout_.count()));
      }
      Peer peer;
      peer.address = *address;
      if (lane_) peer.lane = open_lane(to);
      if (!peer.lane) {
        try {
          peer.socket = zmq::socket_t(ctx_, zmq::socket_type::push);
          peer.socket.set(zmq::sockopt::linger, static_cast<int>(kSendLinger.count()));
          peer.socket.set(zmq::sockopt::immediate, 1);
          peer.socket.set(zmq::sockopt::sndtimeo, static_cast<int>(send_timeout().count()));
          if (auth_) {
            peer.socket.set(zmq::sockopt::curve_serverkey, auth_->server_public());
            peer.socket.set(zmq::sockopt::curve_publickey, send_public_);
            peer.socket.set(zmq::sockopt::curve_secretkey, send_secret_);
          }
          peer.socket.connect(peer.address);
        } catch (const zmq::error_t& e) {
          return Status::IOError(
              fmt::format("{}: cannot connect to {}: {}", what, peer.address, e.what()));
        }
      }
      it = peers_.emplace(to, std::move(peer)).first;
    }

    const std::uint32_t e = epoch_.load();
    const std::array<std::uint8_t, 5> head{static_cast<std::uint8_t>(type),
                                           static_cast<std::uint8_t>(e),
                                           static_cast<std::uint8_t>(e >> 8),
                                           static_cast<std::uint8_t>(e >> 16),
                                           static_cast<std::uint8_t>(e >> 24)};
    std::array<zmq::const_buffer, 3> parts{zmq::const_buffer(head.data(), head.size()),
                                           zmq::buffer(id_), zmq::buffer(payload)};
    Status status;
    if (it->second.lane) {
      // A dead peer's lane fails at once (the kernel closed it); a live peer that reads nothing
      // while its socket buffer is full is waited for up to the whole timeout.
      const Status sent = lane::write_frame(it->second.lane.get(), static_cast<std::uint8_t>(type),
                                            e, payload, timeout_);
      if (!sent.ok())
        status = Status(sent.code(), fmt::format("{} over its same-host lane: {}; the peer closed "
                                                 "it (exited?)",
                                                 what, sent.message()));
    } else {
      status = send_zmq(it->second, parts, what);
    }
    // Look the peer up again next time: it may have restarted under a new address.
    if (!status.ok()) peers_.erase(it);
    if (status.ok()) active_ = Clock::now().time_since_epoch().count();
    return status;
  }

  Result<Message> receive(std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    // A kept message of a later epoch: nothing more is read until this mailbox reached its epoch,
    // so at most one is ever kept.
    if (kept_) {
      if (kept_->epoch > epoch_.load()) return later_epoch(*kept_);
      Message m = std::move(*kept_);
      kept_.reset();
      return m;
    }
    for (;;) {
      std::vector<zmq::message_t> frames;
      try {
        pump_lanes();
        std::optional<Message> m;
        if (!lane_queue_.empty()) {
          m = std::move(lane_queue_.front());
          lane_queue_.pop_front();
        } else if (zmq::recv_multipart(pull_, std::back_inserter(frames),
                                       zmq::recv_flags::dontwait)) {
          m = accept(frames);
          if (!m) continue;  // dropped
        }
        if (m) {
          const std::uint32_t mine = epoch_.load();
          if (m->epoch < mine) {
            // Of a refit that failed in flight: its peers moved on, so must we.
            log::debug("mailbox '{}': dropped a {} message from '{}' of refit epoch {} (now {})",
                       id_, message_type_name(m->type), m->from, m->epoch, mine);
            continue;
          }
          if (m->epoch > mine) {
            kept_ = std::move(*m);
            return later_epoch(*kept_);
          }
          active_ = Clock::now().time_since_epoch().count();
          return std::move(*m);
        }
      } catch (const zmq::error_t& e) {
        return Status::IOError(fmt::format("mailbox '{}': receive failed: {}", id_, e.what()));
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) {
        return Status::Timeout(
            fmt::format("mailbox '{}': no message within {} ms", id_, timeout.count()));
      }
      // While waiting, ask the liveness check now and then: a peer that died without a word
      // (killed, crashed) is noticed there long before the timeout.
      if (liveness_) {
        if (Clock::now() >= next_check_) {
          Status alive = liveness_();
          if (!alive.ok()) return alive;
          next_check_ = Clock::now() + liveness_interval_;
        }
        left = std::min(left, liveness_interval_);
      }
      if (spin_for_message(deadline)) continue;
      std::vector<zmq_pollitem_t>& items = poll_items();
      const int polled =
          zmq_poll(items.data(), static_cast<int>(items.size()), static_cast<long>(left.count()));
      if (polled < 0 && zmq_errno() != EINTR) {
        return Status::IOError(
            fmt::format("mailbox '{}': poll failed: {}", id_, zmq_strerror(zmq_errno())));
      }
    }
  }

  void set_epoch(std::uint32_t epoch) override { epoch_.store(epoch); }
  std::uint32_t epoch() const override { return epoch_.load(); }
  std::uint32_t kept_epoch() const override { return kept_ ? kept_->epoch : 0; }

  void set_liveness_check(std::function<Status()> check,
                          std::chrono::milliseconds interval) override {
    liveness_ = std::move(check);
    liveness_interval_ = interval;
    next_check_ = Clock::now() + interval;
  }

 private:
  struct Peer {
    std::string address;
    zmq::socket_t socket;
    lane::Fd lane;  // set: messages go over the peer's same-host lane, not the socket
  };
  // A connection to this mailbox's lane: `from` is empty until its hello named the sender.
  struct LaneIn {
    lane::Reader reader;
    std::string from;
  };

  Status send_zmq(Peer& peer, std::array<zmq::const_buffer, 3>& parts, const std::string& what) {
    try {
      // Multipart delivery is atomic: the first frame is the one that may time out.
      if (!zmq::send_multipart(peer.socket, parts))
        return Status::Timeout(
            fmt::format("{} at {}: not delivered within {} ms; the peer is not connected (exited?)",
                        what, peer.address, send_timeout().count()));
    } catch (const zmq::error_t& e) {
      return Status::IOError(fmt::format("{} at {}: {}", what, peer.address, e.what()));
    }
    return Status::Ok();
  }

  // A lane to `to` when it published one on this host, else an empty Fd (ZeroMQ carries the
  // messages). Every message to one peer takes one path, so they arrive in order.
  lane::Fd open_lane(const std::string& to) {
    Result<std::optional<std::string>> published = store_.try_get(lane_key(to));
    if (!published.ok() || !published->has_value()) return lane::Fd();
    const std::optional<lane::Address> a = lane::parse_address(**published);
    if (!a) return lane::Fd();  // another host
    std::string proof;
    if (auth_) {
      unsigned char sk[32];
      if (!lane::z85_key(send_secret_, sk)) return lane::Fd();
      proof = lane::make_proof(id_, to, a->key, sk);
      sodium_memzero(sk, sizeof sk);
    }
    Result<lane::Fd> fd = lane::connect(*a, id_, proof, send_timeout());
    if (!fd.ok()) {
      log::debug("mailbox '{}': no lane to '{}' ({}); ZeroMQ carries its messages", id_, to,
                 fd.status().message());
      return lane::Fd();
    }
    log::debug("mailbox '{}': sends to '{}' over its same-host lane", id_, to);
    return std::move(fd).value();
  }

  // Takes new lane connections and every whole frame they hold into lane_queue_; a connection
  // that ends, breaks the framing or fails its hello is closed (the latter two logged and counted
  // in dropped()).
  void pump_lanes() {
    if (!lane_) return;
    for (;;) {
      std::string refused;
      lane::Fd c = lane_->accept(refused);
      if (!refused.empty()) {
        ++dropped_;
        log::warn(
            "mailbox '{}': refused a same-host lane connection from {}: only processes of "
            "its own user may connect",
            id_, refused);
        continue;
      }
      if (!c) break;
      lanes_in_.push_back(LaneIn{lane::Reader(std::move(c)), {}});
      items_stale_ = true;
    }
    for (auto it = lanes_in_.begin(); it != lanes_in_.end();) {
      // The frames a peer wrote before it closed its end are still taken.
      const bool open = it->reader.fill();
      bool keep = true;
      while (keep) {
        Result<std::optional<lane::Frame>> f = it->reader.next(kMaxControlFrameBytes);
        if (!f.ok()) keep = drop_lane(*it, f.status().message());
        if (!f.ok() || !*f) break;
        keep = take_lane_frame(*it, **f);
      }
      if (keep && open) {
        ++it;
      } else {
        it = lanes_in_.erase(it);
        items_stale_ = true;
      }
    }
  }

  // Logs and counts a lane whose input is refused; false (the connection is to be closed).
  bool drop_lane(const LaneIn& in, const std::string& why) {
    ++dropped_;
    log::warn("mailbox '{}': closed a same-host lane{}: {}", id_,
              in.from.empty() ? std::string() : fmt::format(" from '{}'", in.from), why);
    return false;
  }

  // One frame of a lane; false when the connection is to be closed.
  bool take_lane_frame(LaneIn& in, lane::Frame& f) {
    if (in.from.empty()) {  // the hello: who sends on this lane, and with auth its proof
      const auto n = f.payload.empty()
                         ? std::size_t{0}
                         : static_cast<std::size_t>(static_cast<unsigned char>(f.payload[0]));
      if (f.type != lane::kHelloFrame || n == 0 || f.payload.size() < 1 + n)
        return drop_lane(in, "its first frame is not a hello naming the sender");
      std::string from = f.payload.substr(1, n);
      if (auth_) {
        const std::string* key = registered_key(from);
        unsigned char pk[32];
        if (key == nullptr || !lane::z85_key(*key, pk) ||
            !lane::check_proof(std::string_view(f.payload).substr(1 + n), from, id_, pk,
                               lane_->secret_key()))
          return drop_lane(in, fmt::format("its hello claims to come from '{}' without the key "
                                           "that sender registered",
                                           from));
      }
      in.from = std::move(from);
      return true;
    }
    if (!is_known_type(f.type))
      return drop_lane(in, fmt::format("a frame of unknown type {}", static_cast<int>(f.type)));
    Message m;
    m.type = static_cast<MessageType>(f.type);
    m.epoch = f.epoch;
    m.from = in.from;
    m.payload = std::move(f.payload);
    lane_queue_.push_back(std::move(m));
    ++lane_messages_;
    return true;
  }

  // What receive() waits on: the PULL socket, the lane and its connections.
  std::vector<zmq_pollitem_t>& poll_items() {
    if (items_stale_ || items_.empty()) {
      items_.assign(1, zmq_pollitem_t{pull_.handle(), 0, ZMQ_POLLIN, 0});
      if (lane_) items_.push_back(zmq_pollitem_t{nullptr, lane_->fd(), ZMQ_POLLIN, 0});
      for (const LaneIn& in : lanes_in_)
        items_.push_back(zmq_pollitem_t{nullptr, in.reader.fd(), ZMQ_POLLIN, 0});
      items_stale_ = false;
    }
    return items_;
  }
  std::function<Status()> liveness_;
  std::chrono::milliseconds liveness_interval_{1000};
  Clock::time_point next_check_{};

  std::int64_t dropped() const override { return dropped_.load(); }
  std::int64_t lane_messages() const override { return lane_messages_.load(); }

  // REFIT_CONTROL_SPIN_US: within that long of this mailbox's last message, a waiting receive()
  // polls without blocking, yielding the core between polls, until a message is there (true) or
  // the window, `deadline` or the next liveness check passes (false). While a refit is in flight
  // its messages follow each other within milliseconds, and each hop of its critical path otherwise
  // pays for waking this thread from poll (about 0.1 ms on a virtual machine; docs/runtime.md).
  // Between refits the window has passed and the thread blocks at once.
  bool spin_for_message(Clock::time_point deadline) {
    if (spin_.count() == 0) return false;
    const Clock::time_point last{Clock::duration(active_.load())};
    Clock::time_point end = std::min(deadline, last + spin_);
    if (liveness_) end = std::min(end, next_check_);
    std::vector<zmq_pollitem_t>& items = poll_items();
    while (Clock::now() < end) {
      if (zmq_poll(items.data(), static_cast<int>(items.size()), 0) > 0) {
        ++spun_;
        return true;
      }
      std::this_thread::yield();
    }
    return false;
  }

  // A message of a later refit epoch than ours: a peer saw the refit in flight fail before we did.
  Status later_epoch(const Message& m) const {
    return Status::Aborted(fmt::format(
        "mailbox '{}': a {} message from '{}' belongs to refit epoch {}, after this rank's {}: "
        "the refit in flight failed",
        id_, message_type_name(m.type), m.from, m.epoch, epoch_.load()));
  }

  // The message, or nullopt when it is dropped (and logged with its origin): malformed, or, with
  // authentication, sent by a key other than the one its claimed sender registered.
  std::optional<Message> accept(std::vector<zmq::message_t>& frames) {
    const auto origin = [&]() -> std::string {
      if (frames.empty()) return "an unknown peer";
      const char* address = frames[0].gets("Peer-Address");
      return address != nullptr ? address : "an unknown peer";
    };
    if (frames.size() != 3 || frames[0].size() != 5 ||
        !is_known_type(*frames[0].data<std::uint8_t>()) || frames[1].size() > 256) {
      ++dropped_;
      log::warn("mailbox '{}': dropped a malformed message from {} ({} frames, first frame {} "
                "bytes; expected [type, epoch][sender][payload])",
                id_, origin(), frames.size(), frames.empty() ? 0 : frames[0].size());
      return std::nullopt;
    }
    Message m;
    const auto* head = frames[0].data<std::uint8_t>();
    m.type = static_cast<MessageType>(head[0]);
    m.epoch = static_cast<std::uint32_t>(head[1]) | static_cast<std::uint32_t>(head[2]) << 8 |
              static_cast<std::uint32_t>(head[3]) << 16 | static_cast<std::uint32_t>(head[4]) << 24;
    m.from = frames[1].to_string();
    if (auth_) {
      const char* user = frames[0].gets("User-Id");
      const std::string key = user != nullptr ? user : "";
      const std::string* want = registered_key(m.from);
      if (want == nullptr || key != *want) {
        ++dropped_;
        log::warn("mailbox '{}': dropped a {} message claiming to come from '{}' (from {}): {}",
                  id_, message_type_name(m.type), m.from, origin(),
                  want == nullptr ? "no such sender registered a key"
                                  : "it was sent with another sender's key");
        return std::nullopt;
      }
    }
    m.payload = frames[2].to_string();
    return m;
  }

  // The sending key `from` registered, cached; nullptr when it registered none.
  const std::string* registered_key(const std::string& from) {
    auto it = keys_.find(from);
    if (it != keys_.end()) return &it->second;
    auto key = store_.try_get(auth_key_name(from));
    if (!key.ok() || !key->has_value()) return nullptr;
    return &keys_.emplace(from, std::move(**key)).first->second;
  }

  Store& store_;
  const std::string id_;
  const std::chrono::milliseconds timeout_;
  const std::shared_ptr<const ControlAuth> auth_;
  std::string send_public_, send_secret_;  // this mailbox's sending key pair (with auth_)
  std::unordered_map<std::string, std::string> keys_;  // senders' registered keys (receive thread)
  std::atomic<std::int64_t> dropped_{0};
  std::atomic<std::uint32_t> epoch_{0};
  const std::chrono::microseconds spin_;             // REFIT_CONTROL_SPIN_US
  std::atomic<Clock::rep> active_{0};                // when it last sent or received
  std::atomic<std::int64_t> spun_{0};                // messages that arrived while it spun
  std::optional<Message> kept_;  // of a later refit epoch (receive thread)
  std::optional<lane::Listener> lane_;  // this mailbox's same-host lane (REFIT_CONTROL_LANES)
  std::vector<LaneIn> lanes_in_;        // its connections (receive thread)
  std::deque<Message> lane_queue_;      // frames read from them, not yet returned
  std::vector<zmq_pollitem_t> items_;   // poll_items()
  bool items_stale_ = true;
  std::atomic<std::int64_t> lane_messages_{0};
  zmq::context_t ctx_{1};  // declared before the sockets: destroyed after them
  std::unique_ptr<ZapHandler> zap_;
  zmq::socket_t pull_;
  std::string endpoint_;
  std::mutex send_mu_;
  std::unordered_map<std::string, Peer> peers_;
};

}  // namespace

Result<std::unique_ptr<Mailbox>> Mailbox::open(Store& store, const std::string& id,
                                               const std::string& host,
                                               std::chrono::milliseconds timeout,
                                               std::shared_ptr<const ControlAuth> auth) {
  if (id.empty()) return Status::InvalidArgument("mailbox: the id must not be empty");
  if (timeout.count() <= 0) {
    return Status::InvalidArgument(
        fmt::format("mailbox '{}': timeout must be positive, got {} ms", id, timeout.count()));
  }
  std::unique_ptr<ZmqMailbox> box;
  try {
    box = std::make_unique<ZmqMailbox>(store, id, timeout, std::move(auth));
  } catch (const zmq::error_t& e) {
    return Status::IOError(fmt::format("mailbox '{}': cannot create a socket: {}", id, e.what()));
  }
  REFIT_RETURN_IF_ERROR(box->bind_and_publish(host));
  return std::unique_ptr<Mailbox>(std::move(box));
}

}  // namespace refit
