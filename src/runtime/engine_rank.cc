// An engine rank: holds its TP shard of the model in the engine layout, applies buckets as they
// arrive, and bumps its weight version only when the whole refit arrived (commit).
#include <fmt/format.h>
#include <signal.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "comm/communicator.h"
#include "common/convert.h"
#include "common/host_buffer.h"
#include "common/log.h"
#include "common/timer.h"
#include "control/mailbox.h"
#include "control/store.h"
#include "engine/engine_layout.h"
#include "runtime/failure.h"
#include "runtime/materialize.h"
#include "runtime/protocol.h"
#include "runtime/rank.h"
#include "runtime/schedule.h"
#include "runtime/setup.h"
#include "transport/transport.h"

namespace refit {
namespace {

// Applies received buckets on a thread of its own so receiving bucket k+1 overlaps applying k.
class Applier {
 public:
  using Work = std::function<Status()>;
  Applier() : thread_([this] { loop(); }) {}
  ~Applier() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void post(Work w) {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(w));
    cv_.notify_all();
  }
  // Waits until the queue is empty; returns the first failure.
  Status drain(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return (queue_.empty() && !running_) || !error_.ok(); }))
      return Status::Timeout("apply did not finish within the timeout");
    return error_;
  }
  Status error() {
    std::lock_guard lock(mu_);
    return error_;
  }

 private:
  void loop() {
    while (true) {
      Work w;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        w = std::move(queue_.front());
        queue_.pop_front();
        running_ = true;
      }
      Status st = error().ok() ? w() : Status::Ok();
      std::lock_guard lock(mu_);
      running_ = false;
      if (!st.ok() && error_.ok()) error_ = st;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Work> queue_;
  bool running_ = false;
  bool stop_ = false;
  Status error_;
  std::thread thread_;
};

class EngineRank {
 public:
  EngineRank(const RankOptions& opt, int engine_rank)
      : opt_(opt),
        cfg_(opt.config),
        rank_(engine_rank),
        tp_rank_(engine_rank % opt.config.generation.tp_size) {}

  Status run() {
    Status st = setup();
    if (st.ok()) st = serve();
    if (!st.ok()) {
      st = with_root_cause(store_.get(), id(), st);
      announce_failure(store_.get(), mailbox_.get(), {feeder_}, id(), st);
      if (update_comm_) update_comm_->abort();  // peers blocked on us fail now, not at timeout
    }
    return st;
  }

 private:
  std::string id() const {
    return fmt::format("engine {} tp rank {}", rank_ / cfg_.generation.tp_size, tp_rank_);
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
    const std::size_t esize = dtype_size(cfg_.refit.target_precision);
    std::size_t total = 0;
    for (const EngineParam& p : layout_.params) {
      param_offsets_.push_back(total);
      total += static_cast<std::size_t>(matrix_shape(p.shape).numel()) * esize;
      total = (total + 63) / 64 * 64;
    }
    params_ = HostBuffer(total);
    if (vllm()) {  // the manifest is fixed at setup: precompute every bucket's apply runs
      for (const Bucket& b : model_->plan.buckets)
        plan_runs_.push_back(
            build_apply_runs(model_->spec, layout_, b.entries, cfg_.refit.target_precision));
    }
    REFIT_ASSIGN_OR_RETURN(store_, connect_store(opt_.master_addr, opt_.master_port, timeout()));
    REFIT_ASSIGN_OR_RETURN(std::string run_id, store_->get("run_id", timeout()));
    REFIT_ASSIGN_OR_RETURN(
        mailbox_, Mailbox::open(*store_, fmt::format("engine/{}", rank_), opt_.host, timeout()));
    TransportOptions topt{cfg_.refit.num_buffers,
                          static_cast<std::size_t>(cfg_.refit.buffer_size_bytes), timeout()};
    if (broadcast_mode()) {
      feeder_ = "trainer/0";
      GlooOptions g{"update", 1 + rank_, 1 + cfg_.engine_ranks(), opt_.host, timeout()};
      REFIT_ASSIGN_OR_RETURN(update_comm_, make_gloo_communicator(*store_, g));
      REFIT_ASSIGN_OR_RETURN(receiver_, make_broadcast_receiver(*update_comm_, *mailbox_, topt));
    } else {
      feeder_ = fmt::format("trainer/{}", rank_);
      REFIT_RETURN_IF_ERROR(store_->wait({fmt::format("ipc/{}/ready", rank_)}, timeout()));
      REFIT_ASSIGN_OR_RETURN(receiver_, make_ipc_receiver(*mailbox_, feeder_,
                                                          ipc_segment_prefix(run_id, rank_), topt));
    }
    std::string plan_hash = model_->plan.hash_hex();
    if (opt_.fault.kind == Fault::Kind::kPlanMismatch) plan_hash = "0000000000000000";
    nlohmann::json hello = {{"engine_rank", rank_},
                            {"protocol", engine_protocol_name(cfg_.generation.backend)},
                            {"plan_hash", plan_hash},
                            {"total_parameters", model_->spec.total_parameters()}};
    return mailbox_->send(feeder_, MessageType::kHello, hello.dump());
  }

