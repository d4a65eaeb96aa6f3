// refit::Engine: one engine rank. Writes into the caller's registered parameters (its TP shard in
// the engine layout), applies buckets as they arrive, and bumps its weight version only when the
// whole refit arrived (commit).
#include <fmt/format.h>
#include <signal.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "comm/communicator.h"
#include "common/env.h"
#include "common/log.h"
#include "common/timer.h"
#include "control/mailbox.h"
#include "control/store.h"
#include "engine/engine_layout.h"
#include "refit/session.h"
#include "executor/applier.h"
#include "plane/data_plane.h"
#include "runtime/failure.h"
#include "runtime/fault.h"
#include "plane/groups.h"
#include "control/messages.h"
#include "runtime/protocol.h"
#include "executor/route_receiver.h"
#include "executor/routes.h"
#include "runtime/schedule.h"
#include "weights/setup.h"
#include "runtime/slots.h"
#include "runtime/traffic.h"
#include "transport/transport.h"

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
    return latch_.guard(body, store_.get(), id(), [this] {
      if (update_comm_) update_comm_->abort();
    });
  }

  Status init() {
    return guarded([&] { return setup(); });
  }

  const std::vector<TensorSlot>& params() const override { return slots_; }
  Status register_param(const std::string& name, void* data, DType dtype,
                        const std::vector<std::int64_t>& shape) override {
    REFIT_RETURN_IF_ERROR(register_slot(slots_, ptrs_, id(), name, data, dtype, shape));
    plan_runs_.clear();  // they hold the registered addresses: rebuilt at the next refit
    sglang_runs_.clear();
    if (route_receiver_) route_receiver_->invalidate();
    param_handles_.clear();
    export_failed_ = false;
    return Status::Ok();
  }
  void on_pause(std::function<void()> hook) override { pause_hook_ = std::move(hook); }
  void on_resume(std::function<void()> hook) override { resume_hook_ = std::move(hook); }
  void on_verify(std::function<Status(int, const std::string&)> hook) override {
    verify_hook_ = std::move(hook);
  }
  std::string weight_version() const override { return version_; }

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
                                    fmt::format("/refit-{}-e{}", run_id_, rank_), &export_handle_));
      for (std::size_t i = 0; i < slots_.size(); ++i) {
        ptrs_[i] = exported_->data() + offsets[i];
        out.push_back(ptrs_[i]);
      }
      return Status::Ok();
    });
    if (!st.ok()) return st;
    return out;
  }

  Result<bool> serve_one() override {
    bool committed = false;
    Status st = guarded([&]() -> Status {
      REFIT_ASSIGN_OR_RETURN(committed, next());
      return Status::Ok();
    });
    if (!st.ok()) return st;
    return committed;
  }

  Status serve() override {
    while (true) {
      REFIT_ASSIGN_OR_RETURN(bool more, serve_one());
      if (!more) return Status::Ok();
    }
  }

 private:
  std::string id() const {
    return fmt::format("engine {} tp rank {}", rank_ / cfg_.generation.tp_size, tp_rank_);
  }
  // Forms group `name` (this process rank `rank` of `size`) on the plane's backend; every wait in
  // it also checks the run's first failure.
  Result<std::unique_ptr<Communicator>> join_group(const char* name, int rank, int size) {
    return make_group(*store_,
                      GroupOptions{.name = name,
                                   .rank = rank,
                                   .size = size,
                                   .host = ep_.host,
                                   .timeout = timeout(),
                                   .liveness = liveness_check(*store_, id())},
                      *plane_);
  }
  std::chrono::milliseconds timeout() const {
    return std::chrono::milliseconds(static_cast<long long>(cfg_.refit.timeout_s * 1000));
  }
  bool vllm() const { return cfg_.generation.backend == EngineProtocol::kVllm; }
  bool broadcast_mode() const {
    return cfg_.generation.weight_transfer_mode == TransferMode::kBroadcast;
  }

  Status setup() {
    REFIT_ASSIGN_OR_RETURN(model_, load_rank_model(cfg_));
    REFIT_ASSIGN_OR_RETURN(layout_, engine_layout(model_->spec, cfg_.generation.tp_size, tp_rank_));
    for (const EngineParam& p : layout_.params)
      slots_.push_back(TensorSlot{p.name, p.shape, cfg_.refit.target_precision});
    ptrs_.assign(slots_.size(), nullptr);
    REFIT_ASSIGN_OR_RETURN(const int device, default_device(cfg_, false, rank_));
    REFIT_ASSIGN_OR_RETURN(plane_, make_data_plane(cfg_, device));
    REFIT_ASSIGN_OR_RETURN(store_, connect_store(ep_.master_addr, ep_.master_port, timeout()));
    REFIT_ASSIGN_OR_RETURN(run_id_, store_->get("run_id", timeout()));
    REFIT_ASSIGN_OR_RETURN(
        mailbox_, Mailbox::open(*store_, fmt::format("engine/{}", rank_), ep_.host, timeout()));
    mailbox_->set_liveness_check(liveness_check(*store_, id()), std::chrono::milliseconds(500));
    std::string plan_hash = model_->plan.hash_hex();
    if (uses_transfer_plan(cfg_)) {
      REFIT_RETURN_IF_ERROR(setup_routes());
      plan_hash = routes_->plan.hash_hex();
    } else {
      REFIT_RETURN_IF_ERROR(setup_gather());
    }
    // Announce ourselves (with the vLLM manifest hash): the trainer's setup waits for this.
    if (fault_.kind == Fault::Kind::kPlanMismatch) plan_hash = "0000000000000000";
    const HelloMessage hello{.refit_version = fault_.kind == Fault::Kind::kVersionMismatch
                                                  ? std::string(version()) + "+mismatch"
                                                  : std::string(version()),
                             .engine_rank = rank_,
                             .protocol = std::string(engine_protocol_name(cfg_.generation.backend)),
                             .plan_hash = plan_hash,
                             .total_parameters = model_->spec.total_parameters()};
    REFIT_RETURN_IF_ERROR(send_feeders(MessageType::kHello, encode(hello)));
    if (route_receiver_ && !vllm()) REFIT_RETURN_IF_ERROR(receive_route_metadata());
    return Status::Ok();
  }

  // SGLang protocol: each feeder says which routes it will send here, and those are what this rank
  // receives and places (its own derivation of the plan only names the feeders).
  Status receive_route_metadata() {
    IncomingRoutes in;
    std::vector<bool> seen(feeders_.size(), false);
    for (std::size_t got = 0; got < feeders_.size(); ++got) {
      REFIT_ASSIGN_OR_RETURN(Message m, expect_message(*mailbox_, MessageType::kRoutes, timeout(),
                                                       "the feeders' route metadata"));
      const auto it = std::find(feeders_.begin(), feeders_.end(), m.from);
      if (it == feeders_.end() || seen[static_cast<std::size_t>(it - feeders_.begin())])
        return Status::Corruption(fmt::format(
            "{}: unexpected route metadata from {} (not a feeder, or sent twice)", id(), m.from));
      seen[static_cast<std::size_t>(it - feeders_.begin())] = true;
      REFIT_ASSIGN_OR_RETURN(RoutesMessage routes, decode_routes(m.payload, m.from));
      const int trainer =
          control_sources(routes_->plan, rank_)[static_cast<std::size_t>(it - feeders_.begin())];
      REFIT_RETURN_IF_ERROR(add_routes_metadata(in, routes, trainer, layout_,
                                                cfg_.refit.target_precision));
    }
    finish_incoming(in);
    route_receiver_->set_incoming(std::move(in));
    return Status::Ok();
  }

  // Full buckets from one feeder: trainer rank 0 (broadcast) or the colocated trainer rank (ipc).
  Status setup_gather() {
    TransportOptions topt{cfg_.refit.num_buffers,
                          static_cast<std::size_t>(cfg_.refit.buffer_size_bytes), timeout()};
    if (broadcast_mode()) {
      feeders_ = {"trainer/0"};
      REFIT_ASSIGN_OR_RETURN(update_comm_,
                             join_group("update", 1 + rank_, 1 + cfg_.engine_ranks()));
      REFIT_ASSIGN_OR_RETURN(receiver_,
                             make_broadcast_receiver(*update_comm_, *mailbox_, *plane_, topt));
    } else {
      feeders_ = {fmt::format("trainer/{}", rank_)};
      REFIT_ASSIGN_OR_RETURN(receiver_,
                             make_ipc_receiver(*mailbox_, *store_, *plane_, feeders_[0],
                                               ipc_segment_prefix(run_id_, rank_), topt));
    }
    return Status::Ok();
  }

  // The transfer plan: the trainer ranks that feed this rank, where they run, and the
  // point-to-point group.
  Status setup_routes() {
    REFIT_ASSIGN_OR_RETURN(RouteSetup s, make_route_setup(cfg_, model_->spec));
    routes_ = std::make_unique<RouteSetup>(std::move(s));
    REFIT_RETURN_IF_ERROR(publish_host(*store_, fmt::format("engine/{}", rank_)));
    RouteReceiverOptions o;
    o.config = &cfg_;
    o.engine_rank = rank_;
    o.setup = routes_.get();
    o.plane = plane_.get();
    o.sources = control_sources(routes_->plan, rank_);
    for (int r : o.sources) feeders_.push_back(fmt::format("trainer/{}", r));
    REFIT_ASSIGN_OR_RETURN(auto hosts, read_hosts(*store_, feeders_, timeout()));
    for (std::size_t i = 0; i < hosts.size(); ++i) {
      o.source_same_host.push_back(hosts[i] == host_identity());
      REFIT_RETURN_IF_ERROR(
          check_pair_at_setup(cfg_, o.source_same_host.back(), o.sources[i], rank_));
    }
    if (needs_p2p_group(cfg_)) {
      REFIT_ASSIGN_OR_RETURN(p2p_comm_, join_group("p2p", p2p_rank_of_engine(cfg_, rank_),
                                                   cfg_.policy.world_size + cfg_.engine_ranks()));
      o.p2p = p2p_comm_.get();
    }
    o.incoming = incoming_from_plan(routes_->plan, rank_);
    REFIT_ASSIGN_OR_RETURN(route_receiver_, RouteReceiver::create(o));
    return Status::Ok();
  }

  // Where our parameters are for peer access: the region refit allocated (allocate_params), or,
  // on CUDA, an IPC handle per registered parameter (exported once per registration). Nothing when
  // the storage cannot be shared (host memory the caller allocated): point-to-point serves then.
  std::optional<ExportedParams> exported_params() {
    if (exported_) {
      ExportedParams e;
      e.handle = export_handle_;
      e.bytes = exported_->size();
      for (void* p : ptrs_)
        e.offsets.push_back(
            static_cast<std::uint64_t>(static_cast<std::byte*>(p) - exported_->data()));
      return e;
    }
    if (cfg_.device != Device::kCuda || export_failed_) return std::nullopt;
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
          return std::nullopt;
        }
        param_handles_.push_back(std::move(h).value());
      }
    }
    ExportedParams e;
    e.handles = param_handles_;
    return e;
  }

  Status send_feeders(MessageType type, const std::string& payload) {
    for (const std::string& f : feeders_) REFIT_RETURN_IF_ERROR(mailbox_->send(f, type, payload));
    return Status::Ok();
  }

  // One message of `type` from every feeder (any order), starting with `first` from `from`.
  Status expect_from_every_feeder(MessageType type, const std::string& from, const char* what) {
    std::vector<bool> seen(feeders_.size(), false);
    std::size_t got = 0;
    auto mark = [&](const std::string& who) -> Status {
      const auto it = std::find(feeders_.begin(), feeders_.end(), who);
      if (it == feeders_.end() || seen[static_cast<std::size_t>(it - feeders_.begin())])
        return Status::Corruption(fmt::format("{}: unexpected {} from {}", id(),
                                              message_type_name(type), who));
      seen[static_cast<std::size_t>(it - feeders_.begin())] = true;
      ++got;
      return Status::Ok();
    };
    if (!from.empty()) REFIT_RETURN_IF_ERROR(mark(from));
    while (got < feeders_.size()) {
      REFIT_ASSIGN_OR_RETURN(Message m, expect_message(*mailbox_, type, timeout(), what));
      if (type == MessageType::kBegin) {
        REFIT_ASSIGN_OR_RETURN(BeginMessage b, decode_begin(m.payload, m.from));
        if (b.step != begin_.step || b.raw != begin_.raw)
          return Status::Corruption(fmt::format(
              "{}: {} began step {}{}, {} began step {}{}", id(), feeders_[0], begin_.step,
              begin_.raw ? " (raw)" : "", m.from, b.step, b.raw ? " (raw)" : ""));
      }
      REFIT_RETURN_IF_ERROR(mark(m.from));
    }
    return Status::Ok();
  }

  void maybe_fault(int step, int bucket) {
    const Fault& f = fault_;
    if (step != 1 || f.bucket != bucket || f.rank != rank_) return;
    if (f.kind == Fault::Kind::kKillEngine) {
      log::info("fault injection: killing myself at bucket {}", bucket);
      raise(SIGKILL);
    }
  }

  // Apply runs as copies into the registered parameters; the source (the slot) is given per call.
  std::vector<CopyRun> copy_runs(const std::vector<ApplyRun>& runs) const {
    std::vector<CopyRun> out;
    out.reserve(runs.size());
    for (const ApplyRun& r : runs)
      out.push_back(CopyRun{.src = nullptr, .dst = static_cast<std::byte*>(ptrs_[r.param]), .block = r.block});
    return out;
  }

  Status apply(const IncomingBucket& in, bool raw) {
    Timer t;
    const DType dt = cfg_.refit.target_precision;
    if (raw) {  // bench: the bare copy out of the transport buffer
      if (!broadcast_mode()) {
        if (!scratch_ || scratch_->size() < in.header.bytes) {
          REFIT_ASSIGN_OR_RETURN(scratch_, plane_->allocate(in.header.bytes));
        }
        REFIT_RETURN_IF_ERROR(plane_->copy_bytes(scratch_->data(), in.data, in.header.bytes));
      }
    } else {
      const std::vector<CopyRun>* runs = nullptr;
      if (vllm()) {
        if (in.header.bucket < 0 || in.header.bucket >= static_cast<int>(plan_runs_.size()))
          return Status::Corruption(
              fmt::format("vllm: bucket {} is not in the manifest ({} "
                          "buckets)",
                          in.header.bucket, plan_runs_.size()));
        runs = &plan_runs_[in.header.bucket];
      } else {
        // The metadata of a bucket is the same every refit (the trainer's plan is fixed), so the
        // decoded runs are kept per bucket and reused while the metadata is unchanged: a device
        // plane then finds its uploaded copy table again.
        auto& cached = sglang_runs_[in.header.bucket];
        if (cached.first != in.header.meta) {
          REFIT_ASSIGN_OR_RETURN(
              auto entries, decode_sglang_meta(model_->spec, in.header.meta, dt, in.header.bucket));
          cached = {in.header.meta,
                    copy_runs(build_apply_runs(model_->spec, layout_, entries, dt))};
        }
        runs = &cached.second;
      }
      REFIT_RETURN_IF_ERROR(plane_->copy(*runs, dt, dt, in.data));  // from the slot it arrived in
    }
    {
      std::lock_guard lock(apply_mu_);
      apply_seconds_ += t.seconds();
      applied_++;
    }
    return receiver_->release(in);
  }

  // One refit of the gather executor: every bucket of the plan from the one feeder.
  Status refit_buckets() {
    const BeginMessage& begin = begin_;
    const int step = begin.step;
    const int buckets = begin.buckets;
    const bool raw = begin.raw;
    if (buckets != static_cast<int>(model_->plan.buckets.size()) && vllm())
      return Status::InvalidArgument(
          fmt::format("vllm: the trainer announced {} buckets, the manifest has {}", buckets,
                      model_->plan.buckets.size()));
    if (!raw) REFIT_RETURN_IF_ERROR(check_registered(slots_, ptrs_, id()));
    if (vllm() && plan_runs_.empty()) {  // the manifest is fixed: every bucket's runs, once
      for (const Bucket& b : model_->plan.buckets)
        plan_runs_.push_back(copy_runs(
            build_apply_runs(model_->spec, layout_, b.entries, cfg_.refit.target_precision)));
    }
    log::debug("pause generation for refit step {} ({} buckets)", step, buckets);
    if (pause_hook_ && !raw) pause_hook_();
    apply_seconds_ = 0;
    applied_ = 0;
    for (int b = 0; b < buckets; ++b) {
      std::optional<BucketHeader> expected;
      if (vllm() && broadcast_mode()) {
        BucketHeader h;
        h.step = step;
        h.bucket = b;
        h.bytes = static_cast<std::size_t>(model_->plan.buckets[b].bytes);
        expected = h;
      }
      if (!raw) maybe_fault(step, b);
      REFIT_ASSIGN_OR_RETURN(IncomingBucket in, receiver_->receive(expected));
      if (in.header.bucket != b || in.header.step != step)
        return Status::Internal(
            fmt::format("expected bucket {} of step {}, received bucket {} "
                        "of step {}",
                        b, step, in.header.bucket, in.header.step));
      REFIT_RETURN_IF_ERROR(applier_.error());
      applier_.post([this, in, raw] { return apply(in, raw); });
    }
    REFIT_RETURN_IF_ERROR(applier_.drain(timeout()));
    REFIT_RETURN_IF_ERROR(expect_from_every_feeder(MessageType::kCommit, "", "the commit"));
    if (applied_ != buckets)
      return Status::Internal(
          fmt::format("commit of step {} after {} of {} buckets", step, applied_, buckets));
    traffic_ = RankTraffic{.role = "engine", .rank = rank_,
                           .bytes_received = model_->plan.payload_bytes};
    return finish(apply_seconds_);
  }

  // One refit of the transfer plan: every feeder begins, we pause once and tell each whether our
  // parameters are exported; peer feeders write them, point-to-point segments arrive here.
  Status refit_routes(const std::string& first_from) {
    const bool raw = begin_.raw;
    REFIT_RETURN_IF_ERROR(expect_from_every_feeder(MessageType::kBegin, first_from, "begins"));
    if (!raw) REFIT_RETURN_IF_ERROR(check_registered(slots_, ptrs_, id()));
    log::debug("pause generation for refit step {}", begin_.step);
    if (pause_hook_ && !raw) pause_hook_();
    const std::optional<ExportedParams> exported = exported_params();
    REFIT_RETURN_IF_ERROR(route_receiver_->choose(exported.has_value()));
    REFIT_RETURN_IF_ERROR(
        send_feeders(MessageType::kPaused, encode(PausedMessage{.direct = exported})));
    REFIT_RETURN_IF_ERROR(route_receiver_->receive(begin_.step, raw, ptrs_, applier_, fault_));
    REFIT_RETURN_IF_ERROR(applier_.drain(timeout()));
    REFIT_RETURN_IF_ERROR(expect_from_every_feeder(MessageType::kCommit, "", "the commit"));
    // Every peer feeder has mapped the exported memory by now: its name may go.
    if (exported_ && route_receiver_->peer_sources() > 0) exported_->release_name();
    traffic_ = RankTraffic{.role = "engine",
                           .rank = rank_,
                           .bytes_received = route_receiver_->bytes_received(),
                           .peer_pairs = route_receiver_->peer_sources(),
                           .p2p_pairs = route_receiver_->p2p_sources()};
    return finish(route_receiver_->apply_seconds());
  }

  // After a complete refit: publish the version, resume, acknowledge, verify.
  Status finish(double apply_s) {
    const bool raw = begin_.raw;
    if (!raw) version_ = begin_.version;  // only a complete refit publishes a new version
    log::debug("resume generation at weight version {}", version_);
    if (resume_hook_ && !raw) resume_hook_();
    REFIT_RETURN_IF_ERROR(publish_traffic(*store_, traffic_));
    REFIT_RETURN_IF_ERROR(send_feeders(
        MessageType::kCommitted,
        encode(CommittedMessage{.version = version_,
                                .apply_s = apply_s,
                                .bytes_received = traffic_.bytes_received})));
    if (begin_.verify) {
      Status v = verify_hook_ ? verify_hook_(begin_.step, version_)
                              : Status::Unsupported(id() +
                                                    ": verification was asked for but this "
                                                    "engine has no verification hook");
      REFIT_RETURN_IF_ERROR(send_feeders(
          MessageType::kVerified,
          encode(VerifiedMessage{.verified = v.ok(), .error = v.ok() ? "" : v.message()})));
      if (!v.ok()) return v;
    }
    return Status::Ok();
  }

  // Handles the next message between refits: a refit (true) or the shutdown (false).
  Result<bool> next() {
    auto msg = mailbox_->receive(timeout());
    if (!msg.ok())
      return msg.status().with_context(
          fmt::format("{} waiting for the next refit from {}", id(), feeders_[0]));
    switch (msg->type) {
      case MessageType::kBegin: {
        REFIT_ASSIGN_OR_RETURN(begin_, decode_begin(msg->payload, msg->from));
        if (route_receiver_)
          REFIT_RETURN_IF_ERROR(refit_routes(msg->from));
        else
          REFIT_RETURN_IF_ERROR(refit_buckets());
        return true;
      }
      case MessageType::kShutdown: {
        // Every feeder says so; each is answered at once (its shutdown waits for the answer).
        std::vector<std::string> pending = feeders_;
        std::string from = msg->from;
        while (true) {
          const auto it = std::find(pending.begin(), pending.end(), from);
          if (it == pending.end())
            return Status::Corruption(fmt::format("{}: unexpected shutdown from {}", id(), from));
          pending.erase(it);
          REFIT_RETURN_IF_ERROR(mailbox_->send(from, MessageType::kShutdown, ""));
          if (pending.empty()) return false;
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
  std::unique_ptr<PlaneBuffer> scratch_;
  std::unique_ptr<DataPlane> plane_;
  std::vector<std::vector<CopyRun>> plan_runs_;
  std::map<int, std::pair<std::string, std::vector<CopyRun>>> sglang_runs_;  // bucket: meta, runs
  std::unique_ptr<Store> store_;
  std::unique_ptr<Mailbox> mailbox_;
  std::unique_ptr<Communicator> update_comm_;
  std::unique_ptr<BucketReceiver> receiver_;
  std::vector<std::string> feeders_;  // mailbox ids of the trainer ranks that feed this rank
  std::unique_ptr<RouteSetup> routes_;  // transfer plan (every executor but gather)
  std::unique_ptr<RouteReceiver> route_receiver_;
  std::unique_ptr<Communicator> p2p_comm_;
  BeginMessage begin_;  // of the refit in progress
  std::vector<std::string> param_handles_;  // CUDA: IPC handles of the registered parameters
  bool export_failed_ = false;              // a registered parameter cannot be exported
  RankTraffic traffic_;
  std::string version_ = "0";
  std::string run_id_;
  std::unique_ptr<PlaneBuffer> exported_;  // allocate_params(): parameters the trainer maps
  std::string export_handle_;
  std::function<void()> pause_hook_, resume_hook_;
  std::function<Status(int, const std::string&)> verify_hook_;
  FailureLatch latch_;
  std::mutex apply_mu_;
  double apply_seconds_ = 0;
  int applied_ = 0;
  Applier applier_;
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
  auto e = std::make_unique<EngineImpl>(config, engine_rank, endpoint, fault);
  REFIT_RETURN_IF_ERROR(e->init());
  return std::unique_ptr<Engine>(std::move(e));
}

Result<std::unique_ptr<Engine>> Engine::create(const Config& config, int engine_rank,
                                               const Endpoint& endpoint) {
  return create_engine_with_fault(config, engine_rank, endpoint, Fault{});
}

}  // namespace refit
