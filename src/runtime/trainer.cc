// refit::Trainer: one trainer rank. Owns the rank's control — the store (rank 0 hosts it), its
// mailbox, the trainer group, the engines' hellos, the commit, verification, failures and the
// shutdown — around one executor (executor/executor.h) that moves the bytes of each refit from
// the caller's registered shards: the transfer plan, or gather.
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <chrono>
#include <deque>
#include <mutex>
#include <optional>

#include "comm/communicator.h"
#include "common/env.h"
#include "common/log.h"
#include "common/timer.h"
#include "control/mailbox.h"
#include "control/messages.h"
#include "control/auth.h"
#include "control/store.h"
#include "executor/executor.h"
#include "executor/gather_sender.h"
#include "executor/route_sender.h"
#include "executor/routes.h"
#include "plane/data_plane.h"
#include "plane/groups.h"
#include "refit/session.h"
#include "runtime/agreement.h"
#include "runtime/failure.h"
#include "runtime/fault.h"
#include "runtime/slots.h"
#include "runtime/traffic.h"
#include "weights/setup.h"

namespace refit {
namespace {

class TrainerImpl final : public Trainer {
 public:
  TrainerImpl(const Config& cfg, int rank, const Endpoint& ep, const Fault& fault)
      : cfg_(cfg), ep_(ep), rank_(rank), probe_(make_fault_probe(fault, /*trainer=*/true, rank)) {}

  // Every entry point runs through the latch (runtime/failure.h).
  Status guarded(const std::function<Status()>& body) {
    // Failures are recorded over the probe connection, whose requests end within seconds even
    // when the store's host is stopped (store_ waits up to refit.timeout_s).
    return latch_.guard(
        body, probe_store_ ? probe_store_ : store_, id(), [this] { abort_collectives(); },
        [this] {
          // Before the heartbeat exists (early setup) there is no watch to wait for.
          return heartbeat_ ? heartbeat_->verdict()
                            : Status::Unsupported("no heartbeat watch yet");
        });
  }

  // Wakes every call blocked in a collective of this rank (safe from another thread).
  void abort_collectives() {
    std::lock_guard<std::mutex> lock(comm_mu_);
    abort_collectives_locked();
  }
  void abort_collectives_locked() {
    if (trainer_comm_) trainer_comm_->abort();
    if (p2p_comm_) p2p_comm_->abort();
    if (executor_) executor_->abort();
  }
  // The refit of `epoch` failed in flight (the heartbeat watch saw it): wakes the collectives of
  // that epoch, not those already formed for the next.
  void abort_epoch(std::uint32_t epoch) {
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (groups_epoch_ == epoch) abort_collectives_locked();
  }

  bool session_ok() const override { return latch_.status().ok(); }

  Status init() {
    Status st = guarded([&] { return setup(); });
    // Set up: from now on the heartbeat thread also watches the other ranks, and wakes this
    // rank's collectives when one falls silent (runtime/failure.h).
    if (st.ok())
      heartbeat_->watch(
          id(), rank_names(cfg_),
          [this](const Status& why) {
            store_->abort(why);
            abort_collectives();
          },
          &epochs_, [this](std::uint32_t epoch) { abort_epoch(epoch); });
    return st;
  }

  const std::vector<TensorSlot>& tensors() const override { return slots_; }

  Status register_tensor(const std::string& name, void* data, DType dtype,
                         const std::vector<std::int64_t>& shape) override {
    REFIT_RETURN_IF_ERROR(register_slot(slots_, ptrs_, id(), name, data, dtype, shape));
    // Copy lists hold the registered addresses: rebuild them at the next refit.
    if (executor_) executor_->invalidate();
    return Status::Ok();
  }

  // A refit whose bytes all moved but did not arrive intact or failed verification (a checksum
  // mismatch, a failed verification hook) fails on every trainer rank with the same message and
  // leaves the session usable: it does not go through the latch, and the next refit() runs.
  //
  // So does a refit that failed in flight with every rank alive (docs/runtime.md, "A refit that
  // fails in flight"): every rank returns the cause recorded first, and forms its groups anew.
  Status refit(int step, const std::string& version, bool verify) override {
    Status failed;
    Status st = guarded([&]() -> Status {
      REFIT_RETURN_IF_ERROR(check_registered(slots_, ptrs_, id()));
      Status body = refit_body(step, version, verify, failed);
      if (body.ok()) return body;
      std::optional<Status> in_flight = failed_in_flight(step, version, body);
      if (!in_flight) return body;
      REFIT_RETURN_IF_ERROR(reform_groups());
      failed = *in_flight;
      return Status::Ok();
    });
    if (!st.ok()) return st;
    return failed;
  }

