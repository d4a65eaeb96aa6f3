// refit::Trainer: one trainer rank. Reads the caller's registered shards, unshards bucket by bucket
// with the rest of the trainer group and — when it feeds engines — packs and hands buckets to its
// transport.
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>

#include "comm/communicator.h"
#include "common/env.h"
#include "common/log.h"
#include "common/timer.h"
#include "control/mailbox.h"
#include "control/store.h"
#include "engine/engine_layout.h"
#include "io/safetensors.h"
#include "plan/bucket_plan.h"
#include "refit/session.h"
#include "plane/data_plane.h"
#include "runtime/failure.h"
#include "runtime/fault.h"
#include "plane/groups.h"
#include "control/messages.h"
#include "runtime/protocol.h"
#include "executor/route_sender.h"
#include "executor/routes.h"
#include "runtime/schedule.h"
#include "weights/setup.h"
#include "runtime/slots.h"
#include "runtime/traffic.h"
#include "transport/transport.h"

namespace refit {
namespace {

class TrainerImpl final : public Trainer {
 public:
  TrainerImpl(const Config& cfg, int rank, const Endpoint& ep) : cfg_(cfg), ep_(ep), rank_(rank) {}

  // Every entry point runs through the latch (runtime/failure.h).
  Status guarded(const std::function<Status()>& body) {
    return latch_.guard(body, store_.get(), id(), [this] {
      if (trainer_comm_) trainer_comm_->abort();
      if (update_comm_) update_comm_->abort();
    });
  }

  Status init() {
    return guarded([&] { return setup(); });
  }

  const std::vector<TensorSlot>& tensors() const override { return slots_; }

  Status register_tensor(const std::string& name, void* data, DType dtype,
                         const std::vector<std::int64_t>& shape) override {
    REFIT_RETURN_IF_ERROR(register_slot(slots_, ptrs_, id(), name, data, dtype, shape));
    // Copy lists hold the registered addresses: rebuild them at the next refit.
    bucket_runs_.clear();
    if (route_sender_) route_sender_->invalidate();
    return Status::Ok();
  }

