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
  Result<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override;
  Result<std::optional<std::string>> try_get(const std::string& key) override;
  Result<std::vector<std::optional<std::string>>> try_get_many(
      const std::vector<std::string>& keys) override;
  Status wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  Result<std::int64_t> add(const std::string& key, std::int64_t delta) override;
  Status ping(std::chrono::milliseconds timeout) override { return base_.ping(timeout); }
  void abort(const Status& why) override { base_.abort(why); }

 private:
  std::string prefix_;
  Store& base_;
};

class ControlAuth;

// Requests and values are bounded: a frame over kMaxControlFrameBytes is dropped by ZeroMQ.
inline constexpr std::int64_t kMaxControlFrameBytes = std::int64_t{64} << 20;

class StoreServer {
 public:
  // Binds tcp://host:port (port 0 = an ephemeral port) and serves on a background thread until
  // destruction. With `auth` (control/auth.h) only clients holding the run secret can connect; keys
  // under "auth/" can be set only once. Without it, `host` must be a loopback address.
  static Result<std::unique_ptr<StoreServer>> start(const std::string& host, int port,
                                                    std::shared_ptr<const ControlAuth> auth);
  virtual ~StoreServer() = default;
  virtual int port() const = 0;
};

// Connects to a StoreServer. Retries the connection until `connect_timeout` runs out (the server
// may start after the client), then fails naming the address.
// With `auth`, the connection is CURVE-authenticated both ways with the run's keys.
Result<std::unique_ptr<Store>> connect_store(const std::string& host, int port,
                                             std::chrono::milliseconds connect_timeout,
                                             std::shared_ptr<const ControlAuth> auth);

}  // namespace refit
