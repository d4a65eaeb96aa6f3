// Adapts a refit::Store to gloo::rendezvous::Store, the interface Gloo's rendezvous uses.
//
// Gloo signals failures by throwing, so a failed refit call becomes a gloo::IoException; the
// original Status (with its code) is kept and can be read back with last_error() at the boundary
// that catches the exception. get() waits at most `timeout` (Gloo's get has no timeout of its
// own). While a get or wait blocks, `alive` (when set) is asked every 500 ms and a non-ok Status
// from it ends the wait. Not thread-safe beyond what the wrapped Store offers; used by one
// rendezvous at a time.
#pragma once

#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "control/store.h"

namespace refit::gloo_backend {

class GlooStoreAdapter final : public ::gloo::rendezvous::Store {
 public:
  // `store` must outlive the adapter.
  GlooStoreAdapter(refit::Store& store, std::chrono::milliseconds timeout,
                   std::function<Status()> alive = {})
      : store_(store), timeout_(timeout), alive_(std::move(alive)) {}

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  // The first failure seen, or ok.
  Status last_error() const;

 private:
  [[noreturn]] void fail(const Status& status);

  refit::Store& store_;
  const std::chrono::milliseconds timeout_;
  const std::function<Status()> alive_;
  mutable std::mutex mu_;
  Status first_error_;
};

// Gloo's TCP addresses are a sockaddr_storage that holds stack bytes past the address getsockname
// wrote. Zeroes those bytes (and sin_zero) in place in a list of such addresses, so that no
// uninitialised memory leaves the process (a group's connect publishes each address scrubbed); a
// value that is not such a list is left unchanged.
void scrub_tcp_addresses(std::string& value);

}  // namespace refit::gloo_backend
