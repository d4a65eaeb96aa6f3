// StoreClient: the Store interface over DEALER connections to a StoreServer.
//
// Each call takes an idle connection from a small pool (or opens one), so concurrent callers
// never share a socket and a blocking get() on one thread does not hold up a set() on another.
// Every connection has a socket monitor: once a connection to the server is lost (the server
// process exited), every pending and later call fails at once with kIOError naming the store,
// instead of waiting out its timeout. Authentication is blamed only when a handshake failed for
// it (zmq_monitor.h): a connection cut during its handshake may be a server that exited, so the
// client looks at what listens on the port before it says which.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string_view>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "common/log.h"
#include "control/auth.h"
#include "control/fd_limit.h"
#include "control/store.h"
#include "control/store_lanes.h"
#include "control/store_wire.h"
#include "control/zmq_monitor.h"

namespace refit {
namespace {

using Clock = std::chrono::steady_clock;
using store_wire::Op;
using store_wire::Reply;

// Extra time a client waits beyond a get/wait timeout for the server's own timeout reply.
constexpr std::chrono::milliseconds kReplyGrace{500};
// Requests that do not wait for keys (set, try_get, add) are answered at once by a live server.
constexpr std::chrono::milliseconds kMinRequestTimeout{1000};

// Handshakes cut without a reason, in a row and never one that succeeded, after which the client
// looks at what listens on the port (a refit store holding another secret cuts every one).
constexpr int kSilentHandshakeFailures = 3;

std::string quote_keys(const std::vector<std::string>& keys) {
  std::string s;
  for (const auto& k : keys) {
    if (!s.empty()) s += ", ";
    s += "'" + k + "'";
  }
  return s;
}

struct Connection {
  zmq::socket_t dealer;
  zmq::socket_t monitor;     // PAIR receiving the dealer's connect/disconnect events
  bool established = false;  // its handshake succeeded
};

class StoreClient final : public Store {
 public:
  StoreClient(std::string host, int port, std::chrono::milliseconds request_timeout,
              std::shared_ptr<const ControlAuth> auth)
      : host_(std::move(host)),
        port_(port),
        address_(fmt::format("tcp://{}:{}", host_, port_)),
        request_timeout_(request_timeout),
        auth_(std::move(auth)) {}
  ~StoreClient() override {
    // Sockets before the context.
    idle_.clear();
  }
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  void abort(const Status& why) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_.load()) return;
      aborted_why_ = why;
    }
    aborted_.store(true);
  }

  // One ping, retried by ZeroMQ's reconnects until `timeout`.
  Status ping(std::chrono::milliseconds timeout) override {
    Result<std::string> reply = request(Op::kPing, {}, timeout, "connect");
    if (!reply.ok()) {
      if (reply.status().code() == StatusCode::kTimeout) {
        // A server that does not answer a ping is stopped or hung: later calls fail at once
        // instead of each waiting out its own timeout (a failing rank's last words).
        if (pinged_.load()) {
          stalled_.store(true);
          return Status::Timeout(fmt::format("the store server at {} did not answer within {} ms",
                                             address_, timeout.count()));
        }
        return unreachable(timeout);
      }
      return reply.status();
    }
    // The first ping is connect_store's, before the client is shared.
    if (!pinged_.exchange(true)) lanes_at_ = std::move(reply).value();
    return Status::Ok();
  }

  // From now on this client's heartbeats and liveness reads take a lane, as `id`, to the store's
  // process when the first ping found it on this host (`host_identity`), and ZeroMQ otherwise.
  void open_lane(const std::string& id, const std::string& host_identity,
                 std::chrono::milliseconds timeout) {
    std::lock_guard<std::mutex> lock(lane_mu_);
    Result<std::unique_ptr<store_lanes::Client>> lane =
        store_lanes::Client::open(lanes_at_, host_identity, id, auth_.get(), timeout);
    if (!lane.ok()) {
      // Another network namespace refuses at once (debug); a gate that does not answer in time
      // (busy) is worth a line.
      const std::string line =
          fmt::format("store {}: no same-host lane to the store for '{}' ({}); its heartbeats go "
                      "over ZeroMQ",
                      address_, id, lane.status().message());
      if (lane.status().code() == StatusCode::kTimeout)
        log::info("{}", line);
      else
        log::debug("{}", line);
      return;
    }
    lane_ = std::move(lane).value();
    if (lane_) log::debug("store {}: '{}' beats over a same-host lane", address_, id);
  }

  Status set(const std::string& key, const std::string& value) override {
    auto r = request(Op::kSet, {key, value}, request_timeout_, fmt::format("set '{}'", key));
    return r.ok() ? Status::Ok() : r.status();
  }

  Status erase(const std::string& key) override {
    auto r = request(Op::kErase, {key}, request_timeout_, fmt::format("erase '{}'", key));
    return r.ok() ? Status::Ok() : r.status();
  }

  Result<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override {
    return request(Op::kGet, {store_wire::encode_i64(timeout.count()), key}, timeout + kReplyGrace,
                   fmt::format("get '{}' (timeout {} ms)", key, timeout.count()));
  }

  Result<std::optional<std::string>> try_get(const std::string& key) override {
    bool absent = false;
    auto r =
        request(Op::kTryGet, {key}, request_timeout_, fmt::format("try_get '{}'", key), &absent);
    if (!r.ok()) return r.status();
    if (absent) return std::optional<std::string>();
    return std::optional<std::string>(std::move(r).value());
  }

  Result<std::vector<std::optional<std::string>>> try_get_many(
      const std::vector<std::string>& keys) override {
    if (keys.empty()) return std::vector<std::optional<std::string>>();
    REFIT_ASSIGN_OR_RETURN(std::string payload,
                           request(Op::kTryGetMany, keys, request_timeout_,
                                   fmt::format("try_get {}", quote_keys(keys))));
    std::vector<std::optional<std::string>> out;
    if (!store_wire::decode_values(payload, keys.size(), &out))
      return Status::Corruption(fmt::format("store {}: try_get of {} keys got a malformed reply "
                                            "({} bytes)",
                                            address_, keys.size(), payload.size()));
    return out;
  }

  Result<Watched> watch(const std::vector<std::string>& keys, const std::string& prefix,
                        std::chrono::milliseconds silence) override {
    return watch_request({}, keys, prefix, silence, request_timeout_);
  }

  Result<Watched> beat_and_watch(const std::string& beat, const std::vector<std::string>& keys,
                                 const std::string& prefix, std::chrono::milliseconds silence,
                                 std::chrono::milliseconds timeout) override {
    return watch_request(beat, keys, prefix, silence,
                         std::max(timeout, std::chrono::milliseconds(1000)));
  }

  // kWatch, with `beat` (a heartbeat to add to first) or none ("").
  Result<Watched> watch_request(const std::string& beat, const std::vector<std::string>& keys,
                                const std::string& prefix, std::chrono::milliseconds silence,
                                std::chrono::milliseconds timeout) {
    std::vector<std::string> args{store_wire::encode_i64(silence.count()), prefix, beat};
    args.insert(args.end(), keys.begin(), keys.end());
    Result<std::string> reply = request(
        Op::kWatch, args, timeout,
        beat.empty() ? fmt::format("watch '{}' and {} key(s)", prefix, keys.size())
                     : fmt::format("beat '{}' and watch '{}' and {} key(s)", beat, prefix,
                                   keys.size()));
    if (!reply.ok()) return reply.status();
    const std::string payload = std::move(reply).value();
    std::int64_t stale = 0;
    std::vector<std::optional<std::string>> values;
    const std::size_t size = payload.size();
    const auto malformed = [this, n = keys.size(), size] {
      return Status::Corruption(
          fmt::format("store {}: a watch of {} keys got a malformed reply "
                      "({} bytes)",
                      address_, n, size));
    };
    if (size < sizeof stale) return malformed();
    std::memcpy(&stale, payload.data(), sizeof stale);
    const std::string rest(payload.data() + sizeof stale, size - sizeof stale);
    if (stale < 0 || static_cast<std::uint64_t>(stale) > size ||
        !store_wire::decode_values(rest, keys.size() + 2 * static_cast<std::size_t>(stale),
                                   &values))
      return malformed();
    Watched w;
    w.values.assign(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(keys.size()));
    for (std::size_t i = keys.size(); i + 1 < values.size(); i += 2) {
      if (!values[i] || !values[i + 1]) return malformed();
      std::int64_t age = 0;
      std::string_view a = *values[i + 1];
      const bool closed = a.starts_with(store_wire::kClosedMark);
      if (closed) a.remove_prefix(std::strlen(store_wire::kClosedMark));
      const auto [end, ec] = std::from_chars(a.data(), a.data() + a.size(), age);
      if (ec != std::errc() || end != a.data() + a.size()) return malformed();
      w.stale.push_back(
          Stale{.key = *values[i], .age = std::chrono::milliseconds(age), .closed = closed});
    }
    return w;
  }

  std::int64_t requests() const override { return requests_.load(); }

  Status wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    if (keys.empty()) return Status::Ok();
    std::vector<std::string> args{store_wire::encode_i64(timeout.count())};
    args.insert(args.end(), keys.begin(), keys.end());
    auto r = request(Op::kWait, args, timeout + kReplyGrace,
                     fmt::format("wait for {} (timeout {} ms)", quote_keys(keys), timeout.count()));
    return r.ok() ? Status::Ok() : r.status();
  }

  Result<std::int64_t> add(const std::string& key, std::int64_t delta) override {
    REFIT_ASSIGN_OR_RETURN(std::string v,
                           request(Op::kAdd, {key, store_wire::encode_i64(delta)}, request_timeout_,
                                   fmt::format("add {} to '{}'", delta, key)));
    std::int64_t n = 0;
    if (!store_wire::decode_i64(v, &n)) {
      return Status::Corruption(fmt::format("store {}: add to '{}' got a {}-byte reply, expected 8",
                                            address_, key, v.size()));
    }
    return n;
  }

 private:
  // Sends one request and waits for its reply. `what` names the call in error messages.
  // When `absent` is given, a kAbsent reply sets it instead of failing.
  Result<std::string> request(Op op, const std::vector<std::string>& args,
                              std::chrono::milliseconds wait, const std::string& what,
                              bool* absent = nullptr) {
    if (dead()) return lost_status(what);
    requests_.fetch_add(1, std::memory_order_relaxed);
    // A lane that broke closes only after ZeroMQ carried this request in its place: its close
    // then never reads, at the store, as the exit of the rank whose heartbeat it counted.
    std::unique_ptr<store_lanes::Client> broken;
    if (op == Op::kAdd || op == Op::kWatch)
      if (std::optional<Result<std::string>> r = over_lane(op, args, wait, what, absent, broken))
        return *r;
    std::unique_ptr<Connection> conn;
    try {
      conn = acquire();
    } catch (const zmq::error_t& e) {
      return Status::IOError(fmt::format("store {}: cannot open a connection for {}: {}", address_,
                                         what, errno_text(e.num())));
    }
    Result<std::string> result = Status::Internal("unset");
    bool reusable = true;
    try {
      result = exchange(*conn, op, args, wait, what, absent);
    } catch (const zmq::error_t& e) {
      reusable = false;  // the socket may be half-way through a multipart message
      result = Status::IOError(
          fmt::format("store {}: {} failed: {}", address_, what, errno_text(e.num())));
    }
    if (reusable && !lost_.load()) release(std::move(conn));
    return result;
  }

  // The request over this client's same-host lane: nullopt when it has none (or another thread
  // uses it), or when it broke (then handed to `broken`: ZeroMQ carries this request and every
  // later one).
  std::optional<Result<std::string>> over_lane(Op op, const std::vector<std::string>& args,
                                               std::chrono::milliseconds wait,
                                               const std::string& what, bool* absent,
                                               std::unique_ptr<store_lanes::Client>& broken) {
    std::unique_lock<std::mutex> lock(lane_mu_, std::try_to_lock);
    if (!lock.owns_lock() || !lane_) return std::nullopt;
    Result<store_lanes::Answer> a =
        lane_->exchange(op, args, Clock::now() + wait, [this] { return aborted_.load(); });
    if (a.ok()) return answer(op, a->code, std::move(a->payload), what, absent);
    if (aborted_.load()) return lost_status(what);
    if (a.status().code() == StatusCode::kTimeout) return no_reply(what, wait);
    log::info("store {}: the same-host lane to the store broke ({}); heartbeats go over ZeroMQ",
              address_, a.status().message());
    broken = std::move(lane_);
    return std::nullopt;
  }

  Status no_reply(const std::string& what, std::chrono::milliseconds wait) const {
    return Status::Timeout(fmt::format(
        "store {}: no reply to {} within {} ms (is the store server alive?)", address_, what,
        wait.count()));
  }

  Result<std::string> exchange(Connection& conn, Op op, const std::vector<std::string>& args,
                               std::chrono::milliseconds wait, const std::string& what,
                               bool* absent) {
    drain_events(conn);
    if (dead()) return lost_status(what);

    const std::string id = store_wire::encode_i64(static_cast<std::int64_t>(++next_id_));
    const auto op_byte = static_cast<std::uint8_t>(op);
    std::vector<zmq::const_buffer> parts{zmq::buffer(id), zmq::const_buffer(&op_byte, 1)};
    for (const auto& a : args) parts.push_back(zmq::buffer(a));
    if (!zmq::send_multipart(conn.dealer, parts, zmq::send_flags::dontwait)) {
      return Status::IOError(
          fmt::format("store {}: cannot queue {}: the send queue is full", address_, what));
    }

    const auto deadline = Clock::now() + wait;
    for (;;) {
      if (aborted_.load()) return lost_status(what);
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return no_reply(what, wait);
      std::array<zmq_pollitem_t, 2> items{zmq_pollitem_t{conn.dealer.handle(), 0, ZMQ_POLLIN, 0},
                                          zmq_pollitem_t{conn.monitor.handle(), 0, ZMQ_POLLIN, 0}};
      // In slices, so that abort() ends the wait.
      const int rc = zmq_poll(items.data(), 2, std::min<long>(left.count(), 100));
      if (rc < 0) {
        if (zmq_errno() == EINTR) continue;
        return Status::IOError(fmt::format("store {}: poll failed during {}: {}", address_, what,
                                           zmq_strerror(zmq_errno())));
      }
      if (items[1].revents & ZMQ_POLLIN) {
        drain_events(conn);
        if (dead()) return lost_status(what);
      }
      if (!(items[0].revents & ZMQ_POLLIN)) continue;

      std::vector<zmq::message_t> frames;
      if (!zmq::recv_multipart(conn.dealer, std::back_inserter(frames), zmq::recv_flags::dontwait))
        continue;
      if (frames.size() != 3 || frames[1].size() != 1) {
        return Status::Corruption(fmt::format("store {}: malformed reply ({} frames) to {}",
                                              address_, frames.size(), what));
      }
      if (frames[0].to_string() != id) continue;  // a late reply to an earlier, timed-out call
      return answer(op, static_cast<Reply>(*frames[1].data<std::uint8_t>()), frames[2].to_string(),
                    what, absent);
    }
  }

  // What a reply means to the caller of `op`.
  Result<std::string> answer(Op op, Reply code, std::string payload, const std::string& what,
                             bool* absent) {
    switch (code) {
      case Reply::kOk:
        return payload;
      case Reply::kAbsent:
        if (absent) {
          *absent = true;
          return std::string();
        }
        return Status::NotFound(fmt::format("store {}: {}: key not found", address_, what));
      case Reply::kTimeout:
        if (op == Op::kGet)
          return Status::Timeout(fmt::format("store {}: {} timed out", address_, what));
        return Status::Timeout(fmt::format("store {}: {} timed out; still missing: '{}'",
                                           address_, what, payload));
      case Reply::kError:
        return Status::InvalidArgument(fmt::format("store {}: {}: {}", address_, what, payload));
    }
    return Status::Corruption(fmt::format("store {}: unknown reply code {} to {}", address_,
                                          static_cast<int>(code), what));
  }

  // Requests fail at once: the connection was lost, refused, found stalled, or aborted.
  bool dead() const {
    return lost_.load() || refused_.load() || foreign_.load() || stalled_.load() || aborted_.load();
  }

  Status lost_status(const std::string& what) {
    if (aborted_.load()) {
      std::lock_guard<std::mutex> lock(mu_);
      // As a context: the why keeps its origin (the rank a liveness check blamed).
      return aborted_why_.with_context(fmt::format("store {}: {} ended", address_, what));
    }
    if (stalled_.load())
      return Status::IOError(fmt::format(
          "store {}: the store server stopped answering (a ping timed out; its host, trainer rank "
          "0, is stopped or hung); {} failed",
          address_, what));
    if (refused_.load())
      return Status::InvalidArgument(fmt::format(
          "store {}: the store server refused this process's handshake ({}); {} failed. Every "
          "rank must hold the same run secret (REFIT_SECRET or REFIT_SECRET_FILE; this process "
          "has {})",
          address_, refused_why(), what, auth_ ? "one" : "none"));
    if (foreign_.load()) return foreign_status(what);
    return Status::IOError(fmt::format(
        "store {}: the connection to the store server was lost (its process exited?); {} failed",
        address_, what));
  }

  // Reads the monitor's pending events: a connection lost after its handshake marks the whole
  // client as lost; a handshake refused for its keys as refused; one that broke the protocol as
  // foreign (not a refit store). Handshakes cut without a reason, again and again, are looked into
  // (why_handshakes_fail). A connection cut during its handshake while another one of this client
  // was served is lost only if the server's port now refuses connections: a live server cuts
  // handshakes too (its cap on those waiting), and ZeroMQ then connects again.
  void drain_events(Connection& conn) {
    for (const ConnectionEvent& e : read_connection_events(conn.monitor)) {
      switch (e.event) {
        case ZMQ_EVENT_HANDSHAKE_SUCCEEDED:
          conn.established = true;
          established_.store(true);
          silent_failures_.store(0);
          break;
        case ZMQ_EVENT_DISCONNECTED:
          if (conn.established || (established_.load() &&
                                   probe_zmtp(host_, port_, 500).code() == StatusCode::kNotFound))
            lost_.store(true);
          break;
        case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL:
          if (!established_.load() && ++silent_failures_ >= kSilentHandshakeFailures)
            why_handshakes_fail();
          break;
        case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
        case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
          if (e.authentication_failed()) {
            set_refused(e.describe());
          } else {
            foreign_.store(true);
          }
          break;
        default:
          break;
      }
    }
  }

  // Every handshake was cut: a refit store of another secret does that (it cannot open this
  // process's hello), and so does a server that is not ZeroMQ's and closes what it cannot parse.
  // A ZeroMQ greeting on the port tells them apart; nothing listening means the server exited.
  void why_handshakes_fail() {
    const Status probe = probe_zmtp(host_, port_, 500);
    // Without a secret this process speaks ZeroMQ's NULL mechanism, which a store without one
    // accepts: a store that cuts every handshake holds a secret. Which side sees the mismatch
    // first (a protocol error, or only the cut) is a race.
    if (probe.ok())
      set_refused(auth_ ? "it closed every handshake: it does not hold this process's keys"
                        : "it closed every handshake: the peer uses another security mechanism "
                          "(one side holds a run secret, the other none)");
    else if (probe.code() == StatusCode::kUnsupported)
      foreign_.store(true);
    // kTimeout (silent: a stopped store host, or a server that waits to be spoken to) decides
    // nothing: the connection is tried until its deadline, and unreachable() names both.
  }

  void set_refused(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (refused_.load()) return;
      refused_why_ = why;
    }
    refused_.store(true);
  }
  std::string refused_why() {
    std::lock_guard<std::mutex> lock(mu_);
    return refused_why_;
  }

  Status foreign_status(const std::string& what) const {
    return Status::InvalidArgument(fmt::format(
        "store {}: the server on port {} is not a refit store (it does not speak ZeroMQ's "
        "protocol: another server, such as torch.distributed's store on MASTER_PORT, holds the "
        "port); {} failed. Give refit's store a port of its own on every rank: REFIT_PORT, or "
        "master_port= in Python (docs/python.md, \"Ports\")",
        address_, port_, what));
  }

  // Why the first contact failed, from what listens on the port.
  Status unreachable(std::chrono::milliseconds waited) {
    if (refused_.load() || foreign_.load()) return lost_status("connect");
    const Status probe = probe_zmtp(host_, port_, 500);
    if (probe.code() == StatusCode::kUnsupported) {
      foreign_.store(true);
      return foreign_status("connect");
    }
    if (probe.ok())
      return Status::Timeout(fmt::format(
          "a ZeroMQ server listens at {} but did not complete a handshake with this process "
          "within {} ms: it is busy (raise refit.timeout_s), or it is another run's store",
          address_, waited.count()));
    if (probe.code() == StatusCode::kTimeout)
      return Status::Timeout(fmt::format(
          "the server at {} accepted this process's connections but never answered within {} ms "
          "({}): the process that hosts the store (trainer rank 0) is stopped or hung, or another "
          "server that waits for its clients to speak first holds the port (torch.distributed's "
          "store, on MASTER_PORT?); give refit's store a port of its own on every rank: "
          "REFIT_PORT, or master_port= in Python (docs/python.md, \"Ports\")",
          address_, waited.count(), probe.message()));
    return Status::Timeout(fmt::format(
        "cannot reach the store server at {} within {} ms ({}): is the process that hosts it "
        "(trainer rank 0) running, and are the host and port right (REFIT_PORT on every rank)?",
        address_, waited.count(), probe.message()));
  }

  std::unique_ptr<Connection> acquire() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!idle_.empty()) {
        auto c = std::move(idle_.back());
        idle_.pop_back();
        return c;
      }
    }
    auto c = std::make_unique<Connection>();
    c->dealer = zmq::socket_t(ctx_, zmq::socket_type::dealer);
    c->dealer.set(zmq::sockopt::linger, 0);
    c->dealer.set(zmq::sockopt::maxmsgsize, kMaxControlFrameBytes);
    c->dealer.set(zmq::sockopt::handshake_ivl, static_cast<int>(kZmqHandshakeIvl.count()));
    if (auth_) {
      c->dealer.set(zmq::sockopt::curve_serverkey, auth_->server_public());
      c->dealer.set(zmq::sockopt::curve_publickey, auth_->member_public());
      c->dealer.set(zmq::sockopt::curve_secretkey, auth_->member_secret());
    }
    Result<zmq::socket_t> monitor = watch_connections(ctx_, c->dealer);
    if (!monitor.ok()) throw zmq::error_t();
    c->monitor = std::move(monitor).value();
    c->dealer.connect(address_);
    return c;
  }

  void release(std::unique_ptr<Connection> conn) {
    std::lock_guard<std::mutex> lock(mu_);
    idle_.push_back(std::move(conn));
  }

  const std::string host_;
  const int port_;
  const std::string address_;
  const std::chrono::milliseconds request_timeout_;
  const std::shared_ptr<const ControlAuth> auth_;
  std::atomic<std::int64_t> requests_{0};  // requests sent (requests())
  zmq::context_t ctx_{1};
  std::atomic<std::uint64_t> next_id_{0};
  std::atomic<bool> lost_{false};
  std::atomic<bool> refused_{false};      // a handshake failed for its keys: not the run's secret
  std::atomic<bool> foreign_{false};      // the server does not speak ZeroMQ: not a refit store
  std::atomic<bool> established_{false};  // a handshake succeeded once
  std::atomic<int> silent_failures_{0};   // handshakes cut without a reason since then
  std::atomic<bool> pinged_{false};   // a ping was answered once (the server was up)
  std::atomic<bool> stalled_{false};  // then a ping was not: the server is stopped or hung
  std::atomic<bool> aborted_{false};  // abort(): aborted_why_ says why
  std::mutex mu_;
  Status aborted_why_;       // guarded by mu_
  std::string refused_why_;  // guarded by mu_
  std::vector<std::unique_ptr<Connection>> idle_;
  std::mutex lane_mu_;
  std::string lanes_at_;                       // the first ping's answer (ping)
  std::unique_ptr<store_lanes::Client> lane_;  // open_lane (guarded by lane_mu_)
};

}  // namespace