  Status refit_body(int step, const std::string& version, bool verify, Status& failed) {
    in_flight_ = true;
    if (trainer_comm_) REFIT_RETURN_IF_ERROR(trainer_comm_->barrier());
    phase_ = {};
    Timer t;
    REFIT_RETURN_IF_ERROR(refit_once(step, version, verify, false));
    if (trainer_comm_) REFIT_RETURN_IF_ERROR(trainer_comm_->barrier());
    // Past the last barrier every trainer rank is done with the refit: a failure from here on
    // (the store) is not one every rank would see.
    in_flight_ = false;
    stats_.seconds = t.seconds();
    stats_.unshard_s = phase_.unshard;
    stats_.cast_pack_s = phase_.cast_pack;
    stats_.transfer_s = phase_.transfer;
    stats_.apply_s = phase_.apply;
    stats_.bytes = model_->plan.payload_bytes;
    stats_.buckets = executor_->rounds();
    REFIT_RETURN_IF_ERROR(traffic_publisher_.publish(*store_, traffic_));
    if (const std::string& aborted = executor_->aborted(); !aborted.empty()) {
      // Refused before any byte moved (every trainer rank decides alike): nothing to verify or
      // publish.
      failed = Status::Aborted(refit_failure(step, version, aborted));
      return Status::Ok();
    }
    std::string failure = commit_error_;
    if (verify) {
      REFIT_ASSIGN_OR_RETURN(std::string verdict, collect_verdicts());
      if (failure.empty()) failure = verdict;
    }
    if (verify || cfg_.refit.checksum) {
      // Every engine rank publishes, or none does: the ranks of one engine never hold two
      // versions, whichever rank's bytes failed.
      if (trainer_comm_) {
        REFIT_ASSIGN_OR_RETURN(failure, agree_on_failure(failure));
      }
      REFIT_RETURN_IF_ERROR(
          send_each(*mailbox_, fed_engines(), MessageType::kOutcome,
                    encode(OutcomeMessage{.publish = failure.empty(), .error = failure})));
      // Each engine acknowledges once it heard every feeder, so nothing this rank sends next
      // can reach an engine before another rank's outcome.
      REFIT_RETURN_IF_ERROR(expect_from_each(*mailbox_, fed_engines(), MessageType::kOutcome, {},
                                             timeout(), id(), "outcome acknowledgements"));
    }
    if (!failure.empty()) {
      failed = Status::Corruption(refit_failure(step, version, failure));
    }
    return Status::Ok();
  }

  // `failure` of the refit in flight, when every rank is alive and it timed out or lost a
  // connection, or another rank recorded the refit's failure first: the refit's failure, as every
  // rank returns it, after this rank moved to the next refit epoch (RefitEpochs). nullopt when the
  // session must end (a dead peer, a bug, gather).
  std::optional<Status> failed_in_flight(int step, const std::string& version,
                                         const Status& failure) {
    if (!in_flight_ || !uses_transfer_plan(cfg_) || !heartbeat_ || !probe_store_)
      return std::nullopt;
    in_flight_ = false;
    const std::optional<std::string> recorded =
        in_flight_cause(epochs_, *probe_store_, id(), failure,
                        mailbox_->kept_epoch() > epochs_.current(),
                        [this] { return heartbeat_->verdict(); });
    if (!recorded) return std::nullopt;
    const std::string& cause = *recorded;
    abort_epoch(epochs_.current());
    log::warn("{}: refit step {} failed in flight with every rank alive ({}); forming the groups "
              "anew for refit epoch {}",
              id(), step, cause, epochs_.current() + 1);
    epochs_.advance();
    mailbox_->set_epoch(epochs_.current());
    outcomes_ = 0;
    return Status::Aborted(failed_in_flight_message(step, version, cause));
  }

