// StoreServer: one ROUTER socket served by one background thread.
//
// The server never blocks on a client: a get/wait whose keys are missing is parked as a Waiter
// and answered when a set/add makes the keys present, or with kTimeout when its deadline passes.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <list>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "common/log.h"
#include "common/log_throttle.h"
#include "control/auth.h"
#include "control/fd_limit.h"
#include "control/ports.h"
#include "control/store.h"
#include "control/store_lanes.h"
#include "control/store_wire.h"
#include "control/zmq_monitor.h"

namespace refit {
namespace {

using Clock = std::chrono::steady_clock;
using store_wire::Op;
using store_wire::Reply;

// Descriptors a rank holds besides its store connections (its own sockets, files, Gloo pairs of a
// small group): what the store's host needs on top of the ranks' connections.
constexpr std::int64_t kBaseDescriptors = 256;

// How often the serving thread checks whether it should stop.
constexpr std::chrono::milliseconds kStopPollInterval{50};

// How long a bind is tried again while a connection, not a server, holds the port.
constexpr std::chrono::seconds kConnectionHeldWait{2};

// When each key was last set or added to, on the server's clock (ZmqStoreServer::heard), kept
// oldest first within each directory of keys (a key up to its last '/'). A watch walks the
// directories its prefix can match, and each only until the first key that changed within the
// silence: it visits the keys that stood still and the ranks that left, not every live rank's
// heartbeat, so what the store does per beat does not grow with the run.
class ChangeRecord {
 public:
  // `key` changed at `when`, taken as no earlier than the latest change recorded: the server's
  // clock steps back when a request took longer than kDeafGapMs to serve (the deaf stretch is
  // counted from its arrival), and every directory must stay in order.
  void touch(const std::string& key, Clock::time_point when) {
    latest_ = std::max(latest_, when);
    when = latest_;
    erase(key);
    const std::size_t slash = key.rfind('/');
    const std::string dir = slash == std::string::npos ? std::string() : key.substr(0, slash + 1);
    auto d = dirs_.try_emplace(dir).first;
    d->second.push_back(Entry{key, when});
    where_.emplace(key, Where{d, std::prev(d->second.end())});
  }
  void erase(const std::string& key) {
    const auto it = where_.find(key);
    if (it == where_.end()) return;
    const Where w = it->second;
    where_.erase(it);
    w.dir->second.erase(w.entry);
    if (w.dir->second.empty()) dirs_.erase(w.dir);
  }
  // Calls fn(key, when) for every key under `prefix` that last changed at or before `before`, in
  // no particular order; returns how many keys it looked at.
  template <typename Fn>
  std::int64_t each_before(const std::string& prefix, Clock::time_point before, Fn&& fn) const {
    std::int64_t visits = 0;
    const auto walk = [&](const List& keys) {
      for (const Entry& e : keys) {
        ++visits;
        if (e.when > before) return;  // every later key changed later
        if (e.key.compare(0, prefix.size(), prefix) == 0) fn(e.key, e.when);
      }
    };
    // The directories that start with the prefix, and the one a key must be in to match a prefix
    // that ends inside its last part (the prefix up to its last '/').
    for (auto d = dirs_.lower_bound(prefix);
         d != dirs_.end() && d->first.compare(0, prefix.size(), prefix) == 0; ++d)
      walk(d->second);
    const std::size_t slash = prefix.rfind('/');
    const std::string_view under =
        std::string_view(prefix).substr(0, slash == std::string::npos ? 0 : slash + 1);
    if (under.size() < prefix.size())
      if (const auto d = dirs_.find(under); d != dirs_.end()) walk(d->second);
    return visits;
  }

 private:
  struct Entry {
    std::string key;
    Clock::time_point when;
  };
  using List = std::list<Entry>;
  using Dirs = std::map<std::string, List, std::less<>>;
  struct Where {
    Dirs::iterator dir;
    List::iterator entry;
  };
  Dirs dirs_;
  std::unordered_map<std::string, Where> where_;
  Clock::time_point latest_{};
};

class ZmqStoreServer final : public StoreServer {
 public:
  ZmqStoreServer(std::shared_ptr<const ControlAuth> auth, int max_pending)
      : auth_(std::move(auth)), router_(ctx_, zmq::socket_type::router), pending_(max_pending) {}
  ~ZmqStoreServer() override {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
    if (const std::int64_t held = throttle_.suppressed(); held > 0)
      log::warn(
          "store server: {} more line(s) about refused connections and requests were held back by "
          "the log's rate limit",
          held);
    monitor_.close();
    router_.close();
    zap_.reset();
  }
  ZmqStoreServer(const ZmqStoreServer&) = delete;
  ZmqStoreServer& operator=(const ZmqStoreServer&) = delete;

