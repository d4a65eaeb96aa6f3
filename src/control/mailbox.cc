// Mailbox on ZeroMQ: one PULL socket to receive, one PUSH socket per peer to send; between
// mailboxes on one host, a lane (control/lane.h) instead of the PUSH socket. The sending side and
// the lanes' receiving side are parts of their own (control/mailbox_parts.h).
//
// Wire: a 3-frame message [type: 1 byte, refit epoch: 4 bytes little-endian][sender id][payload].
// PUSH sockets are created with ZMQ_IMMEDIATE, so a message is queued only on a live connection:
// a send to a peer that is not (or no longer) connected fails after the send timeout instead of
// queueing forever. On close a PUSH socket lingers for at most 2 s so the last messages (commit,
// shutdown) still leave.
#include "control/mailbox.h"

#include <fmt/format.h>

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "common/log.h"
#include "common/log_throttle.h"
#include "control/auth.h"
#include "control/fd_limit.h"
#include "control/mailbox_parts.h"
#include "control/store.h"
#include "control/zmq_monitor.h"

namespace refit {

namespace mailbox_parts {

bool is_known_type(std::uint8_t t) { return is_message_type(t); }

Result<std::string> SenderKeys::z85_of(const std::string& id, bool budgeted) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = keys_.find(id);
    if (it != keys_.end()) return it->second;
    const auto now = std::chrono::steady_clock::now();
    if (now - window_start_ >= kMissWindow) {
      window_start_ = now;
      misses_ = 0;
    }
    if (budgeted && misses_ >= kMissBudget) {
      return Status::Aborted(fmt::format(
          "which is not a sender this mailbox knows, and it looked up {} unknown senders in the "
          "last {} s (the most it does; docs/security.md)",
          misses_, kMissWindow.count()));
    }
  }
  auto key = store_.try_get(auth_key_name(id));
  std::lock_guard<std::mutex> lock(mu_);
  const bool found = key.ok() && key->has_value();
  if (budgeted && !found) ++misses_;
  if (!key.ok()) return Status::IOError("whose key could not be read: " + key.status().message());
  if (!found) return Status::NotFound("which registered no key");
  return keys_.emplace(id, std::move(**key)).first->second;
}

Result<std::unique_ptr<LaneInbox>> LaneInbox::open(const MailboxOptions& options, SenderKeys* keys,
                                                   log::Throttle& throttle) {
  lane::GateOptions g{.who = fmt::format("mailbox '{}'", options.id),
                      .receiver = options.id,
                      .host_identity = options.settings.host_identity,
                      .limits = options.lane_limits,
                      .keys = {},
                      .throttle = &throttle};
  if (keys != nullptr)
    g.keys = [keys](const std::string& from) -> Result<std::array<unsigned char, 32>> {
      REFIT_ASSIGN_OR_RETURN(const std::string z85, keys->z85_of(from, /*budgeted=*/true));
      std::array<unsigned char, 32> key{};
      if (!lane::z85_key(z85, key.data()))
        return Status::Corruption("whose registered key is malformed");
      return key;
    };
  std::string who = g.who;
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<lane::Gate> gate, lane::Gate::open(std::move(g)));
  REFIT_ASSIGN_OR_RETURN(lane::Fd ready, lane::ready_set(*gate, who));
  return std::unique_ptr<LaneInbox>(
      new LaneInbox(std::move(who), std::move(gate), std::move(ready), throttle));
}

bool LaneInbox::close_lane(const Lane& lane, const std::string& why) {
  log::warn_throttled(throttle_, "{}: closed a same-host lane from '{}': {}", who_,
                      log::escape(lane.from), why);
  ++closed_;
  return false;
}

