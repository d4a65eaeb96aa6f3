// refit::Engine: one engine rank. Owns the rank's control — its mailbox, the hello, the pause and
// resume hooks, the commit, the weight version, verification, failures and the shutdown — around
// one executor (executor/executor.h) that writes each refit into the caller's registered
// parameters (its TP shard in the engine layout). The weight version moves only when the whole
// refit arrived (commit).
#include <fmt/format.h>
#include <signal.h>

#include <algorithm>
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
#include "engine/engine_layout.h"
#include "executor/executor.h"
#include "executor/gather_receiver.h"
#include "executor/route_receiver.h"
#include "executor/routes.h"
#include "plane/data_plane.h"
#include "plane/groups.h"
#include "plane/shared_memory.h"
#include "refit/session.h"
#include "runtime/agreement.h"
#include "runtime/failure.h"
#include "runtime/fault.h"
#include "runtime/slots.h"
#include "runtime/traffic.h"
#include "weights/setup.h"

namespace refit {
namespace {

class EngineImpl final : public Engine {
 public:
  EngineImpl(const Config& cfg, int engine_rank, const Endpoint& ep, const Fault& fault)
      : cfg_(cfg),
        ep_(ep),
        fault_(fault),
        rank_(engine_rank),
        tp_rank_(engine_rank % cfg.generation.tp_size) {}

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

  const std::vector<TensorSlot>& params() const override { return slots_; }
  Status register_param(const std::string& name, void* data, DType dtype,
                        const std::vector<std::int64_t>& shape) override {
    REFIT_RETURN_IF_ERROR(register_slot(slots_, ptrs_, id(), name, data, dtype, shape));
    if (executor_) executor_->invalidate();  // copy lists hold the registered addresses
    keep_.reset();
    param_handles_.clear();
    export_.reset();
    export_failed_ = false;
    return Status::Ok();
  }
  void on_pause(std::function<Status()> hook) override { pause_hook_ = std::move(hook); }
  void on_resume(std::function<void()> hook) override { resume_hook_ = std::move(hook); }
  void on_verify(std::function<Status(int, const std::string&)> hook) override {
    verify_hook_ = std::move(hook);
  }
  void on_load_weights(std::function<Status(const std::vector<ParamView>&)> hook) override {
    load_hook_ = std::move(hook);
  }
  std::string weight_version() const override { return version_; }
  bool is_valid() const override { return valid_; }

  Result<std::vector<void*>> allocate_params() override {
    std::vector<void*> out;
    Status st = guarded([&]() -> Status {
      if (exported_) return Status::InvalidArgument(id() + ": allocate_params() called twice");
      std::vector<std::size_t> offsets;
      std::size_t total = 0;
      for (const TensorSlot& s : slots_) {
        offsets.push_back(total);
        total += static_cast<std::size_t>(s.numel()) * dtype_size(s.dtype);
        total = (total + 255) / 256 * 256;
      }
      REFIT_ASSIGN_OR_RETURN(
          exported_,
          plane_->allocate_exported(std::max<std::size_t>(total, 1),
                                    fmt::format("/refit-{}-e{}-{}", run_id_, rank_, unguessable_suffix()), &export_handle_));
      for (std::size_t i = 0; i < slots_.size(); ++i) {
        ptrs_[i] = exported_->data() + offsets[i];
        out.push_back(ptrs_[i]);
      }
      export_.reset();  // the parameters moved into the region
      return Status::Ok();
    });
    if (!st.ok()) return st;
    return out;
  }

  // A refit whose bytes all landed but did not arrive intact or failed verification is a failed
  // refit, not a failed session: it is returned without going through the latch. So is one that
  // failed in flight with every rank alive (docs/runtime.md, "A refit that fails in flight").
  Result<bool> serve_one() override {
    bool committed = false;
    failed_refit_ = Status::Ok();
    Status st = guarded([&]() -> Status {
      Result<bool> served = next();
      if (served.ok()) {
        committed = *served;
        return Status::Ok();
      }
      std::optional<Status> in_flight = failed_in_flight(served.status());
      if (!in_flight) return served.status();
      REFIT_RETURN_IF_ERROR(reform_groups());
      failed_refit_ = *in_flight;
      committed = true;
      return Status::Ok();
    });
    if (!st.ok()) {
      if (in_refit_) roll_back_at_the_end();
      return st;
    }
    if (!failed_refit_.ok()) return failed_refit_;
    return committed;
  }

  Status serve() override {
    while (true) {
      Result<bool> more = serve_one();
      if (!more.ok() && latch_.status().ok()) continue;  // a failed refit: serve the next one
      if (!more.ok()) return more.status();
      if (!*more) return Status::Ok();
    }
  }