  Status bind(const std::string& host, int port) {
    const std::string requested =
        port == 0 ? fmt::format("tcp://{}:*", host) : fmt::format("tcp://{}:{}", host, port);
    REFIT_RETURN_IF_ERROR(check_listen_address(host, auth_.get(), "store server"));
    if (auth_) {
      const std::string member = auth_->member_public();
      REFIT_ASSIGN_OR_RETURN(
          zap_, ZapHandler::start(
                    ctx_.handle(), [member](const std::string& key) { return key == member; },
                    "store server", throttle_));
    }
    try {
      router_.set(zmq::sockopt::linger, 0);
      router_.set(zmq::sockopt::maxmsgsize, kMaxControlFrameBytes);
      router_.set(zmq::sockopt::handshake_ivl, static_cast<int>(kZmqHandshakeIvl.count()));
      router_.set(zmq::sockopt::backlog, kZmqBacklog);
      if (auth_) {
        router_.set(zmq::sockopt::curve_server, 1);
        router_.set(zmq::sockopt::curve_secretkey, auth_->server_secret());
      }
      REFIT_ASSIGN_OR_RETURN(monitor_, watch_connections(ctx_, router_));
    } catch (const zmq::error_t& e) {
      return Status::IOError(
          fmt::format("store server: cannot set up {}: {}", requested, errno_text(e.num())));
    }
    // A port held by a connection rather than a server (nothing listens there) is usually held
    // for a moment: tried again for kConnectionHeldWait before it is refused.
    const auto until = Clock::now() + kConnectionHeldWait;
    for (;;) {
      try {
        router_.bind(requested);
        endpoint_ = router_.get(zmq::sockopt::last_endpoint);
        break;
      } catch (const zmq::error_t& e) {
        if (e.num() != EADDRINUSE)
          return Status::IOError(
              fmt::format("store server: cannot bind {}: {}", requested, errno_text(e.num())));
        const Status probe = probe_zmtp(host, port, 500);
        if (probe.code() != StatusCode::kNotFound || Clock::now() >= until)
          return port_taken(host, port, probe);
        std::this_thread::sleep_for(kStopPollInterval);
      }
    }
    const auto colon = endpoint_.rfind(':');
    int bound = 0;
    if (colon == std::string::npos ||
        std::from_chars(endpoint_.data() + colon + 1, endpoint_.data() + endpoint_.size(), bound)
                .ec != std::errc()) {
      return Status::Internal(
          fmt::format("store server: cannot parse the bound endpoint '{}'", endpoint_));
    }
    port_ = bound;
    pending_.listening("store server " + endpoint_, bound, kMaxControlFrameBytes);
    return Status::Ok();
  }

  // Takes heartbeats over same-host lanes too (control/store_lanes.h).
  Status open_lanes(const std::string& host_identity) {
    REFIT_ASSIGN_OR_RETURN(lanes_, store_lanes::Server::open("store server " + endpoint_,
                                                             host_identity, auth_.get(),
                                                             throttle_));
    return Status::Ok();
  }

  void start_serving() {
    thread_ = std::thread([this] { serve(); });
  }

  int port() const override { return port_; }
  std::int64_t watch_visits() const override { return watch_visits_.load(); }
  std::int64_t refused() const override {
    return refused_.load() + (lanes_ ? lanes_->refused() : 0);
  }
  std::int64_t lane_requests() const override { return lane_requests_.load(); }
  std::string lane_address() const override { return lanes_ ? lanes_->address() : std::string(); }
  int pending_high_water() const override { return high_water_.load(); }
  Status failure() const override {
    std::lock_guard<std::mutex> lock(failure_mu_);
    return failure_;
  }