  // After a refit failed in flight: the trainer and point-to-point groups of the new refit epoch
  // (every rank forms them now), and the executor's threads drained onto them.
  Status reform_groups() {
    const std::uint32_t epoch = epochs_.current();
    const auto named = [epoch](const char* base) { return fmt::format("{}.{}", base, epoch); };
    std::unique_ptr<Communicator> trainer, p2p;
    if (trainer_comm_) {
      REFIT_ASSIGN_OR_RETURN(trainer,
                             join_group(named("trainer"), rank_, cfg_.policy.world_size,
                                        kReformWait * cfg_.refit.timeout()));
    }
    if (p2p_comm_) {
      REFIT_ASSIGN_OR_RETURN(p2p, join_group(named("p2p"), p2p_rank_of_trainer(rank_),
                                             cfg_.policy.world_size + cfg_.engine_ranks(),
                                             kReformWait * cfg_.refit.timeout()));
    }
    REFIT_RETURN_IF_ERROR(executor_->recover(p2p.get(), timeout()).with_context(id()));
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (trainer) std::swap(trainer_comm_, trainer);
    if (p2p) std::swap(p2p_comm_, p2p);
    groups_epoch_ = epoch;
    return Status::Ok();  // the old groups go here
  }

  const RefitStats& last_stats() const override { return stats_; }

  Result<double> raw_transport_pass() override {
    double secs = 0;
    Status st = guarded([&]() -> Status {
      if (trainer_comm_) REFIT_RETURN_IF_ERROR(trainer_comm_->barrier());
      Timer t;
      REFIT_RETURN_IF_ERROR(refit_once(++raw_passes_, "", false, true));
      if (trainer_comm_) REFIT_RETURN_IF_ERROR(trainer_comm_->barrier());
      secs = t.seconds();
      return Status::Ok();
    });
    if (!st.ok()) return st;
    return secs;
  }

  std::int64_t bytes_per_refit() const override {
    return routes_ ? routes_->wire.payload_bytes() : model_->plan.payload_bytes;
  }
  int buckets_per_refit() const override { return executor_->rounds(); }
  std::string plan_hash() const override { return executor_->plan_hash(); }
  Result<std::vector<RankTraffic>> traffic() override {
    return read_traffic(*store_, cfg_, timeout());
  }

  Status shutdown() override {
    return guarded([&] { return do_shutdown(); });
  }

 private:
  std::string id() const { return fmt::format("trainer rank {}", rank_); }
  // A liveness check for this rank's waits: the verdict of the heartbeat thread's watch (the
  // store, the run's first failure, every other rank's heartbeat; runtime/failure.h).
  // Ends them too once the refit in flight failed on another rank (RefitEpochs).
  std::function<Status()> alive() { return rank_liveness(*heartbeat_, epochs_); }
  // Forms group `name` (this process rank `rank` of `size`) on the plane's backend; every wait in
  // it also checks the run's first failure.
  // `wait`: how long to wait for the others (default refit.timeout_s).
  Result<std::unique_ptr<Communicator>> join_group(const std::string& name, int rank, int size,
                                                   std::chrono::milliseconds wait = {}) {
    return make_group(*store_,
                      GroupOptions{.name = name,
                                   .rank = rank,
                                   .size = size,
                                   .host = ep_.host,
                                   .timeout = wait.count() > 0 ? wait : timeout(),
                                   .liveness = alive()},
                      *plane_);
  }
  std::chrono::milliseconds timeout() const { return cfg_.refit.timeout(); }