 private:
  std::string id() const {
    return fmt::format("engine {} tp rank {}", rank_ / cfg_.generation.tp_size, tp_rank_);
  }
  // A liveness check for this rank's waits: the verdict of the heartbeat thread's watch (the
  // store, the run's first failure, every other rank's heartbeat; runtime/failure.h).
  // Ends them too once the current refit epoch failed on another rank (RefitEpochs).
  std::function<Status()> alive() { return rank_liveness(*heartbeat_, epochs_); }

  // `failure` of the refit in flight (begin_), when every rank is alive and it timed out or lost
  // a connection, or another rank recorded the refit's failure first: the refit's failure, after
  // the weights were dealt with and this rank moved to the next refit epoch (RefitEpochs).
  // nullopt when the session must end (a dead peer, a bug, gather).
  std::optional<Status> failed_in_flight(const Status& failure) {
    if (!in_refit_ || !uses_transfer_plan(cfg_) || !heartbeat_ || !probe_store_)
      return std::nullopt;
    const std::optional<std::string> recorded =
        in_flight_cause(epochs_, *probe_store_, id(), failure,
                        mailbox_->kept_epoch() > epochs_.current(),
                        [this] { return heartbeat_->verdict(); });
    if (!recorded) return std::nullopt;
    in_refit_ = false;
    const std::string& cause = *recorded;
    abort_epoch(epochs_.current());
    Status failed = Status::Aborted(failed_in_flight_message(begin_.step, begin_.version, cause));
    if (!valid_) {
      // Bytes may have landed. A feeder that writes in place may still be writing (stalled, it
      // has not seen the failure yet): no rollback then, the weights stay invalid and generation
      // paused until a refit succeeds, which that feeder takes part in only after it stopped.
      if (executor_->traffic().peer_pairs > 0 && !kept_version_.empty()) {
        log::warn("{}: refit.keep_previous: no rollback after a refit that failed in flight "
                  "while feeders wrote in place",
                  id());
        kept_version_.clear();
      }
      (void)fail_refit(failed);
    }
    log::warn("{}: refit step {} failed in flight with every rank alive ({}); forming the groups "
              "anew for refit epoch {}",
              id(), begin_.step, cause, epochs_.current() + 1);
    epochs_.advance();
    mailbox_->set_epoch(epochs_.current());
    return failed;
  }

  // After a refit failed in flight: the point-to-point group of the new refit epoch (every rank
  // forms it now), and the executor's apply thread drained onto it.
  Status reform_groups() {
    const std::uint32_t epoch = epochs_.current();
    std::unique_ptr<Communicator> p2p;
    if (p2p_comm_) {
      REFIT_ASSIGN_OR_RETURN(p2p, join_group(fmt::format("p2p.{}", epoch),
                                             p2p_rank_of_engine(cfg_, rank_),
                                             cfg_.policy.world_size + cfg_.engine_ranks(),
                                             kReformWait * cfg_.refit.timeout()));
    }
    REFIT_RETURN_IF_ERROR(executor_->recover(p2p.get(), timeout()).with_context(id()));
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (p2p) std::swap(p2p_comm_, p2p);
    groups_epoch_ = epoch;
    return Status::Ok();  // the old group goes here
  }

  // The session ended during a refit (a dead or stopped rank, a bug): with refit.keep_previous
  // the parameters go back to the kept complete version, so that a serving process that outlives
  // the session (docs/runtime.md, "Re-creating a session") serves it, not torn weights — unless a
  // feeder wrote in place in this refit: one that is still alive may still be writing.
  void roll_back_at_the_end() {
    in_refit_ = false;
    if (valid_ || kept_version_.empty() || !keep_) return;
    if (executor_ && executor_->traffic().peer_pairs > 0) {
      log::warn("{}: refit.keep_previous: no rollback at the end of the session: feeders wrote in "
                "place in refit step {}",
                id(), begin_.step);
      return;
    }
    (void)fail_refit(latch_.status());
  }

