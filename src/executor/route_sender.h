// The trainer side of the transfer plan (executor/routes.h): one trainer rank's routes to the
// engine ranks it feeds, moved by peer access or point-to-point, chosen per engine rank at every
// refit. Driven by the trainer's thread; owns its staging buffer and its mappings of engines'
// exported parameters.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "plane/data_plane.h"
#include "common/fault.h"
#include "executor/applier.h"
#include "control/messages.h"
#include "executor/routes.h"

namespace refit {

class Communicator;
class Mailbox;

struct RouteSenderOptions {
  const Config* config = nullptr;
  int rank = 0;
  const RouteSetup* setup = nullptr;
  Mailbox* mailbox = nullptr;
  DataPlane* plane = nullptr;
  Communicator* p2p = nullptr;           // null when no point-to-point group exists
  std::vector<int> targets;              // control_targets(plan, rank)
  std::vector<bool> target_same_host;    // per entry of targets
};

// Seconds per stage of the last transfer.
struct RouteTimes {
  double cast_pack = 0;  // peer copies (cast fused) and packing of p2p segments
  double transfer = 0;   // p2p sends
};

class RouteSender {
 public:
  static Result<std::unique_ptr<RouteSender>> create(const RouteSenderOptions& options);

  // Mailbox ids of the engines this rank talks to ("engine/<g>").
  const std::vector<std::string>& engine_ids() const { return ids_; }

  // Begins the refit on every target, waits until each has paused, then moves every route of
  // this rank (cast to the target precision; `raw`: the same bytes without a cast, bench).
  // `shards` are the registered local tensors. Returns when every byte left this rank; the
  // caller then commits.
  Status transfer(const BeginMessage& begin, const std::vector<void*>& shards, const Fault& fault,
                  RouteTimes& times);
  // The registered storage changed: copy lists are rebuilt at the next transfer.
  void invalidate() {
    peer_runs_.clear();
    pack_runs_.clear();
    send_ops_.clear();
  }

  // Of the last transfer: bytes this rank moved, and how many targets each executor served.
  std::int64_t bytes_sent() const { return bytes_sent_; }
  int peer_targets() const { return peer_targets_; }
  int p2p_targets() const { return p2p_targets_; }

 private:
  explicit RouteSender(const RouteSenderOptions& o);
  Status map_engine(std::size_t i, const ExportedParams& direct);
  void build_peer_runs(const std::vector<void*>& shards);
  void build_pack_runs(const std::vector<void*>& shards);
  Status run_p2p(const BeginMessage& begin, const std::vector<void*>& shards, const Fault& fault,
                 RouteTimes& times);

  // An engine rank's parameters as mapped here: the exported region(s) and each parameter's
  // address. `key` identifies what was exported (remapped when it changes).
  struct Mapped {
    std::string key;
    std::vector<std::unique_ptr<PlaneBuffer>> memory;
    std::vector<std::byte*> params;
  };

  RouteSenderOptions o_;
  std::vector<std::string> ids_;
  std::vector<PairExecutor> modes_;           // per target, of the current refit
  std::vector<PairExecutor> runs_built_for_;  // modes the copy lists were built for
  std::map<std::size_t, Mapped> mapped_;      // target index -> its exported parameters
  std::vector<CopyRun> peer_runs_;
  std::vector<std::vector<CopyRun>> pack_runs_;  // per round (p2p targets only)
  std::vector<std::vector<P2POp>> send_ops_;     // per round
  // num_buffers staging slots; rounds with sends rotate over them, so packing round k+1 overlaps
  // sending round k (on sender_, the one thread that drives the p2p group during a refit).
  std::vector<std::unique_ptr<PlaneBuffer>> staging_;
  Applier sender_;
  double send_seconds_ = 0;  // written on sender_'s thread, read after it drained
  std::int64_t bytes_sent_ = 0;
  int peer_targets_ = 0, p2p_targets_ = 0;
};

}  // namespace refit