bool LaneInbox::read(Lane& lane, std::deque<Message>& out) {
  // The frames a peer wrote before it closed its end are still taken.
  const bool open = lane.reader.fill();
  for (;;) {
    Result<std::optional<lane::Frame>> f = lane.reader.next(kMaxMailboxMessageBytes);
    if (!f.ok()) return close_lane(lane, f.status().message());
    if (!*f) break;
    if (!is_known_type((*f)->type))
      return close_lane(lane,
                        fmt::format("a frame of unknown type {}", static_cast<int>((*f)->type)));
    Message m;
    m.type = static_cast<MessageType>((*f)->type);
    m.epoch = (*f)->epoch;
    m.from = lane.from;
    m.payload = std::move((*f)->payload);
    out.push_back(std::move(m));
    ++messages_;
  }
  if (!open && lane.reader.buffered() > 0)
    return close_lane(lane, fmt::format("it ended in the middle of a frame ({} byte(s) of it)",
                                        lane.reader.buffered()));
  return open;
}

void LaneInbox::pump(std::deque<Message>& out) {
  std::array<epoll_event, 64> ready{};
  const int n = ::epoll_wait(ready_.get(), ready.data(), static_cast<int>(ready.size()), 0);
  for (int i = 0; i < n; ++i) {
    const int fd = ready[static_cast<std::size_t>(i)].data.fd;
    if (fd == gate_fd_) {
      take_accepted(out);
      continue;
    }
    const auto it = lanes_.find(fd);
    if (it == lanes_.end() || read(it->second, out)) continue;
    // Closing the descriptor takes it out of the epoll set.
    lanes_.erase(it);
  }
}

void LaneInbox::take_accepted(std::deque<Message>& out) {
  for (lane::Accepted& a : gate_->take()) {
    // One live lane per sender: a sender opens a new one only after its old one failed, so what
    // the old one still holds is taken first, then it is closed.
    for (auto it = lanes_.begin(); it != lanes_.end(); ++it) {
      if (it->second.from != a.from) continue;
      for (int k = 0; k < 16 && read(it->second, out); ++k) {
      }
      log::debug("{}: a new same-host lane from '{}' replaces its old one", who_,
                 log::escape(a.from));
      lanes_.erase(it);
      break;
    }
    const int fd = a.fd.get();
    epoll_event ev{.events = EPOLLIN, .data = {.fd = fd}};
    if (::epoll_ctl(ready_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
      close_lane(Lane{lane::Reader(std::move(a.fd), std::move(a.seal)), std::move(a.from)},
                 fmt::format("epoll_ctl: {}", errno_text(errno)));
      continue;
    }
    lanes_.emplace(fd, Lane{lane::Reader(std::move(a.fd), std::move(a.seal)), std::move(a.from)});
  }
}

}  // namespace mailbox_parts

namespace {

using Clock = std::chrono::steady_clock;
using mailbox_parts::LaneInbox;
using mailbox_parts::Outbox;
using mailbox_parts::SenderKeys;

std::string mailbox_key(const std::string& id) { return "mailbox/" + id; }

// The ZeroMQ receiving side: the PULL socket, its ZAP handler and the monitor that reports
// connections whose handshake failed, and caps those waiting for it. The monitor is read by a
// thread of its own (the watcher), so that the cap holds while the rank does something else than
// wait for a message (a training step between refits), not only inside receive().
class ZmqInbox {
 public:
  ZmqInbox(zmq::context_t& ctx, const MailboxOptions& o, SenderKeys* keys, log::Throttle& throttle)
      : o_(o),
        keys_(keys),
        pull_(ctx, zmq::socket_type::pull),
        pending_(o.max_pending_handshakes > 0 ? o.max_pending_handshakes
                                              : kZmqMaxPendingHandshakes),
        throttle_(throttle) {}
  ~ZmqInbox() {
    if (watcher_.joinable()) {
      const std::uint64_t one = 1;
      (void)!::write(stop_.get(), &one, sizeof one);
      watcher_.join();
    }
    monitor_.close();
    pull_.close();
    zap_.reset();
  }