  Status setup() {
    const int world = cfg_.policy.world_size;
    REFIT_ASSIGN_OR_RETURN(model_, load_rank_model(cfg_));
    REFIT_ASSIGN_OR_RETURN(const int device, default_device(cfg_, true, rank_));
    REFIT_ASSIGN_OR_RETURN(plane_, make_data_plane(cfg_, device));
    // The caller registers the storage of each local shard, in the policy dtype.
    REFIT_ASSIGN_OR_RETURN(const TrainerShardLayout mine,
                           trainer_layout(model_->spec, cfg_.policy, rank_));
    for (const LocalTensor& t : mine.tensors)
      slots_.push_back(TensorSlot{t.name, t.shape, cfg_.policy.dtype});
    ptrs_.assign(slots_.size(), nullptr);

    // Control plane: trainer rank 0 hosts the store; authenticated when the run has a secret.
    REFIT_ASSIGN_OR_RETURN(const std::shared_ptr<const ControlAuth> auth, process_control_auth());
    if (rank_ == 0) {
      REFIT_ASSIGN_OR_RETURN(server_, StoreServer::start(ep_.master_addr, ep_.master_port, auth));
      log::info("control plane: store on {}:{}, {}", ep_.master_addr, ep_.master_port,
                auth ? "authenticated (CURVE, keys from the run secret)"
                     : "unauthenticated (loopback only; set REFIT_SECRET to authenticate)");
    }
    REFIT_ASSIGN_OR_RETURN(store_,
                           connect_store(ep_.master_addr, ep_.master_port, timeout(), auth));
    REFIT_ASSIGN_OR_RETURN(LivenessConnections live,
                           connect_liveness(ep_.master_addr, ep_.master_port, auth, id()));
    probe_store_ = std::move(live.probe);
    heartbeat_ = std::move(live.heartbeat);
    // From now on a stopped store host or a silent peer ends this rank's store requests, on which
    // setup waits (runtime/failure.h); once set up, its collectives too (init()).
    heartbeat_->watch(id(), rank_names(cfg_), [this](const Status& why) { store_->abort(why); });
    if (rank_ == 0) {
      REFIT_ASSIGN_OR_RETURN(const std::optional<std::string> given, env::run_id());
      REFIT_RETURN_IF_ERROR(
          store_->set("run_id", given.value_or(fmt::format("{}-{}", getpid(), time(nullptr)))));
    }
    REFIT_ASSIGN_OR_RETURN(std::string run_id, store_->get("run_id", timeout()));
    REFIT_RETURN_IF_ERROR(check_trainer_versions(world));
    REFIT_ASSIGN_OR_RETURN(
        mailbox_,
        Mailbox::open(*store_, fmt::format("trainer/{}", rank_), ep_.host, timeout(), auth));
    mailbox_->set_liveness_check(alive(), std::chrono::milliseconds(500));
    probe_->at_setup();
    if (world > 1) {
      REFIT_ASSIGN_OR_RETURN(trainer_comm_, join_group("trainer", rank_, world));
    }
    if (uses_transfer_plan(cfg_)) {
      REFIT_RETURN_IF_ERROR(setup_routes());
    } else {
      REFIT_ASSIGN_OR_RETURN(
          executor_, GatherSender::create(GatherSenderOptions{
                         .config = &cfg_,
                         .rank = rank_,
                         .model = model_.get(),
                         .mailbox = mailbox_.get(),
                         .store = store_.get(),
                         .plane = plane_.get(),
                         .trainer_group = trainer_comm_.get(),
                         .run_id = run_id,
                         .join_group = [this](const char* name, int rank, int size) {
                           return join_group(name, rank, size);
                         }}));
    }
    executor_->set_probe(probe_.get());
    REFIT_RETURN_IF_ERROR(check_engines());
    REFIT_RETURN_IF_ERROR(executor_->attach());
    // Setup is complete on every trainer rank before the first refit.
    if (trainer_comm_) REFIT_RETURN_IF_ERROR(trainer_comm_->barrier());
    return Status::Ok();
  }

  // The transfer plan: this rank's targets, where they run, and the point-to-point group.
  Status setup_routes() {
    REFIT_ASSIGN_OR_RETURN(RouteSetup s, make_route_setup(cfg_, model_->spec));
    routes_ = std::make_unique<RouteSetup>(std::move(s));
    REFIT_RETURN_IF_ERROR(publish_host(*store_, fmt::format("trainer/{}", rank_)));
    RouteSenderOptions o;
    o.config = &cfg_;
    o.rank = rank_;
    o.setup = routes_.get();
    o.mailbox = mailbox_.get();
    o.plane = plane_.get();
    o.trainer_group = trainer_comm_.get();
    o.targets = control_targets(routes_->plan, rank_);
    std::vector<std::string> who;
    for (int g : o.targets) who.push_back(fmt::format("engine/{}", g));
    REFIT_ASSIGN_OR_RETURN(auto hosts,
                           read_hosts(*store_, who, timeout(), alive()));
    for (std::size_t i = 0; i < hosts.size(); ++i) {
      o.target_same_host.push_back(hosts[i] == env::host_identity());
      REFIT_RETURN_IF_ERROR(
          check_pair_at_setup(cfg_, o.target_same_host.back(), rank_, o.targets[i]));
    }
    if (needs_p2p_group(cfg_)) {
      REFIT_ASSIGN_OR_RETURN(p2p_comm_, join_group("p2p", p2p_rank_of_trainer(rank_),
                                                   cfg_.policy.world_size + cfg_.engine_ranks()));
      o.p2p = p2p_comm_.get();
    }
    REFIT_ASSIGN_OR_RETURN(executor_, RouteSender::create(o));
    return Status::Ok();
  }

