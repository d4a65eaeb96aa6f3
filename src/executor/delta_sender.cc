#include "executor/delta_sender.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <utility>

#include "common/log.h"
#include "common/timer.h"

namespace refit {
namespace {

// Refits in full after which `auto` tries a delta again, to measure the pair's density anew.
constexpr int kAutoProbeEvery = 8;

DeltaOptions delta_options(const PairDeltaRoutes& list) {
  DeltaOptions opts;
  opts.describe = list.describe();
  return opts;
}

}  // namespace

AutoPrediction predict_auto(const AutoMeasures& m) {
  AutoPrediction p;
  p.encode_s = m.encode_elems_per_s > 0
                   ? static_cast<double>(m.elements) / m.encode_elems_per_s
                   : 0.0;
  p.delta_s = static_cast<double>(m.last_wire_bytes) / m.link_bytes_per_s + p.encode_s;
  p.full_s = static_cast<double>(m.full_bytes) / m.link_bytes_per_s;
  // Never: with a margin, so that one slow encode (a loaded core, a first touch) does not drop a
  // pair that a delta could still serve.
  p.choice = p.encode_s >= kAutoNeverMargin * p.full_s ? AutoChoice::kNever
             : p.delta_s < p.full_s ? AutoChoice::kDelta
                                    : AutoChoice::kFull;
  return p;
}

DeltaSender::DeltaSender(DeltaSenderOptions o) : o_(std::move(o)) {
  pairs_.resize(o_.targets.size());
}

void DeltaSender::begin(const BeginMessage& begin, RefitProbe& probe) {
  for (std::size_t i = 0; i < pairs_.size(); ++i) {
    DeltaPair& d = pairs_[i];
    d.offer.reset();
    d.use = false;
    if (!begin.raw && !d.version.empty() && probe.forget_delta_base(begin.step, o_.targets[i])) {
      log::info("trainer rank {}: fault injection: forgetting what it kept for engine rank {}",
                o_.rank, o_.targets[i]);
      d.version.clear();
    }
    d.wanted = !begin.raw && wants_delta(i);
  }
}

void DeltaSender::take_offer(std::size_t i, const PausedMessage& answer) {
  for (const DeltaBase& b : answer.delta_bases)
    if (b.rank == o_.rank)
      pairs_[i].offer = DeltaBase{.digest = b.digest, .version = answer.delta_version};
}

// Whether this rank would send target i a delta this refit, before the engine's offer: refit.delta
// on, or auto where predicted faster, with a base kept.
bool DeltaSender::wants_delta(std::size_t i) {
  DeltaPair& d = pairs_[i];
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
  const AutoPrediction p = predict_auto(AutoMeasures{.elements = elements,
                                                     .full_bytes = full,
                                                     .last_wire_bytes = d.last_wire_bytes,
                                                     .encode_elems_per_s = d.encode_elems_per_s,
                                                     .link_bytes_per_s = d.link_bytes_per_s});
  if (p.choice == AutoChoice::kNever) {
    // No density makes a delta faster here (the same device, or a link as fast as memory): the
    // kept copy goes, and with it the capture every full refit would pay.
    log::info(
        "trainer rank {}: refit.delta auto: engine rank {}: encoding the pair's {} elements "
        "takes {:.4f} s at this rank's measured rate, {:.1f} x its full refit ({:.4f} s at "
        "{:.1f} GB/s); no delta can be faster, so its routes move in full from now on and this "
        "rank keeps no copy of them",
        o_.rank, o_.targets[i], elements, p.encode_s, p.encode_s / p.full_s, p.full_s,
        d.link_bytes_per_s / 1e9);
    d.retired = true;
    retired_now_ = true;  // the caller's lists are built anew without its copy
    d.kept.reset();
    d.version.clear();
    d.rounds.clear();
    d.all = PairDeltaRoutes{};
    return false;
  }
  const bool want = p.choice == AutoChoice::kDelta || d.full_since_delta >= kAutoProbeEvery;
  log::debug(
      "trainer rank {}: refit.delta auto for engine rank {}: density {:.4f}, link {:.1f} "
      "MB/s: delta {:.3f} s ({} bytes) against full {:.3f} s ({} bytes): {}",
      o_.rank, o_.targets[i], d.density, d.link_bytes_per_s / 1e6, p.delta_s, d.last_wire_bytes,
      p.full_s, full, want ? "delta" : "full");
  return want;
}

// Per target, once its executor is known: a delta iff this rank wants one, the engine rank
// offered the base of the version this rank kept, moved by the same executor, and (point to
// point) the digest of what it holds equals this rank's. Every other pair moves in full, and the
// log says why.
Status DeltaSender::decide_delta(int step, const std::vector<PairExecutor>& modes) {
  std::map<std::string, std::vector<int>> full;  // why -> engine ranks
  std::vector<int> retired_offers;
  for (std::size_t i = 0; i < pairs_.size(); ++i) {
    DeltaPair& d = pairs_[i];
    d.use = false;
    const bool p2p = modes[i] == PairExecutor::kP2p;
    const bool tracked = tracks();
    if (d.offer && (!tracked || d.offer->digest.has_value() != p2p))
      return Status::Corruption(fmt::format(
          "trainer rank {}: engine rank {} offered a delta base as a {} pair; this rank moves "
          "the pair by {}{}",
          o_.rank, o_.targets[i], d.offer->digest ? "point-to-point" : "peer-access",
          p2p ? "point to point" : "peer access", tracked ? "" : " and keeps no base for it"));
    if (!tracked) continue;
    if (d.retired) {  // said once, when auto retired the pair; its engine rank still offers
      if (d.offer) retired_offers.push_back(o_.targets[i]);
      continue;
    }
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
    else if (d.kept_by != modes[i])
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
  if (!retired_offers.empty())
    log::debug(
        "trainer rank {}: refit.delta: step {}: engine rank(s) {} offered a base; refit.delta "
        "auto found a delta never faster for them, so their routes move in full",
        o_.rank, step, fmt::join(retired_offers, ", "));
  return Status::Ok();
}

Result<bool> DeltaSender::prepare(const BeginMessage& begin,
                                  const std::vector<PairExecutor>& modes) {
  if (!begin.raw) REFIT_RETURN_IF_ERROR(decide_delta(begin.step, modes));
  std::vector<int> uses(pairs_.size(), 0);
  bool kept_new = false;
  traffic_ = RankTraffic{};
  for (std::size_t i = 0; i < pairs_.size(); ++i) {
    DeltaPair& d = pairs_[i];
    d.refit_elements = d.refit_changed = d.refit_wire_bytes = 0;
    d.refit_encode_s = 0;
    traffic_.full_bytes += pair_bytes(i);
    if (tracks(i) && !begin.raw && !d.kept) {
      REFIT_RETURN_IF_ERROR(ensure_kept(i));
      kept_new = true;  // the lists of its rounds are built with the runs
    }
    // What the round layout depends on: a delta, a word before each round's segment, neither.
    uses[i] = d.use ? 2 : d.offer ? 1 : 0;
    if (d.use) ++traffic_.delta_pairs;
  }
  const bool changed = uses != built_uses_ || kept_new || retired_now_;
  retired_now_ = false;
  built_uses_ = std::move(uses);
  return changed;
}

void DeltaSender::invalidate() {
  size_ops_.clear();
  full_words_.clear();
  sends_.clear();
  for (DeltaPair& d : pairs_) d.rounds.clear();
}

void DeltaSender::forget() {
  for (DeltaPair& d : pairs_) d.version.clear();
}

void DeltaSender::note_sent(const std::string& version, const std::vector<PairExecutor>& modes) {
  for (std::size_t i = 0; i < pairs_.size(); ++i) {
    if (!tracks(i)) continue;
    DeltaPair& d = pairs_[i];
    d.version = version;
    d.kept_by = modes[i];
    d.full_since_delta = d.use ? 0 : d.full_since_delta + 1;
    if (d.use && d.refit_elements > 0) {
      d.density = static_cast<double>(d.refit_changed) / static_cast<double>(d.refit_elements);
      d.last_wire_bytes = d.refit_wire_bytes;
      if (d.refit_encode_s > 0)
        d.encode_elems_per_s = static_cast<double>(d.refit_elements) / d.refit_encode_s;
    }
  }
}

std::int64_t DeltaSender::pair_bytes(std::size_t i) const {
  return refit::pair_bytes(*o_.setup, o_.targets[i]);
}

Status DeltaSender::ensure_kept(std::size_t i) {
  DeltaPair& d = pairs_[i];
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
void DeltaSender::build_delta_round(std::size_t i, int round, const std::vector<void*>& shards,
                                    const std::byte* segment, const std::vector<void*>* params) {
  DeltaPair& d = pairs_[i];
  if (!d.kept) return;  // a bare pass before any refit: nothing kept yet
  d.rounds.resize(static_cast<std::size_t>(o_.setup->view.rounds));
  PairDeltaRoutes list =
      trainer_delta_routes(*o_.setup, o_.config->policy.dtype, o_.rank, o_.targets[i],
                           segment != nullptr ? DeltaSource::kSegment : DeltaSource::kShards,
                           &shards, segment, params, round);
  for (DeltaRoute& r : list.routes) r.kept = d.all.routes[r.tag].kept;
  d.rounds[static_cast<std::size_t>(round)] = std::move(list);
}

void DeltaSender::build_peer_lists(std::size_t i, const std::vector<void*>& shards,
                                   const std::vector<void*>& params,
                                   const std::vector<const std::byte*>& segments) {
  for (int k = 0; k < o_.setup->view.rounds; ++k) {
    const auto kk = static_cast<std::size_t>(k);
    build_delta_round(i, k, shards, kk < segments.size() ? segments[kk] : nullptr, &params);
  }
}

void DeltaSender::append_peer_copies(std::size_t i, std::vector<CopyRun>& runs) const {
  for (const PairDeltaRoutes& list : pairs_[i].rounds)
    for (const DeltaRoute& r : list.routes)
      runs.push_back(byte_run(r.src, r.dst, r.block, dtype_size(r.wire_dtype)));
}

Status DeltaSender::encode_round(std::size_t i, int round, std::byte* out, std::size_t capacity,
                                 std::size_t* bytes) {
  DeltaPair& d = pairs_[i];
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
  traffic_.delta_elements += r->elements;
  traffic_.delta_changed += r->changed;
  traffic_.encode_s += secs;
  *bytes = r->stream_bytes;
  return Status::Ok();
}

// After a full refit of the pair: the kept copy takes what was sent.
Status DeltaSender::capture_round(std::size_t i, int round) {
  DeltaPair& d = pairs_[i];
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
  traffic_.encode_s += t.seconds();
  return Status::Ok();
}

// Peer access: only the changed elements are written, to the kept copy and the engine's
// parameters. What moved is counted as the changed elements' bytes.
Result<std::int64_t> DeltaSender::patch_peer(std::size_t i, double pack_s) {
  DeltaPair& d = pairs_[i];
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
  d.refit_encode_s = t.seconds() + pack_s;
  traffic_.encode_s += d.refit_encode_s;
  traffic_.delta_elements += elements;
  traffic_.delta_changed += changed;
  const std::int64_t full = pair_bytes(i);
  const std::int64_t written =
      elements > 0
          ? static_cast<std::int64_t>(static_cast<double>(full) * static_cast<double>(changed) /
                                      static_cast<double>(elements))
          : 0;
  d.refit_wire_bytes = written;
  return written;
}

Status DeltaSender::capture_peer(std::size_t i, double copy_s) {
  for (int k = 0; k < o_.setup->view.rounds; ++k) REFIT_RETURN_IF_ERROR(capture_round(i, k));
  if (copy_s > 0) pairs_[i].link_bytes_per_s = static_cast<double>(pair_bytes(i)) / copy_s;
  return Status::Ok();
}

void DeltaSender::lay_out(std::size_t rounds, const std::vector<void*>& shards,
                          const std::vector<PairExecutor>& modes) {
  size_ops_.assign(rounds, {});
  sends_.assign(rounds, {});
  full_words_.assign(rounds, {});
  // The kept targets' lists of each round, read from the shards (FP8: rebuilt from the packed
  // segments, lay_out_round): what a capture reads, and what a stream of them takes at most.
  for (std::size_t i = 0; i < pairs_.size(); ++i)
    if (modes[i] == PairExecutor::kP2p && tracks(i))
      for (int k = 0; k < o_.setup->view.rounds; ++k)
        build_delta_round(i, k, shards, nullptr, nullptr);
}

std::size_t DeltaSender::capacity(std::size_t i, std::size_t k) const {
  return k < pairs_[i].rounds.size() ? delta_stream_capacity(pairs_[i].rounds[k].routes)
                                     : std::size_t{0};
}

Status DeltaSender::add_slot() {
  REFIT_ASSIGN_OR_RETURN(auto words,
                         o_.plane->allocate(8 * std::max<std::size_t>(pairs_.size(), 1)));
  size_words_.push_back(std::move(words));
  return Status::Ok();
}

std::byte* DeltaSender::slot_words(std::size_t used) const {
  return size_words_[used % size_words_.size()]->data();
}

bool DeltaSender::lay_out_round(std::size_t i, std::size_t k, int peer, std::byte* word,
                                const std::byte* segment, std::byte* stream,
                                const std::vector<void*>& shards, std::vector<P2POp>& ops) {
  const DeltaPair& d = pairs_[i];
  if (d.offer) {
    size_ops_[k].push_back(
        P2POp{.kind = P2POp::Kind::kSend, .peer = peer, .buf = word, .bytes = 8});
    if (!d.use) full_words_[k].push_back(word);
  }
  if (o_.setup->wire().fp8 && tracks())  // FP8: the lists read the packed codes
    build_delta_round(i, static_cast<int>(k), shards, segment, nullptr);
  if (!d.use) return false;
  sends_[k].push_back(DeltaSend{.target = i,
                                .stream = stream,
                                .capacity = capacity(i, k),
                                .size_word = word,
                                .op = ops.size()});
  // The stream's size is set once it is encoded.
  ops.push_back(P2POp{.kind = P2POp::Kind::kSend, .peer = peer, .buf = stream, .bytes = 0});
  return true;
}

Status DeltaSender::write_round(int step, int k, std::vector<P2POp>& ops, RefitProbe& probe) {
  const auto kk = static_cast<std::size_t>(k);
  // Targets that offered a base and get the round in full: the word that says so.
  for (std::byte* word : full_words_[kk]) {
    const std::uint64_t full = kDeltaFullSegment;
    REFIT_RETURN_IF_ERROR(o_.plane->write(word, &full, sizeof full));
  }
  // Delta targets: encode into the slot, then the size word the engine receives first.
  for (const DeltaSend& ds : sends_[kk]) {
    std::size_t bytes = 0;
    REFIT_RETURN_IF_ERROR(encode_round(ds.target, k, ds.stream, ds.capacity, &bytes));
    const std::uint64_t word = bytes;
    REFIT_RETURN_IF_ERROR(o_.plane->write(ds.size_word, &word, sizeof word));
    ops[ds.op].bytes = bytes;
    // What a fault probe may corrupt: the stream's payloads, after its directory.
    const std::size_t directory = delta_directory_bytes(pairs_[ds.target].rounds[kk].routes.size());
    if (bytes > directory)
      REFIT_RETURN_IF_ERROR(probe.after_write(
          step, k, *o_.plane,
          {CopyRun{.dst = ds.stream,
                   .block = {.dst_offset = static_cast<std::int64_t>(directory),
                             .rows = 1,
                             .cols = static_cast<std::int64_t>(bytes - directory)}}},
          kByteCopyDType));
  }
  return Status::Ok();
}

Status DeltaSender::capture_full_round(int k, const std::vector<PairExecutor>& modes) {
  const auto kk = static_cast<std::size_t>(k);
  for (std::size_t i = 0; i < pairs_.size(); ++i)
    if (modes[i] == PairExecutor::kP2p && tracks(i) && !pairs_[i].use &&
        kk < pairs_[i].rounds.size())
      REFIT_RETURN_IF_ERROR(capture_round(i, k));
  return Status::Ok();
}

// refit.delta auto, after a refit's point-to-point sends: each delta pair's density and encode
// rate, and, when every pair went in full, the link's payload rate shared by the pairs in
// proportion to their bytes.
void DeltaSender::note_p2p_rates(const std::vector<PairExecutor>& modes, double send_seconds) {
  std::int64_t full = 0;
  bool all_full = true;
  for (std::size_t i = 0; i < pairs_.size(); ++i) {
    if (modes[i] != PairExecutor::kP2p) continue;
    full += pair_bytes(i);
    all_full = all_full && !pairs_[i].use;
  }
  if (!all_full || send_seconds <= 0 || full <= 0) return;
  const double rate = static_cast<double>(full) / send_seconds;
  for (std::size_t i = 0; i < pairs_.size(); ++i)
    if (modes[i] == PairExecutor::kP2p)
      pairs_[i].link_bytes_per_s =
          rate * static_cast<double>(pair_bytes(i)) / static_cast<double>(full);
}

}  // namespace refit
