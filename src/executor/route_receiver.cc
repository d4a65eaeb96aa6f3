#include "executor/route_receiver.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>

#include "common/log.h"
#include "common/timer.h"
#include "transport/transport.h"

namespace refit {

RouteReceiver::RouteReceiver(const RouteReceiverOptions& o) : o_(o) {
  for (int r : o_.sources) feeders_.push_back(RankId::trainer(r));
  delta_.resize(o_.sources.size());
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
    REFIT_ASSIGN_OR_RETURN(modes_[i],
                           choose_pair_executor(*o_.config, o_.source_same_host[i], params_exported,
                                                o_.p2p != nullptr, o_.sources[i], o_.engine_rank));
    (modes_[i] == PairExecutor::kPeer ? peer_sources_ : p2p_sources_)++;
  }
  if (modes_ != built_for_) {
    runs_.clear();
    built_for_ = modes_;
  }
  return Status::Ok();
}

void RouteReceiver::offer_delta(const BeginMessage& begin, const std::optional<std::string>& held,
                                PausedMessage& answer) {
  if (!tracks()) return;
  std::map<std::string, std::vector<int>> full;  // why -> trainer ranks
  for (std::size_t i = 0; i < o_.sources.size(); ++i) {
    DeltaSource& d = delta_[i];
    d.offered = false;
    d.use = -1;
    if (begin.raw) {  // a bare pass leaves the parameters as no refit sent them
      d.version.clear();
      continue;
    }
    if (!d.version.empty() && probe_->forget_delta_base(begin.step, o_.sources[i])) {
      log::info("{}: fault injection: forgetting what this rank holds from trainer rank {}", o_.who,
                o_.sources[i]);
      d.version.clear();
    }
    std::string why;
    if (d.version.empty())
      why = "this rank holds no base from them (the first refit, a failed one since, a restart, or its "
            "parameters registered anew)";
    else if (!held || *held != d.version)
      why = fmt::format("this rank holds weight version '{}', what it holds from them is of '{}'",
                        held ? *held : "(none complete)", d.version);
    else if (d.by != modes_[i])
      why = "what this rank holds from them moved by another executor";
    if (!why.empty()) {
      full[why].push_back(o_.sources[i]);
      continue;
    }
    d.offered = true;
    DeltaBase b{.rank = o_.sources[i]};
    if (modes_[i] == PairExecutor::kP2p) {
      std::uint64_t mine = 0;
      for (std::uint64_t x : d.digest) mine += x;
      b.digest = digest_hex(mine);
    }
    answer.delta_bases.push_back(std::move(b));
  }
  if (!answer.delta_bases.empty()) answer.delta_version = *held;
  for (const auto& [why, ranks] : full)
    log::info(
        "{}: refit.delta: step {}: no base offered to trainer rank(s) {}: {}: their routes "
        "move in full",
        o_.who, begin.step, fmt::join(ranks, ", "), why);
}