  void maybe_fault(int step, int bucket) {
    const Fault& f = opt_.fault;
    if (step != 1 || f.bucket != bucket || f.rank != rank_) return;
    if (f.kind == Fault::Kind::kKillEngine) {
      log::info("fault injection: killing myself at bucket {}", bucket);
      raise(SIGKILL);
    }
  }

  Status apply(const IncomingBucket& in, bool raw) {
    Timer t;
    const DType dt = cfg_.refit.target_precision;
    if (raw) {  // bench: the bare copy out of the transport buffer
      if (!broadcast_mode()) {
        if (scratch_.size() < in.header.bytes) scratch_ = HostBuffer(in.header.bytes);
        std::memcpy(scratch_.data(), in.data, in.header.bytes);
      }
    } else {
      std::vector<ApplyRun> decoded;
      const std::vector<ApplyRun>* runs = nullptr;
      if (vllm()) {
        if (in.header.bucket < 0 || in.header.bucket >= static_cast<int>(plan_runs_.size()))
          return Status::Corruption(
              fmt::format("vllm: bucket {} is not in the manifest ({} "
                          "buckets)",
                          in.header.bucket, plan_runs_.size()));
        runs = &plan_runs_[in.header.bucket];
      } else {
        REFIT_ASSIGN_OR_RETURN(
            auto entries, decode_sglang_meta(model_->spec, in.header.meta, dt, in.header.bucket));
        decoded = build_apply_runs(model_->spec, layout_, entries, dt);
        runs = &decoded;
      }
      for (const ApplyRun& r : *runs) {
        const Block2D& k = r.block;
        convert_block(in.data, dt, k.src_offset, k.src_stride,
                      params_.data() + param_offsets_[r.param], dt, k.dst_offset, k.dst_stride,
                      k.rows, k.cols);
      }
    }
    {
      std::lock_guard lock(apply_mu_);
      apply_seconds_ += t.seconds();
      applied_++;
    }
    return receiver_->release(in);
  }

  // One refit: every bucket of the plan, then the commit.
  Status refit(const nlohmann::json& begin) {
    const int step = begin.value("step", 0);
    const int buckets = begin.value("buckets", 0);
    const bool raw = begin.value("raw", false);
    const bool verify = begin.value("verify", false);
    const std::string version = begin.value("version", std::string());
    if (buckets != static_cast<int>(model_->plan.buckets.size()) && vllm())
      return Status::InvalidArgument(
          fmt::format("vllm: the trainer announced {} buckets, the manifest has {}", buckets,
                      model_->plan.buckets.size()));
    log::debug("pause generation for refit step {} ({} buckets)", step, buckets);
    paused_ = true;
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
    REFIT_ASSIGN_OR_RETURN(
        Message commit, expect_message(*mailbox_, MessageType::kCommit, timeout(), "the commit"));
    if (applied_ != buckets)
      return Status::Internal(
          fmt::format("commit of step {} after {} of {} buckets", step, applied_, buckets));
    if (!raw) version_ = version;  // only a complete refit publishes a new version
    paused_ = false;
    log::debug("resume generation at weight version {}", version_);
    nlohmann::json ack = {{"version", version_}, {"apply_s", apply_seconds_}};
    REFIT_RETURN_IF_ERROR(mailbox_->send(feeder_, MessageType::kCommitted, ack.dump()));
    if (verify) {
      Status v = verify_params(step);
      nlohmann::json res = {{"verified", v.ok()}, {"error", v.ok() ? "" : v.message()}};
      REFIT_RETURN_IF_ERROR(mailbox_->send(feeder_, MessageType::kVerified, res.dump()));
      if (!v.ok()) return v;
    }
    return Status::Ok();
  }