  Status bind(zmq::context_t& ctx) {
    const std::string requested = fmt::format("tcp://{}:*", o_.host);
    const std::string who = fmt::format("mailbox '{}'", o_.id);
    if (o_.auth) {
      // Any CURVE client that knows the server key (only holders of the secret do) may connect;
      // who it speaks for is checked per message against the registered keys.
      REFIT_ASSIGN_OR_RETURN(
          zap_, ZapHandler::start(
                    ctx.handle(), [](const std::string&) { return true; }, who, throttle_));
    }
    try {
      pull_.set(zmq::sockopt::linger, 0);
      pull_.set(zmq::sockopt::maxmsgsize, kMaxMailboxMessageBytes);
      pull_.set(zmq::sockopt::handshake_ivl, static_cast<int>(kZmqHandshakeIvl.count()));
      pull_.set(zmq::sockopt::backlog, kZmqBacklog);
      if (o_.auth) {
        pull_.set(zmq::sockopt::curve_server, 1);
        pull_.set(zmq::sockopt::curve_secretkey, o_.auth->server_secret());
      }
      REFIT_ASSIGN_OR_RETURN(monitor_, watch_connections(ctx, pull_));
      pull_.bind(requested);
      endpoint_ = pull_.get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      return Status::IOError(
          fmt::format("{}: cannot bind {}: {}", who, requested, errno_text(e.num())));
    }
    pending_.listening(fmt::format("mailbox '{}' {}", o_.id, endpoint_),
                       std::atoi(endpoint_.substr(endpoint_.rfind(':') + 1).c_str()),
                       kMaxMailboxMessageBytes);
    stop_ = lane::Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!stop_) return Status::IOError(fmt::format("{}: eventfd: {}", who, errno_text(errno)));
    watcher_ = std::thread([this] { watch(); });
    return Status::Ok();
  }

  const std::string& endpoint() const { return endpoint_; }
  // The PULL socket's descriptor for a wait outside ZeroMQ (ZMQ_FD): it becomes readable when
  // ZeroMQ has work for the socket, which readable() then does.
  int signal_fd() { return pull_.get(zmq::sockopt::fd); }
  // Whether a message is there to read (ZMQ_EVENTS: handles what ZeroMQ queued for the socket,
  // which drains signal_fd()).
  bool readable() { return (pull_.get(zmq::sockopt::events) & ZMQ_POLLIN) != 0; }
  std::int64_t dropped() const { return dropped_.load(); }

  // The next message on the PULL socket: nullopt when none is there; an empty Message (type 0)
  // when one was dropped.
  std::optional<std::optional<Message>> next() {
    std::vector<zmq::message_t> frames;
    if (!zmq::recv_multipart(pull_, std::back_inserter(frames), zmq::recv_flags::dontwait))
      return std::nullopt;
    if (!frames.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.authenticated(zmq_msg_get(frames[0].handle(), ZMQ_SRCFD));
    }
    return accept(frames);
  }

  int pending_high_water() const {
    std::lock_guard<std::mutex> lock(mu_);
    return pending_.high_water();
  }

 private:
  // The watcher: waits for the monitor's events (or the stop) and handles them.
  void watch() {
    for (;;) {
      std::array<zmq_pollitem_t, 2> items{zmq_pollitem_t{monitor_.handle(), 0, ZMQ_POLLIN, 0},
                                          zmq_pollitem_t{nullptr, stop_.get(), ZMQ_POLLIN, 0}};
      // No timeout: what the cap counts changes only with the monitor's events, and an idle
      // rank's watcher should not wake (hundreds of ranks may share a host's cores).
      const int polled = zmq_poll(items.data(), static_cast<int>(items.size()), -1);
      if (polled < 0 && zmq_errno() != EINTR) {
        log::warn("mailbox '{}': its connection monitor stopped: {}", o_.id,
                  zmq_strerror(zmq_errno()));
        return;
      }
      if ((items[1].revents & ZMQ_POLLIN) != 0) return;
      try {
        drain_monitor();
      } catch (const zmq::error_t& e) {
        log::warn("mailbox '{}': its connection monitor stopped: {}", o_.id, errno_text(e.num()));
        return;
      }
    }
  }

  // Counts and logs the connections the monitor saw refused, and caps those waiting for their
  // handshake. A connection the ZAP handler refused is logged there; one shut down for the cap,
  // when it was.
  void drain_monitor() {
    std::lock_guard<std::mutex> lock(mu_);
    for (const ConnectionEvent& e : read_connection_events(monitor_)) {
      if (pending_.see(e)) {
        ++dropped_;
        log::warn_throttled(throttle_, "mailbox '{}': refused a ZeroMQ connection at {}: {}", o_.id,
                            log::escape(e.address), pending_.silent_refusal());
      }
      if (!e.refused()) continue;
      ++dropped_;
      if (pending_.caused(e) || e.event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) continue;
      log::warn_throttled(throttle_, "mailbox '{}': refused a ZeroMQ connection at {}: {}", o_.id,
                          log::escape(e.address), e.describe());
    }
    pending_.enforce(throttle_);
  }

