// refit::Trainer: one trainer rank. It sets the rank up — its core (runtime/rank_core.h; rank 0
// hosts the store), the trainer group, the executor that moves the bytes of each refit from the
// caller's registered shards (executor/executor.h) — and runs each refit through its protocol
// (runtime/trainer_protocol.h), between the trainer group's barriers.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string_view>

#include "common/log.h"
#include "common/timer.h"
#include "control/messages.h"
#include "executor/gather_sender.h"
#include "executor/route_sender.h"
#include "executor/routes.h"
#include "refit/session.h"
#include "runtime/agreement.h"
#include "runtime/create.h"
#include "runtime/rank_core.h"
#include "runtime/slots.h"
#include "runtime/traffic.h"
#include "runtime/trainer_protocol.h"
#include "weights/setup.h"

namespace refit {
namespace {

// What a trainer rank's view of the transfer plan holds, for the setup log.
std::string plan_view_line(const RouteSetup& routes) {
  const PlanView& v = routes.view;
  std::size_t blocks = 0;  // the rectangles the routes stand for (a compact route: its count)
  for (const PairPlan& p : v.pairs)
    for (const Route& r : p.routes) blocks += static_cast<std::size_t>(r.count);
  return fmt::format(
      "transfer plan {}: this rank sends {} routes ({} blocks) to {} engine rank(s) in {} "
      "round(s); its view holds {} bytes, derived in {:.3f} s",
      v.identity_hex(), v.routes(), blocks, v.pairs.size(), v.rounds, v.heap_bytes(),
      routes.seconds);
}

class TrainerImpl final : public Trainer {
 public:
  TrainerImpl(const Config& cfg, RankId self, const Endpoint& ep, RankServices services)
      : core_(cfg, self, ep, std::move(services)) {}
  ~TrainerImpl() override { core_.stop_watching(); }  // before the executor goes

  // create_trainer: the model and this rank's shards, the shared core (rank 0 starts the store),
  // the versions, the trainer group, the executor, and every engine's hello.
  Status init() {
    return core_.set_up([this] { return setup(); });
  }

  const std::vector<TensorSlot>& tensors() const override { return shards_.slots(); }

  Status register_tensor(const std::string& name, void* data, DType dtype,
                         const std::vector<std::int64_t>& shape) override {
    if (Status st = shards_.add(name, data, dtype, shape); !st.ok()) {
      core_.note_error(st);  // named by the peers should this process go before fixing it
      return st;
    }
    // Copy lists hold the registered addresses: rebuild them at the next refit.
    executor_->invalidate();
    return Status::Ok();
  }

  // A refit whose bytes all moved but did not arrive intact or failed verification (a checksum
  // mismatch, a failed verification hook) fails on every trainer rank with the same message and
  // leaves the session usable: it does not go through the latch, and the next refit() runs. So
  // does one an engine rank refused before any byte moved, and one that failed in flight with
  // every rank alive (docs/runtime.md, "A refit that fails in flight"): every rank returns the
  // cause recorded first, and forms its groups anew.
  Status refit(int step, const std::string& version, bool verify) override {
    // The same on every trainer rank (each saw the same refits succeed): refused before any
    // message, and the session goes on.
    if (auto it = published_.find(version); it != published_.end())
      return Status::InvalidArgument(fmt::format(
          "{}: refit step {} would publish weight version '{}', which refit step {} already "
          "published for other weights; every refit that succeeds needs a version of its own (a "
          "retry of a failed refit may reuse its step)",
          core_.id(), step, version, it->second));
    Status failed;
    Status st = core_.guarded([&]() -> Status {
      REFIT_RETURN_IF_ERROR(shards_.check());
      Status body = pass(BeginMessage{.step = step, .version = version, .verify = verify}, failed);
      if (body.ok()) return body;
      std::optional<Status> in_flight = failed_in_flight(step, version, body);
      if (!in_flight) return body;
      REFIT_RETURN_IF_ERROR(core_.reform_groups(
          [this](Communicator* p2p) { return executor_->recover(p2p, core_.timeout()); }));
      failed = *in_flight;
      return Status::Ok();
    });
    if (!st.ok()) return st;
    if (failed.ok()) {
      published_.emplace(version, step);
      core_.forget_noted_error();
    }
    return failed;
  }

