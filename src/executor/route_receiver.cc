#include "executor/route_receiver.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "common/log.h"
#include "common/timer.h"
#include "transport/transport.h"

namespace refit {

RouteReceiver::RouteReceiver(const RouteReceiverOptions& o) : o_(o) {
  for (int r : o_.sources) feeders_.push_back(fmt::format("trainer/{}", r));
  for (int r = 0; r < o_.config->policy.world_size; ++r)
    trainer_ids_.push_back(fmt::format("trainer/{}", r));
}

Result<std::unique_ptr<RouteReceiver>> RouteReceiver::create(const RouteReceiverOptions& o) {
  if (o.sources.size() != o.source_same_host.size())
    return Status::Internal("route receiver: one host flag per source expected");
  return std::unique_ptr<RouteReceiver>(new RouteReceiver(o));
}

Status RouteReceiver::choose(bool params_exported) {
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

Status RouteReceiver::attach() {
  if (o_.config->generation.backend != EngineProtocol::kSglang) return Status::Ok();
  const EngineShardLayout& lay =
      o_.setup->engines[static_cast<std::size_t>(o_.engine_rank % o_.config->generation.tp_size)];
  IncomingRoutes in;
  std::vector<bool> seen(feeders_.size(), false);
  for (std::size_t got = 0; got < feeders_.size(); ++got) {
    REFIT_ASSIGN_OR_RETURN(Message m, expect_message(*o_.mailbox, MessageType::kRoutes,
                                                     o_.config->refit.timeout(),
                                                     "the feeders' route metadata"));
    const auto it = std::find(feeders_.begin(), feeders_.end(), m.from);
    const auto i = static_cast<std::size_t>(it - feeders_.begin());
    if (it == feeders_.end() || seen[i])
      return Status::Corruption(fmt::format(
          "{}: unexpected route metadata from {} (not a feeder, or sent twice)", o_.who, m.from));
    seen[i] = true;
    REFIT_ASSIGN_OR_RETURN(RoutesMessage routes, decode_routes(m.payload, m.from));
    REFIT_RETURN_IF_ERROR(add_routes_metadata(in, routes, o_.sources[i], lay));
  }
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

Status RouteReceiver::receive(const EngineRefit& r) {
  const BeginMessage& begin = r.begin;
  // Which export each feeder holds already (BeginMessage::export_held).
  std::map<std::string, std::string> held{{r.first_from, begin.export_held}};
  REFIT_RETURN_IF_ERROR(expect_from_each(
      *o_.mailbox, feeders_, MessageType::kBegin, {r.first_from}, o_.config->refit.timeout(),
      o_.who,
      "begins", [&](const Message& m) -> Status {
        REFIT_ASSIGN_OR_RETURN(BeginMessage b, decode_begin(m.payload, m.from));
        if (b.step != begin.step || b.raw != begin.raw)
          return Status::Corruption(fmt::format(
              "{}: {} began step {}{}, {} began step {}{}", o_.who, r.first_from, begin.step,
              begin.raw ? " (raw)" : "", m.from, b.step, b.raw ? " (raw)" : ""));
        held[m.from] = b.export_held;
        return Status::Ok();
      }));
  log::debug("{}: every feeder began refit step {}", o_.who, begin.step);
  // Pause (the hook may refuse), answer, and write nothing before every feeder said to proceed:
  // each trainer rank decides once every engine rank answered it.
  const Status paused = r.pause();
  const ExportedParams* exported = nullptr;
  if (paused.ok()) {
    exported = r.exported();
    REFIT_RETURN_IF_ERROR(choose(exported != nullptr));
  }
  // To every trainer rank, not only the feeders: each decides from every engine rank's answer.
  // The export travels only to a feeder that does not hold it already (the handles of a large
  // model are tens of kilobytes of JSON); the others get its digest.
  PausedMessage answer{.step = begin.step, .refused = paused.ok() ? "" : paused.message()};
  if (exported) answer.direct = ExportedParams{.digest = exported->digest, .elided = true};
  const std::string elided = encode(answer);
  std::string full;  // encoded for the first feeder that needs it
  for (const std::string& t : trainer_ids_) {
    const auto h = held.find(t);
    const bool send_full = exported && h != held.end() && h->second != exported->digest;
    if (send_full && full.empty()) {
      answer.direct = *exported;
      full = encode(answer);
    }
    REFIT_RETURN_IF_ERROR(o_.mailbox->send(t, MessageType::kPaused, send_full ? full : elided));
  }
  log::debug("{}: paused for refit step {} and answered", o_.who, begin.step);
  REFIT_ASSIGN_OR_RETURN(const ProceedMessage proceed, await_proceed(begin.step, r.early_commits));
  log::debug("{}: every feeder proceeds with refit step {}", o_.who, begin.step);
  if (!proceed.go) {
    r.abandon(proceed.error, paused.ok());
    return send_each(*o_.mailbox, feeders_, MessageType::kProceed,
                     encode(ProceedMessage{.step = begin.step, .go = false}));
  }
  if (!paused.ok())
    return Status::Internal(fmt::format(
        "{}: the feeders proceeded with refit step {} although this rank refused it: {}", o_.who,
        begin.step, paused.message()));
  REFIT_RETURN_IF_ERROR(receive_rounds(begin.step, begin.raw, *r.params));
  return applier_.drain(o_.config->refit.timeout());
}

// Every feeder's proceed for `step` (all say the same: every trainer rank decided from the same
// answers). A feeder that
// writes in place may commit before a slower feeder's proceed arrived: its commit is recorded in
// `early_commits`. The wait is bounded by 3 x the timeout + 5 s: longer than the feeders wait for
// every engine rank's answer (2 x the timeout + 5 s), however short the timeout.
Result<ProceedMessage> RouteReceiver::await_proceed(int step,
                                                    std::vector<std::string>* early_commits) {
  std::vector<bool> seen(feeders_.size(), false);
  ProceedMessage out{.step = step, .go = true};
  for (std::size_t got = 0; got < feeders_.size();) {
    Result<Message> r =
        o_.mailbox->receive(o_.config->refit.timeout() * 3 + std::chrono::seconds(5));
    if (!r.ok())
      return r.status().with_context(fmt::format("{} waiting for the feeders' proceed of refit "
                                                 "step {}",
                                                 o_.who, step));
    const Message& m = *r;
    const auto it = std::find(feeders_.begin(), feeders_.end(), m.from);
    const std::size_t i = static_cast<std::size_t>(it - feeders_.begin());
    if (it != feeders_.end() && seen[i] && m.type == MessageType::kCommit && early_commits &&
        std::find(early_commits->begin(), early_commits->end(), m.from) == early_commits->end()) {
      early_commits->push_back(m.from);
      continue;
    }
    if (it == feeders_.end() || seen[i] || m.type != MessageType::kProceed)
      return Status::Corruption(fmt::format("{} waiting for the feeders' proceed of refit step {}: "
                                            "unexpected {} from {}",
                                            o_.who, step, message_type_name(m.type), m.from));
    REFIT_ASSIGN_OR_RETURN(ProceedMessage p, decode_proceed(m.payload, m.from));
    if (p.step != step)
      return Status::Corruption(fmt::format("{}: {} sent the proceed of refit step {} in step {}",
                                            o_.who, m.from, p.step, step));
    if (!p.go && out.go) out = std::move(p);
    seen[i] = true;
    ++got;
  }
  return out;
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