  // The message, or nullopt when it is dropped (and logged with its origin): malformed, or, with
  // authentication, sent by a key other than the one its claimed sender registered.
  std::optional<Message> accept(std::vector<zmq::message_t>& frames) {
    const auto origin = [&]() -> std::string {
      if (frames.empty()) return "an unknown peer";
      const char* address = frames[0].gets("Peer-Address");
      return address != nullptr ? log::escape(address) : "an unknown peer";
    };
    if (frames.size() != 3 || frames[0].size() != 5 ||
        !mailbox_parts::is_known_type(*frames[0].data<std::uint8_t>()) ||
        frames[1].size() > lane::kMaxIdBytes) {
      ++dropped_;
      log::warn_throttled(throttle_,
                          "mailbox '{}': dropped a malformed message from {} ({} frames, first "
                          "frame {} bytes; expected [type, epoch][sender][payload])",
                          o_.id, origin(), frames.size(), frames.empty() ? 0 : frames[0].size());
      return std::nullopt;
    }
    Message m;
    const auto* head = frames[0].data<std::uint8_t>();
    m.type = static_cast<MessageType>(head[0]);
    m.epoch = static_cast<std::uint32_t>(head[1]) | static_cast<std::uint32_t>(head[2]) << 8 |
              static_cast<std::uint32_t>(head[3]) << 16 | static_cast<std::uint32_t>(head[4]) << 24;
    m.from = frames[1].to_string();
    if (o_.auth) {
      const char* user = frames[0].gets("User-Id");
      const std::string key = user != nullptr ? user : "";
      const Result<std::string> want = keys_->z85_of(m.from, /*budgeted=*/false);
      if (!want.ok() || key != *want) {
        ++dropped_;
        log::warn_throttled(throttle_,
                            "mailbox '{}': dropped a {} message claiming to come from '{}' (from "
                            "{}): {}",
                            o_.id, message_type_name(m.type), log::escape(m.from), origin(),
                            !want.ok() ? "no such sender registered a key"
                                       : "it was sent with another sender's key");
        return std::nullopt;
      }
    }
    m.payload = frames[2].to_string();
    return m;
  }

  const MailboxOptions& o_;
  SenderKeys* keys_;  // with auth
  std::unique_ptr<ZapHandler> zap_;
  zmq::socket_t pull_;
  zmq::socket_t monitor_;  // the watcher's
  std::string endpoint_;
  mutable std::mutex mu_;
  PendingHandshakes pending_;  // guarded by mu_
  lane::Fd stop_;              // an eventfd: written to stop the watcher
  std::thread watcher_;
  std::atomic<std::int64_t> dropped_{0};
  log::Throttle& throttle_;  // the mailbox's
};

// REFIT_CONTROL_SPIN_US (ControlSettings::spin): within that long of this mailbox's last message,
// a waiting receive() polls without blocking, yielding the core between polls, until a message is
// there or the window passes. While a refit is in flight its messages follow each other within
// milliseconds, and each hop of its critical path otherwise pays for waking this thread from poll
// (about 0.1 ms on a virtual machine; docs/runtime.md). Between refits the window has passed and
// the thread blocks at once.
class Spin {
 public:
  explicit Spin(std::chrono::microseconds window) : window_(window) {}
  void touch() { active_.store(Clock::now().time_since_epoch().count()); }
  // Calls `ready` (a check that does not block) until it is true (true) or the window or `until`
  // passed (false).
  template <typename Ready>
  bool wait(Ready&& ready, Clock::time_point until) {
    if (window_.count() == 0) return false;
    const Clock::time_point last{Clock::duration(active_.load())};
    const Clock::time_point end = std::min(until, last + window_);
    while (Clock::now() < end) {
      if (ready()) {
        ++spun_;
        return true;
      }
      std::this_thread::yield();
    }
    return false;
  }
  std::chrono::microseconds window() const { return window_; }
  std::int64_t spun() const { return spun_.load(); }