  const RefitStats& last_stats() const override { return stats_; }
  bool session_ok() const override { return core_.session_ok(); }
  Status fail(const Status& cause) override { return core_.fail(cause); }
  void note_error(const Status& error) override { core_.note_error(error); }

  Result<double> raw_pass() {
    double secs = 0;
    Status st = core_.guarded([&]() -> Status {
      Timer t;
      Status refused;
      REFIT_RETURN_IF_ERROR(pass(BeginMessage{.step = ++raw_passes_, .raw = true}, refused));
      REFIT_RETURN_IF_ERROR(refused);
      secs = t.seconds();
      return Status::Ok();
    });
    if (!st.ok()) return st;
    return secs;
  }

  // One copy of the model on the wire (target dtypes, FP8 scales included): the wire model, the
  // one source of a refit's bytes (RefitStats::bytes, the report, the step line).
  std::int64_t bytes_per_refit() const override {
    return routes_ ? routes_->wire().payload_bytes() : model_->plan.payload_bytes;
  }
  int buckets_per_refit() const override { return executor_->rounds(); }
  std::string plan_hash() const override { return executor_->plan_hash(); }
  int store_port() const override { return core_.store_port(); }
  Result<std::vector<RankTraffic>> traffic() override {
    return read_traffic(core_.store(), core_.config(), core_.timeout());
  }

  Status shutdown() override {
    return core_.guarded([&]() -> Status {
      REFIT_RETURN_IF_ERROR(protocol_->shutdown());
      // Before this rank counts itself in; trainer rank 0 reads every rank's record once all did.
      const bool leader = core_.self().rank == 0;
      if (!leader) REFIT_RETURN_IF_ERROR(core_.publish_control_traffic());
      REFIT_RETURN_IF_ERROR(core_.trainers_meet("shutdown", /*wait=*/leader));
      core_.leave();
      shut_down_ = true;
      return Status::Ok();
    });
  }

  Result<ControlTraffic> control_traffic() {
    if (core_.self().rank != 0 || !shut_down_)
      return Status::Unsupported(fmt::format(
          "{}: the session's control-plane traffic is trainer rank 0's to read, after shutdown()",
          core_.id()));
    return core_.read_control_traffic();
  }

 private:
  // One refit or raw pass. With the transfer plan, trainer rank 0's messages order the trainer
  // ranks: each moves its bytes after engines-paused and returns after refit-done, which trainer
  // rank 0 sends once every rank's bytes moved and every engine rank answered. With gather, which
  // has no such messages, the refit lies between two barriers of the trainer group; past the last
  // one every trainer rank is done with it: a failure from there on (the store) is not one every
  // rank would see.
  Status pass(const BeginMessage& begin, Status& failed) {
    Communicator* group =
        core_.executor_kind().transfer_plan ? nullptr : core_.group(RankCore::Group::kTrainer);
    const RankCore::RefitScope counted = core_.refit_scope();
    in_flight_ = true;
    if (group) REFIT_RETURN_IF_ERROR(group->barrier());
    Timer t;
    TransferTimes times;
    double apply_s = 0;
    REFIT_RETURN_IF_ERROR(protocol_->run(begin, shards_.ptrs(), times, apply_s, failed));
    if (group) REFIT_RETURN_IF_ERROR(group->barrier());
    in_flight_ = false;
    if (begin.raw) return Status::Ok();
    stats_ = RefitStats{.seconds = t.seconds(),
                        .unshard_s = times.unshard,
                        .cast_pack_s = times.cast_pack,
                        .transfer_s = times.transfer,
                        .apply_s = apply_s,
                        .pause_s = protocol_->pause_seconds(),
                        .bytes = bytes_per_refit(),
                        .buckets = executor_->rounds()};
    return Status::Ok();
  }