 private:
  struct Waiter {
    std::string identity;
    std::string request_id;
    bool want_value = false;  // get (reply with the value) vs wait (reply empty)
    std::vector<std::string> keys;
    Clock::time_point deadline;
  };

  void serve() {
    while (!stop_.load()) {
      auto timeout = kStopPollInterval;
      const auto now = Clock::now();
      for (const auto& w : waiters_) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(w.deadline - now);
        timeout = std::max(std::chrono::milliseconds(0), std::min(timeout, left));
      }
      std::array<zmq_pollitem_t, 3> items{
          zmq_pollitem_t{router_.handle(), 0, ZMQ_POLLIN, 0},
          zmq_pollitem_t{monitor_.handle(), 0, ZMQ_POLLIN, 0},
          zmq_pollitem_t{nullptr, lanes_ ? lanes_->fd() : -1, ZMQ_POLLIN, 0}};
      const int rc = zmq_poll(items.data(), lanes_ ? 3 : 2, static_cast<long>(timeout.count()));
      if (rc < 0 && zmq_errno() != EINTR) {
        std::fprintf(stderr, "refit store server %s: poll failed: %s\n", endpoint_.c_str(),
                     zmq_strerror(zmq_errno()));
        std::this_thread::sleep_for(kStopPollInterval);
      }
      if (rc > 0 && (items[0].revents & ZMQ_POLLIN) != 0) drain_requests();
      if (rc > 0 && (items[2].revents & ZMQ_POLLIN) != 0) serve_lanes();
      watch_connections_once();
      expire_waiters(Clock::now());
    }
  }

  // Counts and logs (at most 10 lines per 10 s) the connections refused before they were
  // authenticated, and caps those waiting for their handshake. A connection the ZAP handler
  // refused is logged there, with its address; one this server shut down, when it did.
  void watch_connections_once() {
    for (const ConnectionEvent& e : read_connection_events(monitor_)) {
      if (pending_.see(e)) {
        ++refused_;
        log::warn_throttled(throttle_, "store server {}: refused a connection: {}", endpoint_,
                            pending_.silent_refusal());
      }
      if (e.event == ZMQ_EVENT_DISCONNECTED) note_closed(e.value);
      if (e.event == ZMQ_EVENT_ACCEPTED) accept_failures_ = 0;
      if (!e.refused()) continue;
      if (e.event == ZMQ_EVENT_ACCEPT_FAILED) {
        accept_failed(e);
        continue;
      }
      ++refused_;
      if (pending_.caused(e) || e.event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) continue;
      log::warn_throttled(throttle_, "store server {}: refused a connection: {}", endpoint_,
                          e.describe());
    }
    pending_.enforce(throttle_);
    high_water_.store(pending_.high_water());
  }

  // ZeroMQ's listener retries a failed accept each time the listening socket polls readable: at
  // once, while the connection waits in the listen queue. Those retries are one connection that
  // cannot be taken, counted and logged once until an accept succeeds again. Out of descriptors,
  // every rank that connects now fails, so the store's process fails too: the first failure
  // records the error (failure()), naming the limit.
  void accept_failed(const ConnectionEvent& e) {
    if (accept_failures_++ > 0) return;
    ++refused_;
    const std::string line = fmt::format(
        "store server {}: cannot take a connection: {}: a rank that connects now cannot reach "
        "the store",
        endpoint_, e.describe());
    if (e.value == EMFILE || e.value == ENFILE) {
      std::lock_guard<std::mutex> lock(failure_mu_);
      if (failure_.ok()) failure_ = Status::IOError(line);
    }
    if (throttle_.allow()) log::error("{}", line);
  }

  // A counter (a heartbeat) remembers the connection that last added to it (the descriptor the
  // request came in on, or its lane). When that connection closes and the key does not hold
  // "left", the process closed it without leaving: it exited or was killed, which the kernel
  // tells at once, on this host or another; kWatch reports the key as closed from then on. A
  // connection that closes after another one took the key over (a heartbeat that moved from
  // ZeroMQ to its lane, or back) reports nothing.
  void note_counter(std::int64_t connection, const std::string& key) {
    if (connection < 0) return;
    counter_of_[connection] = key;
    counting_[key] = connection;
    closed_.erase(key);
  }
  void note_closed(std::int64_t connection) {
    const auto it = counter_of_.find(connection);
    if (it == counter_of_.end()) return;
    const std::string key = std::move(it->second);
    counter_of_.erase(it);
    const auto c = counting_.find(key);
    if (c == counting_.end() || c->second != connection) return;
    counting_.erase(c);
    const auto v = data_.find(key);
    if (v != data_.end() && v->second == "left") return;
    closed_[key] = Clock::now();
    log::debug("store server {}: the connection that counts '{}' closed without leaving",
               endpoint_, log::escape(key));
  }