  Status refit(int step, const std::string& version, bool verify) override {
    return guarded([&]() -> Status {
      REFIT_RETURN_IF_ERROR(check_registered(slots_, ptrs_, id()));
      if (trainer_comm_) REFIT_RETURN_IF_ERROR(trainer_comm_->barrier());
      phase_ = {};
      Timer t;
      REFIT_RETURN_IF_ERROR(refit_once(step, version, verify, false));
      if (trainer_comm_) REFIT_RETURN_IF_ERROR(trainer_comm_->barrier());
      stats_.seconds = t.seconds();
      stats_.unshard_s = phase_.unshard;
      stats_.cast_pack_s = phase_.cast_pack;
      stats_.transfer_s = phase_.transfer;
      stats_.apply_s = phase_.apply;
      stats_.bytes = model_->plan.payload_bytes;
      stats_.buckets = buckets_per_refit();
      REFIT_RETURN_IF_ERROR(publish_traffic(*store_, traffic_));
      if (verify)
        REFIT_RETURN_IF_ERROR(collect_verification().with_context(fmt::format("step {}", step)));
      return Status::Ok();
    });
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

  std::int64_t bytes_per_refit() const override { return model_->plan.payload_bytes; }
  int buckets_per_refit() const override {
    return routes_ ? routes_->plan.rounds : static_cast<int>(model_->plan.buckets.size());
  }
  std::string plan_hash() const override {
    return routes_ ? routes_->plan.hash_hex() : model_->plan.hash_hex();
  }
  Result<std::vector<RankTraffic>> traffic() override {
    return read_traffic(*store_, cfg_, timeout());
  }

  Status shutdown() override {
    return guarded([&] { return do_shutdown(); });
  }

  // Test hook: fault injection of `refit run --fault` (step 1 only).
  void set_fault(const Fault& f) { fault_ = f; }

 private:
  std::string id() const { return fmt::format("trainer rank {}", rank_); }
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
  bool broadcast_mode() const {
    return cfg_.generation.weight_transfer_mode == TransferMode::kBroadcast;
  }
  bool feeds() const { return !fed_engines_.empty(); }

  Status setup() {
    const int world = cfg_.policy.world_size;
    progress_ = rank_ == 0 && isatty(2);
    REFIT_ASSIGN_OR_RETURN(model_, load_rank_model(cfg_));
    REFIT_ASSIGN_OR_RETURN(const int device, default_device(cfg_, true, rank_));
    REFIT_ASSIGN_OR_RETURN(plane_, make_data_plane(cfg_, device));
    const ModelSpec& spec = model_->spec;
    // Every rank's layout: this rank packs its own shards and scatters everyone's contribution.
    for (int r = 0; r < world; ++r) {
      REFIT_ASSIGN_OR_RETURN(auto lay, trainer_layout(spec, cfg_.policy, r));
      layouts_.push_back(std::move(lay));
    }
    gather_ = build_gather_schedule(spec, model_->plan, layouts_);
    // The caller registers the storage of each local shard, in the policy dtype.
    for (const LocalTensor& t : layouts_[rank_].tensors)
      slots_.push_back(TensorSlot{t.name, t.shape, cfg_.policy.dtype});
    ptrs_.assign(slots_.size(), nullptr);

    // Control plane: trainer rank 0 hosts the store.
    if (rank_ == 0) {
      REFIT_ASSIGN_OR_RETURN(server_, StoreServer::start(ep_.master_addr, ep_.master_port));
    }
    REFIT_ASSIGN_OR_RETURN(store_, connect_store(ep_.master_addr, ep_.master_port, timeout()));
    if (rank_ == 0)
      REFIT_RETURN_IF_ERROR(store_->set("run_id", fmt::format("{}-{}", getpid(), time(nullptr))));
    REFIT_ASSIGN_OR_RETURN(std::string run_id, store_->get("run_id", timeout()));
    REFIT_RETURN_IF_ERROR(check_trainer_versions(world));
    REFIT_ASSIGN_OR_RETURN(
        mailbox_, Mailbox::open(*store_, fmt::format("trainer/{}", rank_), ep_.host, timeout()));
    mailbox_->set_liveness_check(liveness_check(*store_, id()), std::chrono::milliseconds(500));
    if (world > 1) {
      REFIT_ASSIGN_OR_RETURN(trainer_comm_, join_group("trainer", rank_, world));
    }
    if (uses_transfer_plan(cfg_)) {
      REFIT_RETURN_IF_ERROR(setup_routes());
      if (trainer_comm_) REFIT_RETURN_IF_ERROR(trainer_comm_->barrier());
      return Status::Ok();
    }
    // Which engine ranks this rank feeds, and the transport to them.
    const int engines = cfg_.engine_ranks();
    TransportOptions topt{cfg_.refit.num_buffers,
                          static_cast<std::size_t>(cfg_.refit.buffer_size_bytes), timeout()};
    const bool sglang = cfg_.generation.backend == EngineProtocol::kSglang;
    if (broadcast_mode()) {
      if (rank_ == 0) {
        for (int g = 0; g < engines; ++g) fed_engines_.push_back(fmt::format("engine/{}", g));
        REFIT_ASSIGN_OR_RETURN(update_comm_, join_group("update", 0, 1 + engines));
        REFIT_ASSIGN_OR_RETURN(sender_, make_broadcast_sender(*update_comm_, *mailbox_, *plane_,
                                                              fed_engines_, sglang, topt));
      }
    } else {
      fed_engines_.push_back(fmt::format("engine/{}", rank_));
      REFIT_ASSIGN_OR_RETURN(sender_, make_ipc_sender(*mailbox_, *store_, *plane_, fed_engines_[0],
                                                      ipc_segment_prefix(run_id, rank_), topt));
    }
    const auto bucket_bytes = static_cast<std::size_t>(model_->plan.max_bucket_bytes);
    if (feeds() || world > 1) {
      REFIT_ASSIGN_OR_RETURN(stage_, plane_->allocate(bucket_bytes));
    }
    if (world > 1) {
      REFIT_ASSIGN_OR_RETURN(send_, plane_->allocate(bucket_bytes));
    }
    if (feeds()) {
      REFIT_RETURN_IF_ERROR(check_engines());
      sender_->on_receivers_attached();
    }
    // Bytes per refit: this rank's all-gather contribution, and what it hands to its transport.
    traffic_ = RankTraffic{.role = "trainer", .rank = rank_};
    if (world > 1)
      for (const BucketGather& g : gather_)
        traffic_.bytes_sent += static_cast<std::int64_t>(g.counts[static_cast<std::size_t>(rank_)]);
    if (feeds())
      traffic_.bytes_sent += model_->plan.payload_bytes *
                             (broadcast_mode() ? 1 : static_cast<std::int64_t>(fed_engines_.size()));
    // Setup is complete on every trainer rank before the first refit.
    if (trainer_comm_) REFIT_RETURN_IF_ERROR(trainer_comm_->barrier());
    return Status::Ok();
  }

  // The transfer plan: this rank's targets, where they run, the point-to-point group, and the
  // engines' hellos.
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
    o.targets = control_targets(routes_->plan, rank_);
    std::vector<std::string> who;
    for (int g : o.targets) who.push_back(fmt::format("engine/{}", g));
    REFIT_ASSIGN_OR_RETURN(auto hosts, read_hosts(*store_, who, timeout()));
    for (std::size_t i = 0; i < hosts.size(); ++i) {
      o.target_same_host.push_back(hosts[i] == host_identity());
      REFIT_RETURN_IF_ERROR(
          check_pair_at_setup(cfg_, o.target_same_host.back(), rank_, o.targets[i]));
    }
    if (needs_p2p_group(cfg_)) {
      REFIT_ASSIGN_OR_RETURN(p2p_comm_, join_group("p2p", p2p_rank_of_trainer(rank_),
                                                   cfg_.policy.world_size + cfg_.engine_ranks()));
      o.p2p = p2p_comm_.get();
    }
    REFIT_ASSIGN_OR_RETURN(route_sender_, RouteSender::create(o));
    fed_engines_ = route_sender_->engine_ids();
    traffic_ = RankTraffic{.role = "trainer", .rank = rank_};
    REFIT_RETURN_IF_ERROR(check_engines());
    // SGLang protocol: the metadata of every route travels to its engine rank (once, here).
    if (cfg_.generation.backend == EngineProtocol::kSglang) {
      const std::vector<int> targets = control_targets(routes_->plan, rank_);
      for (std::size_t i = 0; i < targets.size(); ++i) {
        const int g = targets[i];
        const EngineShardLayout& lay =
            routes_->engines[static_cast<std::size_t>(g % cfg_.generation.tp_size)];
        REFIT_RETURN_IF_ERROR(mailbox_->send(
            fed_engines_[i], MessageType::kRoutes,
            encode(routes_metadata(routes_->plan, lay, rank_, g))));
      }
    }
    return Status::Ok();
  }