  // Every trainer rank stamps its refit and wire versions into the store; rank 0 checks every
  // other rank's stamp and the others check rank 0's, so both sides of a mismatch name it.
  Status check_trainer_versions(int world) {
    const auto settings = agreed_settings(cfg_, model_->spec);
    REFIT_RETURN_IF_ERROR(store_->set(fmt::format("version/trainer/{}", rank_),
                                      encode_version_stamp(version(), settings)));
    for (int r = 0; r < world; ++r) {
      if (r == rank_ || (rank_ != 0 && r != 0)) continue;
      const std::string who = fmt::format("trainer rank {}", r);
      REFIT_ASSIGN_OR_RETURN(std::string stamp,
                             get_while_alive(*store_, fmt::format("version/trainer/{}", r),
                                             timeout(), alive()));
      REFIT_RETURN_IF_ERROR(check_peer_versions(stamp, who, id()));
      REFIT_ASSIGN_OR_RETURN(auto theirs, decode_stamp_settings(stamp, who));
      REFIT_RETURN_IF_ERROR(check_agreed_settings(settings, theirs, who, id()));
    }
    return Status::Ok();
  }

  const std::vector<std::string>& fed_engines() const { return executor_->engine_ids(); }

  // Every fed engine says hello; for vLLM its plan hash must equal ours (refused at setup).
  Status check_engines() {
    for (std::size_t i = 0; i < fed_engines().size(); ++i) {
      REFIT_ASSIGN_OR_RETURN(Message hello, expect_message(*mailbox_, MessageType::kHello,
                                                           timeout(), "engine hellos"));
      REFIT_RETURN_IF_ERROR(check_peer_versions(hello.payload, hello.from, id()));
      REFIT_ASSIGN_OR_RETURN(HelloMessage h, decode_hello(hello.payload, hello.from));
      REFIT_RETURN_IF_ERROR(check_agreed_settings(agreed_settings(cfg_, model_->spec), h.settings,
                                                  hello.from, id()));
      const std::string& theirs = h.plan_hash;
      const std::string ours = plan_hash();
      if (h.total_parameters != model_->spec.total_parameters())
        return Status::InvalidArgument(fmt::format(
            "setup: {} serves a model of {} parameters, the trainer's has {}; both sides must "
            "load the same model",
            hello.from, h.total_parameters, model_->spec.total_parameters()));
      // vLLM agrees on its manifest at setup; SGLang engines place what the metadata says (per
      // bucket with executor gather, per route from the trainer ranks with the transfer plan).
      if (cfg_.generation.backend == EngineProtocol::kVllm && theirs != ours)
        return Status::InvalidArgument(fmt::format(
            "setup: vllm manifest mismatch: {} derived {} {} but the trainer's is {}; "
            "both sides must use the same model, layouts, refit.target_precision, "
            "refit.buffer_size_bytes and refit.executor",
            hello.from, uses_transfer_plan(cfg_) ? "transfer plan" : "bucket plan", theirs, ours));
    }
    return Status::Ok();
  }

  // One refit (or, with raw, one pass of the bare transport): the executor moves every byte,
  // then the commit.
  Status refit_once(int step, const std::string& version, bool verify, bool raw) {
    early_verdicts_.clear();
    commit_error_.clear();
    TransferTimes times;
    const BeginMessage begin{.step = step, .version = version, .verify = verify && !raw, .raw = raw};
    REFIT_RETURN_IF_ERROR(executor_->transfer(begin, ptrs_, times));
    if (!executor_->aborted().empty()) return Status::Ok();  // nothing moved: nothing to commit
    phase_.unshard += times.unshard;
    phase_.cast_pack += times.cast_pack;
    phase_.transfer += times.transfer;
    traffic_ = executor_->traffic();
    if (fed_engines().empty()) return Status::Ok();
    return commit(step, raw);
  }

