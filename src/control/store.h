// The rendezvous store of the control plane (docs/design.md §3), on ZeroMQ.
//
// A StoreServer is hosted by trainer rank 0 (or any process: tests host their own); StoreClients
// connect to it over TCP. Keys are strings, values byte strings. Every blocking call takes a
// timeout and returns kTimeout naming the key(s) when it runs out, or kIOError when the server
// cannot be reached. StoreClient is thread-safe: concurrent calls use separate connections, so a
// blocking get() on one thread does not hold up a set() on another. Once a client sees its
// connection to the server drop (the hosting process exited), every call fails at once with
// kIOError naming the store address. Keys of a get/wait are answered by the server as soon as
// they are set: a parked get costs the server nothing while it waits.
#pragma once

#include <chrono>
#include <functional>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "refit/status.h"

namespace refit {

class Store {
 public:
  virtual ~Store() = default;
  virtual Status set(const std::string& key, const std::string& value) = 0;
  // Removes `key` (nothing when it is absent): what a run writes once per refit or per export
  // does not stay for the run's life. Only such keys may go (is_erasable_key: export/, outcome/);
  // any other is an error, so no member can erase an address, a heartbeat or a failure.
  virtual Status erase(const std::string& key) = 0;
  // Waits until `key` exists, then returns its value.
  virtual Result<std::string> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // The value, or nullopt right away when the key is absent.
  virtual Result<std::optional<std::string>> try_get(const std::string& key) = 0;
  // Waits until every key exists.
  virtual Status wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  // try_get of every key, in one request where the store allows (the liveness check reads every
  // peer's heartbeat this way, so its cost per check does not grow with the number of ranks).
  virtual Result<std::vector<std::optional<std::string>>> try_get_many(
      const std::vector<std::string>& keys) {
    std::vector<std::optional<std::string>> out;
    for (const std::string& k : keys) {
      REFIT_ASSIGN_OR_RETURN(std::optional<std::string> v, try_get(k));
      out.push_back(std::move(v));
    }
    return out;
  }
  // Atomically adds `delta` to the integer stored at `key` (absent = 0); returns the new value.
  virtual Result<std::int64_t> add(const std::string& key, std::int64_t delta) = 0;
  // The liveness read, in one request: try_get_many(keys), and every key under `prefix` that
  // exists, does not hold "left", and was last set or added to at least `silence` ago by the
  // server's clock (a heartbeat that stood still), with how long ago. The server answers from its
  // own record of when each key changed, so the cost of the request does not grow with the
  // number of ranks that are alive. A key added to by a connection that then closed without the
  // key holding "left" is reported at once, `closed`, with the time since the close as `age`: its
  // process exited or was killed.
  struct Stale {
    std::string key;
    std::chrono::milliseconds age{0};
    bool closed = false;
  };
  struct Watched {
    std::vector<std::optional<std::string>> values;
    std::vector<Stale> stale;
  };
  virtual Result<Watched> watch(const std::vector<std::string>& /*keys*/,
                                const std::string& /*prefix*/,
                                std::chrono::milliseconds /*silence*/) {
    return Status::Unsupported("this store cannot report stale keys");
  }
  // add(beat, 1), then watch(keys, prefix, silence), in one request where the store allows (that
  // request waits up to `timeout` for its answer, at least 1 s): a rank's heartbeat and its
  // liveness read (runtime/failure.h).
  virtual Result<Watched> beat_and_watch(const std::string& beat,
                                         const std::vector<std::string>& keys,
                                         const std::string& prefix,
                                         std::chrono::milliseconds silence,
                                         std::chrono::milliseconds /*timeout*/) {
    REFIT_RETURN_IF_ERROR(add(beat, 1).status());
    return watch(keys, prefix, silence);
  }
  // Requests this client sent so far (0 where a store does not count).
  virtual std::int64_t requests() const { return 0; }
  // Whether the server answers within `timeout` (kTimeout when it does not: stopped or hung).
  virtual Status ping(std::chrono::milliseconds /*timeout*/) { return Status::Ok(); }
  // Ends every request in flight (within 100 ms) and every later one with `why` (safe from any
  // thread): the runtime's liveness check found the store's host or a peer gone.
  virtual void abort(const Status& /*why*/) {}
};

// get() that also asks `alive` every 500 ms while it waits: a non-ok Status from it ends the wait
// (the runtime's liveness check: another rank failed, or the store's host is gone), so a rank
// whose peer failed at setup does not wait out the whole timeout.
Result<std::string> get_while_alive(Store& store, const std::string& key,
                                    std::chrono::milliseconds timeout,
                                    const std::function<Status()>& alive);

// Prepends "<prefix>/" to every key of an underlying store it does not own.
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, Store& base) : prefix_(std::move(prefix) + "/"), base_(base) {}
  Status set(const std::string& key, const std::string& value) override;
  Status erase(const std::string& key) override;
  Result<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override;
  Result<std::optional<std::string>> try_get(const std::string& key) override;
  Result<std::vector<std::optional<std::string>>> try_get_many(
      const std::vector<std::string>& keys) override;
  Status wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  Result<std::int64_t> add(const std::string& key, std::int64_t delta) override;
  Result<Watched> watch(const std::vector<std::string>& keys, const std::string& prefix,
                        std::chrono::milliseconds silence) override;
  Result<Watched> beat_and_watch(const std::string& beat, const std::vector<std::string>& keys,
                                 const std::string& prefix, std::chrono::milliseconds silence,
                                 std::chrono::milliseconds timeout) override;
  std::int64_t requests() const override { return base_.requests(); }
  Status ping(std::chrono::milliseconds timeout) override { return base_.ping(timeout); }
  void abort(const Status& why) override { base_.abort(why); }

 private:
  std::string prefix_;
  Store& base_;
};

