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
// by source, each aligned) and the scatter of those segments into the parameters.
Status RouteReceiver::build(const std::vector<void*>& params) {
  const IncomingRoutes& in = o_.incoming;
  const int g = o_.engine_rank;
  const EngineShardLayout& lay = o_.setup->engine_layout(g);
  const auto nslots = static_cast<std::size_t>(o_.config->refit.num_buffers);
  if (slots_.empty())
    for (std::size_t s = 0; s < nslots; ++s) {
      REFIT_ASSIGN_OR_RETURN(auto buf, o_.plane->allocate(static_cast<std::size_t>(
                                           std::max<std::int64_t>(in.max_slot_bytes, 1))));
      slots_.push_back(std::move(buf));
    }
  const auto rounds = static_cast<std::size_t>(in.rounds);
  runs_.assign(rounds, {});
  recv_ops_.assign(rounds, {});
  // Where each source's segment of each round starts in the round's slot, and which rounds
  // receive point-to-point.
  std::vector<std::int64_t> next(rounds, 0);
  std::vector<std::vector<std::int64_t>> base(in.pairs.size());
  std::vector<bool> p2p(in.pairs.size(), false), receives(rounds, false);
  for (std::size_t q = 0; q < in.pairs.size(); ++q) {
    const IncomingPair& pair = in.pairs[q];
    const auto it = std::find(o_.sources.begin(), o_.sources.end(), pair.trainer);
    if (it == o_.sources.end())
      return Status::Corruption(
          fmt::format("engine rank {}: routes from trainer rank {}, which "
                      "does not feed it",
                      g, pair.trainer));
    p2p[q] = modes_[static_cast<std::size_t>(it - o_.sources.begin())] == PairExecutor::kP2p;
    for (std::size_t k = 0; k < pair.round_bytes.size(); ++k) {
      base[q].push_back(next[k]);
      next[k] += aligned_segment_bytes(pair.round_bytes[k]);
      if (p2p[q]) receives[k] = true;
    }
  }
  std::vector<std::byte*> slot(rounds, nullptr);
  std::size_t used = 0;  // rounds with segments so far: slots rotate over them
  for (std::size_t k = 0; k < rounds; ++k)
    if (receives[k]) slot[k] = slots_[used++ % nslots]->data();
  for (std::size_t q = 0; q < in.pairs.size(); ++q) {
    if (!p2p[q]) continue;
    const IncomingPair& pair = in.pairs[q];
    for (std::size_t k = 0; k < pair.round_bytes.size(); ++k)
      recv_ops_[k].push_back(P2POp{.kind = P2POp::Kind::kRecv,
                                   .peer = p2p_rank_of_trainer(pair.trainer),
                                   .buf = slot[k] + base[q][k],
                                   .bytes = static_cast<std::size_t>(pair.round_bytes[k])});
    for_each_incoming_slice(pair, in.pair_budget, lay, [&](const Route& s) {
      const auto k = static_cast<std::size_t>(s.round);
      std::int64_t at = base[q][k] + s.segment_offset;
      for (std::int32_t j = 0; j < s.count; ++j) {
        const Route r = s.member(j);
        const EngineParam& p = lay.params[r.engine_param];
        const std::int64_t dst_cols = matrix_shape(p.shape).cols;
        const std::size_t esize = dtype_size(p.dtype);
        runs_[k].push_back(byte_run(slot[k], static_cast<std::byte*>(params[r.engine_param]),
                                    {.src_offset = at / static_cast<std::int64_t>(esize),
                                     .src_stride = r.cols,
                                     .dst_offset = r.engine_row * dst_cols + r.engine_col,
                                     .dst_stride = dst_cols,
                                     .rows = r.rows,
                                     .cols = r.cols},
                                    esize));
        at += r.numel() * static_cast<std::int64_t>(esize);
      }
    });
  }
  return Status::Ok();
}

std::string RouteReceiver::routes_digest(std::size_t i) const {
  return pair_routes_digest(*o_.setup, o_.sources[i]);
}

Status RouteReceiver::take_routes(const std::vector<RoutesMessage>& per_feeder) {
  const EngineShardLayout& lay = o_.setup->engine_layout(o_.engine_rank);
  IncomingRoutes in;
  in.pair_budget = o_.setup->view.pair_budget;
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
  const EngineShardLayout& lay = o_.setup->engine_layout(o_.engine_rank);
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
