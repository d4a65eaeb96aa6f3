#include "executor/route_sender.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>

#include "common/log.h"
#include "common/timer.h"
#include "transport/transport.h"

namespace refit {

RouteSender::RouteSender(const RouteSenderOptions& o) : o_(o) {
  const int tp = o_.config->generation.tp_size;
  for (int g : o_.targets) targets_.push_back(RankId::engine(g, tp));
  for (int g = 0; g < o_.config->engine_ranks(); ++g) all_engines_.push_back(RankId::engine(g, tp));
  delta_.resize(targets_.size());
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
void RouteSender::build_peer_runs(const std::vector<void*>& shards) {
  peer_runs_.clear();
  const PlanView& view = o_.setup->view;
  const TrainerShardLayout& mine = o_.setup->trainer;
  std::vector<std::pair<Route, std::size_t>> routes;  // one member each, target index
  for (std::size_t i = 0; i < o_.targets.size(); ++i) {
    if (modes_[i] != PairExecutor::kPeer) continue;
    if (tracks(i)) {  // the pair's delta lists write the mapped parameters (patch)
      const Mapped& m = mapped_.at(i);
      const std::vector<void*> params(m.params.begin(), m.params.end());
      for (int k = 0; k < view.rounds; ++k) build_delta_round(i, k, shards, nullptr, &params);
    }
    if (delta_[i].use) continue;  // patched, not copied
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
  const TrainerShardLayout& mine = o_.setup->trainer;
  const bool fp8 = o_.setup->wire().fp8.has_value();
  const auto rounds = static_cast<std::size_t>(view.rounds);
  pack_runs_.assign(rounds, {});
  send_ops_.assign(rounds, {});
  size_ops_.assign(rounds, {});
  delta_sends_.assign(rounds, {});
  full_words_.assign(rounds, {});
  // The kept targets' lists of each round, read from the shards (FP8: rebuilt below from the
  // packed segments): what a capture reads, and what a stream of them takes at most.
  for (std::size_t i = 0; i < targets_.size(); ++i)
    if (modes_[i] == PairExecutor::kP2p && tracks(i))
      for (int k = 0; k < view.rounds; ++k) build_delta_round(i, k, shards, nullptr, nullptr);
  auto capacity = [&](std::size_t i, std::size_t k) {
    return k < delta_[i].rounds.size() ? delta_stream_capacity(delta_[i].rounds[k].routes)
                                       : std::size_t{0};
  };
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
    const bool use = p2p && delta_[i].use;
    for (std::size_t k = 0; k < pair.round_bytes.size(); ++k) {
      base[q].push_back(next[k]);
      if (!use || fp8) next[k] += aligned_segment_bytes(pair.round_bytes[k]);
      stream[q].push_back(next[k]);
      if (use) next[k] += aligned_segment_bytes(static_cast<std::int64_t>(capacity(i, k)));
      if (p2p) sends[k] = true;
    }
  }
  std::int64_t need = std::max<std::int64_t>(view.max_stage_bytes, 1);
  for (std::int64_t n : next) need = std::max(need, n);
  if (staging_.empty() || staging_.front()->size() < static_cast<std::size_t>(need)) {
    staging_.clear();
    size_words_.clear();
    for (int s = 0; s < cfg.refit.num_buffers; ++s) {
      REFIT_ASSIGN_OR_RETURN(auto buf, o_.plane->allocate(static_cast<std::size_t>(need)));
      staging_.push_back(std::move(buf));
      REFIT_ASSIGN_OR_RETURN(auto words,
                             o_.plane->allocate(8 * std::max<std::size_t>(targets_.size(), 1)));
      size_words_.push_back(std::move(words));
    }
  }
  std::vector<std::byte*> slot(rounds, nullptr), words(rounds, nullptr);
  std::size_t used = 0;  // rounds with sends so far
  for (std::size_t k = 0; k < rounds; ++k)
    if (sends[k]) {
      words[k] = size_words_[used % size_words_.size()]->data();
      slot[k] = staging_[used++ % staging_.size()]->data();
    }
  for (std::size_t q = 0; q < view.pairs.size(); ++q) {
    const PairPlan& pair = view.pairs[q];
    const std::size_t i = target_of[q];
    if (modes_[i] != PairExecutor::kP2p) continue;
    const DeltaPair& d = delta_[i];
    const bool use = d.use, worded = d.offer.has_value();
    const int peer = p2p_rank_of_engine(cfg, pair.engine);
    for (std::size_t k = 0; k < pair.round_bytes.size(); ++k) {
      std::byte* word = words[k] + 8 * i;
      if (worded) {
        size_ops_[k].push_back(
            P2POp{.kind = P2POp::Kind::kSend, .peer = peer, .buf = word, .bytes = 8});
        if (!use) full_words_[k].push_back(word);
      }
      if (fp8 && tracks(i))  // FP8: the lists read the packed codes
        build_delta_round(i, static_cast<int>(k), shards, slot[k] + base[q][k], nullptr);
      if (!use) {
        send_ops_[k].push_back(P2POp{.kind = P2POp::Kind::kSend,
                                     .peer = peer,
                                     .buf = slot[k] + base[q][k],
                                     .bytes = static_cast<std::size_t>(pair.round_bytes[k])});
        continue;
      }
      delta_sends_[k].push_back(DeltaSend{.target = i,
                                          .stream = slot[k] + stream[q][k],
                                          .capacity = capacity(i, k),
                                          .size_word = word,
                                          .op = send_ops_[k].size()});
      // The stream's size is set once it is encoded.
      send_ops_[k].push_back(P2POp{
          .kind = P2POp::Kind::kSend, .peer = peer, .buf = slot[k] + stream[q][k], .bytes = 0});
    }
    if (use && !fp8) continue;  // encoded from the shards: nothing packed
    for_each_slice(view, pair, [&](const Route& s) {
      const auto k = static_cast<std::size_t>(s.round);
      const auto esize = static_cast<std::int64_t>(dtype_size(view.dtype_of(s)));
      std::int64_t at = base[q][k] + s.segment_offset;
      for (std::int32_t j = 0; j < s.count; ++j) {
        const Route r = s.member(j);
        const std::int64_t src_cols = matrix_shape(mine.tensors[r.trainer_tensor].shape).cols;
        pack_runs_[k].add(*o_.setup, r, static_cast<const std::byte*>(shards[r.trainer_tensor]),
                          slot[k],
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
  return Status::Ok();
}

// ---- refit.delta ----

// Whether this rank keeps a copy of what it sends target i (refit.delta on or auto). FP8 weights
// reach the encoder only through the p2p staging segment (a quantization is not a cast), so a
// peer pair with FP8 weights moves in full.
bool RouteSender::tracks(std::size_t i) const {
  if (o_.config->refit.delta == DeltaMode::kOff) return false;
  return !(o_.setup->wire().fp8 && i < modes_.size() && modes_[i] == PairExecutor::kPeer);
}

// Refits in full after which `auto` tries a delta again, to measure the pair's density anew.
constexpr int kAutoProbeEvery = 8;

// Whether this rank would send target i a delta this refit, before the engine's offer: refit.delta
// on, or auto where predicted faster, with a base kept.
bool RouteSender::wants_delta(std::size_t i) {
  DeltaPair& d = delta_[i];
  const DeltaMode mode = o_.config->refit.delta;
  if (mode == DeltaMode::kOff || d.version.empty()) return false;
  // auto: the first delta measures the pair's density.
  if (mode == DeltaMode::kOn || d.density < 0 || d.link_bytes_per_s <= 0) return true;
  // The delta's bytes as the last one measured them (its density, and how far its changes moved:
  // a prediction from the density alone assumes one-step changes), its encode at the rate
  // measured then; the full refit's bytes at the link's rate.
  std::int64_t elements = 0;
  const std::int64_t full = delta_full_bytes(d.all.routes);
  for (const DeltaRoute& r : d.all.routes) elements += r.elements();
  const double encode_s =
      d.encode_elems_per_s > 0 ? static_cast<double>(elements) / d.encode_elems_per_s : 0.0;
  const double delta_s = static_cast<double>(d.last_wire_bytes) / d.link_bytes_per_s + encode_s;
  const double full_s = static_cast<double>(full) / d.link_bytes_per_s;
  const bool want = delta_s < full_s || d.full_since_delta >= kAutoProbeEvery;
  log::debug(
      "trainer rank {}: refit.delta auto for engine rank {}: density {:.4f}, link {:.1f} "
      "MB/s: delta {:.3f} s ({} bytes) against full {:.3f} s ({} bytes): {}",
      o_.rank, o_.targets[i], d.density, d.link_bytes_per_s / 1e6, delta_s, d.last_wire_bytes,
      full_s, full, want ? "delta" : "full");
  return want;
}

// Per target, once its executor is known: a delta iff this rank wants one, the engine rank
// offered the base of the version this rank kept, moved by the same executor, and (point to
// point) the digest of what it holds equals this rank's. Every other pair moves in full, and the
// log says why.
Status RouteSender::decide_delta(int step) {
  std::map<std::string, std::vector<int>> full;  // why -> engine ranks
  for (std::size_t i = 0; i < targets_.size(); ++i) {
    DeltaPair& d = delta_[i];
    d.use = false;
    const bool p2p = modes_[i] == PairExecutor::kP2p;
    if (d.offer && (!tracks(i) || d.offer->digest.has_value() != p2p))
      return Status::Corruption(fmt::format(
          "trainer rank {}: engine rank {} offered a delta base as a {} pair; this rank moves "
          "the pair by {}{}",
          o_.rank, o_.targets[i], d.offer->digest ? "point-to-point" : "peer-access",
          p2p ? "point to point" : "peer access", tracks(i) ? "" : " and keeps no base for it"));
    if (!tracks(i)) continue;
    std::uint64_t sum = 0;
    for (std::uint64_t x : d.digest) sum += x;
    std::string why;
    if (d.version.empty())
      why = "this rank keeps no base for them (the first refit, or a failed one since)";
    else if (!d.wanted)
      why = "refit.delta auto predicts them faster in full";
    else if (!d.offer)
      why = "they offered no base (their logs say why)";
    else if (d.offer->version != d.version)
      why = fmt::format("they hold weight version '{}', this rank kept '{}'", d.offer->version,
                        d.version);
    else if (d.kept_by != modes_[i])
      why = "this rank's kept copy moved by another executor";
    else if (p2p && *d.offer->digest != digest_hex(sum))
      why = fmt::format("they hold digest {} of weight version '{}', this rank kept {}",
                        *d.offer->digest, d.version, digest_hex(sum));
    if (why.empty()) {
      d.use = true;
      continue;
    }
    full[why].push_back(o_.targets[i]);
  }
  for (const auto& [why, engines] : full)
    log::info(
        "trainer rank {}: refit.delta: step {}: engine rank(s) {}: {}: their routes move "
        "in full",
        o_.rank, step, fmt::join(engines, ", "), why);
  return Status::Ok();
}

std::int64_t RouteSender::pair_bytes(std::size_t i) const {
  const PairPlan* pair = o_.setup->view.pair_with(o_.targets[i]);
  return pair != nullptr ? pair->bytes : 0;
}

Status RouteSender::ensure_kept(std::size_t i) {
  DeltaPair& d = delta_[i];
  if (d.kept) return Status::Ok();
  d.all = trainer_delta_routes(*o_.setup, o_.config->policy.dtype, o_.rank, o_.targets[i],
                               DeltaSource::kShards, nullptr, nullptr, nullptr);
  const std::int64_t bytes = assign_kept_offsets(d.all.routes);
  REFIT_ASSIGN_OR_RETURN(
      d.kept, o_.plane->allocate(static_cast<std::size_t>(std::max<std::int64_t>(bytes, 16))));
  d.digest.assign(static_cast<std::size_t>(o_.setup->view.rounds), 0);
  return Status::Ok();
}

// Target i's routes of `round`, read from `shards` or (FP8) the packed `segment`, written to
// `params` (peer access) or nowhere; each keeps the kept offset of the pair's list.
void RouteSender::build_delta_round(std::size_t i, int round, const std::vector<void*>& shards,
                                    const std::byte* segment, const std::vector<void*>* params) {
  DeltaPair& d = delta_[i];
  if (!d.kept) return;  // a bare pass before any refit: nothing kept yet
  d.rounds.resize(static_cast<std::size_t>(o_.setup->view.rounds));
  PairDeltaRoutes list =
      trainer_delta_routes(*o_.setup, o_.config->policy.dtype, o_.rank, o_.targets[i],
                           segment != nullptr ? DeltaSource::kSegment : DeltaSource::kShards,
                           &shards, segment, params, round);
  for (DeltaRoute& r : list.routes) r.kept = d.all.routes[r.tag].kept;
  d.rounds[static_cast<std::size_t>(round)] = std::move(list);
}

DeltaOptions RouteSender::delta_options(const PairDeltaRoutes& list) const {
  DeltaOptions opts;
  opts.describe = list.describe();
  return opts;
}

Status RouteSender::encode_round(std::size_t i, int round, std::byte* out, std::size_t capacity,
                                 std::size_t* bytes) {
  DeltaPair& d = delta_[i];
  const auto k = static_cast<std::size_t>(round);
  const PairDeltaRoutes& list = d.rounds[k];
  Timer t;
  Result<DeltaResult> r = o_.plane->delta_encode(list.routes, d.kept->data(), out, capacity,
                                                 d.digest[k], delta_options(list));
  if (!r.ok())
    return r.status().with_context(
        fmt::format("trainer rank {}: the delta to engine rank {}, "
                    "round {}",
                    o_.rank, o_.targets[i], round));
  const double secs = t.seconds();
  d.digest[k] += r->digest_delta;
  d.refit_elements += r->elements;
  d.refit_changed += r->changed;
  d.refit_encode_s += secs;
  d.refit_wire_bytes += static_cast<std::int64_t>(r->stream_bytes) + 8;  // and its size word
  delta_traffic_.delta_elements += r->elements;
  delta_traffic_.delta_changed += r->changed;
  delta_traffic_.encode_s += secs;
  *bytes = r->stream_bytes;
  return Status::Ok();
}

// After a full refit of the pair: the kept copy takes what was sent.
Status RouteSender::capture_round(std::size_t i, int round) {
  DeltaPair& d = delta_[i];
  const auto k = static_cast<std::size_t>(round);
  const PairDeltaRoutes& list = d.rounds[k];
  if (list.routes.empty()) {
    d.digest[k] = 0;
    return Status::Ok();
  }
  Timer t;
  Result<DeltaResult> r = o_.plane->delta_capture(list.routes, d.kept->data(), delta_options(list));
  if (!r.ok())
    return r.status().with_context(
        fmt::format("trainer rank {}: keeping what it sent engine rank {}, round {}", o_.rank,
                    o_.targets[i], round));
  d.digest[k] = r->digest_delta;
  delta_traffic_.encode_s += t.seconds();
  return Status::Ok();
}

// Peer access: only the changed elements are written, to the kept copy and the engine's
// parameters. What moved is counted as the changed elements' bytes.
Status RouteSender::patch_peer(std::size_t i) {
  DeltaPair& d = delta_[i];
  std::int64_t elements = 0, changed = 0;
  Timer t;
  for (std::size_t k = 0; k < d.rounds.size(); ++k) {
    const PairDeltaRoutes& list = d.rounds[k];
    if (list.routes.empty()) continue;
    Result<DeltaResult> r = o_.plane->delta_patch(list.routes, d.kept->data(), delta_options(list));
    if (!r.ok())
      return r.status().with_context(
          fmt::format("trainer rank {}: patching engine rank {}'s parameters, round {}", o_.rank,
                      o_.targets[i], k));
    d.digest[k] += r->digest_delta;
    elements += r->elements;
    changed += r->changed;
  }
  d.refit_elements = elements;
  d.refit_changed = changed;
  d.refit_encode_s = t.seconds();
  delta_traffic_.encode_s += t.seconds();
  delta_traffic_.delta_elements += elements;
  delta_traffic_.delta_changed += changed;
  const std::int64_t full = pair_bytes(i);
  const std::int64_t written =
      elements > 0
          ? static_cast<std::int64_t>(static_cast<double>(full) * static_cast<double>(changed) /
                                      static_cast<double>(elements))
          : 0;
  bytes_sent_ += written;
  d.refit_wire_bytes = written;
  return Status::Ok();
}

// refit.delta auto, after a refit's point-to-point sends: each delta pair's density and encode
// rate, and, when every pair went in full, the link's payload rate shared by the pairs in
// proportion to their bytes.
void RouteSender::note_p2p_rates() {
  std::int64_t full = 0;
  bool all_full = true;
  for (std::size_t i = 0; i < targets_.size(); ++i) {
    if (modes_[i] != PairExecutor::kP2p) continue;
    full += pair_bytes(i);
    all_full = all_full && !delta_[i].use;
  }
  if (!all_full || send_seconds_ <= 0 || full <= 0) return;
  const double rate = static_cast<double>(full) / send_seconds_;
  for (std::size_t i = 0; i < targets_.size(); ++i)
    if (modes_[i] == PairExecutor::kP2p)
      delta_[i].link_bytes_per_s =
          rate * static_cast<double>(pair_bytes(i)) / static_cast<double>(full);
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

std::string RouteSender::export_held(std::size_t i) const {
  return i < held_.size() && held_[i] ? held_[i]->digest : std::string();
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
  for (std::size_t i = 0; i < delta_.size(); ++i) {
    DeltaPair& d = delta_[i];
    d.offer.reset();
    d.use = false;
    if (!begin.raw && !d.version.empty() && probe_->forget_delta_base(begin.step, o_.targets[i])) {
      log::info("trainer rank {}: fault injection: forgetting what it kept for engine rank {}",
                o_.rank, o_.targets[i]);
      d.version.clear();
    }
    d.wanted = !begin.raw && wants_delta(i);
  }
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
    for (const DeltaBase& b : a.delta_bases)
      if (b.rank == o_.rank)
        delta_[i].offer = DeltaBase{.digest = b.digest, .version = a.delta_version};
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
  if (!begin.raw) REFIT_RETURN_IF_ERROR(decide_delta(begin.step));
  std::vector<int> uses(targets_.size(), 0);
  bool kept_new = false;
  delta_traffic_ = RankTraffic{};
  for (std::size_t i = 0; i < targets_.size(); ++i) {
    DeltaPair& d = delta_[i];
    d.refit_elements = d.refit_changed = d.refit_wire_bytes = 0;
    d.refit_encode_s = 0;
    delta_traffic_.full_bytes += pair_bytes(i);
    if (tracks(i) && !begin.raw && !d.kept) {
      REFIT_RETURN_IF_ERROR(ensure_kept(i));
      kept_new = true;  // the lists of its rounds are built with the runs
    }
    // What the round layout depends on: a delta, a word before each round's segment, neither.
    uses[i] = d.use ? 2 : d.offer ? 1 : 0;
    if (d.use) ++delta_traffic_.delta_pairs;
  }
  if (modes_ != runs_built_for_ || uses != built_uses_ || kept_new) {
    invalidate();
    runs_built_for_ = modes_;
    built_uses_ = uses;
  }

  if (peer_targets_ > 0) {
    if (!peer_built_) {
      build_peer_runs(shards);
      peer_built_ = true;
    }
    // With point-to-point targets too, the rounds below are this rank's probe points.
    if (!begin.raw && p2p_targets_ == 0) probe_->before_round(begin.step, RefitProbe::kEveryRound);
    Timer t;
    if (!peer_runs_.empty())
      REFIT_RETURN_IF_ERROR(peer_runs_.run(*o_.plane, cfg.policy.dtype, begin.raw));
    if (scales_ && !begin.raw) REFIT_RETURN_IF_ERROR(scales_->check_in_pass());
    const double copy_s = t.seconds();
    for (std::size_t i = 0; i < targets_.size(); ++i) {
      if (modes_[i] != PairExecutor::kPeer) continue;
      const std::int64_t full = pair_bytes(i);
      if (delta_[i].use) {
        REFIT_RETURN_IF_ERROR(patch_peer(i));
        continue;
      }
      bytes_sent_ += full;
      if (begin.raw || !tracks(i)) continue;
      for (int k = 0; k < o_.setup->view.rounds; ++k) REFIT_RETURN_IF_ERROR(capture_round(i, k));
      if (copy_s > 0) delta_[i].link_bytes_per_s = static_cast<double>(full) / copy_s;
    }
    times.cast_pack += t.seconds();
    log::debug("trainer rank {}: peer copies of step {}: {:.3f} ms", o_.rank, begin.step,
               t.seconds() * 1e3);
    if (!begin.raw && !peer_runs_.empty()) {
      const auto [written, dtype] = peer_runs_.written();
      REFIT_RETURN_IF_ERROR(probe_->after_write(begin.step, RefitProbe::kEveryRound, *o_.plane,
                                                *written, dtype));
    }
  }
  if (p2p_targets_ > 0) REFIT_RETURN_IF_ERROR(run_p2p(begin, shards, times));
  if (begin.raw) return Status::Ok();
  // Every kept copy now holds what this refit sent.
  for (std::size_t i = 0; i < targets_.size(); ++i) {
    if (!tracks(i)) continue;
    DeltaPair& d = delta_[i];
    d.version = begin.version;
    d.kept_by = modes_[i];
    d.full_since_delta = d.use ? 0 : d.full_since_delta + 1;
    if (d.use && d.refit_elements > 0) {
      d.density = static_cast<double>(d.refit_changed) / static_cast<double>(d.refit_elements);
      d.last_wire_bytes = d.refit_wire_bytes;
      if (d.refit_encode_s > 0)
        d.encode_elems_per_s = static_cast<double>(d.refit_elements) / d.refit_encode_s;
    }
  }
  return Status::Ok();
}

Status RouteSender::run_p2p(const BeginMessage& begin, const std::vector<void*>& shards,
                            TransferTimes& times) {
  const Config& cfg = *o_.config;
  const PlanView& view = o_.setup->view;
  if (send_ops_.empty()) REFIT_RETURN_IF_ERROR(build_pack_runs(shards));
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
      // Targets that offered a base and get the round in full: the word that says so.
      for (std::byte* word : full_words_[kk]) {
        const std::uint64_t full = kDeltaFullSegment;
        REFIT_RETURN_IF_ERROR(o_.plane->write(word, &full, sizeof full));
      }
      // Delta targets: encode into the slot, then the size word the engine receives first.
      for (const DeltaSend& ds : delta_sends_[kk]) {
        std::size_t bytes = 0;
        REFIT_RETURN_IF_ERROR(encode_round(ds.target, k, ds.stream, ds.capacity, &bytes));
        const std::uint64_t word = bytes;
        REFIT_RETURN_IF_ERROR(o_.plane->write(ds.size_word, &word, sizeof word));
        send_ops_[kk][ds.op].bytes = bytes;
        // What a fault probe may corrupt: the stream's payloads, after its directory.
        const std::size_t directory =
            delta_directory_bytes(delta_[ds.target].rounds[kk].routes.size());
        if (bytes > directory)
          REFIT_RETURN_IF_ERROR(probe_->after_write(
              begin.step, k, *o_.plane,
              {CopyRun{.dst = ds.stream,
                       .block = {.dst_offset = static_cast<std::int64_t>(directory),
                                 .rows = 1,
                                 .cols = static_cast<std::int64_t>(bytes - directory)}}},
              kByteCopyDType));
      }
    }
    const auto& sizes = size_ops_[kk];
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
    if (!begin.raw)
      for (std::size_t i = 0; i < targets_.size(); ++i)
        if (modes_[i] == PairExecutor::kP2p && tracks(i) && !delta_[i].use &&
            kk < delta_[i].rounds.size())
          REFIT_RETURN_IF_ERROR(capture_round(i, k));
  }
  Status st = sender_.drain(timeout);
  times.transfer += send_seconds_;
  if (st.ok() && !begin.raw && cfg.refit.delta != DeltaMode::kOff) note_p2p_rates();
  if (st.code() == StatusCode::kTimeout)
    return Status::Timeout(fmt::format(
        "trainer rank {}: the point-to-point sends of refit step {} did not finish within "
        "refit.timeout_s ({} s): an engine rank it sends to is stuck, or waits for another "
        "trainer rank first",
        o_.rank, begin.step, cfg.refit.timeout_s));
  return st;
}

}  // namespace refit