  // Between refits: the last refit failed in flight on other ranks after this rank published its
  // part (its weights are complete), or a peer already moved to the next refit epoch. This rank
  // moves on too.
  Status catch_up() {
    log::warn("{}: the refit of epoch {} failed in flight on another rank after this rank "
              "published weight version '{}' (its bytes are complete); forming the groups anew",
              id(), epochs_.current(), version_);
    abort_epoch(epochs_.current());
    epochs_.advance();
    mailbox_->set_epoch(epochs_.current());
    return reform_groups();
  }

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
    REFIT_ASSIGN_OR_RETURN(model_, load_rank_model(cfg_));
    // What this rank stores, each parameter in its own dtype (with fp8: fp8 weights, their
    // float32 scales, bf16 for the rest; spec/fp8.h).
    REFIT_ASSIGN_OR_RETURN(const WireModel wire, wire_model(cfg_, model_->spec));
    REFIT_ASSIGN_OR_RETURN(layout_, engine_wire_layout(cfg_, model_->spec, wire, tp_rank_));
    for (const EngineParam& p : layout_.params)
      slots_.push_back(TensorSlot{p.name, p.shape, p.dtype});
    ptrs_.assign(slots_.size(), nullptr);
    REFIT_ASSIGN_OR_RETURN(const int device, default_device(cfg_, false, rank_));
    REFIT_ASSIGN_OR_RETURN(plane_, make_data_plane(cfg_, device));
    REFIT_ASSIGN_OR_RETURN(const std::shared_ptr<const ControlAuth> auth, process_control_auth());
    REFIT_ASSIGN_OR_RETURN(store_,
                           connect_store(ep_.master_addr, ep_.master_port, timeout(), auth));
    REFIT_ASSIGN_OR_RETURN(LivenessConnections live,
                           connect_liveness(ep_.master_addr, ep_.master_port, auth, id()));
    probe_store_ = std::move(live.probe);
    heartbeat_ = std::move(live.heartbeat);
    // From now on a stopped store host or a silent peer ends this rank's store requests, on which
    // setup waits (runtime/failure.h); once set up, its collectives too (init()).
    heartbeat_->watch(id(), rank_names(cfg_), [this](const Status& why) { store_->abort(why); });
    REFIT_ASSIGN_OR_RETURN(run_id_, store_->get("run_id", timeout()));
    REFIT_ASSIGN_OR_RETURN(
        mailbox_, Mailbox::open(*store_, fmt::format("engine/{}", rank_), ep_.host, timeout(), auth));
    mailbox_->set_liveness_check(alive(), std::chrono::milliseconds(500));
    probe_ = make_fault_probe(fault_, /*trainer=*/false, rank_);
    probe_->at_setup();
    // Agree with trainer rank 0 before joining any group: a rank launched with another config (or
    // another refit) fails here naming the key, not in a group of the wrong size.
    REFIT_ASSIGN_OR_RETURN(std::string stamp,
                           get_while_alive(*store_, "version/trainer/0", timeout(),
                                           alive()));
    REFIT_RETURN_IF_ERROR(check_peer_versions(stamp, "trainer rank 0", id()));
    REFIT_ASSIGN_OR_RETURN(auto trainer_settings, decode_stamp_settings(stamp, "trainer rank 0"));
    REFIT_RETURN_IF_ERROR(check_agreed_settings(agreed_settings(cfg_, model_->spec),
                                                trainer_settings, "trainer rank 0", id()));
    if (uses_transfer_plan(cfg_)) {
      REFIT_RETURN_IF_ERROR(setup_routes());
    } else {
      REFIT_ASSIGN_OR_RETURN(
          executor_, GatherReceiver::create(GatherReceiverOptions{
                         .config = &cfg_,
                         .engine_rank = rank_,
                         .who = id(),
                         .model = model_.get(),
                         .layout = &layout_,
                         .mailbox = mailbox_.get(),
                         .store = store_.get(),
                         .plane = plane_.get(),
                         .run_id = run_id_,
                         .join_group = [this](const char* name, int rank, int size) {
                           return join_group(name, rank, size);
                         }}));
    }
    executor_->set_probe(probe_.get());
    // Announce ourselves (with the vLLM manifest hash): the trainer's setup waits for this.
    const HelloMessage hello{.refit_version = fault_.kind == Fault::Kind::kVersionMismatch
                                                  ? std::string(version()) + "+mismatch"
                                                  : std::string(version()),
                             .engine_rank = rank_,
                             .protocol = std::string(engine_protocol_name(cfg_.generation.backend)),
                             .plan_hash = fault_.kind == Fault::Kind::kPlanMismatch
                                              ? std::string("0000000000000000")
                                              : executor_->plan_hash(),
                             .total_parameters = model_->spec.total_parameters(),
                             .settings = agreed_settings(cfg_, model_->spec)};
    REFIT_RETURN_IF_ERROR(send_each(*mailbox_, feeders(), MessageType::kHello, encode(hello)));
    return executor_->attach();
  }

  const std::vector<std::string>& feeders() const { return executor_->feeders(); }

