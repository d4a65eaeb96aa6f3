#include "executor/route_receiver.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "common/log.h"
#include "common/timer.h"
#include "transport/transport.h"

namespace refit {

RouteReceiver::RouteReceiver(const RouteReceiverOptions& o) : o_(o) {
  for (int r : o_.sources) feeders_.push_back(RankId::trainer(r));
}

Result<std::unique_ptr<RouteReceiver>> RouteReceiver::create(const RouteReceiverOptions& o) {
  if (o.sources.size() != o.source_same_host.size())
    return Status::Internal("route receiver: one host flag per source expected");
  return std::unique_ptr<RouteReceiver>(new RouteReceiver(o));
}

Status RouteReceiver::prepare(bool params_exported) {
  modes_.assign(o_.sources.size(), PairExecutor::kP2p);
  peer_sources_ = p2p_sources_ = 0;
  for (std::size_t i = 0; i < o_.sources.size(); ++i) {
    REFIT_ASSIGN_OR_RETURN(
        modes_[i], choose_pair_executor(*o_.config, o_.source_same_host[i], params_exported,
                                        o_.p2p != nullptr, o_.sources[i], o_.engine_rank));
    (modes_[i] == PairExecutor::kPeer ? peer_sources_ : p2p_sources_)++;
  }
  if (modes_ != built_for_) {
    runs_.clear();
    built_for_ = modes_;
  }
  return Status::Ok();
}

// Per round with point-to-point segments: one receive per source into the round's slot (laid out
// by source) and the scatter of those segments into the parameters.
Status RouteReceiver::build(const std::vector<void*>& params) {
  const IncomingRoutes& in = o_.incoming;
  const int g = o_.engine_rank;
  const EngineShardLayout& lay =
      o_.setup->engines[static_cast<std::size_t>(g % o_.config->generation.tp_size)];
  const auto nslots = static_cast<std::size_t>(o_.config->refit.num_buffers);
  if (slots_.empty())
    for (std::size_t s = 0; s < nslots; ++s) {
      REFIT_ASSIGN_OR_RETURN(auto buf, o_.plane->allocate(static_cast<std::size_t>(
                                           std::max<std::int64_t>(in.max_slot_bytes, 1))));
      slots_.push_back(std::move(buf));
    }
  runs_.assign(in.rounds.size(), {});
  recv_ops_.assign(in.rounds.size(), {});
  std::size_t used = 0;  // rounds with segments so far: slots rotate over them
  for (std::size_t k = 0; k < in.rounds.size(); ++k) {
    std::byte* slot = slots_[used % nslots]->data();
    std::int64_t base = 0;
    for (const IncomingSegment& s : in.rounds[k]) {
      const auto it = std::find(o_.sources.begin(), o_.sources.end(), s.trainer);
      if (it == o_.sources.end())
        return Status::Corruption(fmt::format("engine rank {}: routes from trainer rank {}, which "
                                              "does not feed it",
                                              g, s.trainer));
      if (modes_[static_cast<std::size_t>(it - o_.sources.begin())] == PairExecutor::kP2p) {
        recv_ops_[k].push_back(P2POp{.kind = P2POp::Kind::kRecv,
                                     .peer = p2p_rank_of_trainer(s.trainer),
                                     .buf = slot + base,
                                     .bytes = static_cast<std::size_t>(s.bytes)});
        for (const Route& r : s.routes) {
          const EngineParam& p = lay.params[r.engine_param];
          const std::int64_t dst_cols = matrix_shape(p.shape).cols;
          const std::size_t esize = dtype_size(p.dtype);
          runs_[k].push_back(byte_run(slot, static_cast<std::byte*>(params[r.engine_param]),
                                      {.src_offset = (base + r.segment_offset) /
                                                     static_cast<std::int64_t>(esize),
                                       .src_stride = r.cols,
                                       .dst_offset = r.engine_row * dst_cols + r.engine_col,
                                       .dst_stride = dst_cols,
                                       .rows = r.rows,
                                       .cols = r.cols},
                                      esize));
        }
      }
      base += aligned_segment_bytes(s.bytes);
    }
    if (!recv_ops_[k].empty()) ++used;
  }
  return Status::Ok();
}

Status RouteReceiver::take_routes(const std::vector<RoutesMessage>& per_feeder) {
  const EngineShardLayout& lay =
      o_.setup->engines[static_cast<std::size_t>(o_.engine_rank % o_.config->generation.tp_size)];
  IncomingRoutes in;
  for (std::size_t i = 0; i < per_feeder.size() && i < o_.sources.size(); ++i)
    REFIT_RETURN_IF_ERROR(add_routes_metadata(in, per_feeder[i], o_.sources[i], lay));
  finish_incoming(in);
  o_.incoming = std::move(in);
  invalidate();
  slots_.clear();
  return Status::Ok();
}

Result<std::uint64_t> RouteReceiver::checksum_from(std::size_t i,
                                                   const std::vector<void*>& params) {
  const EngineShardLayout& lay = o_.setup->engines[static_cast<std::size_t>(
      o_.engine_rank % o_.config->generation.tp_size)];
  if (checksum_runs_.empty()) {
    checksum_runs_ = engine_checksum_runs(o_.incoming, lay, params);
    checksum_runs_.try_emplace(-1);  // built, even when nothing arrives
  }
  const auto it = checksum_runs_.find(o_.sources[i]);
  if (it == checksum_runs_.end()) return std::uint64_t{0};
  return checksum_groups(*o_.plane, it->second, std::nullopt);
}

Status RouteReceiver::receive(const BeginMessage& begin, const std::vector<void*>& params) {
  REFIT_RETURN_IF_ERROR(receive_rounds(begin.step, begin.raw, params));
  return applier_.drain(o_.config->refit.timeout());
}

Status RouteReceiver::receive_rounds(int step, bool raw, const std::vector<void*>& params) {
  const int g = o_.engine_rank;
  bytes_received_ = 0;
  apply_seconds_ = 0;
  for (std::size_t i = 0; i < o_.sources.size(); ++i)
    if (modes_[i] == PairExecutor::kPeer) bytes_received_ += o_.incoming.bytes_from(o_.sources[i]);
  if (p2p_sources_ == 0) {  // every feeder writes our parameters itself
    if (!raw) probe_->before_round(step, RefitProbe::kEveryRound);
    return Status::Ok();
  }
  if (runs_.empty()) REFIT_RETURN_IF_ERROR(build(params));
  const auto nslots = static_cast<std::int64_t>(o_.config->refit.num_buffers);
  const auto timeout = o_.config->refit.timeout();
  const std::int64_t base = applier_.completed();
  std::int64_t posted = 0;
  for (std::size_t kk = 0; kk < recv_ops_.size(); ++kk) {
    const int k = static_cast<int>(kk);
    if (recv_ops_[kk].empty()) continue;
    if (!raw) probe_->before_round(step, k);
    // The slot is free once the round that used it before was applied.
    if (posted >= nslots)
      REFIT_RETURN_IF_ERROR(applier_.wait_completed(base + posted - nslots + 1, timeout)
                                .with_context(fmt::format("engine rank {} round {}", g, k)));
    Status st = o_.p2p->exchange(recv_ops_[kk]);
    if (!st.ok()) return st.with_context(fmt::format("p2p round {} of engine rank {}", k, g));
    for (const P2POp& op : recv_ops_[kk]) bytes_received_ += static_cast<std::int64_t>(op.bytes);
    const std::vector<CopyRun>* runs = &runs_[kk];
    applier_.post([this, runs, raw] {
      if (raw) return Status::Ok();
      Timer t;
      Status st = o_.plane->copy(*runs, kByteCopyDType, kByteCopyDType);
      apply_seconds_ += t.seconds();
      return st;
    });
    ++posted;
  }
  return Status::Ok();
}

}  // namespace refit
