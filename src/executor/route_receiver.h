// The engine side of the transfer plan (executor/routes.h; an EngineExecutor, executor.h): which
// trainer ranks feed this engine rank by which executor, and the point-to-point rounds — receive
// each round's segments into a staging slot, scatter them into the parameters on the apply
// thread. Peer-access feeders write the parameters themselves; nothing runs here for them.
// Driven by the engine's thread.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "executor/applier.h"
#include "executor/executor.h"
#include "executor/routes.h"
#include "plane/data_plane.h"

namespace refit {

struct RouteReceiverOptions {
  const Config* config = nullptr;
  int engine_rank = 0;
  std::string who;  // "engine I tp rank T", for errors
  const RouteSetup* setup = nullptr;
  DataPlane* plane = nullptr;
  Communicator* p2p = nullptr;         // null when no point-to-point group exists
  std::vector<int> sources;            // control_sources(setup)
  std::vector<bool> source_same_host;  // per entry of sources
  IncomingRoutes incoming;             // what arrives point-to-point (incoming_from_view)
};

class RouteReceiver final : public EngineExecutor {
 public:
  static Result<std::unique_ptr<RouteReceiver>> create(const RouteReceiverOptions& options);

  const std::vector<RankId>& feeders() const override { return feeders_; }
  bool pause_handshake() const override { return true; }
  std::string plan_hash() const override { return o_.setup->view.identity_hex(); }
  std::string routes_digest(std::size_t i) const override;
  // SGLang protocol: each feeder says which routes it will send here, and those are what this
  // rank receives and places (its own derivation of the plan only names the feeders).
  bool wants_routes() const override {
    return o_.config->generation.backend == EngineProtocol::kSglang;
  }
  Status take_routes(const std::vector<RoutesMessage>& per_feeder) override;
  // Whether our parameters are exported decides every pair's executor (errors naming the pair
  // and the fix).
  Status prepare(bool params_exported) override;
  // Peer feeders write the parameters themselves; point-to-point segments arrive here and are
  // scattered on the apply thread. Returns once every round was applied.
  Status receive(const BeginMessage& begin, const std::vector<void*>& params) override;
  bool checksums() const override { return true; }
  bool can_recover() const override { return true; }
  void invalidate() override {
    runs_.clear();
    checksum_runs_.clear();
  }
  Result<std::uint64_t> checksum_from(std::size_t i, const std::vector<void*>& params) override;
  Status recover(Communicator* p2p, std::chrono::milliseconds timeout) override {
    REFIT_RETURN_IF_ERROR(applier_.reset(timeout));
    o_.p2p = p2p;
    return Status::Ok();
  }
  // Bytes that reached this rank (received point-to-point, plus what peer feeders wrote per the
  // plan), and the sources each executor served.
  RankTraffic traffic() const override {
    return RankTraffic{.role = "engine",
                       .rank = o_.engine_rank,
                       .bytes_received = bytes_received_,
                       .peer_pairs = peer_sources_,
                       .p2p_pairs = p2p_sources_,
                       .setup_seconds = setup_seconds_,
                       .plan_bytes = static_cast<std::int64_t>(o_.setup->view.heap_bytes())};
  }
  double apply_seconds() const override { return apply_seconds_; }

 private:
  explicit RouteReceiver(const RouteReceiverOptions& o);
  Status build(const std::vector<void*>& params);
  Status receive_rounds(int step, bool raw, const std::vector<void*>& params);

  RouteReceiverOptions o_;
  std::vector<RankId> feeders_;
  std::vector<PairExecutor> modes_;
  std::vector<PairExecutor> built_for_;
  std::vector<std::unique_ptr<PlaneBuffer>> slots_;
  std::vector<std::vector<P2POp>> recv_ops_;  // per round
  std::vector<std::vector<CopyRun>> runs_;    // per round: slot -> parameters
  std::map<int, std::vector<ChecksumGroup>> checksum_runs_;  // per trainer rank (refit.checksum)
  std::int64_t bytes_received_ = 0;
  int peer_sources_ = 0, p2p_sources_ = 0;
  double apply_seconds_ = 0;  // written on the apply thread
  Applier applier_;
};

}  // namespace refit