  // The transfer plan: the trainer ranks that feed this rank, where they run, and the
  // point-to-point group.
  Status setup_routes() {
    REFIT_ASSIGN_OR_RETURN(RouteSetup s, make_route_setup(cfg_, model_->spec));
    routes_ = std::make_unique<RouteSetup>(std::move(s));
    REFIT_RETURN_IF_ERROR(publish_host(*store_, fmt::format("engine/{}", rank_)));
    RouteReceiverOptions o;
    o.config = &cfg_;
    o.engine_rank = rank_;
    o.who = id();
    o.setup = routes_.get();
    o.plane = plane_.get();
    o.mailbox = mailbox_.get();
    o.sources = control_sources(routes_->plan, rank_);
    std::vector<std::string> who;
    for (int r : o.sources) who.push_back(fmt::format("trainer/{}", r));
    REFIT_ASSIGN_OR_RETURN(auto hosts,
                           read_hosts(*store_, who, timeout(), alive()));
    for (std::size_t i = 0; i < hosts.size(); ++i) {
      o.source_same_host.push_back(hosts[i] == env::host_identity());
      REFIT_RETURN_IF_ERROR(
          check_pair_at_setup(cfg_, o.source_same_host.back(), o.sources[i], rank_));
    }
    if (needs_p2p_group(cfg_)) {
      REFIT_ASSIGN_OR_RETURN(p2p_comm_, join_group("p2p", p2p_rank_of_engine(cfg_, rank_),
                                                   cfg_.policy.world_size + cfg_.engine_ranks()));
      o.p2p = p2p_comm_.get();
    }
    o.incoming = incoming_from_plan(routes_->plan, rank_);
    REFIT_ASSIGN_OR_RETURN(executor_, RouteReceiver::create(o));
    return Status::Ok();
  }

  // Where our parameters are for peer access: the region refit allocated (allocate_params), or,
  // on CUDA, an IPC handle per registered parameter. Built with its digest once per registration
  // (register_param resets it), not per refit. nullptr when the storage cannot be shared (host
  // memory the caller allocated): point-to-point serves then.
  const ExportedParams* exported_params() {
    if (export_) return &*export_;
    if (exported_) {
      ExportedParams e;
      e.handle = export_handle_;
      e.bytes = exported_->size();
      for (void* p : ptrs_)
        e.offsets.push_back(
            static_cast<std::uint64_t>(static_cast<std::byte*>(p) - exported_->data()));
      e.digest = export_digest(e);
      export_ = std::move(e);
      return &*export_;
    }
    if (cfg_.device != Device::kCuda || export_failed_) return nullptr;
    if (param_handles_.empty()) {
      for (std::size_t i = 0; i < ptrs_.size(); ++i) {
        const auto bytes = static_cast<std::size_t>(slots_[i].numel()) * dtype_size(slots_[i].dtype);
        if (bytes == 0) {
          param_handles_.emplace_back();
          continue;
        }
        auto h = plane_->export_existing(static_cast<std::byte*>(ptrs_[i]), bytes);
        if (!h.ok()) {
          log::warn("{}: parameter {} cannot be exported for peer access ({}); feeders on this "
                    "host use point-to-point",
                    id(), slots_[i].name, h.status().message());
          param_handles_.clear();
          export_failed_ = true;  // until the next registration
          return nullptr;
        }
        param_handles_.push_back(std::move(h).value());
      }
    }
    ExportedParams e;
    e.handles = param_handles_;
    e.digest = export_digest(e);
    export_ = std::move(e);
    return &*export_;
  }

