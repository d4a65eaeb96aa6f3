#include "executor/gather_sender.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>

#include "comm/communicator.h"
#include "common/timer.h"
#include "executor/bucket_meta.h"

namespace refit {

Result<std::unique_ptr<GatherSender>> GatherSender::create(const GatherSenderOptions& o) {
  auto s = std::unique_ptr<GatherSender>(new GatherSender(o));
  REFIT_RETURN_IF_ERROR(s->setup());
  return s;
}

Status GatherSender::setup() {
  const Config& cfg = *o_.config;
  const int world = cfg.policy.world_size;
  progress_ = o_.rank == 0 && isatty(2);
  // Every rank's layout: this rank packs its own shards and scatters everyone's contribution.
  std::vector<TrainerShardLayout> layouts;
  for (int r = 0; r < world; ++r) {
    REFIT_ASSIGN_OR_RETURN(auto lay, trainer_layout(o_.model->spec, cfg.policy, r));
    layouts.push_back(std::move(lay));
  }
  gather_ = build_gather_schedule(o_.model->spec, o_.model->plan, layouts);
  // Which engine ranks this rank feeds, and the transport to them.
  const TransportOptions topt{cfg.refit.num_buffers,
                              static_cast<std::size_t>(cfg.refit.buffer_size_bytes),
                              cfg.refit.timeout()};
  if (cfg.generation.weight_transfer_mode == TransferMode::kBroadcast) {
    if (o_.rank == 0) {
      for (int g = 0; g < cfg.engine_ranks(); ++g)
        fed_.push_back(RankId::engine(g, cfg.generation.tp_size));
      REFIT_ASSIGN_OR_RETURN(update_,
                             o_.rank_links.join_group("update", 0, 1 + cfg.engine_ranks()));
      REFIT_ASSIGN_OR_RETURN(
          sender_, make_broadcast_sender(*update_, *o_.rank_links.mailbox, *o_.rank_links.plane,
                                         mailbox_ids(fed_),
                                         cfg.generation.backend == EngineProtocol::kSglang, topt));
    }
  } else {
    fed_.push_back(RankId::engine(o_.rank, cfg.generation.tp_size));
    REFIT_ASSIGN_OR_RETURN(
        sender_, make_ipc_sender(*o_.rank_links.mailbox, *o_.rank_links.store, *o_.rank_links.plane,
                                 fed_[0].mailbox(),
                                 ipc_segment_prefix(o_.rank_links.run_id, o_.rank), topt));
  }
  const auto bucket_bytes = static_cast<std::size_t>(o_.model->plan.max_bucket_bytes);
  if (feeds() || world > 1) {
    REFIT_ASSIGN_OR_RETURN(stage_, o_.rank_links.plane->allocate(bucket_bytes));
  }
  if (world > 1) {
    REFIT_ASSIGN_OR_RETURN(send_, o_.rank_links.plane->allocate(bucket_bytes));
  }
  // Bytes per refit: this rank's all-gather contribution, and what it hands to its transport.
  traffic_ = RankTraffic{.role = "trainer", .rank = o_.rank};
  if (world > 1)
    for (const BucketGather& g : gather_)
      traffic_.bytes_sent += static_cast<std::int64_t>(g.counts[static_cast<std::size_t>(o_.rank)]);
  if (feeds())
    traffic_.bytes_sent +=
        o_.model->plan.payload_bytes *
        (update_ ? 1 : static_cast<std::int64_t>(fed_.size()));  // a broadcast sends once
  return Status::Ok();
}

void GatherSender::targets_attached() {
  if (sender_) sender_->on_receivers_attached();
}

void GatherSender::prepare_begin(std::size_t /*i*/, BeginMessage& begin) const {
  begin.buckets = static_cast<int>(o_.model->plan.buckets.size());
}

void GatherSender::abort() {
  if (update_) update_->abort();
}

const GatherSender::BucketRuns& GatherSender::runs_of(std::size_t b,
                                                      const std::vector<void*>& shards,
                                                      std::byte* dst) {
  if (bucket_runs_.empty()) bucket_runs_.resize(gather_.size());
  BucketRuns& r = bucket_runs_[b];
  if (r.built) return r;
  r.built = true;
  const BucketGather& g = gather_[b];
  const auto& mine = g.runs[static_cast<std::size_t>(o_.rank)];
  if (o_.trainer_group == nullptr) {  // one trainer rank: cast straight into the bucket
    for (const GatherRun& run : mine)
      r.pack.push_back(CopyRun{.src = static_cast<const std::byte*>(shards[run.local]),
                               .dst = dst,
                               .block = run.block});
    return r;
  }
  std::int64_t cursor = 0;
  for (const GatherRun& run : mine) {  // this rank's owned blocks, end to end
    const Block2D& k = run.block;
    r.pack.push_back(CopyRun{.src = static_cast<const std::byte*>(shards[run.local]),
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

Status GatherSender::unshard(std::size_t b, const std::vector<void*>& shards, std::byte* dst,
                             TransferTimes& times) {
  const DType pol = o_.config->policy.dtype, tgt = o_.config->refit.target_precision;
  const BucketRuns& runs = runs_of(b, shards, dst);
  Timer t;
  REFIT_RETURN_IF_ERROR(o_.rank_links.plane->copy(runs.pack, pol, tgt));
  times.cast_pack += t.seconds();
  if (o_.trainer_group == nullptr) return Status::Ok();
  t.reset();
  Status st = o_.trainer_group->all_gather_v(send_->data(), stage_->data(), gather_[b].counts);
  times.unshard += t.seconds();
  if (!st.ok()) return st.with_context(fmt::format("unshard of bucket {}", b));
  t.reset();
  REFIT_RETURN_IF_ERROR(o_.rank_links.plane->copy(runs.scatter, tgt, tgt));
  times.cast_pack += t.seconds();
  return Status::Ok();
}

Status GatherSender::send(const BeginMessage& begin_in, const std::vector<void*>& shards,
                          TransferTimes& times) {
  const Config& cfg = *o_.config;
  const BucketPlan& plan = o_.model->plan;
  const DType tgt = cfg.refit.target_precision;
  const bool raw = begin_in.raw;
  for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
    std::byte* slot = nullptr;
    const int s = static_cast<int>(b % static_cast<std::size_t>(cfg.refit.num_buffers));
    if (feeds()) {
      REFIT_RETURN_IF_ERROR(sender_->wait_slot(s));
      slot = sender_->slot_data(s);
    }
    if (raw) {
      if (slot != nullptr && !update_)  // ipc: the bare copy into shared memory
        REFIT_RETURN_IF_ERROR(o_.rank_links.plane->copy_bytes(
            slot, stage_->data(), static_cast<std::size_t>(plan.buckets[b].bytes)));
    } else if (feeds() || o_.trainer_group != nullptr) {
      probe_->before_round(begin_in.step, static_cast<int>(b));
      REFIT_RETURN_IF_ERROR(unshard(b, shards, slot, times));
      if (slot != nullptr) {
        const BucketRuns& runs = bucket_runs_[b];
        REFIT_RETURN_IF_ERROR(
            probe_->after_write(begin_in.step, static_cast<int>(b), *o_.rank_links.plane,
                                o_.trainer_group ? runs.scatter : runs.pack, tgt));
      }
    }
    if (feeds()) {
      BucketHeader h;
      h.step = begin_in.step;
      h.bucket = static_cast<int>(b);
      h.bytes = static_cast<std::size_t>(plan.buckets[b].bytes);
      if (cfg.generation.backend == EngineProtocol::kSglang && !raw)
        h.meta = encode_sglang_meta(o_.model->spec, plan.buckets[b], plan.dtype);
      REFIT_RETURN_IF_ERROR(sender_->send(s, std::move(h)));
    }
    if (progress_)
      std::fprintf(stderr, "\r[refit] %s %d: bucket %zu/%zu   ", raw ? "raw pass" : "step",
                   begin_in.step, b + 1, plan.buckets.size());
  }
  if (!feeds()) return Status::Ok();
  REFIT_RETURN_IF_ERROR(sender_->drain());
  times.transfer += sender_->take_busy_seconds();
  return Status::Ok();
}

}  // namespace refit