  // Recomputes what every parameter must hold after `step` and compares bit for bit.
  Status verify_params(int step) {
    const DType dt = cfg_.refit.target_precision;
    const std::size_t esize = dtype_size(dt);
    std::vector<std::byte> expected;
    for (std::size_t i = 0; i < layout_.params.size(); ++i) {
      const EngineParam& p = layout_.params[i];
      const std::size_t n = static_cast<std::size_t>(matrix_shape(p.shape).numel());
      expected.assign(n * esize, std::byte{0});
      materialize_pieces(model_->spec, p.pieces, p.shape, *model_->weights, step, cfg_.policy.dtype,
                         dt, expected.data());
      const std::byte* got = params_.data() + param_offsets_[i];
      if (std::memcmp(expected.data(), got, n * esize) == 0) continue;
      std::size_t k = 0;
      while (std::memcmp(expected.data() + k * esize, got + k * esize, esize) == 0) ++k;
      const std::int64_t cols = matrix_shape(p.shape).cols;
      const std::int64_t row = static_cast<std::int64_t>(k) / cols,
                         col = static_cast<std::int64_t>(k) % cols;
      std::string source = "vocabulary padding (must be zero)";
      for (const Piece& pc : p.pieces)
        if (row >= pc.dst_row && row < pc.dst_row + pc.rows && col >= pc.dst_col &&
            col < pc.dst_col + pc.cols) {
          source = fmt::format("{}[{}, {}]", model_->spec.tensors()[pc.hf_tensor].name,
                               pc.src_row + row - pc.dst_row, pc.src_col + col - pc.dst_col);
          break;
        }
      auto bits = [&](const std::byte* at) {
        std::uint32_t v = 0;
        std::memcpy(&v, at, esize);
        return v;
      };
      return Status::Corruption(fmt::format(
          "verify: {}: tensor {} element {} (row {}, col {}; from {}) is 0x{:0{}x}, expected "
          "0x{:0{}x}",
          id(), p.name, k, row, col, source, bits(got + k * esize), esize * 2,
          bits(expected.data() + k * esize), esize * 2));
    }
    return Status::Ok();
  }

  Status serve() {
    while (true) {
      auto msg = mailbox_->receive(timeout());
      if (!msg.ok())
        return msg.status().with_context(
            fmt::format("{} waiting for the next refit from {}", id(), feeder_));
      switch (msg->type) {
        case MessageType::kBegin: {
          auto j = nlohmann::json::parse(msg->payload, nullptr, false);
          if (j.is_discarded()) return Status::Corruption("malformed begin from " + msg->from);
          REFIT_RETURN_IF_ERROR(refit(j));
          break;
        }
        case MessageType::kShutdown:
          return mailbox_->send(feeder_, MessageType::kShutdown, "");
        case MessageType::kAbort:
        case MessageType::kError:
          return Status::Aborted(fmt::format("{} (reported by {})", msg->payload, msg->from));
        case MessageType::kHello:
        case MessageType::kBucket:
        case MessageType::kBucketDone:
        case MessageType::kCommit:
        case MessageType::kCommitted:
        case MessageType::kVerified:
          return Status::Internal(fmt::format("{}: unexpected {} from {} between refits", id(),
                                              message_type_name(msg->type), msg->from));
      }
    }
  }

  const RankOptions& opt_;
  const Config& cfg_;
  const int rank_;
  const int tp_rank_;
  std::unique_ptr<RankModel> model_;
  EngineShardLayout layout_;
  std::vector<std::size_t> param_offsets_;
  HostBuffer params_, scratch_;
  std::vector<std::vector<ApplyRun>> plan_runs_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Mailbox> mailbox_;
  std::unique_ptr<Communicator> update_comm_;
  std::unique_ptr<BucketReceiver> receiver_;
  std::string feeder_;
  std::string version_ = "0";
  bool paused_ = false;
  std::mutex apply_mu_;
  double apply_seconds_ = 0;
  int applied_ = 0;
  Applier applier_;
};

}  // namespace

Status run_engine_rank(const RankOptions& options, int engine_rank) {
  signal(SIGPIPE, SIG_IGN);
  log::set_prefix(fmt::format("engine rank {}", engine_rank));
  EngineRank e(options, engine_rank);
  return e.run();
}

}  // namespace refit