  // One refit, from its first begin: the executor receives every byte (the pause hook runs
  // before the first lands), then every feeder commits. A refit the trainer ranks aborted before
  // any byte landed (this or another engine rank refused it) fails the refit, not the session.
  Status refit(const std::string& first_from) {
    const bool raw = begin_.raw;
    const std::string prior_version = version_;
    const bool prior_valid = valid_;
    std::string aborted;
    std::vector<std::string> early_commits;
    const EngineRefit r{.begin = begin_,
                        .first_from = first_from,
                        .params = &ptrs_,
                        .pause = [&]() -> Status {
                          if (raw) return Status::Ok();
                          REFIT_RETURN_IF_ERROR(check_registered(slots_, ptrs_, id()));
                          log::debug("pause generation for refit step {}", begin_.step);
                          if (pause_hook_) {
                            Timer took;
                            const Status paused = pause_hook_();
                            if (!paused.ok())
                              return Status(paused.code(),
                                            fmt::format("{}: the pause hook failed, so refit step "
                                                        "{} was aborted before any parameter "
                                                        "changed: {}",
                                                        id(), begin_.step, paused.message()));
                            // Longer than a step of a refit may take: refused here, the same to
                            // every feeder (they wait longer), and generation goes on.
                            if (took.seconds() > cfg_.refit.timeout_s) {
                              if (resume_hook_) resume_hook_();
                              return Status::Timeout(fmt::format(
                                  "{}: the pause hook took {:.1f} s, longer than "
                                  "refit.timeout_s ({} s), so refit step {} was aborted before "
                                  "any parameter changed",
                                  id(), took.seconds(), cfg_.refit.timeout_s, begin_.step));
                            }
                          }
                          // refit.keep_previous: a copy of a complete version to roll back to.
                          REFIT_RETURN_IF_ERROR(keep_previous());
                          // From here bytes may land: the old version no longer describes the
                          // weights until this refit publishes its own.
                          valid_ = false;
                          version_.clear();
                          return Status::Ok();
                        },
                        .exported = [this] { return exported_params(); },
                        .abandon =
                            [&](const std::string& why, bool paused) {
                              // Nothing landed: the weights are the previous version's.
                              aborted = why;
                              version_ = prior_version;
                              valid_ = prior_valid;
                              log::warn("{}: refit step {} was aborted before any byte landed; "
                                        "weight version '{}' stays{}: {}",
                                        id(), begin_.step, version_,
                                        paused ? " and generation resumes" : "", why);
                              if (paused && !raw && resume_hook_) resume_hook_();
                            },
                        .early_commits = &early_commits};
    REFIT_RETURN_IF_ERROR(executor_->receive(r));
    if (!aborted.empty()) {
      failed_refit_ = Status::Aborted(fmt::format("refit step {} was aborted before any byte "
                                                  "landed: {}",
                                                  begin_.step, aborted));
      return Status::Ok();
    }
    REFIT_RETURN_IF_ERROR(expect_from_each(*mailbox_, feeders(), MessageType::kCommit,
                                           early_commits, timeout(), id(), "the commit"));
    log::debug("{}: every feeder committed refit step {}", id(), begin_.step);
    if (!raw) probe_->before_commit(begin_.step);
    traffic_ = executor_->traffic();
    // Every peer feeder has mapped the exported memory by now: its name may go.
    if (exported_ && traffic_.peer_pairs > 0) exported_->release_name();
    std::vector<std::string> landed(feeders().size());
    if (!raw && cfg_.refit.checksum) {
      REFIT_ASSIGN_OR_RETURN(landed, checksums());
    }
    return finish(executor_->apply_seconds(), landed);
  }

  // refit.checksum: this rank's checksum of what landed from each feeder (16 hex digits each),
  // computed once every byte is in, while each feeder computes its own of what it sent; the
  // feeder compares (docs/runtime.md).
  Result<std::vector<std::string>> checksums() {
    std::vector<std::string> out;
    for (std::size_t i = 0; i < feeders().size(); ++i) {
      REFIT_ASSIGN_OR_RETURN(const std::uint64_t sum, executor_->checksum_from(i, ptrs_));
      out.push_back(fmt::format("{:016x}", sum));
    }
    return out;
  }

  // refit.keep_previous: before bytes of a refit land, a copy of the parameters when they hold a
  // complete version (once per refit; the buffer is allocated at the first).
  Status keep_previous() {
    if (!cfg_.refit.keep_previous) return Status::Ok();
    kept_version_.clear();
    if (!valid_) return Status::Ok();  // nothing complete to keep
    if (!keep_) {
      auto k = std::make_unique<Kept>();
      std::size_t total = 0;
      std::vector<std::size_t> offsets;
      for (const TensorSlot& s : slots_) {
        offsets.push_back(total);
        total += static_cast<std::size_t>(s.numel()) * dtype_size(s.dtype);
      }
      REFIT_ASSIGN_OR_RETURN(k->buffer, plane_->allocate(std::max<std::size_t>(total, 1)));
      for (std::size_t i = 0; i < slots_.size(); ++i) {
        // As bytes: the parameters' dtypes may differ (fp8).
        const auto n = slots_[i].numel() * static_cast<std::int64_t>(dtype_size(slots_[i].dtype));
        if (n == 0) continue;
        std::byte* param = static_cast<std::byte*>(ptrs_[i]);
        std::byte* copy = k->buffer->data() + offsets[i];
        k->save.push_back({param, copy, {0, n, 0, n, 1, n}});
        k->restore.push_back({copy, param, {0, n, 0, n, 1, n}});
      }
      keep_ = std::move(k);
    }
    REFIT_RETURN_IF_ERROR(plane_->copy(keep_->save, kByteCopyDType, kByteCopyDType).with_context(
        id() + ": refit.keep_previous: copying the parameters"));
    kept_version_ = version_;
    return Status::Ok();
  }