  // Every fed engine commits; the slowest one's apply time is the refit's. With refit.checksum,
  // this rank checksums what it sent each engine while the engines checksum what landed, and
  // compares their answer with its own: the first mismatch is kept in commit_error_.
  Status commit(int step, bool raw) {
    if (!raw) probe_->before_commit(step);
    REFIT_RETURN_IF_ERROR(send_each(*mailbox_, fed_engines(), MessageType::kCommit,
                                    encode(CommitMessage{.step = step})));
    log::debug("{}: committed refit step {}", id(), step);
    std::vector<std::string> sent(fed_engines().size());
    if (cfg_.refit.checksum && !raw)
      for (std::size_t i = 0; i < sent.size(); ++i) {
        REFIT_ASSIGN_OR_RETURN(const std::uint64_t sum, executor_->checksum_to(i, ptrs_));
        sent[i] = fmt::format("{:016x}", sum);
      }
    for (std::size_t i = 0; i < fed_engines().size(); ++i) {
      REFIT_ASSIGN_OR_RETURN(Message m, expect_commit_ack());
      REFIT_ASSIGN_OR_RETURN(CommittedMessage c, decode_committed(m.payload, m.from));
      phase_.apply = std::max(phase_.apply, c.apply_s);
      const auto at = std::find(fed_engines().begin(), fed_engines().end(), m.from);
      if (at == fed_engines().end())
        return Status::Corruption(fmt::format("{}: commit acknowledgement from {}, which it does "
                                              "not feed",
                                              id(), m.from));
      const std::string& mine = sent[static_cast<std::size_t>(at - fed_engines().begin())];
      if (commit_error_.empty() && mine != c.checksum)
        commit_error_ = reported(
            m.from, fmt::format("checksum mismatch in refit step {}: the bytes {} sent (checksum "
                                "{}) arrived as checksum {} (refit.checksum)",
                                step, id(), mine, c.checksum.empty() ? "(none)" : c.checksum));
    }
    log::debug("{}: every engine acknowledged the commit of refit step {}", id(), step);
    return Status::Ok();
  }

  // One engine's commit acknowledgement. Each engine verifies right after its own commit, so its
  // verdict can overtake another engine's acknowledgement: verdicts that arrive early are kept for
  // collect_verification().
  Result<Message> expect_commit_ack() {
    while (true) {
      auto msg = mailbox_->receive(timeout());
      if (msg.ok() && msg->type == MessageType::kVerified) {
        early_verdicts_.push_back(std::move(msg).value());
        continue;
      }
      if (!msg.ok())
        return msg.status().with_context(
            fmt::format("{} waiting for commit acknowledgements", mailbox_->id()));
      if (msg->type == MessageType::kCommitted) return msg;
      return Status::Internal(fmt::format("{} waiting for commit acknowledgements: got {} from {}",
                                          mailbox_->id(), message_type_name(msg->type), msg->from));
    }
  }

  // After a verified refit: the first failing verdict of the engines this rank feeds ("" when
  // every one passed).
  Result<std::string> collect_verdicts() {
    std::string verdict;
    for (std::size_t i = 0; i < fed_engines().size(); ++i) {
      Message m;
      if (!early_verdicts_.empty()) {
        m = std::move(early_verdicts_.front());
        early_verdicts_.pop_front();
      } else {
        REFIT_ASSIGN_OR_RETURN(m, expect_message(*mailbox_, MessageType::kVerified, timeout() * 4,
                                                 "verification results"));
      }
      auto v = decode_verified(m.payload, m.from);
      if (verdict.empty() && (!v.ok() || !v->verified))
        verdict = reported(m.from, v.ok() ? (v->error.empty() ? "verification failed" : v->error)
                                           : v.status().message());
    }
    return verdict;
  }

  // The refit's error on every trainer rank, from "<process>: <error>" of the first engine rank
  // that failed or refused it.
  static std::string refit_failure(int step, const std::string& version,
                                   const std::string& failure) {
    const std::size_t colon = failure.find(": ");
    if (colon == std::string::npos) return failed_refit_message(step, version, "?", failure);
    return failed_refit_message(step, version, failure.substr(0, colon), failure.substr(colon + 2));
  }

  // "<process>: <error>" for an engine's report (mailbox id "engine/<g>").
  std::string reported(const std::string& from, const std::string& error) const {
    return engine_process(from, cfg_.generation.tp_size) + ": " + error;
  }