class ControlAuth;

// Requests and values are bounded: a frame over kMaxControlFrameBytes is dropped by ZeroMQ.
inline constexpr std::int64_t kMaxControlFrameBytes = std::int64_t{64} << 20;
// A ZeroMQ connection that has not completed its handshake (CURVE with the run's keys) within this
// long is closed, on every socket of the control plane (ZMQ_HANDSHAKE_IVL).
inline constexpr std::chrono::milliseconds kZmqHandshakeIvl{10000};
// The listen queue of the store's and the mailboxes' TCP sockets (ZMQ_BACKLOG; the kernel caps it
// at net.core.somaxconn): a burst of ranks starting at once waits there instead of having its
// connection attempts dropped and retried seconds later.
inline constexpr int kZmqBacklog = 4096;

// Connections a store server or a mailbox lets wait for their handshake at once (accepted, not yet
// authenticated); over it, the newest is shut down (control/zmq_monitor.h, PendingHandshakes). A
// store server lets at least its ranks' connections wait (StoreServerOptions::ranks).
inline constexpr int kZmqMaxPendingHandshakes = 256;

// How many connections one rank may hold to the store: its main client (a connection per thread
// that uses it at once), the liveness probe and the heartbeat; a store that takes same-host lanes
// (StoreServerOptions::lane_host_identity) counts one descriptor more per rank.
inline constexpr int kStoreConnectionsPerRank = 4;

struct StoreServerOptions {
  std::string host = "127.0.0.1";  // the address it binds; off loopback only with `auth`
  int port = 0;                    // 0: a free port the system picks (port() says which)
  // With auth (control/auth.h) only clients holding the run secret can connect; keys under
  // "auth/" can be set only once. nullptr: `host` must be a loopback address.
  std::shared_ptr<const ControlAuth> auth;
  // The ranks that will connect: the server makes sure its process may hold their connections
  // (kStoreConnectionsPerRank each, RLIMIT_NOFILE; control/fd_limit.h) or refuses naming the
  // limit. 0: no check.
  int ranks = 0;
  // Connections that may wait for their handshake at once; 0: kZmqMaxPendingHandshakes, or the
  // ranks' connections when there are more.
  int max_pending_handshakes = 0;
  // This host's identity (ControlSettings::host_identity) where same-host lanes are on: the
  // server then also takes heartbeats over lanes from the ranks on its host
  // (control/store_lanes.h). Empty: ZeroMQ only.
  std::string lane_host_identity;
};

class StoreServer {
 public:
  // Binds tcp://host:port and serves on a background thread until destruction. A port another
  // server holds is refused, saying whether it is a ZeroMQ server (another run's store?) or not
  // (torch.distributed's store on MASTER_PORT?).
  static Result<std::unique_ptr<StoreServer>> start(const StoreServerOptions& options);
  static Result<std::unique_ptr<StoreServer>> start(const std::string& host, int port,
                                                    std::shared_ptr<const ControlAuth> auth) {
    return start(StoreServerOptions{.host = host, .port = port, .auth = std::move(auth)});
  }
  virtual ~StoreServer() = default;
  virtual int port() const = 0;
  // Connections refused so far: handshakes that failed (no run secret, another one, not
  // ZeroMQ), accepts that failed (out of file descriptors).
  virtual std::int64_t refused() const = 0;
  // The most connections that waited for their handshake at once.
  virtual int pending_high_water() const = 0;
  // Ok, or the error that stops the store from serving every rank: out of file descriptors, a
  // connection it could not accept ("too many open files: this process's RLIMIT_NOFILE is N").
  // Trainer rank 0, which hosts the store, fails with it (its liveness check).
  virtual Status failure() const = 0;
  // The keys the liveness reads (kWatch) looked at so far: the heartbeats that stood still and
  // the ranks that left, not every live rank's heartbeat.
  virtual std::int64_t watch_visits() const = 0;
  // Requests answered over same-host lanes so far (heartbeats and liveness reads), and where its
  // lanes' gate listens (what a ping answers: lane::publish_address; empty without lanes).
  virtual std::int64_t lane_requests() const = 0;
  virtual std::string lane_address() const = 0;
};

struct StoreClientOptions {
  std::string host = "127.0.0.1";
  int port = 0;
  // How long the first contact may take, retried meanwhile: the server may start after the
  // client, and under a burst of ranks starting at once it answers late (refit.timeout_s).
  std::chrono::milliseconds connect_timeout{60000};
  // Each later request that does not wait for keys (set, try_get, add); at least 1 s.
  std::chrono::milliseconds request_timeout{60000};
  // With auth, the connection is CURVE-authenticated both ways with the run's keys.
  std::shared_ptr<const ControlAuth> auth;
  // With an id (1 to 255 bytes: the rank's name in the store's log lines) and this host's
  // identity (ControlSettings::host_identity, where same-host lanes are on): the client's
  // heartbeats and liveness reads (add, beat_and_watch, watch) take a lane to the store's
  // process when it runs on this host (control/store_lanes.h), and ZeroMQ when there is none or
  // it breaks. Every other request takes ZeroMQ.
  std::string lane_id;
  std::string lane_host_identity;
};

// Connects to a StoreServer, then fails naming the address and what was found there: nothing
// listening, another server (not a refit store), a refit store that refused this process's keys
// (another run secret, or none), or one that did not answer in time.
Result<std::unique_ptr<Store>> connect_store(const StoreClientOptions& options);
// connect_timeout = request_timeout = `timeout` (at least 1 s for requests).
Result<std::unique_ptr<Store>> connect_store(const std::string& host, int port,
                                             std::chrono::milliseconds timeout,
                                             std::shared_ptr<const ControlAuth> auth);

}  // namespace refit
