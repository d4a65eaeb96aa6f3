// The collectives refit needs, behind one interface: Gloo on CPU (comm/gloo), NCCL on GPU
// (comm/nccl).
//
// A Communicator is a fixed group of `size()` processes. Every call is collective: all members
// call it in the same order with matching sizes. Calls are bounded by the timeout given at
// creation and return a Status naming the operation, this rank and (where known) the peer;
// they never hang. Not thread-safe: one thread drives a communicator at a time, except abort(),
// which may be called from any thread to make pending and future calls fail promptly.
#pragma once

#include <chrono>
#include <functional>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "refit/status.h"

namespace refit {

class Store;

// One point-to-point transfer of an exchange (Communicator::exchange).
struct P2POp {
  enum class Kind { kSend, kRecv };
  Kind kind = Kind::kSend;
  int peer = 0;           // group rank of the other side
  void* buf = nullptr;    // send: read from; recv: written to
  std::size_t bytes = 0;
};

// The peers of a plan's rounds that exchange bytes (rounds[k] not empty), with those of the size
// words sent ahead of them (size_ops[k], where there is one): what a rank passes to
// Communicator::connect before its first exchange.
inline std::vector<int> round_peers(const std::vector<std::vector<P2POp>>& rounds,
                                    const std::vector<std::vector<P2POp>>& size_ops) {
  std::vector<int> peers;
  for (std::size_t k = 0; k < rounds.size(); ++k) {
    if (rounds[k].empty()) continue;  // such a round exchanges nothing, its size words included
    for (const P2POp& op : rounds[k]) peers.push_back(op.peer);
    if (k < size_ops.size())
      for (const P2POp& op : size_ops[k]) peers.push_back(op.peer);
  }
  return peers;
}

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view backend() const = 0;  // "gloo", "nccl"

  // Rank r contributes `counts[r]` bytes from `send` (send may be null when counts[rank()] is 0);
  // `recv` receives sum(counts) bytes, rank-major. counts must be identical on every rank.
  virtual Status all_gather_v(const void* send, void* recv,
                              const std::vector<std::size_t>& counts) = 0;
  // `bytes` from `root`'s buf into every other member's buf.
  virtual Status broadcast(void* buf, std::size_t bytes, int root) = 0;
  virtual Status barrier() = 0;
  // Point-to-point: posts every op at once and returns when all completed. Not collective: only
  // the peers named take part. Between two ranks, the k-th send of one matches the k-th receive
  // of the other (over all exchanges), with equal sizes.
  virtual Status exchange(const std::vector<P2POp>& ops) = 0;
  // Connects this rank's pairs with `peers` now, where the group connects its pairs on first use
  // (GlooOptions::connect_on_first_use); no-op where they are connected already. Not collective:
  // each peer connects its side of the pair in its own connect() or exchange(). Both sides of a
  // pair must connect it in corresponding calls (GlooOptions::connect_on_first_use says why): a
  // rank that exchanges with several peers calls this once with all of them before its first
  // exchange, and its peers do the same.
  virtual Status connect(const std::vector<int>& /*peers*/) { return Status::Ok(); }
  virtual void abort() = 0;
};

struct GlooOptions {
  std::string name;  // group name; namespaces its keys in the store ("update", "trainer")
  int rank = 0;
  int size = 1;
  std::string hostname = "127.0.0.1";  // address this rank listens on for its peers
  // Bounds every wait; a transfer split into chunks gets it per chunk.
  std::chrono::milliseconds timeout{60000};
  // Broadcasts and all-gathers above this many bytes are split into chunks of at most this size.
  std::size_t max_chunk_bytes = std::size_t{1} << 30;
  // Asked every 500 ms while the rendezvous waits for peers' keys; a non-ok Status ends the wait
  // (a peer failed at setup). Null: wait out the timeout.
  std::function<Status()> liveness;
  // The members this rank connects to, for a group used only point to point (exchange); nullopt
  // connects every member (a full mesh). The relation must be symmetric: a rank lists a peer
  // exactly when that peer lists it. Collectives then fail, and so does an exchange with a member
  // not listed, naming it.
  std::optional<std::vector<int>> peers;
  // With `peers`: the group connects a pair when it is first used (connect() or exchange()), not
  // when it is formed. A group none of whose pairs is ever used opens no socket and runs no Gloo
  // event loop (a thread that wakes every 10 ms). Each call publishes, per new pair, the address
  // it listens on for that peer (key "gloo/<name>/pair/<rank>/<peer>"), all of them before it
  // waits for any peer's, then connects them in ascending peer order. Gloo makes one side of a
  // pair initiate (it connects without waiting for its peer) and the other wait for it. Rank a
  // waits for peer b only while b is stuck on a pair with a peer below a, so, provided both
  // sides of every pair connect it in corresponding calls (the k-th call of each that names the
  // other; the executors connect all of a refit's new pairs in one call per rank), no ranks can
  // wait on each other in a cycle. Pairs split over calls that do not correspond can: rank r
  // connecting r+1 first and r+2 second, of three ranks, waits forever.
  bool connect_on_first_use = false;
};

// Forms a Gloo group through `store` (keys under "gloo/<name>/"). Errors name the group and rank.
// A group name is used once per store: its rendezvous keys are not cleaned up.
// Gloo's TCP transport reports a dead peer as EPIPE only when SIGPIPE is ignored, so the first
// call sets SIGPIPE to SIG_IGN if it still has its default action.
// abort() marks the communicator aborted, closes its connections (peers' pending and later calls
// fail with kIOError "connection closed/reset" instead of waiting out their timeout), then wakes
// the call pending on this rank, which returns kAborted; later calls fail at once with kAborted.
// After any failure the group is unusable: later calls return the first cause at once.
Result<std::unique_ptr<Communicator>> make_gloo_communicator(Store& store,
                                                             const GlooOptions& options);

}  // namespace refit
