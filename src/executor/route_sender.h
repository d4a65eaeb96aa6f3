// The trainer side of the transfer plan (executor/routes.h; a TrainerExecutor, executor.h): one
// trainer rank's routes to the engine ranks it feeds, moved by peer access or point-to-point,
// chosen per engine rank at every refit. Driven by the trainer's thread; owns its staging buffer
// and its mappings of engines' exported parameters.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "control/messages.h"
#include "executor/applier.h"
#include "executor/delta_sender.h"
#include "executor/executor.h"
#include "executor/routes.h"
#include "executor/trainer_scales.h"
#include "plane/data_plane.h"

namespace refit {

class Communicator;

struct RouteSenderOptions {
  const Config* config = nullptr;
  int rank = 0;
  const RouteSetup* setup = nullptr;
  DataPlane* plane = nullptr;
  Communicator* p2p = nullptr;           // null when no point-to-point group exists
  Communicator* trainer_group = nullptr;  // FP8 scales are combined over it (null: one rank)
  std::vector<int> targets;               // control_targets(setup)
  std::vector<bool> target_same_host;    // per entry of targets
};

class RouteSender final : public TrainerExecutor {
 public:
  static Result<std::unique_ptr<RouteSender>> create(const RouteSenderOptions& options);

  const std::vector<RankId>& targets() const override { return targets_; }
  const std::vector<RankId>& answers_from() const override { return all_engines_; }
  std::string plan_hash() const override { return o_.setup->view.identity_hex(); }
  int rounds() const override { return o_.setup->view.rounds; }
  // SGLang protocol: the metadata of every route travels to its engine rank (once).
  std::optional<RoutesMessage> routes_for(std::size_t i) const override;
  // The target's digest of the pair's routes must equal this rank's (setup: transfer plan
  // mismatch, naming both ranks).
  Status check_hello(std::size_t i, const HelloMessage& hello) const override;
  // The digest of target i's export this rank holds, so that the target answers without it.
  std::string_view export_held(std::size_t i) const override;
  // FP8: every scale, before any engine pauses (a non-finite block refuses the refit here, on
  // every trainer rank alike, and nothing moves).
  Status before_begin(const BeginMessage& begin, const std::vector<void*>& shards,
                      TransferTimes& times) override;
  // The targets' exports: what each target's pair executor and mapping use; refit.delta: each
  // target's offer of a base (decided on in send, once the pair's executor is known).
  Status take_answers(std::vector<PausedMessage>& answers) override;
  // Moves every route of this rank (cast to the target precision; `raw`: the same bytes without
  // a cast, bench), choosing each target's executor from what it exported.
  Status send(const BeginMessage& begin, const std::vector<void*>& shards,
              TransferTimes& times) override;
  bool checksums() const override { return true; }
  bool can_recover() const override { return true; }
  void invalidate() override {
    peer_runs_.clear();
    pack_runs_.clear();
    send_ops_.clear();
    delta_.invalidate();
    peer_built_ = false;
    checksum_runs_.clear();
  }
  Result<std::uint64_t> checksum_to(std::size_t i, const std::vector<void*>& shards) override;
  // A refit that failed in flight: what the kept copies hold may not have reached the engines.
  Status recover(Communicator* p2p, std::chrono::milliseconds timeout) override {
    REFIT_RETURN_IF_ERROR(sender_.reset(timeout));
    o_.p2p = p2p;
    p2p_connected_ = false;
    delta_.forget();
    return Status::Ok();
  }
  // Bytes this rank moved in the last transfer (delta streams as sent), how many targets each
  // executor served, and what the deltas did.
  RankTraffic traffic() const override {
    RankTraffic t = delta_.traffic();
    t.role = "trainer";
    t.rank = o_.rank;
    t.bytes_sent = bytes_sent_;
    t.peer_pairs = peer_targets_;
    t.p2p_pairs = p2p_targets_;
    t.setup_seconds = setup_seconds_;
    t.plan_bytes = static_cast<std::int64_t>(o_.setup->view.heap_bytes());
    return t;
  }

 private:
  explicit RouteSender(const RouteSenderOptions& o);
  Status resolve_export(std::size_t i, PausedMessage& answer);
  Status map_engine(std::size_t i, const ExportedParams& direct);
  Status build_peer_runs(const std::vector<void*>& shards);
  Result<std::vector<const std::byte*>> pack_peer_segments(std::size_t i,
                                                           const std::vector<void*>& shards);
  Status build_pack_runs(const std::vector<void*>& shards);
  void add_pack_runs(const PairPlan& pair, const std::vector<void*>& shards,
                     const std::vector<std::byte*>& dst, const std::vector<std::int64_t>& base,
                     const std::vector<RouteCopies*>& runs) const;
  Status run_p2p(const BeginMessage& begin, const std::vector<void*>& shards, TransferTimes& times);

  // An engine rank's parameters as mapped here: the exported region(s) and each parameter's
  // address. `key` identifies what was exported (remapped when it changes).
  struct Mapped {
    std::string key;
    std::vector<std::unique_ptr<PlaneBuffer>> memory;
    std::vector<std::byte*> params;
  };

  RouteSenderOptions o_;
  std::vector<RankId> targets_;
  std::vector<RankId> all_engines_;  // each answers every begin here
  std::vector<PairExecutor> modes_;           // per target, of the current refit
  std::vector<PairExecutor> runs_built_for_;  // modes the copy lists were built for
  std::map<std::size_t, Mapped> mapped_;      // target index -> its exported parameters
  // Per target: the last export it sent whole (its answers then leave it out; resolve_export).
  std::vector<std::optional<ExportedParams>> held_;
  RouteCopies peer_runs_;
  // refit.delta with FP8: each kept peer pair's routes packed into its segments (peer_segments_,
  // by target index), which its patch or capture reads.
  RouteCopies peer_pack_runs_;
  std::map<std::size_t, std::unique_ptr<PlaneBuffer>> peer_segments_;
  std::vector<CopyRun> peer_segment_copies_;  // those sent in full: their segments, as bytes
  std::int64_t peer_packed_bytes_ = 0;        // the plan's bytes of the pairs packed
  std::map<std::size_t, std::vector<ChecksumGroup>> checksum_runs_;  // per target index
  std::vector<RouteCopies> pack_runs_;                               // per round (p2p targets only)
  std::unique_ptr<TrainerScales> scales_;                            // FP8 only
  std::vector<void*> all_shards_;             // the caller's shards, then the FP8 scale tensors
  std::vector<std::vector<P2POp>> send_ops_;  // per round
  bool p2p_connected_ = false;  // its rounds' pairs, on o_.p2p (run_p2p)
  DeltaSender delta_;                         // refit.delta (docs/delta.md, "Wiring")
  bool peer_built_ = false;                   // peer_runs_ and the peer targets' delta lists
  // num_buffers staging slots; rounds with sends rotate over them, so packing round k+1 overlaps
  // sending round k (on sender_, the one thread that drives the p2p group during a refit).
  std::vector<std::unique_ptr<PlaneBuffer>> staging_;
  Applier sender_;
  double send_seconds_ = 0;  // written on sender_'s thread, read after it drained
  std::int64_t bytes_sent_ = 0;
  int peer_targets_ = 0, p2p_targets_ = 0;
};

}  // namespace refit