  // The server's clock: steady time less the deaf stretches (heard()).
  Clock::time_point clock() const { return Clock::now() - deaf_; }

  // A request arrived at `now`: a deaf stretch before it (store_wire.h, kDeafGapMs) stops the
  // server's clock (clock()) for its length beyond kDeafGapMs, so that no key's age counts it.
  void heard(Clock::time_point now) {
    const auto gap = std::chrono::milliseconds(store_wire::kDeafGapMs);
    if (last_heard_ != Clock::time_point{} && now - last_heard_ > gap) {
      deaf_ += now - last_heard_ - gap;
      log::debug("store server {}: heard no request for {:.1f} s; heartbeat ages leave it out",
                 endpoint_, std::chrono::duration<double>(now - last_heard_).count());
    }
    last_heard_ = now;
  }

  void drain_requests() {
    for (;;) {
      std::vector<zmq::message_t> frames;
      try {
        if (!zmq::recv_multipart(router_, std::back_inserter(frames), zmq::recv_flags::dontwait))
          return;
      } catch (const zmq::error_t& e) {
        std::fprintf(stderr, "refit store server %s: receive failed: %s\n", endpoint_.c_str(),
                     e.what());
        return;
      }
      if (!frames.empty()) pending_.authenticated(zmq_msg_get(frames.back().handle(), ZMQ_SRCFD));
      heard(Clock::now());
      handle(frames);
    }
  }

  void reply(const std::string& identity, const std::string& request_id, Reply code,
             const std::string& payload) {
    std::array<zmq::const_buffer, 4> parts{zmq::buffer(identity), zmq::buffer(request_id),
                                           zmq::const_buffer(&code, 1), zmq::buffer(payload)};
    try {
      // A ROUTER drops replies to clients that went away; dontwait keeps a slow client from
      // stalling everyone else.
      (void)zmq::send_multipart(router_, parts, zmq::send_flags::dontwait);
    } catch (const zmq::error_t& e) {
      std::fprintf(stderr, "refit store server %s: reply failed: %s\n", endpoint_.c_str(),
                   e.what());
    }
  }