  // Every trainer rank stamps its refit and wire versions into the store; rank 0 checks every
  // other rank's stamp and the others check rank 0's, so both sides of a mismatch name it.
  Status check_trainer_versions(int world) {
    REFIT_RETURN_IF_ERROR(
        store_->set(fmt::format("version/trainer/{}", rank_), encode_version_stamp(version())));
    for (int r = 0; r < world; ++r) {
      if (r == rank_ || (rank_ != 0 && r != 0)) continue;
      REFIT_ASSIGN_OR_RETURN(std::string stamp,
                             store_->get(fmt::format("version/trainer/{}", r), timeout()));
      REFIT_RETURN_IF_ERROR(check_peer_versions(stamp, fmt::format("trainer rank {}", r), id()));
    }
    return Status::Ok();
  }

  // Every fed engine says hello; for vLLM its plan hash must equal ours (refused at setup).
  Status check_engines() {
    for (std::size_t i = 0; i < fed_engines_.size(); ++i) {
      REFIT_ASSIGN_OR_RETURN(Message hello, expect_message(*mailbox_, MessageType::kHello,
                                                           timeout(), "engine hellos"));
      REFIT_RETURN_IF_ERROR(check_peer_versions(hello.payload, hello.from, id()));
      REFIT_ASSIGN_OR_RETURN(HelloMessage h, decode_hello(hello.payload, hello.from));
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
            hello.from, routes_ ? "transfer plan" : "bucket plan", theirs, ours));
    }
    return Status::Ok();
  }

