#include "executor/route_sender.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"
#include "common/timer.h"
#include "transport/transport.h"

namespace refit {

RouteSender::RouteSender(const RouteSenderOptions& o) : o_(o) {
  const int tp = o_.config->generation.tp_size;
  for (int g : o_.targets) targets_.push_back(RankId::engine(g, tp));
  for (int g = 0; g < o_.config->engine_ranks(); ++g) all_engines_.push_back(RankId::engine(g, tp));
}

Result<std::unique_ptr<RouteSender>> RouteSender::create(const RouteSenderOptions& o) {
  if (o.targets.size() != o.target_same_host.size())
    return Status::Internal("route sender: one host flag per target expected");
  return std::unique_ptr<RouteSender>(new RouteSender(o));
}

// Keeps a target's export as held_[i]: a full one is moved there; one left out (the runtime read
// in full only the exports whose digest differs from export_held) must be the one held (a
// protocol violation otherwise).
// held_[i] is then what the answer exports, or nothing.
Status RouteSender::resolve_export(std::size_t i, PausedMessage& answer) {
  if (!answer.direct) {
    held_[i].reset();
    return Status::Ok();
  }
  if (!answer.direct->elided) {
    held_[i] = std::move(answer.direct);
    return Status::Ok();
  }
  if (!held_[i] || held_[i]->digest != answer.direct->digest)
    return Status::Corruption(fmt::format(
        "trainer rank {}: engine rank {} answered with export {} left out, which this rank does "
        "not hold ({})",
        o_.rank, o_.targets[i], answer.direct->digest, held_[i] ? held_[i]->digest : "none"));
  log::debug("trainer rank {}: engine rank {} left out its export {}, unchanged since it sent it",
             o_.rank, o_.targets[i], held_[i]->digest);
  return Status::Ok();
}

Status RouteSender::map_engine(std::size_t i, const ExportedParams& direct) {
  const std::string key = direct.digest.empty() ? export_digest(direct) : direct.digest;
  Mapped& m = mapped_[i];
  if (!m.params.empty() && m.key == key) return Status::Ok();
  const int g = o_.targets[i];
  const EngineShardLayout& lay =
      o_.setup->engines[static_cast<std::size_t>(g % o_.config->generation.tp_size)];
  const bool per_param = !direct.handles.empty();
  const std::size_t n = per_param ? direct.handles.size() : direct.offsets.size();
  if (n != lay.params.size())
    return Status::Corruption(fmt::format(
        "peer: engine rank {} exported {} parameters, its layout has {}", g, n, lay.params.size()));
  const std::string what =
      fmt::format("peer: trainer rank {} mapping engine rank {}'s parameters", o_.rank, g);
  m = Mapped{};
  m.key = key;
  if (per_param) {  // registered CUDA storage: one handle per parameter
    for (std::size_t p = 0; p < n; ++p) {
      if (direct.handles[p].empty()) {  // an empty parameter: nothing to map
        m.params.push_back(nullptr);
        continue;
      }
      const auto bytes = static_cast<std::size_t>(lay.params[p].bytes());
      auto mem = o_.plane->open_exported(direct.handles[p], bytes);
      if (!mem.ok()) return mem.status().with_context(what + " (" + lay.params[p].name + ")");
      m.params.push_back((*mem)->data());
      m.memory.push_back(std::move(mem).value());
    }
  } else {  // one region (allocate_params)
    // Every parameter must lie inside the region the engine says it exported: a paused message
    // with other offsets (a bug, or a forged message) must not make us write outside it.
    for (std::size_t p = 0; p < n; ++p) {
      const auto esize = static_cast<std::uint64_t>(dtype_size(lay.params[p].dtype));
      const auto bytes = static_cast<std::uint64_t>(lay.params[p].bytes());
      const std::uint64_t off = direct.offsets[p];
      if (off % esize != 0 || off > direct.bytes || bytes > direct.bytes - off)
        return Status::Corruption(fmt::format(
            "peer: engine rank {} exported parameter {} ({} bytes) at offset {} of a {}-byte "
            "region: outside it, refusing to write",
            g, lay.params[p].name, bytes, off, direct.bytes));
    }
    auto mem = o_.plane->open_exported(direct.handle, direct.bytes);
    if (!mem.ok()) return mem.status().with_context(what);
    for (std::uint64_t off : direct.offsets) m.params.push_back((*mem)->data() + off);
    m.memory.push_back(std::move(mem).value());
  }
  peer_runs_.clear();  // they hold the mapped addresses
  log::debug("trainer rank {}: mapped engine rank {}'s parameters ({})", o_.rank, g,
             per_param ? fmt::format("{} handles", n) : fmt::format("{} bytes", direct.bytes));
  return Status::Ok();
}

// Every route of this rank to a peer target: read from the shard, cast, written in place. One
// list, in model order with the targets interleaved tensor by tensor, so that one copy call keeps
// local writes and writes over the link to other devices in flight at the same time.
void RouteSender::build_peer_runs(const std::vector<void*>& shards) {
  peer_runs_.clear();
  const TransferPlan& plan = o_.setup->plan;
  const TrainerShardLayout& mine = o_.setup->trainers[static_cast<std::size_t>(o_.rank)];
  const int tp = o_.config->generation.tp_size;
  std::vector<std::pair<const Route*, std::size_t>> routes;  // route, target index
  for (std::size_t i = 0; i < o_.targets.size(); ++i) {
    if (modes_[i] != PairExecutor::kPeer) continue;
    for (const auto& segs : plan.segments)
      for (const Segment& s : segs)
        if (s.trainer == o_.rank && s.engine == o_.targets[i])
          for (std::size_t k = s.first_route; k < s.first_route + s.num_routes; ++k)
            routes.emplace_back(&plan.routes[k], i);
  }
  std::stable_sort(routes.begin(), routes.end(), [](const auto& a, const auto& b) {
    return a.first->hf_tensor < b.first->hf_tensor;
  });
  for (const auto& [r, i] : routes) {
    const Mapped& m = mapped_.at(i);
    const EngineShardLayout& lay =
        o_.setup->engines[static_cast<std::size_t>(o_.targets[i] % tp)];
    const std::int64_t src_cols = matrix_shape(mine.tensors[r->trainer_tensor].shape).cols;
    const std::int64_t dst_cols = matrix_shape(lay.params[r->engine_param].shape).cols;
    peer_runs_.add(*o_.setup, *r, static_cast<const std::byte*>(shards[r->trainer_tensor]),
                   m.params[r->engine_param],
                   {.src_offset = r->trainer_row * src_cols + r->trainer_col,
                    .src_stride = src_cols,
                    .dst_offset = r->engine_row * dst_cols + r->engine_col,
                    .dst_stride = dst_cols,
                    .rows = r->rows,
                    .cols = r->cols},
                   scales_.get());
  }
}

// Per round: this rank's routes to p2p targets, cast into their segments of the round's staging
// slot, and one send per segment. Rounds this rank sends in take the slots in turn.
void RouteSender::build_pack_runs(const std::vector<void*>& shards) {
  const TransferPlan& plan = o_.setup->plan;
  const TrainerShardLayout& mine = o_.setup->trainers[static_cast<std::size_t>(o_.rank)];
  pack_runs_.assign(static_cast<std::size_t>(plan.rounds), {});
  send_ops_.assign(static_cast<std::size_t>(plan.rounds), {});
  std::size_t used = 0;  // rounds with sends so far
  for (int k = 0; k < plan.rounds; ++k) {
    const auto kk = static_cast<std::size_t>(k);
    std::byte* slot = staging_[used % staging_.size()]->data();
    std::int64_t base = 0;  // bytes into the slot
    for (const Segment& s : plan.segments[kk]) {
      if (s.trainer != o_.rank) continue;
      const auto it = std::find(o_.targets.begin(), o_.targets.end(), s.engine);
      const auto i = static_cast<std::size_t>(it - o_.targets.begin());
      if (modes_[i] == PairExecutor::kP2p) {
        for (std::size_t q = s.first_route; q < s.first_route + s.num_routes; ++q) {
          const Route& r = plan.routes[q];
          const std::int64_t src_cols = matrix_shape(mine.tensors[r.trainer_tensor].shape).cols;
          const auto esize = static_cast<std::int64_t>(dtype_size(plan.dtype_of(r)));
          pack_runs_[kk].add(*o_.setup, r, static_cast<const std::byte*>(shards[r.trainer_tensor]),
                             slot,
                             {.src_offset = r.trainer_row * src_cols + r.trainer_col,
                              .src_stride = src_cols,
                              .dst_offset = (base + r.segment_offset) / esize,
                              .dst_stride = r.cols,
                              .rows = r.rows,
                              .cols = r.cols},
                             scales_.get());
        }
        send_ops_[kk].push_back(P2POp{.kind = P2POp::Kind::kSend,
                                      .peer = p2p_rank_of_engine(*o_.config, s.engine),
                                      .buf = slot + base,
                                      .bytes = static_cast<std::size_t>(s.bytes)});
      }
      base += aligned_segment_bytes(s.bytes);
    }
    if (!send_ops_[kk].empty()) ++used;
  }
}

std::optional<RoutesMessage> RouteSender::routes_for(std::size_t i) const {
  if (o_.config->generation.backend != EngineProtocol::kSglang) return std::nullopt;
  const int g = o_.targets[i];
  const EngineShardLayout& lay =
      o_.setup->engines[static_cast<std::size_t>(g % o_.config->generation.tp_size)];
  return routes_metadata(o_.setup->plan, lay, o_.rank, g);
}

std::string RouteSender::export_held(std::size_t i) const {
  return i < held_.size() && held_[i] ? held_[i]->digest : std::string();
}

Result<std::uint64_t> RouteSender::checksum_to(std::size_t i, const std::vector<void*>& shards) {
  auto it = checksum_runs_.find(i);
  if (it == checksum_runs_.end())
    it = checksum_runs_
             .emplace(i, trainer_checksum_runs(*o_.setup, o_.rank, o_.targets[i], shards))
             .first;
  return checksum_groups(*o_.plane, it->second, o_.config->policy.dtype);
}

Status RouteSender::before_begin(const BeginMessage& begin, const std::vector<void*>& user_shards,
                                 TransferTimes& times) {
  all_shards_ = user_shards;
  if (!o_.setup->wire.fp8) return Status::Ok();
  if (!scales_) {
    REFIT_ASSIGN_OR_RETURN(scales_, TrainerScales::create(*o_.setup, o_.rank, *o_.plane));
  }
  if (!begin.raw) {
    Timer t;
    REFIT_RETURN_IF_ERROR(
        scales_->compute(user_shards, o_.config->policy.dtype, o_.trainer_group));
    times.cast_pack += t.seconds();
  }
  for (void* p : scales_->local_tensors()) all_shards_.push_back(p);
  return Status::Ok();
}

Status RouteSender::take_answers(std::vector<PausedMessage>& answers) {
  held_.resize(targets_.size());
  for (std::size_t i = 0; i < targets_.size(); ++i)
    REFIT_RETURN_IF_ERROR(resolve_export(i, answers[static_cast<std::size_t>(o_.targets[i])]));
  return Status::Ok();
}

Status RouteSender::send(const BeginMessage& begin, const std::vector<void*>& /*user_shards*/,
                         TransferTimes& times) {
  const Config& cfg = *o_.config;
  bytes_sent_ = 0;
  const std::vector<void*>& shards = all_shards_;  // the caller's, then the FP8 scales
  modes_.assign(targets_.size(), PairExecutor::kP2p);
  peer_targets_ = p2p_targets_ = 0;
  held_.resize(targets_.size());
  for (std::size_t i = 0; i < targets_.size(); ++i) {
    const bool exported = held_[i].has_value();
    REFIT_ASSIGN_OR_RETURN(modes_[i],
                           choose_pair_executor(cfg, o_.target_same_host[i], exported,
                                                o_.p2p != nullptr, o_.rank, o_.targets[i]));
    if (modes_[i] == PairExecutor::kPeer) {
      REFIT_RETURN_IF_ERROR(map_engine(i, *held_[i]));
      ++peer_targets_;
    } else {
      ++p2p_targets_;
    }
  }
  if (modes_ != runs_built_for_) {
    invalidate();
    runs_built_for_ = modes_;
  }

  if (peer_targets_ > 0) {
    if (peer_runs_.empty()) build_peer_runs(shards);
    // With point-to-point targets too, the rounds below are this rank's probe points.
    if (!begin.raw && p2p_targets_ == 0) probe_->before_round(begin.step, RefitProbe::kEveryRound);
    Timer t;
    REFIT_RETURN_IF_ERROR(peer_runs_.run(*o_.plane, cfg.policy.dtype, begin.raw));
    if (scales_ && !begin.raw) REFIT_RETURN_IF_ERROR(scales_->check_in_pass());
    times.cast_pack += t.seconds();
    log::debug("trainer rank {}: peer copies of step {}: {:.3f} ms", o_.rank, begin.step,
               t.seconds() * 1e3);
    for (std::size_t i = 0; i < targets_.size(); ++i)
      if (modes_[i] == PairExecutor::kPeer)
        bytes_sent_ += o_.setup->plan.pair_bytes(o_.rank, o_.targets[i]);
    if (!begin.raw) {
      const auto [written, dtype] = peer_runs_.written();
      REFIT_RETURN_IF_ERROR(probe_->after_write(begin.step, RefitProbe::kEveryRound, *o_.plane,
                                                *written, dtype));
    }
  }
  if (p2p_targets_ > 0) REFIT_RETURN_IF_ERROR(run_p2p(begin, shards, times));
  return Status::Ok();
}

Status RouteSender::run_p2p(const BeginMessage& begin, const std::vector<void*>& shards,
                            TransferTimes& times) {
  const Config& cfg = *o_.config;
  const TransferPlan& plan = o_.setup->plan;
  if (staging_.empty())
    for (int s = 0; s < cfg.refit.num_buffers; ++s) {
      REFIT_ASSIGN_OR_RETURN(auto buf, o_.plane->allocate(static_cast<std::size_t>(
                                           std::max<std::int64_t>(plan.max_send_bytes, 1))));
      staging_.push_back(std::move(buf));
    }
  if (send_ops_.empty()) build_pack_runs(shards);
  const auto timeout = cfg.refit.timeout();
  const auto nslots = static_cast<std::int64_t>(staging_.size());
  const std::int64_t base = sender_.completed();
  std::int64_t posted = 0;
  send_seconds_ = 0;
  for (int k = 0; k < plan.rounds; ++k) {
    const auto& ops = send_ops_[static_cast<std::size_t>(k)];
    if (ops.empty()) continue;
    if (!begin.raw) probe_->before_round(begin.step, k);
    // The slot is free once the round that used it before was sent.
    if (posted >= nslots)
      REFIT_RETURN_IF_ERROR(sender_.wait_completed(base + posted - nslots + 1, timeout)
                                .with_context(fmt::format("p2p sends of trainer rank {}", o_.rank)));
    if (!begin.raw) {
      Timer t;
      const RouteCopies& copies = pack_runs_[static_cast<std::size_t>(k)];
      REFIT_RETURN_IF_ERROR(copies.run(*o_.plane, cfg.policy.dtype, false));
      // Before the round is sent: a block found non-finite in its quantizing pass stops it.
      if (scales_ && !copies.quant.empty()) REFIT_RETURN_IF_ERROR(scales_->check_in_pass());
      times.cast_pack += t.seconds();
      const auto [written, dtype] = copies.written();
      REFIT_RETURN_IF_ERROR(probe_->after_write(begin.step, k, *o_.plane, *written, dtype));
    }
    for (const P2POp& op : ops) bytes_sent_ += static_cast<std::int64_t>(op.bytes);
    sender_.post([this, &ops, k] {
      Timer t;
      Status st = o_.p2p->exchange(ops);
      send_seconds_ += t.seconds();
      return st.ok() ? st
                     : st.with_context(fmt::format("p2p round {} of trainer rank {}", k, o_.rank));
    });
    ++posted;
  }
  Status st = sender_.drain(timeout);
  times.transfer += send_seconds_;
  if (st.code() == StatusCode::kTimeout)
    return Status::Timeout(fmt::format(
        "trainer rank {}: the point-to-point sends of refit step {} did not finish within "
        "refit.timeout_s ({} s): an engine rank it sends to is stuck, or waits for another "
        "trainer rank first",
        o_.rank, begin.step, cfg.refit.timeout_s));
  return st;
}

}  // namespace refit
