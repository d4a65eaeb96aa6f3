#include "executor/route_sender.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"
#include "common/timer.h"
#include "transport/transport.h"

namespace refit {

RouteSender::RouteSender(const RouteSenderOptions& o)
    : o_(o),
      delta_({.config = o.config,
              .rank = o.rank,
              .setup = o.setup,
              .plane = o.plane,
              .targets = o.targets}) {
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
  // Called for every peer target in every refit: the digest is compared in place.
  std::string computed;
  const std::string& key =
      direct.digest.empty() ? (computed = export_digest(direct)) : direct.digest;
  Mapped& m = mapped_[i];
  if (!m.params.empty() && m.key == key) return Status::Ok();
  const int g = o_.targets[i];
  const EngineShardLayout& lay = o_.setup->engine_layout(g);
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
  peer_built_ = false;
  log::debug("trainer rank {}: mapped engine rank {}'s parameters ({})", o_.rank, g,
             per_param ? fmt::format("{} handles", n) : fmt::format("{} bytes", direct.bytes));
  return Status::Ok();
}

// Every route of this rank to a peer target: read from the shard, cast, written in place. One
// list, in model order with the targets interleaved tensor by tensor, so that one copy call keeps
// local writes and writes over the link to other devices in flight at the same time.
Status RouteSender::build_peer_runs(const std::vector<void*>& shards) {
  peer_runs_.clear();
  peer_pack_runs_.clear();
  peer_segment_copies_.clear();
  peer_packed_bytes_ = 0;
  const PlanView& view = o_.setup->view;
  const TrainerShardLayout& mine = o_.setup->trainer;
  std::vector<std::pair<Route, std::size_t>> routes;  // one member each, target index
  for (std::size_t i = 0; i < o_.targets.size(); ++i) {
    if (modes_[i] != PairExecutor::kPeer) {
      peer_segments_.erase(i);
      continue;
    }
    // The pair's delta lists write the mapped parameters (patch). A pair with no kept copy (auto
    // gave up on it, or a bare pass before its first refit) needs no segments: it is copied.
    if (!delta_.tracks(i) || !delta_.keeps(i)) {
      peer_segments_.erase(i);
    } else {
      const Mapped& m = mapped_.at(i);
      REFIT_ASSIGN_OR_RETURN(const std::vector<const std::byte*> segments,
                             pack_peer_segments(i, shards));
      delta_.build_peer_lists(i, shards, std::vector<void*>(m.params.begin(), m.params.end()),
                              segments);
      if (delta_.sends_delta(i)) continue;  // patched, not copied
      if (!segments.empty()) {  // FP8: copied from its packed segments, quantized once
        delta_.append_peer_copies(i, peer_segment_copies_);
        continue;
      }
    }
    const PairPlan* pair = view.pair_with(o_.targets[i]);
    if (pair == nullptr) continue;
    for (const Route& r : pair->routes)
      for (std::int32_t j = 0; j < r.count; ++j) routes.emplace_back(r.member(j), i);
  }
  std::stable_sort(routes.begin(), routes.end(), [](const auto& a, const auto& b) {
    return a.first.hf_tensor < b.first.hf_tensor;
  });
  for (const auto& [r, i] : routes) {
    const Mapped& m = mapped_.at(i);
    const EngineShardLayout& lay = o_.setup->engine_layout(o_.targets[i]);
    const std::int64_t src_cols = matrix_shape(mine.tensors[r.trainer_tensor].shape).cols;
    const std::int64_t dst_cols = matrix_shape(lay.params[r.engine_param].shape).cols;
    peer_runs_.add(*o_.setup, r, static_cast<const std::byte*>(shards[r.trainer_tensor]),
                   m.params[r.engine_param],
                   {.src_offset = r.trainer_row * src_cols + r.trainer_col,
                    .src_stride = src_cols,
                    .dst_offset = r.engine_row * dst_cols + r.engine_col,
                    .dst_stride = dst_cols,
                    .rows = r.rows,
                    .cols = r.cols},
                   scales_.get());
  }
  return Status::Ok();
}

// refit.delta with FP8 weights, peer target i: its routes packed each refit into segments of its
// own, laid out as the p2p sender lays out a round's (a quantization is not a cast, so the encoder
// reads the packed codes). The segment of each round (none without FP8: the lists read the shards).
Result<std::vector<const std::byte*>> RouteSender::pack_peer_segments(
    std::size_t i, const std::vector<void*>& shards) {
  std::vector<const std::byte*> out;
  const PairPlan* pair = o_.setup->view.pair_with(o_.targets[i]);
  if (!o_.setup->wire().fp8 || pair == nullptr) return out;
  const std::size_t rounds = pair->round_bytes.size();
  std::vector<std::int64_t> base;
  std::int64_t bytes = 0;
  for (std::int64_t b : pair->round_bytes) {
    base.push_back(bytes);
    bytes += aligned_segment_bytes(b);
  }
  std::unique_ptr<PlaneBuffer>& segment = peer_segments_[i];
  if (!segment || segment->size() < static_cast<std::size_t>(bytes)) {
    segment.reset();
    REFIT_ASSIGN_OR_RETURN(
        segment, o_.plane->allocate(static_cast<std::size_t>(std::max<std::int64_t>(bytes, 1))));
  }
  add_pack_runs(*pair, shards, std::vector<std::byte*>(rounds, segment->data()), base,
                std::vector<RouteCopies*>(rounds, &peer_pack_runs_));
  peer_packed_bytes_ += pair_bytes(*o_.setup, o_.targets[i]);
  for (std::size_t k = 0; k < rounds; ++k) out.push_back(segment->data() + base[k]);
  return out;
}

// The copies that pack `pair`'s routes from `shards` into segments: round k's slices into
// `runs[k]`, written at `dst[k]` + `base[k]` + the slice's segment offset, member after member.
void RouteSender::add_pack_runs(const PairPlan& pair, const std::vector<void*>& shards,
                                const std::vector<std::byte*>& dst,
                                const std::vector<std::int64_t>& base,
                                const std::vector<RouteCopies*>& runs) const {
  const PlanView& view = o_.setup->view;
  const TrainerShardLayout& mine = o_.setup->trainer;
  for_each_slice(view, pair, [&](const Route& s) {
    const auto k = static_cast<std::size_t>(s.round);
    const auto esize = static_cast<std::int64_t>(dtype_size(view.dtype_of(s)));
    std::int64_t at = base[k] + s.segment_offset;
    for (std::int32_t j = 0; j < s.count; ++j) {
      const Route r = s.member(j);
      const std::int64_t src_cols = matrix_shape(mine.tensors[r.trainer_tensor].shape).cols;
      runs[k]->add(*o_.setup, r, static_cast<const std::byte*>(shards[r.trainer_tensor]), dst[k],
                   {.src_offset = r.trainer_row * src_cols + r.trainer_col,
                    .src_stride = src_cols,
                    .dst_offset = at / esize,
                    .dst_stride = r.cols,
                    .rows = r.rows,
                    .cols = r.cols},
                   scales_.get());
      at += r.numel() * esize;
    }
  });
}

// Per round: this rank's routes to p2p targets, cast into their segments of the round's staging
// slot (by engine rank, each aligned), and one send per segment. Rounds this rank sends in take
// the slots in turn. refit.delta: a target this rank sends a delta gets a word (the stream's
// size), then its stream, encoded into the slot after its segment — a segment only FP8 weights
// need, since a quantization is not a cast and their encoder reads the packed codes; a target that
// offered a base and gets its routes in full gets the word kDeltaFullSegment before its segment.
Status RouteSender::build_pack_runs(const std::vector<void*>& shards) {
  const Config& cfg = *o_.config;
  const PlanView& view = o_.setup->view;
  const bool fp8 = o_.setup->wire().fp8.has_value();
  const auto rounds = static_cast<std::size_t>(view.rounds);
  pack_runs_.assign(rounds, {});
  send_ops_.assign(rounds, {});
  delta_.lay_out(rounds, shards, modes_);
  // Where each pair's segment and stream of each round start in the round's slot, and which
  // rounds send.
  std::vector<std::int64_t> next(rounds, 0);
  std::vector<std::vector<std::int64_t>> base(view.pairs.size()), stream(view.pairs.size());
  std::vector<bool> sends(rounds, false);
  std::vector<std::size_t> target_of(view.pairs.size());
  for (std::size_t q = 0; q < view.pairs.size(); ++q) {
    const PairPlan& pair = view.pairs[q];
    const auto it = std::find(o_.targets.begin(), o_.targets.end(), pair.engine);
    const auto i = static_cast<std::size_t>(it - o_.targets.begin());
    target_of[q] = i;
    const bool p2p = modes_[i] == PairExecutor::kP2p;
    const bool use = p2p && delta_.sends_delta(i);
    for (std::size_t k = 0; k < pair.round_bytes.size(); ++k) {
      base[q].push_back(next[k]);
      if (!use || fp8) next[k] += aligned_segment_bytes(pair.round_bytes[k]);
      stream[q].push_back(next[k]);
      if (use) next[k] += aligned_segment_bytes(static_cast<std::int64_t>(delta_.capacity(i, k)));
      if (p2p) sends[k] = true;
    }
  }
  std::int64_t need = std::max<std::int64_t>(view.max_stage_bytes, 1);
  for (std::int64_t n : next) need = std::max(need, n);
  if (staging_.empty() || staging_.front()->size() < static_cast<std::size_t>(need)) {
    staging_.clear();
    delta_.drop_slots();
    for (int s = 0; s < cfg.refit.num_buffers; ++s) {
      REFIT_ASSIGN_OR_RETURN(auto buf, o_.plane->allocate(static_cast<std::size_t>(need)));
      staging_.push_back(std::move(buf));
      REFIT_RETURN_IF_ERROR(delta_.add_slot());
    }
  }
  std::vector<std::byte*> slot(rounds, nullptr), words(rounds, nullptr);
  std::size_t used = 0;  // rounds with sends so far
  for (std::size_t k = 0; k < rounds; ++k)
    if (sends[k]) {
      words[k] = delta_.slot_words(used);
      slot[k] = staging_[used++ % staging_.size()]->data();
    }
  for (std::size_t q = 0; q < view.pairs.size(); ++q) {
    const PairPlan& pair = view.pairs[q];
    const std::size_t i = target_of[q];
    if (modes_[i] != PairExecutor::kP2p) continue;
    const bool use = delta_.sends_delta(i);
    const int peer = p2p_rank_of_engine(cfg, pair.engine);
    for (std::size_t k = 0; k < pair.round_bytes.size(); ++k) {
      if (delta_.lay_out_round(i, k, peer, words[k] + 8 * i, slot[k] + base[q][k],
                               slot[k] + stream[q][k], shards, send_ops_[k]))
        continue;
      send_ops_[k].push_back(P2POp{.kind = P2POp::Kind::kSend,
                                   .peer = peer,
                                   .buf = slot[k] + base[q][k],
                                   .bytes = static_cast<std::size_t>(pair.round_bytes[k])});
    }
    if (use && !fp8) continue;  // encoded from the shards: nothing packed
    std::vector<RouteCopies*> runs;
    for (RouteCopies& r : pack_runs_) runs.push_back(&r);
    add_pack_runs(pair, shards, slot, base[q], runs);
  }
  return Status::Ok();
}

std::optional<RoutesMessage> RouteSender::routes_for(std::size_t i) const {
  if (o_.config->generation.backend != EngineProtocol::kSglang) return std::nullopt;
  const int g = o_.targets[i];
  const PairPlan* pair = o_.setup->view.pair_with(g);
  return pair ? routes_metadata(*pair, o_.setup->engine_layout(g)) : RoutesMessage{};
}

Status RouteSender::check_hello(std::size_t i, const HelloMessage& hello) const {
  const std::string ours = pair_routes_digest(*o_.setup, o_.targets[i]);
  if (hello.routes_digest == ours) return Status::Ok();
  return routes_digest_mismatch(o_.rank, targets_[i], ours, hello.routes_digest);
}

std::string_view RouteSender::export_held(std::size_t i) const {
  return i < held_.size() && held_[i] ? std::string_view(held_[i]->digest) : std::string_view();
}

Result<std::uint64_t> RouteSender::checksum_to(std::size_t i, const std::vector<void*>& shards) {
  auto it = checksum_runs_.find(i);
  if (it == checksum_runs_.end())
    it = checksum_runs_.emplace(i, trainer_checksum_runs(*o_.setup, o_.targets[i], shards)).first;
  return checksum_groups(*o_.plane, it->second, o_.config->policy.dtype);
}

Status RouteSender::before_begin(const BeginMessage& begin, const std::vector<void*>& user_shards,
                                 TransferTimes& times) {
  all_shards_ = user_shards;
  delta_.begin(begin, *probe_);
  if (!o_.setup->wire().fp8) return Status::Ok();
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
  for (std::size_t i = 0; i < targets_.size(); ++i) {
    PausedMessage& a = answers[static_cast<std::size_t>(o_.targets[i])];
    REFIT_RETURN_IF_ERROR(resolve_export(i, a));
    // refit.delta: the engine rank's offer of a base for this rank's pair, if any.
    delta_.take_offer(i, a);
  }
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
  REFIT_ASSIGN_OR_RETURN(const bool delta_changed, delta_.prepare(begin, modes_));
  if (modes_ != runs_built_for_ || delta_changed) {
    invalidate();
    runs_built_for_ = modes_;
  }

  if (peer_targets_ > 0) {
    if (!peer_built_) {
      REFIT_RETURN_IF_ERROR(build_peer_runs(shards));
      peer_built_ = true;
    }
    // With point-to-point targets too, the rounds below are this rank's probe points.
    if (!begin.raw && p2p_targets_ == 0) probe_->before_round(begin.step, RefitProbe::kEveryRound);
    Timer t;
    // FP8 with refit.delta: each kept peer pair's codes and scales, which its patch, or its copy
    // and capture, read. A delta's encode includes its share of the pack (refit.delta auto weighs
    // it against the copy alone).
    double pack_s = 0;
    if (!peer_pack_runs_.empty()) {
      REFIT_RETURN_IF_ERROR(peer_pack_runs_.run(*o_.plane, cfg.policy.dtype, begin.raw));
      pack_s = t.seconds();
    }
    if (!peer_runs_.empty())
      REFIT_RETURN_IF_ERROR(peer_runs_.run(*o_.plane, cfg.policy.dtype, begin.raw));
    if (!peer_segment_copies_.empty())
      REFIT_RETURN_IF_ERROR(o_.plane->copy(peer_segment_copies_, kByteCopyDType, kByteCopyDType));
    if (scales_ && !begin.raw) REFIT_RETURN_IF_ERROR(scales_->check_in_pass());
    const double copy_s = t.seconds() - pack_s;
    for (std::size_t i = 0; i < targets_.size(); ++i) {
      if (modes_[i] != PairExecutor::kPeer) continue;
      if (delta_.sends_delta(i)) {
        const double share =
            peer_packed_bytes_ > 0 && peer_segments_.count(i) != 0
                ? pack_s * static_cast<double>(pair_bytes(*o_.setup, o_.targets[i])) /
                      static_cast<double>(peer_packed_bytes_)
                : 0.0;
        REFIT_ASSIGN_OR_RETURN(const std::int64_t written, delta_.patch_peer(i, share));
        bytes_sent_ += written;
        continue;
      }
      bytes_sent_ += pair_bytes(*o_.setup, o_.targets[i]);
      if (begin.raw || !delta_.tracks(i)) continue;
      REFIT_RETURN_IF_ERROR(delta_.capture_peer(i, copy_s));
    }
    times.cast_pack += t.seconds();
    log::debug("trainer rank {}: peer copies of step {}: {:.3f} ms", o_.rank, begin.step,
               t.seconds() * 1e3);
    if (!begin.raw && !peer_runs_.empty()) {
      const auto [written, dtype] = peer_runs_.written();
      REFIT_RETURN_IF_ERROR(probe_->after_write(begin.step, RefitProbe::kEveryRound, *o_.plane,
                                                *written, dtype));
    } else if (!begin.raw && !peer_segment_copies_.empty()) {
      REFIT_RETURN_IF_ERROR(probe_->after_write(begin.step, RefitProbe::kEveryRound, *o_.plane,
                                                peer_segment_copies_, kByteCopyDType));
    }
  }
  if (p2p_targets_ > 0) REFIT_RETURN_IF_ERROR(run_p2p(begin, shards, times));
  if (begin.raw) return Status::Ok();
  // Every kept copy now holds what this refit sent.
  delta_.note_sent(begin.version, modes_);
  return Status::Ok();
}

Status RouteSender::run_p2p(const BeginMessage& begin, const std::vector<void*>& shards,
                            TransferTimes& times) {
  const Config& cfg = *o_.config;
  const PlanView& view = o_.setup->view;
  if (send_ops_.empty()) {
    REFIT_RETURN_IF_ERROR(build_pack_runs(shards));
    p2p_connected_ = false;
  }
  // The group connects a pair on its first use: every pair the rounds exchange with, at once,
  // before the first exchange (Communicator::connect); again only once the rounds are rebuilt or
  // the group is formed anew (recover()).
  if (!p2p_connected_) {
    REFIT_RETURN_IF_ERROR(
        o_.p2p->connect(round_peers(send_ops_, delta_.size_ops()))
            .with_context(fmt::format(
                "trainer rank {}: connecting to the engine ranks it sends to point to point",
                o_.rank)));
    p2p_connected_ = true;
  }
  const auto timeout = cfg.refit.timeout();
  const auto nslots = static_cast<std::int64_t>(staging_.size());
  const std::int64_t base = sender_.completed();
  std::int64_t posted = 0;
  send_seconds_ = 0;
  for (int k = 0; k < view.rounds; ++k) {
    const auto& ops = send_ops_[static_cast<std::size_t>(k)];
    if (ops.empty()) continue;
    if (!begin.raw) probe_->before_round(begin.step, k);
    // The slot is free once the round that used it before was sent.
    if (posted >= nslots)
      REFIT_RETURN_IF_ERROR(
          sender_.wait_completed(base + posted - nslots + 1, timeout)
              .with_context(fmt::format("p2p sends of trainer rank {}", o_.rank)));
    const auto kk = static_cast<std::size_t>(k);
    if (!begin.raw) {
      Timer t;
      const RouteCopies& copies = pack_runs_[kk];
      if (!copies.empty()) {
        REFIT_RETURN_IF_ERROR(copies.run(*o_.plane, cfg.policy.dtype, false));
        // Before the round is sent: a block found non-finite in its quantizing pass stops it.
        if (scales_ && !copies.quant.empty()) REFIT_RETURN_IF_ERROR(scales_->check_in_pass());
        times.cast_pack += t.seconds();
        const auto [written, dtype] = copies.written();
        REFIT_RETURN_IF_ERROR(probe_->after_write(begin.step, k, *o_.plane, *written, dtype));
      }
      // refit.delta: the words of targets that get the round in full, the delta targets' streams.
      REFIT_RETURN_IF_ERROR(delta_.write_round(begin.step, k, send_ops_[kk], *probe_));
    }
    const auto& sizes = delta_.size_ops(kk);
    for (const P2POp& op : sizes) bytes_sent_ += static_cast<std::int64_t>(op.bytes);
    for (const P2POp& op : ops) bytes_sent_ += static_cast<std::int64_t>(op.bytes);
    sender_.post([this, &ops, &sizes, k] {
      Timer t;
      Status st = sizes.empty() ? Status::Ok() : o_.p2p->exchange(sizes);
      if (st.ok()) st = o_.p2p->exchange(ops);
      send_seconds_ += t.seconds();
      return st.ok() ? st
                     : st.with_context(fmt::format("p2p round {} of trainer rank {}", k, o_.rank));
    });
    ++posted;
    // Full targets this rank keeps a copy for: it takes the round's values while they are sent.
    if (!begin.raw) REFIT_RETURN_IF_ERROR(delta_.capture_full_round(k, modes_));
  }
  Status st = sender_.drain(timeout);
  times.transfer += send_seconds_;
  if (st.ok() && !begin.raw && cfg.refit.delta != DeltaMode::kOff)
    delta_.note_p2p_rates(modes_, send_seconds_);
  if (st.code() == StatusCode::kTimeout)
    return Status::Timeout(fmt::format(
        "trainer rank {}: the point-to-point sends of refit step {} did not finish within "
        "refit.timeout_s ({} s): an engine rank it sends to is stuck, or waits for another "
        "trainer rank first",
        o_.rank, begin.step, cfg.refit.timeout_s));
  return st;
}

}  // namespace refit
