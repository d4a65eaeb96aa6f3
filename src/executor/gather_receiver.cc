#include "executor/gather_receiver.h"

#include <fmt/format.h>

#include "comm/communicator.h"
#include "common/timer.h"
#include "executor/bucket_meta.h"

namespace refit {

Result<std::unique_ptr<GatherReceiver>> GatherReceiver::create(const GatherReceiverOptions& o) {
  auto r = std::unique_ptr<GatherReceiver>(new GatherReceiver(o));
  REFIT_RETURN_IF_ERROR(r->setup());
  return r;
}

// Full buckets from one feeder: trainer rank 0 (broadcast) or the colocated trainer rank (ipc).
Status GatherReceiver::setup() {
  const Config& cfg = *o_.config;
  const TransportOptions topt{cfg.refit.num_buffers,
                              static_cast<std::size_t>(cfg.refit.buffer_size_bytes),
                              cfg.refit.timeout()};
  if (cfg.generation.weight_transfer_mode == TransferMode::kBroadcast) {
    feeders_ = {RankId::trainer(0)};
    REFIT_ASSIGN_OR_RETURN(
        update_, o_.rank_links.join_group("update", 1 + o_.engine_rank, 1 + cfg.engine_ranks()));
    REFIT_ASSIGN_OR_RETURN(receiver_, make_broadcast_receiver(*update_, *o_.rank_links.mailbox,
                                                              *o_.rank_links.plane, topt));
  } else {
    feeders_ = {RankId::trainer(o_.engine_rank)};
    REFIT_ASSIGN_OR_RETURN(
        receiver_,
        make_ipc_receiver(*o_.rank_links.mailbox, *o_.rank_links.store, *o_.rank_links.plane,
                          feeders_[0].mailbox(),
                          ipc_segment_prefix(o_.rank_links.run_id, o_.engine_rank), topt));
  }
  return Status::Ok();
}

void GatherReceiver::abort() {
  if (update_) update_->abort();
}

std::vector<CopyRun> GatherReceiver::copy_runs(const std::vector<ApplyRun>& runs,
                                               const std::vector<void*>& params) const {
  std::vector<CopyRun> out;
  out.reserve(runs.size());
  for (const ApplyRun& r : runs)
    out.push_back(
        CopyRun{.src = nullptr, .dst = static_cast<std::byte*>(params[r.param]), .block = r.block});
  return out;
}

Status GatherReceiver::apply(const IncomingBucket& in, bool raw, const std::vector<void*>& params) {
  Timer t;
  const DType dt = o_.config->refit.target_precision;
  if (raw) {  // bench: the bare copy out of the transport buffer
    if (!update_) {
      if (!scratch_ || scratch_->size() < in.header.bytes) {
        REFIT_ASSIGN_OR_RETURN(scratch_, o_.rank_links.plane->allocate(in.header.bytes));
      }
      REFIT_RETURN_IF_ERROR(
          o_.rank_links.plane->copy_bytes(scratch_->data(), in.data, in.header.bytes));
    }
  } else {
    const std::vector<CopyRun>* runs = nullptr;
    if (vllm()) {
      if (in.header.bucket < 0 || in.header.bucket >= static_cast<int>(plan_runs_.size()))
        return Status::Corruption(fmt::format("vllm: bucket {} is not in the manifest ({} buckets)",
                                              in.header.bucket, plan_runs_.size()));
      runs = &plan_runs_[static_cast<std::size_t>(in.header.bucket)];
    } else {
      // The metadata of a bucket is the same every refit (the trainer's plan is fixed), so the
      // decoded runs are kept per bucket and reused while the metadata is unchanged: a device
      // plane then finds its uploaded copy table again.
      auto& cached = sglang_runs_[in.header.bucket];
      if (cached.first != in.header.meta) {
        REFIT_ASSIGN_OR_RETURN(auto entries,
                               decode_sglang_meta(o_.model->spec, in.header.meta, dt,
                                                  in.header.bucket,
                                                  o_.config->refit.buffer_size_bytes));
        cached = {in.header.meta,
                  copy_runs(build_apply_runs(o_.model->spec, *o_.layout, entries, dt), params)};
      }
      runs = &cached.second;
    }
    REFIT_RETURN_IF_ERROR(
        o_.rank_links.plane->copy(*runs, dt, dt, in.data));  // from the slot it arrived in
  }
  {
    std::lock_guard lock(apply_mu_);
    apply_seconds_ += t.seconds();
    applied_++;
  }
  return receiver_->release(in);
}

Status GatherReceiver::receive(const BeginMessage& begin, const std::vector<void*>& params) {
  const int step = begin.step, buckets = begin.buckets;
  const bool raw = begin.raw;
  const BucketPlan& plan = o_.model->plan;
  if (buckets != static_cast<int>(plan.buckets.size()) && vllm())
    return Status::InvalidArgument(fmt::format(
        "vllm: the trainer announced {} buckets, the manifest has {}", buckets, plan.buckets.size()));
  if (vllm() && plan_runs_.empty()) {  // the manifest is fixed: every bucket's runs, once
    for (const Bucket& b : plan.buckets)
      plan_runs_.push_back(copy_runs(build_apply_runs(o_.model->spec, *o_.layout, b.entries,
                                                      o_.config->refit.target_precision),
                                     params));
  }
  apply_seconds_ = 0;
  applied_ = 0;
  for (int b = 0; b < buckets; ++b) {
    std::optional<BucketHeader> expected;
    if (vllm() && update_) {
      BucketHeader h;
      h.step = step;
      h.bucket = b;
      h.bytes = static_cast<std::size_t>(plan.buckets[static_cast<std::size_t>(b)].bytes);
      expected = h;
    }
    if (!raw) probe_->before_round(step, b);
    REFIT_ASSIGN_OR_RETURN(IncomingBucket in, receiver_->receive(expected));
    if (in.header.bucket != b || in.header.step != step)
      return Status::Internal(fmt::format("expected bucket {} of step {}, received bucket {} of step {}",
                                          b, step, in.header.bucket, in.header.step));
    REFIT_RETURN_IF_ERROR(applier_.error());
    applier_.post([this, in, raw, &params] { return apply(in, raw, params); });
  }
  REFIT_RETURN_IF_ERROR(
      applier_.drain(o_.config->refit.timeout()));
  if (applied_ != buckets)
    return Status::Internal(
        fmt::format("{}: step {} applied {} of {} buckets", o_.who, step, applied_, buckets));
  return Status::Ok();
}

}  // namespace refit