// Per round with point-to-point segments: one receive per source into the round's slot (laid out
// by source, each aligned) and the scatter of those segments into the parameters. A source this
// rank offered a base (refit.delta) sends a word first, then a delta stream (applied in place) or
// its segment in full: its region of the slot takes either.
Status RouteReceiver::build(const std::vector<void*>& params) {
  const IncomingRoutes& in = o_.incoming;
  const int g = o_.engine_rank;
  const EngineShardLayout& lay = o_.setup->engine_layout(g);
  const auto nslots = static_cast<std::size_t>(o_.config->refit.num_buffers);
  const auto rounds = static_cast<std::size_t>(in.rounds);
  runs_.assign(rounds, {});
  recv_ops_.assign(rounds, {});
  size_ops_.assign(rounds, {});
  delta_recvs_.assign(rounds, {});
  digest_after_.assign(rounds, {});
  for (std::size_t i = 0; i < o_.sources.size(); ++i) {
    delta_[i].rounds.clear();
    if (!tracks() || modes_[i] != PairExecutor::kP2p) continue;
    delta_[i].digest.resize(rounds, 0);
    for (std::size_t k = 0; k < rounds; ++k)
      delta_[i].rounds.push_back(
          engine_delta_routes(in, lay, o_.sources[i], params, static_cast<int>(k)));
  }
  // Where each source's segment of each round starts in the round's slot, and which rounds
  // receive point-to-point.
  std::vector<std::int64_t> next(rounds, 0);
  std::vector<std::vector<std::int64_t>> base(in.pairs.size());
  std::vector<std::size_t> source_of(in.pairs.size());
  std::vector<bool> p2p(in.pairs.size(), false), receives(rounds, false);
  for (std::size_t q = 0; q < in.pairs.size(); ++q) {
    const IncomingPair& pair = in.pairs[q];
    const auto it = std::find(o_.sources.begin(), o_.sources.end(), pair.trainer);
    if (it == o_.sources.end())
      return Status::Corruption(
          fmt::format("engine rank {}: routes from trainer rank {}, which "
                      "does not feed it",
                      g, pair.trainer));
    const auto i = static_cast<std::size_t>(it - o_.sources.begin());
    source_of[q] = i;
    p2p[q] = modes_[i] == PairExecutor::kP2p;
    const bool offered = p2p[q] && delta_[i].offered;
    for (std::size_t k = 0; k < pair.round_bytes.size(); ++k) {
      base[q].push_back(next[k]);
      std::int64_t bytes = pair.round_bytes[k];
      if (offered)
        bytes = std::max(
            bytes, static_cast<std::int64_t>(delta_stream_capacity(delta_[i].rounds[k].routes)));
      next[k] += aligned_segment_bytes(bytes);
      if (p2p[q]) receives[k] = true;
    }
  }
  std::int64_t need = std::max<std::int64_t>(in.max_slot_bytes, 1);
  for (std::int64_t n : next) need = std::max(need, n);
  if (slots_.empty() || slots_.front()->size() < static_cast<std::size_t>(need)) {
    slots_.clear();
    size_words_.clear();
    for (std::size_t s = 0; s < nslots; ++s) {
      REFIT_ASSIGN_OR_RETURN(auto buf, o_.plane->allocate(static_cast<std::size_t>(need)));
      slots_.push_back(std::move(buf));
      REFIT_ASSIGN_OR_RETURN(auto words,
                             o_.plane->allocate(8 * std::max<std::size_t>(o_.sources.size(), 1)));
      size_words_.push_back(std::move(words));
    }
  }
  std::vector<std::byte*> slot(rounds, nullptr), words(rounds, nullptr);
  std::size_t used = 0;  // rounds with segments so far: slots rotate over them
  for (std::size_t k = 0; k < rounds; ++k)
    if (receives[k]) {
      words[k] = size_words_[used % nslots]->data();
      slot[k] = slots_[used++ % nslots]->data();
    }
  for (std::size_t q = 0; q < in.pairs.size(); ++q) {
    if (!p2p[q]) continue;
    const IncomingPair& pair = in.pairs[q];
    const std::size_t i = source_of[q];
    const bool offered = delta_[i].offered;
    const int peer = p2p_rank_of_trainer(pair.trainer);
    std::vector<std::size_t> entry(pair.round_bytes.size(), 0);  // in delta_recvs_[k]
    for (std::size_t k = 0; k < pair.round_bytes.size(); ++k) {
      std::byte* at = slot[k] + base[q][k];
      const auto full = static_cast<std::size_t>(pair.round_bytes[k]);
      if (!offered) {
        recv_ops_[k].push_back(
            P2POp{.kind = P2POp::Kind::kRecv, .peer = peer, .buf = at, .bytes = full});
        if (tracks() && !delta_[i].rounds[k].routes.empty()) digest_after_[k].push_back(i);
        continue;
      }
      std::byte* word = words[k] + 8 * i;
      size_ops_[k].push_back(
          P2POp{.kind = P2POp::Kind::kRecv, .peer = peer, .buf = word, .bytes = 8});
      entry[k] = delta_recvs_[k].size();
      delta_recvs_[k].push_back(
          DeltaRecv{.source = i,
                    .stream = at,
                    .capacity = delta_stream_capacity(delta_[i].rounds[k].routes),
                    .full_bytes = full,
                    .size_word = word,
                    .op = recv_ops_[k].size()});
      // Its size is set once the word arrived.
      recv_ops_[k].push_back(
          P2POp{.kind = P2POp::Kind::kRecv, .peer = peer, .buf = at, .bytes = 0});
    }
    for_each_incoming_slice(pair, in.pair_budget, lay, [&](const Route& s) {
      const auto k = static_cast<std::size_t>(s.round);
      std::vector<CopyRun>& runs = offered ? delta_recvs_[k][entry[k]].runs : runs_[k];
      std::int64_t at = base[q][k] + s.segment_offset;
      for (std::int32_t j = 0; j < s.count; ++j) {
        const Route r = s.member(j);
        const EngineParam& p = lay.params[r.engine_param];
        const std::int64_t dst_cols = matrix_shape(p.shape).cols;
        const std::size_t esize = dtype_size(p.dtype);
        runs.push_back(byte_run(slot[k], static_cast<std::byte*>(params[r.engine_param]),
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

// On the apply thread: the round's full segments scattered, its delta streams applied in place
// (each checked before a byte is written, and after), and the digests of the full sources this
// rank keeps a base for taken from what landed.
Status RouteReceiver::apply_round(std::size_t k) {
  Timer t;
  if (!runs_[k].empty())
    REFIT_RETURN_IF_ERROR(o_.plane->copy(runs_[k], kByteCopyDType, kByteCopyDType));
  for (const DeltaRecv& dr : delta_recvs_[k]) {
    DeltaSource& d = delta_[dr.source];
    const PairDeltaRoutes& list = d.rounds[k];
    if (dr.full) {  // offered a base, sent in full: scattered, and its digest taken
      if (!dr.runs.empty())
        REFIT_RETURN_IF_ERROR(o_.plane->copy(dr.runs, kByteCopyDType, kByteCopyDType));
      d.digest[k] = 0;
      if (list.routes.empty()) continue;
      Result<std::uint64_t> sum = o_.plane->delta_digest(list.routes);
      if (!sum.ok())
        return sum.status().with_context(
            fmt::format("{}: the digest of what trainer rank {} sent in round {}", o_.who,
                        o_.sources[dr.source], k));
      d.digest[k] = *sum;
      continue;
    }
    DeltaOptions opts;
    opts.describe = list.describe();
    if (logging_) {
      d.logs.resize(d.rounds.size());
      opts.log = &d.logs[k];
    }
    Timer ta;
    Result<DeltaResult> r =
        o_.plane->delta_apply(list.routes, dr.stream, dr.bytes, d.digest[k], opts);
    if (!r.ok())
      return r.status().with_context(fmt::format("{}: the delta from trainer rank {}, round {}",
                                                 o_.who, o_.sources[dr.source], k));
    d.digest[k] += r->digest_delta;
    delta_traffic_.delta_elements += r->elements;
    delta_traffic_.delta_changed += r->changed;
    delta_traffic_.delta_apply_s += ta.seconds();
  }
  for (std::size_t i : digest_after_[k]) {
    DeltaSource& d = delta_[i];
    Result<std::uint64_t> sum = o_.plane->delta_digest(d.rounds[k].routes);
    if (!sum.ok())
      return sum.status().with_context(fmt::format(
          "{}: the digest of what trainer rank {} sent in round {}", o_.who, o_.sources[i], k));
    d.digest[k] = *sum;
  }
  apply_seconds_ += t.seconds();
  return Status::Ok();
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
  REFIT_RETURN_IF_ERROR(applier_.drain(o_.config->refit.timeout()));
  if (begin.raw) return Status::Ok();
  // What this rank holds of every source it keeps a base for is now this refit's.
  std::vector<int> in_full;  // offered a base, sent in full
  for (std::size_t i = 0; i < o_.sources.size(); ++i) {
    if (!tracks()) continue;
    DeltaSource& d = delta_[i];
    d.version = begin.version;
    d.by = modes_[i];
    if (modes_[i] != PairExecutor::kP2p || !d.offered) continue;
    if (d.use == 1) ++delta_traffic_.delta_pairs;
    if (d.use == 0) in_full.push_back(o_.sources[i]);
  }
  // At info when the set changes (a trainer rank that went on sending in full, as one whose
  // refit.delta auto retired the pair does, is said once), at debug while it stays the same.
  const log::Level level = in_full != last_in_full_ ? log::Level::kInfo : log::Level::kDebug;
  if (!in_full.empty() && log::enabled(level))
    log::write(level, fmt::format("{}: refit.delta: step {}: trainer rank(s) {} sent their routes "
                                  "in full, though this rank offered them its base (their logs "
                                  "say why)",
                                  o_.who, begin.step, fmt::join(in_full, ", ")));
  last_in_full_ = std::move(in_full);
  return Status::Ok();
}

// replay_deltas: the logs of the last refit's applies, onto the parameters through the same
// routes with the parameters as their destination.
Result<bool> RouteReceiver::replay_deltas(const std::vector<void*>& params) {
  if (!logging_) return false;
  // Every list that received routes was applied through a complete log (a round that came in
  // full, or an apply that failed, left its log incomplete), or nothing is written.
  for (const DeltaSource& d : delta_)
    for (std::size_t k = 0; k < d.rounds.size(); ++k)
      if (!d.rounds[k].routes.empty() && (k >= d.logs.size() || !d.logs[k].complete)) return false;
  if (replay_params_ != params) replay_routes_.clear();
  if (replay_routes_.empty()) {
    const EngineShardLayout& lay = o_.setup->engine_layout(o_.engine_rank);
    replay_routes_.resize(o_.sources.size());
    for (std::size_t i = 0; i < o_.sources.size(); ++i)
      for (std::size_t k = 0; k < delta_[i].rounds.size(); ++k)
        replay_routes_[i].push_back(
            engine_delta_routes(o_.incoming, lay, o_.sources[i], params, static_cast<int>(k)));
    replay_params_ = params;
  }
  for (std::size_t i = 0; i < o_.sources.size(); ++i) {
    const DeltaSource& d = delta_[i];
    for (std::size_t k = 0; k < d.logs.size() && k < replay_routes_[i].size(); ++k) {
      const PairDeltaRoutes& list = replay_routes_[i][k];
      if (list.routes.empty()) continue;
      DeltaOptions opts;
      opts.describe = list.describe();
      REFIT_RETURN_IF_ERROR(o_.plane->delta_replay(list.routes, d.logs[k], opts)
                                .with_context(fmt::format(
                                    "{}: refit.staged: writing the changes trainer rank {} sent "
                                    "in round {} into the parameters",
                                    o_.who, o_.sources[i], k)));
    }
  }
  return true;
}

Status RouteReceiver::receive_rounds(int step, bool raw, const std::vector<void*>& params) {
  const int g = o_.engine_rank;
  bytes_received_ = 0;
  apply_seconds_ = 0;
  delta_traffic_ = RankTraffic{};
  // refit.staged: the applies log their writes when every source sends point to point to a base
  // this rank offered; each log counts once its apply in this refit succeeded.
  logging_ = o_.config->refit.staged && !raw && peer_sources_ == 0;
  for (std::size_t i = 0; i < o_.sources.size() && logging_; ++i)
    logging_ = modes_[i] == PairExecutor::kP2p && delta_[i].offered;
  for (DeltaSource& d : delta_)
    for (DeltaLog& l : d.logs) l.complete = false;
  std::vector<int> offers(o_.sources.size(), 0);
  for (std::size_t i = 0; i < o_.sources.size(); ++i) {
    offers[i] = modes_[i] == PairExecutor::kP2p && delta_[i].offered ? 1 : 0;
    delta_traffic_.full_bytes += o_.incoming.bytes_from(o_.sources[i]);
    // A peer feeder writes our parameters itself: in full, unless this rank offered it a base,
    // when it may have written only what changed, which this rank cannot see.
    if (modes_[i] == PairExecutor::kPeer && !delta_[i].offered)
      bytes_received_ += o_.incoming.bytes_from(o_.sources[i]);
  }
  if (offers != built_offers_) {
    runs_.clear();
    built_offers_ = offers;
  }
  if (p2p_sources_ == 0) {  // every feeder writes our parameters itself
    if (!raw) probe_->before_round(step, RefitProbe::kEveryRound);
    return Status::Ok();
  }
  if (runs_.empty()) {
    REFIT_RETURN_IF_ERROR(build(params));
    p2p_connected_ = false;
  }
  // The group connects a pair on its first use: every pair the rounds exchange with, at once,
  // before the first exchange (Communicator::connect); again only once the rounds are rebuilt or
  // the group is formed anew (recover()).
  if (!p2p_connected_) {
    REFIT_RETURN_IF_ERROR(
        o_.p2p->connect(round_peers(recv_ops_, size_ops_))
            .with_context(fmt::format(
                "{}: connecting to the trainer ranks that send to it point to point", o_.who)));
    p2p_connected_ = true;
  }
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
    if (!size_ops_[kk].empty()) {  // sources offered a base: what follows, first
      Status st = o_.p2p->exchange(size_ops_[kk]);
      if (!st.ok()) return st.with_context(fmt::format("p2p round {} of engine rank {}", k, g));
      for (DeltaRecv& dr : delta_recvs_[kk]) {
        std::uint64_t word = 0;
        REFIT_RETURN_IF_ERROR(o_.plane->read(&word, dr.size_word, sizeof word));
        bytes_received_ += static_cast<std::int64_t>(sizeof word);
        DeltaSource& d = delta_[dr.source];
        const bool full = word == kDeltaFullSegment;
        if (!full && (word < delta_directory_bytes(0) || word > dr.capacity))
          return Status::Corruption(fmt::format(
              "{}: trainer rank {} announced a delta stream of {} bytes for round {}, where a "
              "stream of its routes there takes {} to {} bytes",
              o_.who, o_.sources[dr.source], word, k, delta_directory_bytes(0), dr.capacity));
        if (d.use >= 0 && d.use != (full ? 0 : 1))
          return Status::Corruption(fmt::format(
              "{}: trainer rank {} sends round {} of refit step {} {}, an earlier round {}: a "
              "pair moves as a delta or in full for a whole refit",
              o_.who, o_.sources[dr.source], k, step, full ? "in full" : "as a delta",
              full ? "as a delta" : "in full"));
        d.use = full ? 0 : 1;
        dr.full = full;
        dr.bytes = full ? dr.full_bytes : static_cast<std::size_t>(word);
        recv_ops_[kk][dr.op].bytes = dr.bytes;
      }
    }
    Status st = o_.p2p->exchange(recv_ops_[kk]);
    if (!st.ok()) return st.with_context(fmt::format("p2p round {} of engine rank {}", k, g));
    for (const P2POp& op : recv_ops_[kk]) bytes_received_ += static_cast<std::int64_t>(op.bytes);
    applier_.post([this, kk, raw] { return raw ? Status::Ok() : apply_round(kk); });
    ++posted;
  }
  return Status::Ok();
}

}  // namespace refit