 private:
  const std::chrono::microseconds window_;
  std::atomic<Clock::rep> active_{0};  // when it last sent or received
  std::atomic<std::int64_t> spun_{0};  // messages that arrived while it spun
};

class ZmqMailbox final : public Mailbox {
 public:
  ZmqMailbox(Store& store, MailboxOptions options)
      : store_(store),
        o_(std::move(options)),
        keys_(store),
        spin_(o_.settings.spin),
        zmq_in_(ctx_, o_, o_.auth ? &keys_ : nullptr, throttle_) {}
  ~ZmqMailbox() override {
    if (spin_.window().count() > 0)
      log::debug("mailbox '{}': {} message(s) arrived while it spun (REFIT_CONTROL_SPIN_US={})",
                 o_.id, spin_.spun(), spin_.window().count());
    if (lanes_in_)
      log::debug("mailbox '{}': {} message(s) arrived over same-host lanes", o_.id,
                 lanes_in_->messages());
    out_.reset();  // sockets before the context
    // The lines peers can cause, of every part, share one rate limit: what it held back is said
    // once, with the total, after the parts that log through it are gone.
    const std::int64_t dropped_in_all = dropped();
    lanes_in_.reset();
    if (const std::int64_t held = throttle_.suppressed(); held > 0)
      log::warn(
          "mailbox '{}': {} more line(s) about dropped messages and refused connections were held "
          "back by the log's rate limit",
          o_.id, held);
    if (const std::int64_t n = dropped_in_all; n > 0)
      log::warn("mailbox '{}': dropped {} message(s) and connection(s) in all (docs/security.md)",
                o_.id, n);
  }
  ZmqMailbox(const ZmqMailbox&) = delete;
  ZmqMailbox& operator=(const ZmqMailbox&) = delete;

  Status bind_and_publish() {
    const std::string who = fmt::format("mailbox '{}'", o_.id);
    REFIT_RETURN_IF_ERROR(check_listen_address(o_.host, o_.auth.get(), who));
    std::string send_public, send_secret;
    if (o_.auth) {
      std::tie(send_public, send_secret) = curve_keypair();
      Status registered = store_.set(auth_key_name(o_.id), send_public);
      if (!registered.ok())
        return registered.with_context(fmt::format(
            "{}: registering its key (is another process running as '{}'?)", who, o_.id));
    }
    REFIT_RETURN_IF_ERROR(zmq_in_.bind(ctx_));
    const bool lanes = o_.settings.lanes && !o_.settings.host_identity.empty();
    out_ = std::make_unique<Outbox>(store_, o_, ctx_, std::move(send_public),
                                    std::move(send_secret), lanes);
    // The lane first: a sender that finds the mailbox finds its lane too.
    if (lanes) {
      Result<std::unique_ptr<LaneInbox>> l =
          LaneInbox::open(o_, o_.auth ? &keys_ : nullptr, throttle_);
      if (l.ok()) {
        lanes_in_ = std::move(l).value();
        REFIT_RETURN_IF_ERROR(store_.set("lane/" + o_.id, lanes_in_->address())
                                  .with_context(who + ": publishing its lane"));
      } else {
        log::warn("{}: no same-host lane, ZeroMQ carries every message: {}", who,
                  l.status().message());
      }
    }
    REFIT_RETURN_IF_ERROR(open_wait_set(who));
    return store_.set(mailbox_key(o_.id), zmq_in_.endpoint())
        .with_context(fmt::format("{}: publishing its address {}", who, zmq_in_.endpoint()));
  }