  // The load_weights hook over every parameter, in batches (refit/session.h on_load_weights):
  // a decoder layer is never split, a batch is at most refit.buffer_size_bytes unless one layer
  // is larger.
  Status load_weights(const char* what) {
    if (!load_hook_) return Status::Ok();
    const auto limit = cfg_.refit.buffer_size_bytes;
    const int device = cfg_.device == Device::kCuda ? plane_->ordinal() : -1;
    std::vector<ParamView> batch;
    std::int64_t bytes = 0;
    int calls = 0;
    auto flush = [&]() -> Status {
      if (batch.empty()) return Status::Ok();
      ++calls;
      Status st = load_hook_(batch);
      batch.clear();
      bytes = 0;
      if (!st.ok())
        return st.with_context(fmt::format("{}: the load_weights hook ({}, step {})", id(), what,
                                           begin_.step));
      return Status::Ok();
    };
    // Units: a decoder layer's consecutive parameters, or one parameter outside the layers. A
    // unit goes whole into a batch; a batch ends before a unit that would take it over the limit.
    for (std::size_t i = 0; i < slots_.size();) {
      const std::int64_t layer = layer_of_name(slots_[i].name);
      std::size_t end = i + 1;
      while (layer >= 0 && end < slots_.size() && layer_of_name(slots_[end].name) == layer) ++end;
      std::int64_t unit = 0;
      for (std::size_t k = i; k < end; ++k)
        unit += slots_[k].numel() * static_cast<std::int64_t>(dtype_size(slots_[k].dtype));
      if (bytes + unit > limit) REFIT_RETURN_IF_ERROR(flush());
      for (std::size_t k = i; k < end; ++k)
        batch.push_back(ParamView{slots_[k].name, slots_[k].shape, slots_[k].dtype, ptrs_[k], device});
      bytes += unit;
      i = end;
    }
    REFIT_RETURN_IF_ERROR(flush());
    const bool refit = std::string_view(what) == "the refit";
    log::write(refit ? log::Level::kDebug : log::Level::kInfo,
               fmt::format("{}: load_weights hook: {} parameters in {} call(s) ({})", id(),
                           slots_.size(), calls, what));
    return Status::Ok();
  }

  // A refit failed after bytes may have landed, with every rank alive: roll back to the kept copy
  // (refit.keep_previous) and resume, or leave the weights invalid and generation paused.
  Status fail_refit(const Status& why) {
    if (!kept_version_.empty() && keep_) {
      Status restored = plane_->copy(keep_->restore, kByteCopyDType, kByteCopyDType);
      // The engine's own weights took the failed refit's bytes: hand it the restored ones.
      if (restored.ok()) restored = load_weights("after the rollback");
      if (restored.ok()) {
        version_ = kept_version_;
        valid_ = true;
        log::warn("{}: refit step {} failed; rolled back to weight version '{}' "
                  "(refit.keep_previous) and resumed generation: {}",
                  id(), begin_.step, version_, why.message());
        if (resume_hook_) resume_hook_();
        return why;
      }
      log::error("{}: refit.keep_previous: restoring the parameters failed: {}", id(),
                 restored.to_string());
    }
    log::warn("{}: refit step {} failed; the weights are invalid and generation stays paused "
              "until a refit succeeds: {}",
              id(), begin_.step, why.message());
    return why;
  }

