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
#include "executor/delta_routes.h"
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
  // refit.delta: the bases this rank offers — per feeder whose pair it holds complete of the
  // weight version it holds, moved by the executor the pair uses now, with no failure since: the
  // digest of what it holds from it (point to point), or its trust (peer access).
  void offer_delta(const BeginMessage& begin, const std::optional<std::string>& held,
                   PausedMessage& answer) override;
  void refit_failed() override {
    for (DeltaSource& d : delta_) d.version.clear();
  }
  Result<bool> replay_deltas(const std::vector<void*>& params) override;
  bool checksums() const override { return true; }
  bool can_recover() const override { return true; }
  // The registered storage changed: what it holds is not what any feeder sent, so no base of a
  // delta is held either.
  void invalidate() override {
    runs_.clear();
    checksum_runs_.clear();
    replay_routes_.clear();
    refit_failed();
  }
  Result<std::uint64_t> checksum_from(std::size_t i, const std::vector<void*>& params) override;
  // A refit that failed in flight: no base of a delta is held any more.
  Status recover(Communicator* p2p, std::chrono::milliseconds timeout) override {
    REFIT_RETURN_IF_ERROR(applier_.reset(timeout));
    o_.p2p = p2p;
    p2p_connected_ = false;
    refit_failed();
    return Status::Ok();
  }
  // Bytes that reached this rank (received point-to-point, delta streams as received, plus what
  // peer feeders wrote in full per the plan), the sources each executor served, and what the
  // deltas did.
  RankTraffic traffic() const override {
    RankTraffic t = delta_traffic_;
    t.role = "engine";
    t.rank = o_.engine_rank;
    t.bytes_received = bytes_received_;
    t.peer_pairs = peer_sources_;
    t.p2p_pairs = p2p_sources_;
    t.setup_seconds = setup_seconds_;
    t.plan_bytes = static_cast<std::int64_t>(o_.setup->view.heap_bytes());
    return t;
  }
  double apply_seconds() const override { return apply_seconds_; }

 private:
  explicit RouteReceiver(const RouteReceiverOptions& o);
  Status build(const std::vector<void*>& params);
  // Whether this rank keeps what its sources send (refit.delta on or auto).
  bool tracks() const { return o_.config->refit.delta != DeltaMode::kOff; }
  Status apply_round(std::size_t round);
  Status receive_rounds(int step, bool raw, const std::vector<void*>& params);

  RouteReceiverOptions o_;
  std::vector<RankId> feeders_;
  std::vector<PairExecutor> modes_;
  std::vector<PairExecutor> built_for_;
  std::vector<std::unique_ptr<PlaneBuffer>> slots_;
  std::vector<std::vector<P2POp>> recv_ops_;                 // per round
  bool p2p_connected_ = false;  // its rounds' pairs, on o_.p2p (receive_rounds)
  std::vector<std::vector<CopyRun>> runs_;                   // per round: slot -> parameters
  std::map<int, std::vector<ChecksumGroup>> checksum_runs_;  // per trainer rank (refit.checksum)
  // refit.delta, per source: what this rank holds of what it sent (docs/delta.md, "State").
  struct DeltaSource {
    std::vector<PairDeltaRoutes> rounds;  // per round, its routes into the parameters
    std::vector<std::uint64_t> digest;    // per round (point-to-point sources)
    std::vector<DeltaLog> logs;           // per round, refit.staged: what its apply wrote
    std::string version;                  // the weight version they belong to; "" for none
    PairExecutor by = PairExecutor::kP2p;
    bool offered = false;  // this refit's pause answer offered its base (point to point: a word
                           // precedes each round's bytes)
    int use = -1;          // this refit: 1 a delta arrived, 0 in full, -1 not known yet
  };
  std::vector<DeltaSource> delta_;
  std::vector<int> built_offers_;  // per source, whether the rounds were laid out for an offer
  // Per round, per point-to-point source offered a base: the word that says what follows (a
  // stream's size, or kDeltaFullSegment), received first; the slot region (a stream, or the
  // segment in full); and the scatter of the segment when it comes in full.
  struct DeltaRecv {
    std::size_t source = 0;
    std::byte* stream = nullptr;
    std::size_t capacity = 0;    // the most a stream of its routes there takes
    std::size_t full_bytes = 0;  // the round's segment in full
    std::byte* size_word = nullptr;
    std::size_t op = 0;         // its entry in recv_ops_[round]
    std::size_t bytes = 0;      // of this refit's stream
    bool full = false;          // this refit: the segment came in full
    std::vector<CopyRun> runs;  // slot -> parameters, for a segment in full
  };
  std::vector<std::vector<P2POp>> size_ops_;
  std::vector<std::vector<DeltaRecv>> delta_recvs_;
  std::vector<std::vector<std::size_t>> digest_after_;    // sources kept, not offered
  std::vector<std::unique_ptr<PlaneBuffer>> size_words_;  // per slot, 8 bytes per source
  RankTraffic delta_traffic_;                             // written on the apply thread
  // refit.staged: whether the last refit's applies logged what they wrote (replay_deltas).
  bool logging_ = false;
  // replay_deltas' routes: per source, per round, into the parameters it was last given.
  std::vector<std::vector<PairDeltaRoutes>> replay_routes_;
  std::vector<void*> replay_params_;
  std::int64_t bytes_received_ = 0;
  std::vector<int> last_in_full_;  // the sources the last refit's log line named (receive)
  int peer_sources_ = 0, p2p_sources_ = 0;
  double apply_seconds_ = 0;  // written on the apply thread
  Applier applier_;
};

}  // namespace refit