  Status send_all(MessageType type, const std::string& payload) {
    for (const auto& e : fed_engines_) REFIT_RETURN_IF_ERROR(mailbox_->send(e, type, payload));
    return Status::Ok();
  }

  // The copy lists of bucket b, built on first use (storage is registered by then and never
  // moves): pack (this rank's shards → bucket or send buffer, with the cast) and scatter
  // (everyone's gathered contributions → bucket). `dst` is the bucket's slot (fixed per bucket:
  // slot = bucket % num_buffers), null when this rank does not feed engines.
  struct BucketRuns {
    bool built = false;
    std::vector<CopyRun> pack, scatter;
  };
  const BucketRuns& runs_of(std::size_t b, std::byte* dst) {
    if (bucket_runs_.empty()) bucket_runs_.resize(gather_.size());
    BucketRuns& r = bucket_runs_[b];
    if (r.built) return r;
    r.built = true;
    const BucketGather& g = gather_[b];
    if (!trainer_comm_) {  // one trainer rank: cast straight into the bucket
      for (const GatherRun& run : g.runs[rank_])
        r.pack.push_back(CopyRun{.src = static_cast<const std::byte*>(ptrs_[run.local]),
                                 .dst = dst,
                                 .block = run.block});
      return r;
    }
    std::int64_t cursor = 0;
    for (const GatherRun& run : g.runs[rank_]) {  // this rank's owned blocks, end to end
      const Block2D& k = run.block;
      r.pack.push_back(CopyRun{.src = static_cast<const std::byte*>(ptrs_[run.local]),
                               .dst = send_->data(),
                               .block = {.src_offset = k.src_offset,
                                         .src_stride = k.src_stride,
                                         .dst_offset = cursor,
                                         .dst_stride = k.cols,
                                         .rows = k.rows,
                                         .cols = k.cols}});
      cursor += k.numel();
    }
    if (dst == nullptr) return r;
    std::int64_t offset = 0;  // elements into the gathered stage
    for (const auto& rank_runs : g.runs)
      for (const GatherRun& run : rank_runs) {
        const Block2D& k = run.block;
        r.scatter.push_back(CopyRun{.src = stage_->data(),
                                    .dst = dst,
                                    .block = {.src_offset = offset,
                                              .src_stride = k.cols,
                                              .dst_offset = k.dst_offset,
                                              .dst_stride = k.dst_stride,
                                              .rows = k.rows,
                                              .cols = k.cols}});
        offset += k.numel();
      }
    return r;
  }

  // Unshard bucket b; when `dst` is set, pack the full bucket there.
  Status unshard(std::size_t b, std::byte* dst) {
    const BucketGather& g = gather_[b];
    const DType pol = cfg_.policy.dtype, tgt = cfg_.refit.target_precision;
    const BucketRuns& runs = runs_of(b, dst);
    Timer t;
    REFIT_RETURN_IF_ERROR(plane_->copy(runs.pack, pol, tgt));
    phase_.cast_pack += t.seconds();
    if (!trainer_comm_) return Status::Ok();
    t.reset();
    Status st = trainer_comm_->all_gather_v(send_->data(), stage_->data(), g.counts);
    phase_.unshard += t.seconds();
    if (!st.ok()) return st.with_context(fmt::format("unshard of bucket {}", b));
    t.reset();
    REFIT_RETURN_IF_ERROR(plane_->copy(runs.scatter, tgt, tgt));
    phase_.cast_pack += t.seconds();
    return Status::Ok();
  }

  void maybe_fault(int step, std::size_t b, std::byte* bucket) {
    const Fault& f = fault_;
    if (step != 1 || f.bucket != static_cast<int>(b)) return;
    if (f.kind == Fault::Kind::kKillTrainer && f.rank == rank_) {
      log::info("fault injection: killing myself at bucket {}", b);
      raise(SIGKILL);
    }
    if (f.kind == Fault::Kind::kCorrupt && bucket != nullptr) {
      const BucketEntry& e = model_->plan.buckets[b].entries.front();
      const std::size_t tsize = dtype_size(cfg_.refit.target_precision);
      const std::size_t at =
          static_cast<std::size_t>(e.offset) + static_cast<std::size_t>(e.elem_count / 2) * tsize;
      log::info("fault injection: corrupting bucket {} ({}) in flight", b,
                model_->spec.tensors()[e.tensor].name);
      corrupt_status_ = plane_->corrupt_byte(bucket + at);
    }
  }