  // After every byte of a refit landed and every feeder committed: acknowledge (with
  // refit.checksum, each feeder gets this rank's checksum of its bytes), then — with checksums or
  // verification — run the verification hook and publish only on the trainer ranks' agreed
  // outcome, so that no engine rank publishes while another's bytes failed. A failed outcome fails
  // the refit, not the session (failed_refit_): rollback (refit.keep_previous), or the weights stay
  // invalid and generation paused.
  Status finish(double apply_s, const std::vector<std::string>& landed) {
    const bool raw = begin_.raw;
    const bool agreed = !raw && (begin_.verify || cfg_.refit.checksum);
    // Every byte landed: the engine's load_weights takes them before anything is published or
    // verified. Its failure ends the session (the engine's weights are torn).
    if (!raw) REFIT_RETURN_IF_ERROR(load_weights("the refit"));
    REFIT_RETURN_IF_ERROR(traffic_publisher_.publish(*store_, traffic_));
    if (!raw && !agreed) publish();
    for (std::size_t i = 0; i < feeders().size(); ++i)
      REFIT_RETURN_IF_ERROR(mailbox_->send(
          feeders()[i], MessageType::kCommitted,
          encode(CommittedMessage{.version = raw ? version_ : begin_.version,
                                  .apply_s = apply_s,
                                  .bytes_received = traffic_.bytes_received,
                                  .checksum = landed[i]})));
    log::debug("{}: acknowledged the commit of refit step {}", id(), begin_.step);
    if (!agreed) return Status::Ok();
    Status v;
    if (begin_.verify) {
      v = verify_hook_ ? verify_hook_(begin_.step, begin_.version)
                       : Status::Unsupported(id() +
                                             ": verification was asked for but this engine has "
                                             "no verification hook");
      REFIT_RETURN_IF_ERROR(send_each(
          *mailbox_, feeders(), MessageType::kVerified,
          encode(VerifiedMessage{.verified = v.ok(), .error = v.ok() ? "" : v.message()})));
    }
    // Every feeder sends the same agreed outcome; it waits for every engine's verification.
    OutcomeMessage outcome{.publish = true};
    REFIT_RETURN_IF_ERROR(expect_from_each(
        *mailbox_, feeders(), MessageType::kOutcome, {}, timeout() * 5, id(), "the outcome",
        [&](const Message& m) -> Status {
          REFIT_ASSIGN_OR_RETURN(OutcomeMessage o, decode_outcome(m.payload, m.from));
          if (!o.publish && outcome.publish) outcome = std::move(o);
          return Status::Ok();
        }));
    if (outcome.publish && v.ok()) {
      if (cfg_.refit.checksum) {
        // Once at info level (tests look for it), then at debug level.
        const auto level = checksums_passed_++ == 0 ? log::Level::kInfo : log::Level::kDebug;
        if (log::enabled(level))
          log::write(level, fmt::format("{}: refit.checksum: step {} arrived intact from {} "
                                        "feeder(s)",
                                        id(), begin_.step, feeders().size()));
      }
      publish();
    } else {
      failed_refit_ = fail_refit(!v.ok() ? v
                                         : Status::Corruption(fmt::format(
                                               "refit step {} failed: {}", begin_.step,
                                               outcome.error)));
    }
    // Acknowledged to every feeder, which waits for it before its next message: a feeder that ran
    // ahead (its next begin, or the shutdown) cannot overtake another feeder's outcome.
    return send_each(*mailbox_, feeders(), MessageType::kOutcome,
                     encode(OutcomeMessage{.publish = valid_, .error = version_}));
  }

  // The refit's weights are complete (and verified when asked): they carry its version now.
  void publish() {
    version_ = begin_.version;
    valid_ = true;
    log::debug("resume generation at weight version {}", version_);
    if (resume_hook_) resume_hook_();
  }

  // Handles the next message between refits: a refit (true) or the shutdown (false).
  // Between refits the wait has no bound but the trainer's life: the mailbox's liveness check
  // (every 500 ms) ends it when the store's host is gone or any rank recorded a failure.
  // refit.timeout_s bounds each step of a refit in flight, not the gap between refits, which
  // lasts a rollout and a training step.
  Result<bool> next() {
    Result<Message> msg = mailbox_->receive(timeout());
    while (!msg.ok()) {
      if (msg.status().code() == StatusCode::kTimeout) {
        log::debug("{}: no refit for {} s; the trainer is alive, waiting on", id(),
                   cfg_.refit.timeout_s);
      } else if (uses_transfer_plan(cfg_) &&
                 (epochs_.failed() || mailbox_->kept_epoch() > epochs_.current())) {
        REFIT_RETURN_IF_ERROR(catch_up());
      } else {
        break;
      }
      msg = mailbox_->receive(timeout());
    }
    if (!msg.ok())
      return msg.status().with_context(
          fmt::format("{} waiting for the next refit from {}", id(), feeders()[0]));
    switch (msg->type) {
      case MessageType::kBegin: {
        REFIT_ASSIGN_OR_RETURN(begin_, decode_begin(msg->payload, msg->from));
        in_refit_ = true;
        REFIT_RETURN_IF_ERROR(refit(msg->from));
        in_refit_ = false;
        return true;
      }
      case MessageType::kShutdown: {
        // Every feeder says so; each is answered at once (its shutdown waits for the answer).
        std::vector<std::string> pending = feeders();
        std::string from = msg->from;
        while (true) {
          const auto it = std::find(pending.begin(), pending.end(), from);
          if (it == pending.end())
            return Status::Corruption(fmt::format("{}: unexpected shutdown from {}", id(), from));
          pending.erase(it);
          REFIT_RETURN_IF_ERROR(mailbox_->send(from, MessageType::kShutdown, ""));
          if (pending.empty()) {
            if (heartbeat_) heartbeat_->leave();
            return false;
          }
          REFIT_ASSIGN_OR_RETURN(Message m, expect_message(*mailbox_, MessageType::kShutdown,
                                                           timeout(), "the shutdown"));
          from = m.from;
        }
      }
      case MessageType::kHello:
      case MessageType::kBucket:
      case MessageType::kBucketDone:
      case MessageType::kCommit:
      case MessageType::kCommitted:
      case MessageType::kVerified:
      case MessageType::kPaused:
      case MessageType::kRoutes:
      case MessageType::kOutcome:
      case MessageType::kProceed:
        return Status::Internal(fmt::format("{}: unexpected {} from {} between refits", id(),
                                            message_type_name(msg->type), msg->from));
    }
    return Status::Internal("unreachable");
  }