  void handle(std::vector<zmq::message_t>& frames) {
    if (frames.size() < 3 || frames[1].size() != 8 || frames[2].size() != 1) {
      if (frames.size() >= 2)
        reply(frames[0].to_string(), frames[1].to_string(), Reply::kError,
              "malformed store request");
      return;
    }
    const std::string identity = frames[0].to_string();
    const std::string request_id = frames[1].to_string();
    const auto op = static_cast<Op>(*frames[2].data<std::uint8_t>());
    const std::size_t nargs = frames.size() - 3;
    auto arg = [&](std::size_t i) { return frames[3 + i].to_string(); };
    auto malformed = [&](const char* what) {
      reply(identity, request_id, Reply::kError, fmt::format("malformed {} request", what));
    };

    switch (op) {
      case Op::kPing:
        // With same-host lanes, where they are (a client on this host beats over one).
        reply(identity, request_id, Reply::kOk, lanes_ ? lanes_->address() : std::string());
        return;
      case Op::kSet: {
        if (nargs != 2) return malformed("set");
        if (auth_ && is_set_once_key(arg(0)) && data_.count(arg(0))) {
          log::warn_throttled(throttle_,
                              "store server: refused to overwrite '{}' (it can be set "
                              "once)",
                              log::escape(arg(0)));
          return reply(identity, request_id, Reply::kError,
                       fmt::format("'{}' is already set and can be set only once",
                                   log::escape(arg(0))));
        }
        data_[arg(0)] = arg(1);
        changed_.touch(arg(0), clock());
        reply(identity, request_id, Reply::kOk, {});
        wake_waiters();
        return;
      }
      case Op::kTryGet: {
        if (nargs != 1) return malformed("try_get");
        auto it = data_.find(arg(0));
        if (it == data_.end()) return reply(identity, request_id, Reply::kAbsent, {});
        return reply(identity, request_id, Reply::kOk, it->second);
      }
      case Op::kTryGetMany: {
        if (nargs < 1) return malformed("try_get_many");
        std::vector<std::optional<std::string>> values;
        for (std::size_t i = 0; i < nargs; ++i) {
          auto it = data_.find(arg(i));
          values.push_back(it == data_.end() ? std::nullopt
                                             : std::optional<std::string>(it->second));
        }
        return reply(identity, request_id, Reply::kOk, store_wire::encode_values(values));
      }
      case Op::kWatch:
      case Op::kAdd: {
        std::vector<std::string> args;
        for (std::size_t i = 0; i < nargs; ++i) args.push_back(arg(i));
        const store_lanes::Answer a =
            counted(op, args, zmq_msg_get(frames.back().handle(), ZMQ_SRCFD));
        return reply(identity, request_id, a.code, a.payload);
      }
      case Op::kGet:
      case Op::kWait: {
        std::int64_t timeout_ms = 0;
        if (nargs < 2 || !store_wire::decode_i64(arg(0), &timeout_ms))
          return malformed(op == Op::kGet ? "get" : "wait");
        if (op == Op::kGet && nargs != 2) return malformed("get");
        Waiter w;
        w.identity = identity;
        w.request_id = request_id;
        w.want_value = op == Op::kGet;
        for (std::size_t i = 1; i < nargs; ++i) w.keys.push_back(arg(i));
        w.deadline =
            Clock::now() + std::chrono::milliseconds(std::max<std::int64_t>(timeout_ms, 0));
        if (ready(w)) return answer(w);
        waiters_.push_back(std::move(w));
        return;
      }
      case Op::kErase: {
        if (nargs != 1) return malformed("erase");
        const std::string key = arg(0);
        if (!is_erasable_key(key))
          return reply(identity, request_id, Reply::kError,
                       fmt::format("'{}' is not erasable (only export/ and outcome/ keys are)",
                                   log::escape(key)));
        data_.erase(key);
        changed_.erase(key);
        closed_.erase(key);
        return reply(identity, request_id, Reply::kOk, {});
      }
    }
    reply(identity, request_id, Reply::kError,
          fmt::format("unknown store op {}", static_cast<int>(op)));
  }

  // The requests that count a key for their connection (a ZeroMQ connection's descriptor, or a
  // lane's number), from a connection or a lane alike: kAdd, and kWatch with its beat.
  store_lanes::Answer counted(Op op, const std::vector<std::string>& args,
                              std::int64_t connection) {
    const auto malformed = [](const char* what) {
      return store_lanes::Answer{Reply::kError, fmt::format("malformed {} request", what)};
    };
    if (op == Op::kAdd) {
      std::int64_t delta = 0;
      if (args.size() != 2 || !store_wire::decode_i64(args[1], &delta)) return malformed("add");
      Result<std::int64_t> n = add_to(args[0], delta, connection);
      if (!n.ok()) return {Reply::kError, n.status().message()};
      wake_waiters();
      return {Reply::kOk, store_wire::encode_i64(*n)};
    }
    if (op != Op::kWatch)
      return {Reply::kError, fmt::format("store op {} does not travel on a same-host lane",
                                         static_cast<int>(op))};
    std::int64_t silence_ms = 0;
    if (args.size() < 3 || !store_wire::decode_i64(args[0], &silence_ms)) return malformed("watch");
    const std::vector<std::string> keys(args.begin() + 3, args.end());
    // The beat first, so that the rank's own key is fresh in the answer.
    if (const std::string& beat = args[2]; !beat.empty()) {
      Result<std::int64_t> n = add_to(beat, 1, connection);
      if (!n.ok()) return {Reply::kError, n.status().message()};
      wake_waiters();
    }
    return {Reply::kOk, watch_payload(silence_ms, args[1], keys)};
  }