  // `failure` of the refit in flight, when every rank is alive and it timed out or lost a
  // connection, or another rank recorded the refit's failure first: the refit's failure, as every
  // rank returns it, after this rank moved to the next refit epoch (RefitEpochs). nullopt when
  // the session must end (a dead peer, a bug, an executor that cannot recover).
  std::optional<Status> failed_in_flight(int step, const std::string& version,
                                         const Status& failure) {
    if (!in_flight_ || !executor_->can_recover()) return std::nullopt;
    in_flight_ = false;
    const std::optional<FailureOrigin> cause = core_.settle_in_flight(step, failure);
    if (!cause) return std::nullopt;
    protocol_->abandon();
    return refit::failed_in_flight(step, version, *cause);
  }

  Status setup() {
    const Config& cfg = core_.config();
    const int rank = core_.self().rank;
    REFIT_ASSIGN_OR_RETURN(model_, load_rank_model(cfg));
    // The caller registers the storage of each local shard, in the policy dtype.
    REFIT_ASSIGN_OR_RETURN(const TrainerShardLayout mine,
                           trainer_layout(model_->spec, cfg.policy, rank));
    std::vector<TensorSlot> slots;
    for (const LocalTensor& t : mine.tensors)
      slots.push_back(TensorSlot{t.name, t.shape, cfg.policy.dtype});
    shards_ = Registry(std::move(slots), core_.id());
    REFIT_RETURN_IF_ERROR(core_.connect());
    const auto settings = agreed_settings(cfg, model_->spec);
    REFIT_RETURN_IF_ERROR(check_trainer_versions(settings));
    REFIT_RETURN_IF_ERROR(core_.executor_kind().transfer_plan ? setup_routes() : setup_gather());
    core_.adopt(*executor_);
    protocol_ = std::make_unique<TrainerRefitProtocol>(core_, *executor_);
    REFIT_RETURN_IF_ERROR(protocol_->attach(settings, model_->spec.total_parameters()));
    // Setup is complete on every trainer rank before the first refit.
    return core_.trainers_meet("setup", /*wait=*/true);
  }

  // The trainer group (none with one rank): gather unshards its buckets over it, and FP8 scales
  // are combined over it. The transfer plan without FP8 runs no collective of the trainer ranks
  // and forms none: a group is a full mesh of the trainer ranks (N - 1 connections each) and, on
  // the CPU, an event loop in every rank that wakes every 10 ms.
  // `purpose` says what it is for, in the debug log.
  Status join_trainer_group(std::string_view purpose) {
    const int world = core_.config().policy.world_size;
    if (world == 1) return Status::Ok();
    REFIT_ASSIGN_OR_RETURN(auto group, core_.join_group("trainer", core_.self().rank, world));
    core_.hold(RankCore::Group::kTrainer, std::move(group));
    log::debug("{}: formed the trainer group ({} ranks) for {}", core_.id(), world, purpose);
    return Status::Ok();
  }

  // The transfer plan: this rank's targets, where they run, and the point-to-point group.
  Status setup_routes() {
    const Config& cfg = core_.config();
    const int rank = core_.self().rank;
    REFIT_ASSIGN_OR_RETURN(RouteSetup s, make_trainer_route_setup(cfg, model_->spec, rank));
    routes_ = std::make_unique<RouteSetup>(std::move(s));
    if (rank == 0)
      log::info("{}", plan_view_line(*routes_));
    else
      log::debug("{}: {}", core_.id(), plan_view_line(*routes_));
    if (routes_->wire().fp8) REFIT_RETURN_IF_ERROR(join_trainer_group("the FP8 scales"));
    RouteSenderOptions o;
    o.config = &cfg;
    o.rank = rank;
    o.setup = routes_.get();
    o.plane = &core_.plane();
    o.trainer_group = core_.group(RankCore::Group::kTrainer);
    o.targets = control_targets(*routes_);
    std::vector<RankId> targets;
    for (int g : o.targets) targets.push_back(RankId::engine(g, cfg.generation.tp_size));
    REFIT_ASSIGN_OR_RETURN(o.target_same_host, core_.same_host(targets));
    std::vector<RankId> byte_peers;
    for (int g : routes_->view.peers())
      byte_peers.push_back(RankId::engine(g, cfg.generation.tp_size));
    REFIT_ASSIGN_OR_RETURN(o.p2p, core_.join_p2p(byte_peers));
    REFIT_ASSIGN_OR_RETURN(executor_, RouteSender::create(o));
    return Status::Ok();
  }