  const Config cfg_;
  const Endpoint ep_;
  const Fault fault_;
  const int rank_;
  const int tp_rank_;
  std::unique_ptr<RankModel> model_;
  EngineShardLayout layout_;
  std::vector<TensorSlot> slots_;
  std::vector<void*> ptrs_;  // registered storage of slots_
  std::unique_ptr<DataPlane> plane_;
  std::unique_ptr<Store> store_;
  // Liveness checks and failure records: requests bounded by kBeatRequestTimeout.
  std::unique_ptr<Store> probe_store_;
  std::unique_ptr<Mailbox> mailbox_;
  std::unique_ptr<Communicator> p2p_comm_;
  std::unique_ptr<RouteSetup> routes_;  // the transfer plan (before the executor that uses it)
  std::unique_ptr<EngineExecutor> executor_;
  std::unique_ptr<RefitProbe> probe_;  // fault injection (tests)
  BeginMessage begin_;  // of the refit in progress
  bool in_refit_ = false;  // from its begin until it published or failed
  std::vector<std::string> param_handles_;  // CUDA: IPC handles of the registered parameters
  std::optional<ExportedParams> export_;    // exported_params(), until the next registration
  bool export_failed_ = false;              // a registered parameter cannot be exported
  RankTraffic traffic_;
  TrafficPublisher traffic_publisher_;
  std::string version_ = "0";
  bool valid_ = true;  // false from the moment a refit may write until it publishes
  std::string run_id_;
  std::unique_ptr<PlaneBuffer> exported_;  // allocate_params(): parameters the trainer maps
  std::string export_handle_;
  std::function<Status()> pause_hook_;
  std::function<void()> resume_hook_;
  std::function<Status(int, const std::string&)> verify_hook_;
  std::function<Status(const std::vector<ParamView>&)> load_hook_;
  Status failed_refit_;  // serve_one(): the refit failed, the session did not
  // refit.keep_previous: the copy of the parameters and the copy lists to and from it.
  struct Kept {
    std::unique_ptr<PlaneBuffer> buffer;
    std::vector<CopyRun> save, restore;
  };
  std::unique_ptr<Kept> keep_;
  std::string kept_version_;  // the version in keep_ for the refit in flight ("" for none)
  int checksums_passed_ = 0;
  FailureLatch latch_;
  RefitEpochs epochs_;  // refits that failed in flight (runtime/failure.h)
  std::uint32_t groups_epoch_ = 0;  // the refit epoch the groups were formed for
  std::mutex comm_mu_;  // the group, replaced on the main thread, aborted from the heartbeat's
  // Last: destroyed first, so that its thread is gone before the collectives it may abort.
  std::unique_ptr<Heartbeat> heartbeat_;
};

}  // namespace

Result<std::unique_ptr<Engine>> create_engine_with_fault(const Config& config, int engine_rank,
                                                         const Endpoint& endpoint,
                                                         const Fault& fault) {
  if (engine_rank < 0 || engine_rank >= config.engine_ranks())
    return Status::InvalidArgument(
        fmt::format("engine rank {} is outside 0..{} (engine index * generation.tp_size + tp rank)",
                    engine_rank, config.engine_ranks() - 1));
  REFIT_RETURN_IF_ERROR(env::check());  // a bad REFIT_* value is a setup error, before joining
  Fault armed = fault;
  armed.stall_ms = static_cast<int>(config.refit.timeout_s * 2500);
  auto e = std::make_unique<EngineImpl>(config, engine_rank, endpoint, armed);
  REFIT_RETURN_IF_ERROR(e->init());
  return std::unique_ptr<Engine>(std::move(e));
}

Result<std::unique_ptr<Engine>> Engine::create(const Config& config, int engine_rank,
                                               const Endpoint& endpoint) {
  return create_engine_with_fault(config, engine_rank, endpoint, Fault{});
}

}  // namespace refit
