// The engine side of the transfer plan (executor/routes.h): which trainer ranks feed this engine
// rank by which executor, and the point-to-point rounds — receive each round's segments into a
// staging slot, scatter them into the parameters on the apply thread. Peer-access feeders write
// the parameters themselves; nothing runs here for them. Driven by the engine's thread.
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "executor/applier.h"
#include "plane/data_plane.h"
#include "common/fault.h"
#include "executor/routes.h"

namespace refit {

struct RouteReceiverOptions {
  const Config* config = nullptr;
  int engine_rank = 0;
  const RouteSetup* setup = nullptr;
  DataPlane* plane = nullptr;
  Communicator* p2p = nullptr;        // null when no point-to-point group exists
  std::vector<int> sources;           // control_sources(plan, engine_rank)
  std::vector<bool> source_same_host; // per entry of sources
  IncomingRoutes incoming;            // what arrives point-to-point (incoming_from_plan)
};

class RouteReceiver {
 public:
  static Result<std::unique_ptr<RouteReceiver>> create(const RouteReceiverOptions& options);

  // Decides every source's executor for this refit (the trainer side decides the same from the
  // pause answer). Errors name the pair and the fix.
  Status choose(bool params_exported);
  // Receives every point-to-point segment of the refit and posts its scatter into `params` (the
  // registered parameters) to `applier`; with `raw` nothing is applied. Returns when the last
  // segment arrived; the caller drains the applier.
  Status receive(int step, bool raw, const std::vector<void*>& params, Applier& applier,
                 const Fault& fault);
  void invalidate() { runs_.clear(); }
  // SGLang protocol: the routes as the trainer ranks' metadata says (replaces the plan's).
  void set_incoming(IncomingRoutes incoming) {
    o_.incoming = std::move(incoming);
    runs_.clear();
    slots_.clear();
  }

  // Of the last refit: bytes that reached this rank (received point-to-point, plus what peer
  // feeders wrote per the plan), and the sources each executor served.
  std::int64_t bytes_received() const { return bytes_received_; }
  int peer_sources() const { return peer_sources_; }
  int p2p_sources() const { return p2p_sources_; }
  // Seconds the apply thread spent scattering the last refit's segments (valid after a drain).
  double apply_seconds() const { return apply_seconds_; }

 private:
  explicit RouteReceiver(const RouteReceiverOptions& o) : o_(o) {}
  Status build(const std::vector<void*>& params);

  RouteReceiverOptions o_;
  std::vector<PairExecutor> modes_;
  std::vector<PairExecutor> built_for_;
  std::vector<std::unique_ptr<PlaneBuffer>> slots_;
  std::vector<std::vector<P2POp>> recv_ops_;    // per round
  std::vector<std::vector<CopyRun>> runs_;      // per round: slot -> parameters
  std::int64_t bytes_received_ = 0;
  int peer_sources_ = 0, p2p_sources_ = 0;
  double apply_seconds_ = 0;  // written on the apply thread
};

}  // namespace refit