Result<std::unique_ptr<Store>> connect_store(const StoreClientOptions& o) {
  if (o.port == 0)
    return Status::InvalidArgument(
        "store client: port 0 (any free port) is for trainer rank 0, which hosts the store; the "
        "other ranks need the port it chose (REFIT_PORT; its log says 'control plane: store on "
        "HOST:PORT')");
  if (o.port < 0 || o.port > 65535) {
    return Status::InvalidArgument(
        fmt::format("store client: port {} is out of range (1..65535)", o.port));
  }
  std::unique_ptr<StoreClient> client;
  try {
    client = std::make_unique<StoreClient>(o.host, o.port,
                                           std::max(o.request_timeout, kMinRequestTimeout), o.auth);
  } catch (const zmq::error_t& e) {
    return Status::IOError(
        fmt::format("store client for tcp://{}:{}: {}", o.host, o.port, errno_text(e.num())));
  }
  REFIT_RETURN_IF_ERROR(client->ping(o.connect_timeout));
  if (!o.lane_id.empty() && !o.lane_host_identity.empty())
    client->open_lane(o.lane_id, o.lane_host_identity,
                      std::min(o.connect_timeout, std::chrono::milliseconds(2000)));
  return std::unique_ptr<Store>(std::move(client));
}

Result<std::unique_ptr<Store>> connect_store(const std::string& host, int port,
                                             std::chrono::milliseconds timeout,
                                             std::shared_ptr<const ControlAuth> auth) {
  return connect_store(StoreClientOptions{.host = host,
                                          .port = port,
                                          .connect_timeout = timeout,
                                          .request_timeout = timeout,
                                          .auth = std::move(auth)});
}

}  // namespace refit