  // Heartbeats and liveness reads over the same-host lanes.
  void serve_lanes() {
    lanes_->serve(
        [this](Op op, const std::vector<std::string>& args, std::int64_t connection) {
          heard(Clock::now());
          ++lane_requests_;
          return counted(op, args, connection);
        },
        [this](std::int64_t connection) { note_closed(connection); });
  }

  // kAdd (and a kWatch's beat): adds `delta` to the integer at `key` (absent: 0), the request's
  // connection counting it from now on.
  Result<std::int64_t> add_to(const std::string& key, std::int64_t delta,
                              std::int64_t connection) {
    std::int64_t current = 0;
    auto it = data_.find(key);
    if (it != data_.end()) {
      const std::string& s = it->second;
      auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), current);
      if (ec != std::errc() || end != s.data() + s.size())
        return Status::InvalidArgument(
            fmt::format("the value of key '{}' is not an integer: '{}'", log::escape(key),
                        log::escape(s.substr(0, 64))));
    }
    current += delta;
    data_[key] = std::to_string(current);
    changed_.touch(key, clock());
    note_counter(connection, key);
    return current;
  }

  // A kWatch reply (store_wire.h): the keys' values, then every stale key under `prefix`.
  std::string watch_payload(std::int64_t silence_ms, const std::string& prefix,
                            const std::vector<std::string>& keys) {
    std::vector<std::optional<std::string>> values;
    for (const std::string& k : keys) {
      auto it = data_.find(k);
      values.push_back(it == data_.end() ? std::nullopt : std::optional<std::string>(it->second));
    }
    const auto now = Clock::now();
    std::int64_t stale = 0;
    // Closed without leaving: reported at once, whatever `silence` is (store_wire.h).
    for (const auto& [key, when] : closed_) {
      if (key.compare(0, prefix.size(), prefix) != 0) continue;
      const auto v = data_.find(key);
      if (v != data_.end() && v->second == "left") continue;
      const auto age = std::chrono::duration_cast<std::chrono::milliseconds>(now - when);
      values.emplace_back(key);
      values.emplace_back(std::string(store_wire::kClosedMark) + std::to_string(age.count()));
      ++stale;
    }
    const Clock::time_point at = clock();
    watch_visits_ += changed_.each_before(
        prefix, at - std::chrono::milliseconds(silence_ms),
        [&](const std::string& key, Clock::time_point when) {
          if (closed_.count(key) != 0) return;
          const auto v = data_.find(key);
          if (v == data_.end() || v->second == "left") return;
          values.emplace_back(key);
          values.emplace_back(std::to_string(
              std::chrono::duration_cast<std::chrono::milliseconds>(at - when).count()));
          ++stale;
        });
    return store_wire::encode_i64(stale) + store_wire::encode_values(values);
  }

  bool ready(const Waiter& w) const {
    for (const auto& k : w.keys)
      if (!data_.count(k)) return false;
    return true;
  }

  void answer(const Waiter& w) {
    reply(w.identity, w.request_id, Reply::kOk, w.want_value ? data_.at(w.keys[0]) : std::string());
  }

  void wake_waiters() {
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (ready(*it)) {
        answer(*it);
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void expire_waiters(Clock::time_point now) {
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->deadline <= now) {
        std::string missing;
        for (const auto& k : it->keys) {
          if (data_.count(k)) continue;
          if (!missing.empty()) missing += "', '";
          missing += k;
        }
        reply(it->identity, it->request_id, Reply::kTimeout, missing);
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Another socket holds `port`: a ZeroMQ server (another run's store?), another server
  // (torch.distributed's), or a connection (nothing listens: `probe` is NotFound).
  static Status port_taken(const std::string& host, int port, const Status& probe) {
    if (probe.code() == StatusCode::kNotFound) {
      const PortRange ephemeral = ephemeral_ports();
      return Status::IOError(fmt::format(
          "store server: port {} on {} is held by a connection, not by a server (nothing listens "
          "there): {}; give refit's store a port of its own on every rank, below {}: REFIT_PORT "
          "(or master_port= in Python), or 0 for any free port (docs/python.md, \"Ports\")",
          port, host,
          ephemeral.contains(port)
              ? fmt::format("the port lies in this host's ephemeral range {}-{} "
                            "(net.ipv4.ip_local_port_range), from which every outgoing "
                            "connection takes its source port",
                            ephemeral.low, ephemeral.high)
              : std::string("a connection bound it as its source port"),
          ephemeral.low));
    }
    const std::string holder =
        probe.ok() ? "another ZeroMQ server (the store of another refit run?)"
        : probe.code() == StatusCode::kTimeout
            ? "another server that is not ZeroMQ, or a stopped one (torch.distributed's store, "
              "on MASTER_PORT?)"
            : "another server that is not ZeroMQ (torch.distributed's store, on MASTER_PORT?)";
    return Status::IOError(fmt::format(
        "store server: port {} on {} is taken by {}; give refit's store a port of its own on "
        "every rank: REFIT_PORT (or master_port= in Python), or 0 for any free port "
        "(docs/python.md, \"Ports\")",
        port, host, holder));
  }

  std::shared_ptr<const ControlAuth> auth_;
  // One rate limit for every line a peer can cause (the ZAP handler's too): outlives them.
  log::Throttle throttle_;
  // Declared first: destroyed after the socket and the ZAP handler.
  zmq::context_t ctx_{1};
  std::unique_ptr<ZapHandler> zap_;
  zmq::socket_t router_;
  zmq::socket_t monitor_;  // router_'s connection events
  std::atomic<std::int64_t> refused_{0};
  std::atomic<std::int64_t> watch_visits_{0};  // keys the watches looked at (watch_visits())
  std::unique_ptr<store_lanes::Server> lanes_;  // same-host lanes (open_lanes), or none
  std::atomic<std::int64_t> lane_requests_{0};
  std::atomic<int> high_water_{0};
  PendingHandshakes pending_;         // the serving thread's
  std::int64_t accept_failures_ = 0;  // in a row, since the last accepted connection
  mutable std::mutex failure_mu_;
  Status failure_;  // guarded by failure_mu_
  std::string endpoint_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  // Owned by the serving thread.
  std::unordered_map<std::string, std::string> data_;
  // When each key was last set or added to (kWatch: heartbeats that stood still).
  ChangeRecord changed_;
  Clock::duration deaf_{0};         // the deaf stretches so far, beyond kDeafGapMs each (heard())
  Clock::time_point last_heard_{};  // when the last request arrived (heard())
  // The counter each connection last added to (by descriptor, or a lane's number), and the
  // counters whose connection closed without leaving, since when (note_counter, note_closed).
  std::unordered_map<std::int64_t, std::string> counter_of_;
  std::unordered_map<std::string, std::int64_t> counting_;  // the connection counting each key
  std::unordered_map<std::string, Clock::time_point> closed_;
  std::list<Waiter> waiters_;
};

}  // namespace

Result<std::unique_ptr<StoreServer>> StoreServer::start(const StoreServerOptions& o) {
  const std::string& host = o.host;
  const int port = o.port;
  if (port < 0 || port > 65535) {
    return Status::InvalidArgument(
        fmt::format("store server: port {} is out of range (0 = any free port, 1..65535)", port));
  }
  std::unique_ptr<ZmqStoreServer> server;
  try {
    const int max_pending =
        o.max_pending_handshakes > 0
            ? o.max_pending_handshakes
            : std::max(kZmqMaxPendingHandshakes, kStoreConnectionsPerRank * std::max(o.ranks, 0));
    server = std::make_unique<ZmqStoreServer>(o.auth, max_pending);
  } catch (const zmq::error_t& e) {
    return Status::IOError(
        fmt::format("store server: cannot create a ZeroMQ socket: {}", e.what()));
  }
  // A same-host lane holds one descriptor more per rank.
  const int per_rank = kStoreConnectionsPerRank + (o.lane_host_identity.empty() ? 0 : 1);
  if (o.ranks > 0)
    REFIT_RETURN_IF_ERROR(ensure_fd_limit(
        std::int64_t{per_rank} * o.ranks + kBaseDescriptors, "store server",
        fmt::format("a store for {} ranks ({} connections each)", o.ranks, per_rank)));
  REFIT_RETURN_IF_ERROR(server->bind(host, port));
  if (!o.lane_host_identity.empty()) REFIT_RETURN_IF_ERROR(server->open_lanes(o.lane_host_identity));
  server->start_serving();
  return std::unique_ptr<StoreServer>(std::move(server));
}

}  // namespace refit