  Status open_wait_set(const std::string& who) {
    wait_ = lane::Fd(::epoll_create1(EPOLL_CLOEXEC));
    if (!wait_)
      return Status::IOError(fmt::format("{}: epoll_create1: {}", who, errno_text(errno)));
    const auto add = [&](int fd, std::uint32_t what) {
      epoll_event ev{.events = EPOLLIN, .data = {.u32 = what}};
      return ::epoll_ctl(wait_.get(), EPOLL_CTL_ADD, fd, &ev) == 0;
    };
    if (!add(zmq_in_.signal_fd(), kZmqReady) ||
        (lanes_in_ && !add(lanes_in_->poll_fd(), kLanesReady)))
      return Status::IOError(fmt::format("{}: epoll_ctl: {}", who, errno_text(errno)));
    lanes_ready_ = lanes_in_ != nullptr;
    return Status::Ok();
  }

  const std::string& id() const override { return o_.id; }

  Status send(const std::string& to, MessageType type, const std::string& payload) override {
    Status status = out_->send(to, type, epoch_.load(), payload);
    if (status.ok()) {
      spin_.touch();
      sent_.fetch_add(1, std::memory_order_relaxed);
    }
    return status;
  }

  std::int64_t sent() const override { return sent_.load(); }

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
      // A message dropped below (malformed, of a failed refit's epoch) is followed by the deadline
      // and liveness checks before the next is read, so that a stream of them neither outlasts
      // the timeout nor hides a dead peer.
      bool dropped = false;
      try {
        if (lanes_in_ && lane_queue_.empty() && lanes_ready_) {
          lanes_in_->pump(lane_queue_);
          lanes_ready_ = false;
        }
        std::optional<Message> m;
        if (!lane_queue_.empty()) {
          m = std::move(lane_queue_.front());
          lane_queue_.pop_front();
        } else if (zmq_ready_) {
          if (std::optional<std::optional<Message>> z = zmq_in_.next()) {
            if (*z)
              m = std::move(*z);
            else
              dropped = true;
          } else {
            zmq_ready_ = false;
          }
        }
        const std::uint32_t mine = epoch_.load();
        if (m && m->epoch < mine) {
          // Of a refit that failed in flight: its peers moved on, so must we. Not counted in
          // dropped(): it passed every check (an authenticated sender, well formed), and every
          // refit that fails in flight leaves some.
          log::debug("mailbox '{}': dropped a {} message from '{}' of refit epoch {} (now {})",
                     o_.id, message_type_name(m->type), log::escape(m->from), m->epoch, mine);
          dropped = true;
        } else if (m) {
          if (m->epoch > mine) {
            kept_ = std::move(*m);
            return later_epoch(*kept_);
          }
          spin_.touch();
          return std::move(*m);
        }
      } catch (const zmq::error_t& e) {
        return Status::IOError(
            fmt::format("mailbox '{}': receive failed: {}", o_.id, errno_text(e.num())));
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) {
        return Status::Timeout(
            fmt::format("mailbox '{}': no message within {} ms", o_.id, timeout.count()));
      }
      // While waiting, ask the liveness check now and then: a peer that died without a word
      // (killed, crashed) is noticed there long before the timeout.
      Clock::time_point spin_until = deadline;
      if (liveness_) {
        if (Clock::now() >= next_check_) {
          Status alive = liveness_();
          if (!alive.ok()) return alive;
          next_check_ = Clock::now() + liveness_interval_;
        }
        left = std::min(left, liveness_interval_);
        spin_until = std::min(spin_until, next_check_);
      }
      if (dropped) continue;  // more may be queued: read them before waiting
      // The spin counts messages: a ready descriptor that brought none (ZeroMQ's own commands)
      // spins on.
      if (spin_.wait([this] { return wait_ready(0) > 0 && (zmq_ready_ || lanes_ready_); },
                     spin_until))
        continue;
      if (wait_ready(static_cast<int>(left.count())) < 0 && errno != EINTR) {
        return Status::IOError(
            fmt::format("mailbox '{}': wait failed: {}", o_.id, errno_text(errno)));
      }
    }
  }

  void set_epoch(std::uint32_t epoch) override { epoch_.store(epoch); }
  std::uint32_t epoch() const override { return epoch_.load(); }
  std::uint32_t kept_epoch() const override { return kept_ ? kept_->epoch : 0; }

  void set_liveness_check(std::function<Status()> check,
                          std::chrono::milliseconds interval) override {
    out_->set_liveness_check(check);
    liveness_ = std::move(check);
    liveness_interval_ = interval;
    next_check_ = Clock::now() + interval;
  }

  std::int64_t dropped() const override {
    return zmq_in_.dropped() + (lanes_in_ ? lanes_in_->dropped() : 0);
  }
  std::int64_t lane_messages() const override { return lanes_in_ ? lanes_in_->messages() : 0; }

 private:
  // Waits up to `ms` (0: only looks) for the PULL socket or a lane, and notes which of them may
  // hold a message (zmq_ready_, lanes_ready_). Returns what epoll_wait returns.
  int wait_ready(int ms) {
    std::array<epoll_event, 2> ready{};
    const int n = ::epoll_wait(wait_.get(), ready.data(), static_cast<int>(ready.size()), ms);
    for (int i = 0; i < n; ++i) {
      if (ready[static_cast<std::size_t>(i)].data.u32 == kLanesReady) {
        lanes_ready_ = true;
        continue;
      }
      try {
        zmq_ready_ = zmq_ready_ || zmq_in_.readable();
      } catch (const zmq::error_t&) {
        zmq_ready_ = true;  // the read says what failed
      }
    }
    return n;
  }

  // A message of a later refit epoch than ours: a peer saw the refit in flight fail before we did.
  Status later_epoch(const Message& m) const {
    return Status::Aborted(fmt::format(
        "mailbox '{}': a {} message from '{}' belongs to refit epoch {}, after this rank's {}: "
        "the refit in flight failed",
        o_.id, message_type_name(m.type), log::escape(m.from), m.epoch, epoch_.load()));
  }

  Store& store_;
  const MailboxOptions o_;
  SenderKeys keys_;  // with auth: the senders' registered keys
  std::atomic<std::uint32_t> epoch_{0};
  std::atomic<std::int64_t> sent_{0};  // messages sent (sent())
  Spin spin_;
  std::optional<Message> kept_;  // of a later refit epoch (receive thread)
  std::function<Status()> liveness_;
  std::chrono::milliseconds liveness_interval_{1000};
  Clock::time_point next_check_{};
  std::deque<Message> lane_queue_;  // frames read from lanes, not yet returned
  // What receive() waits on, one epoll set: the PULL socket's signal_fd() and the lanes' own
  // epoll set (their gate and every lane). A wait is one system call; the socket is read only
  // after it signalled or returned a message, the lanes only after their set was ready.
  static constexpr std::uint32_t kZmqReady = 0, kLanesReady = 1;
  lane::Fd wait_;
  bool zmq_ready_ = true;    // the PULL socket may hold a message: read it before waiting
  bool lanes_ready_ = true;  // a lane may hold a frame (never without lanes)
  // One rate limit for every line a peer can cause, of every part: declared before them.
  log::Throttle throttle_;
  zmq::context_t ctx_{1};  // declared before the sockets: destroyed after them
  ZmqInbox zmq_in_;
  std::unique_ptr<LaneInbox> lanes_in_;  // this mailbox's same-host lane (ControlSettings::lanes)
  std::unique_ptr<Outbox> out_;
};

}  // namespace

Result<std::unique_ptr<Mailbox>> Mailbox::open(Store& store, MailboxOptions options) {
  if (options.id.empty() || options.id.size() > lane::kMaxIdBytes)
    return Status::InvalidArgument(fmt::format("mailbox: the id must have 1 to {} bytes, got {}",
                                               lane::kMaxIdBytes, options.id.size()));
  if (options.timeout.count() <= 0) {
    return Status::InvalidArgument(fmt::format("mailbox '{}': timeout must be positive, got {} ms",
                                               options.id, options.timeout.count()));
  }
  std::unique_ptr<ZmqMailbox> box;
  const std::string id = options.id;
  try {
    box = std::make_unique<ZmqMailbox>(store, std::move(options));
  } catch (const zmq::error_t& e) {
    return Status::IOError(
        fmt::format("mailbox '{}': cannot create a socket: {}", id, errno_text(e.num())));
  }
  REFIT_RETURN_IF_ERROR(box->bind_and_publish());
  return std::unique_ptr<Mailbox>(std::move(box));
}

}  // namespace refit