  // Gather: every bucket unsharded over the trainer group and delivered whole.
  Status setup_gather() {
    REFIT_RETURN_IF_ERROR(join_trainer_group("gather's buckets"));
    Communicator* unshard = core_.group(RankCore::Group::kTrainer);  // null with one rank
    REFIT_ASSIGN_OR_RETURN(
        executor_, GatherSender::create(GatherSenderOptions{.config = &core_.config(),
                                                            .rank = core_.self().rank,
                                                            .model = model_.get(),
                                                            .trainer_group = unshard,
                                                            .rank_links = core_.gather_links()}));
    return Status::Ok();
  }

  // Every trainer rank stamps its refit and wire versions into the store; rank 0 checks every
  // other rank's stamp and the others check rank 0's, so both sides of a mismatch name it.
  Status check_trainer_versions(const std::map<std::string, std::string>& settings) {
    const int rank = core_.self().rank;
    const auto stamp_key = [](int r) { return "version/" + RankId::trainer(r).mailbox(); };
    REFIT_RETURN_IF_ERROR(
        core_.store().set(stamp_key(rank), encode_version_stamp(version(), settings)));
    for (int r = 0; r < core_.config().policy.world_size; ++r) {
      if (r == rank || (rank != 0 && r != 0)) continue;
      const std::string who = RankId::trainer(r).name();
      REFIT_ASSIGN_OR_RETURN(std::string stamp, get_while_alive(core_.store(), stamp_key(r),
                                                                core_.timeout(), core_.alive()));
      REFIT_RETURN_IF_ERROR(check_peer_versions(stamp, who, core_.id()));
      REFIT_ASSIGN_OR_RETURN(auto theirs, decode_stamp_settings(stamp, who));
      REFIT_RETURN_IF_ERROR(check_agreed_settings(settings, theirs, who, core_.id()));
    }
    return Status::Ok();
  }

  RankCore core_;
  std::unique_ptr<RankModel> model_;
  Registry shards_;
  std::map<std::string, int> published_;  // every version a refit of this rank published -> step
  std::unique_ptr<RouteSetup> routes_;  // the transfer plan (before the executor that uses it)
  std::unique_ptr<TrainerExecutor> executor_;
  std::unique_ptr<TrainerRefitProtocol> protocol_;
  RefitStats stats_;
  int raw_passes_ = 0;
  bool shut_down_ = false;
  bool in_flight_ = false;  // a refit() before its last barrier
};

}  // namespace

Result<std::unique_ptr<Trainer>> create_trainer(const Config& config, int rank,
                                                const Endpoint& endpoint, RankServices services) {
  return set_up_rank<Trainer, TrainerImpl>(config, RankId::trainer(rank), endpoint,
                                           std::move(services));
}

Result<std::unique_ptr<Trainer>> Trainer::create(const Config& config, int rank,
                                                 const Endpoint& endpoint) {
  REFIT_ASSIGN_OR_RETURN(RankServices services, services_from_environment());
  return create_trainer(config, rank, endpoint, std::move(services));
}

Result<double> raw_transport_pass(Trainer& trainer) {
  return static_cast<TrainerImpl&>(trainer).raw_pass();
}

Result<ControlTraffic> control_traffic(Trainer& trainer) {
  return static_cast<TrainerImpl&>(trainer).control_traffic();
}

}  // namespace refit