  // Every trainer rank's failure of this refit ("" for none) through the store (host-side on
  // every device), so that every trainer rank fails with the same cause: the lowest rank's
  // failure wins.
  Result<std::string> agree_on_failure(const std::string& mine) {
    const int world = trainer_comm_->size();
    // Per refit epoch: ranks whose refit failed in flight before this point did not count it.
    const std::string key = fmt::format("outcome/{}/{}/", epochs_.current(), ++outcomes_);
    // "ok", or "!" + the failure (a key must hold something to exist).
    REFIT_RETURN_IF_ERROR(
        store_->set(key + std::to_string(rank_), mine.empty() ? "ok" : "!" + mine));
    std::string first;
    for (int r = 0; r < world; ++r) {
      REFIT_ASSIGN_OR_RETURN(std::string theirs,
                             get_while_alive(*store_, key + std::to_string(r), timeout(), alive()));
      if (first.empty() && !theirs.empty() && theirs.front() == '!') first = theirs.substr(1);
    }
    return first;
  }

  // Engines acknowledge the shutdown before their feeder leaves, and trainer rank 0 (which hosts
  // the store) leaves last, so no process loses the control plane while it still needs it.
  Status do_shutdown() {
    if (!fed_engines().empty())
      REFIT_RETURN_IF_ERROR(send_each(*mailbox_, fed_engines(), MessageType::kShutdown, ""));
    for (std::size_t i = 0; i < fed_engines().size(); ++i)
      REFIT_RETURN_IF_ERROR(
          expect_message(*mailbox_, MessageType::kShutdown, timeout(), "engine exits").status());
    if (trainer_comm_) REFIT_RETURN_IF_ERROR(trainer_comm_->barrier());
    if (heartbeat_) heartbeat_->leave();
    return Status::Ok();
  }

  struct Phases {
    double unshard = 0, cast_pack = 0, transfer = 0, apply = 0;
  };

  const Config cfg_;
  const Endpoint ep_;
  const int rank_;
  const std::unique_ptr<RefitProbe> probe_;  // fault injection (tests); does nothing by default
  std::unique_ptr<RankModel> model_;
  std::unique_ptr<DataPlane> plane_;  // before every buffer allocated on it
  std::vector<TensorSlot> slots_;
  std::vector<void*> ptrs_;  // registered storage of slots_
  int outcomes_ = 0;  // refits of this epoch whose outcome the ranks shared: namespaces their keys
  std::string commit_error_;  // the first engine's report of bytes that did not arrive intact
  std::unique_ptr<StoreServer> server_;
  std::unique_ptr<Store> store_;
  // Liveness checks and failure records: requests bounded by kBeatRequestTimeout.
  std::unique_ptr<Store> probe_store_;
  std::unique_ptr<Mailbox> mailbox_;
  std::unique_ptr<Communicator> trainer_comm_, p2p_comm_;
  std::unique_ptr<RouteSetup> routes_;  // the transfer plan (before the executor that uses it)
  std::unique_ptr<TrainerExecutor> executor_;
  RankTraffic traffic_;
  TrafficPublisher traffic_publisher_;
  std::deque<Message> early_verdicts_;  // verdicts that overtook a commit acknowledgement
  Phases phase_;
  RefitStats stats_;
  int raw_passes_ = 0;
  FailureLatch latch_;
  RefitEpochs epochs_;  // refits that failed in flight (runtime/failure.h)
  std::uint32_t groups_epoch_ = 0;  // the refit epoch the groups were formed for
  bool in_flight_ = false;  // a refit() before its last barrier
  std::mutex comm_mu_;  // the groups, replaced on the main thread, aborted from the heartbeat's
  // Last: destroyed first, so that its thread is gone before the collectives it may abort.
  std::unique_ptr<Heartbeat> heartbeat_;
};

}  // namespace

Result<std::unique_ptr<Trainer>> Trainer::create(const Config& config, int rank,
                                                 const Endpoint& endpoint) {
  return create_trainer_with_fault(config, rank, endpoint, Fault{});
}

Result<std::unique_ptr<Trainer>> create_trainer_with_fault(const Config& config, int rank,
                                                           const Endpoint& endpoint,
                                                           const Fault& fault) {
  if (rank < 0 || rank >= config.policy.world_size)
    return Status::InvalidArgument(fmt::format("trainer rank {} is outside policy.world_size {}",
                                               rank, config.policy.world_size));
  REFIT_RETURN_IF_ERROR(env::check());  // a bad REFIT_* value is a setup error, before joining
  Fault armed = fault;
  armed.stall_ms = static_cast<int>(config.refit.timeout_s * 2500);
  auto t = std::make_unique<TrainerImpl>(config, rank, endpoint, armed);
  REFIT_RETURN_IF_ERROR(t->init());
  return std::unique_ptr<Trainer>(std::move(t));
}

}  // namespace refit