  // One refit (or, with raw, one pass of the bare transport).
  Status refit_once(int step, const std::string& version, bool verify, bool raw) {
    early_verdicts_.clear();
    if (route_sender_) return refit_routes(step, version, verify, raw);
    const BucketPlan& plan = model_->plan;
    const bool sglang = cfg_.generation.backend == EngineProtocol::kSglang;
    if (feeds()) {
      const BeginMessage begin{.step = step,
                               .version = version,
                               .verify = verify && !raw,
                               .raw = raw,
                               .buckets = static_cast<int>(plan.buckets.size())};
      REFIT_RETURN_IF_ERROR(send_all(MessageType::kBegin, encode(begin)));
    }
    for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
      std::byte* slot = nullptr;
      const int s = static_cast<int>(b % static_cast<std::size_t>(cfg_.refit.num_buffers));
      if (feeds()) {
        REFIT_RETURN_IF_ERROR(sender_->wait_slot(s));
        slot = sender_->slot_data(s);
      }
      if (raw) {
        if (slot != nullptr && !broadcast_mode())  // ipc: the bare copy into shared memory
          REFIT_RETURN_IF_ERROR(plane_->copy_bytes(
              slot, stage_->data(), static_cast<std::size_t>(plan.buckets[b].bytes)));
      } else if (feeds() || trainer_comm_) {
        maybe_fault(step, b, nullptr);
        REFIT_RETURN_IF_ERROR(unshard(b, slot));
        maybe_fault(step, b, slot);
        REFIT_RETURN_IF_ERROR(std::exchange(corrupt_status_, Status::Ok()));
      }
      if (feeds()) {
        BucketHeader h;
        h.step = step;
        h.bucket = static_cast<int>(b);
        h.bytes = static_cast<std::size_t>(plan.buckets[b].bytes);
        if (sglang && !raw) h.meta = encode_sglang_meta(model_->spec, plan.buckets[b], plan.dtype);
        REFIT_RETURN_IF_ERROR(sender_->send(s, std::move(h)));
      }
      if (rank_ == 0 && progress_) {
        std::fprintf(stderr, "\r[refit] %s %d: bucket %zu/%zu   ", raw ? "raw pass" : "step", step,
                     b + 1, plan.buckets.size());
      }
    }
    if (!feeds()) return Status::Ok();
    REFIT_RETURN_IF_ERROR(sender_->drain());
    phase_.transfer += sender_->take_busy_seconds();
    return commit(step);
  }

  // The transfer plan: this rank's routes, then the commit.
  Status refit_routes(int step, const std::string& version, bool verify, bool raw) {
    RouteTimes times;
    const BeginMessage begin{.step = step, .version = version, .verify = verify && !raw, .raw = raw};
    REFIT_RETURN_IF_ERROR(route_sender_->transfer(begin, ptrs_, fault_, times));
    phase_.cast_pack += times.cast_pack;
    phase_.transfer += times.transfer;
    traffic_.bytes_sent = route_sender_->bytes_sent();
    traffic_.peer_pairs = route_sender_->peer_targets();
    traffic_.p2p_pairs = route_sender_->p2p_targets();
    return commit(step);
  }

  // Every fed engine commits; the slowest one's apply time is the refit's.
  Status commit(int step) {
    REFIT_RETURN_IF_ERROR(send_all(MessageType::kCommit, encode(CommitMessage{.step = step})));
    for (std::size_t i = 0; i < fed_engines_.size(); ++i) {
      REFIT_ASSIGN_OR_RETURN(Message m, expect_commit_ack());
      REFIT_ASSIGN_OR_RETURN(CommittedMessage c, decode_committed(m.payload, m.from));
      phase_.apply = std::max(phase_.apply, c.apply_s);
    }
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

  // After a verified refit: every fed engine's verdict; ranks agree on the first failure.
  Status collect_verification() {
    std::string verdict;
    for (std::size_t i = 0; i < fed_engines_.size(); ++i) {
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
        verdict = v.ok() ? (v->error.empty() ? "verification failed on " + m.from : v->error)
                         : v.status().message();
    }
    if (trainer_comm_) {
      // Share verdicts through the store (host-side on every device) so every trainer rank fails
      // with the same cause: the lowest rank's failure wins.
      const int world = trainer_comm_->size();
      const std::string key = fmt::format("verdict/{}/", ++verifications_);
      // "ok", or "!" + the failure (a key must hold something to exist).
      REFIT_RETURN_IF_ERROR(
          store_->set(key + std::to_string(rank_), verdict.empty() ? "ok" : "!" + verdict));
      std::string first;
      for (int r = 0; r < world; ++r) {
        Result<std::string> theirs = store_->get(key + std::to_string(r), timeout());
        if (!theirs.ok()) return theirs.status();
        if (first.empty() && !theirs->empty() && theirs->front() == '!') first = theirs->substr(1);
      }
      verdict = first;
    }
    if (!verdict.empty()) return Status::Corruption(verdict);
    return Status::Ok();
  }

  // Engines acknowledge the shutdown before their feeder leaves, and trainer rank 0 (which hosts
  // the store) leaves last, so no process loses the control plane while it still needs it.
  Status do_shutdown() {
    if (feeds()) {
      REFIT_RETURN_IF_ERROR(send_all(MessageType::kShutdown, ""));
      for (std::size_t i = 0; i < fed_engines_.size(); ++i)
        REFIT_RETURN_IF_ERROR(
            expect_message(*mailbox_, MessageType::kShutdown, timeout(), "engine exits").status());
    }
    if (trainer_comm_) REFIT_RETURN_IF_ERROR(trainer_comm_->barrier());
    return Status::Ok();
  }

  struct Phases {
    double unshard = 0, cast_pack = 0, transfer = 0, apply = 0;
  };

  const Config cfg_;
  const Endpoint ep_;
  const int rank_;
  std::unique_ptr<RankModel> model_;
  std::unique_ptr<DataPlane> plane_;  // before every buffer allocated on it
  std::vector<TrainerShardLayout> layouts_;
  std::vector<BucketGather> gather_;
  std::vector<TensorSlot> slots_;
  std::vector<void*> ptrs_;                    // registered storage of slots_
  std::unique_ptr<PlaneBuffer> send_, stage_;  // unshard: this rank's part, everyone's parts
  std::vector<BucketRuns> bucket_runs_;
  Status corrupt_status_;  // a failed fault injection
  int verifications_ = 0;  // verified refits so far: namespaces the verdict keys
  std::unique_ptr<StoreServer> server_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Mailbox> mailbox_;
  std::unique_ptr<Communicator> trainer_comm_, update_comm_;
  std::unique_ptr<BucketSender> sender_;
  std::vector<std::string> fed_engines_;
  std::unique_ptr<RouteSetup> routes_;  // transfer plan (every executor but gather)
  std::unique_ptr<RouteSender> route_sender_;
  std::unique_ptr<Communicator> p2p_comm_;
  RankTraffic traffic_;
  std::deque<Message> early_verdicts_;  // verdicts that overtook a commit acknowledgement
  Phases phase_;
  RefitStats stats_;
  Fault fault_;
  int raw_passes_ = 0;
  bool progress_ = false;
  FailureLatch latch_;
};

}  // namespace

Result<std::unique_ptr<Trainer>> Trainer::create(const Config& config, int rank,
                                                 const Endpoint& endpoint) {
  if (rank < 0 || rank >= config.policy.world_size)
    return Status::InvalidArgument(fmt::format("trainer rank {} is outside policy.world_size {}",
                                               rank, config.policy.world_size));
  REFIT_RETURN_IF_ERROR(env::check());  // a bad REFIT_* value is a setup error, before joining
  auto t = std::make_unique<TrainerImpl>(config, rank, endpoint);
  REFIT_RETURN_IF_ERROR(t->init());
  return std::unique_ptr<Trainer>(std::move(t));
}

void set_trainer_fault(Trainer& trainer, const Fault& fault) {
  static_cast<TrainerImpl&>(trainer).set_fault(fault);
}

}  // namespace refit
