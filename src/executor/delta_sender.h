// refit.delta on the trainer side of the transfer plan (docs/delta.md, "Wiring"): per engine rank
// a RouteSender feeds, the copy of what this rank last sent it, the decision to send a delta or
// the routes in full, and the delta's part of each p2p round (its size words, streams and the
// words that say a round goes in full) or its patch of a peer pair. Driven by its RouteSender,
// which owns the pairs' executors, staging slots and sends.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "control/messages.h"
#include "executor/delta_routes.h"
#include "executor/probe.h"
#include "executor/routes.h"
#include "plane/data_plane.h"
#include "refit/session.h"

namespace refit {

struct DeltaSenderOptions {
  const Config* config = nullptr;
  int rank = 0;
  const RouteSetup* setup = nullptr;
  DataPlane* plane = nullptr;
  std::vector<int> targets;  // the engine ranks fed, by target index
};

// refit.delta auto's prediction for one pair, from what its last refits measured: its elements
// and full bytes, the wire bytes of its last delta, this rank's encode rate (elements per second)
// and the link's payload rate (bytes per second, > 0).
struct AutoMeasures {
  std::int64_t elements = 0, full_bytes = 0, last_wire_bytes = 0;
  double encode_elems_per_s = 0, link_bytes_per_s = 0;
};
enum class AutoChoice : std::uint8_t {
  kDelta,  // predicted faster than the full refit
  kFull,   // past its break-even density
  kNever,  // encoding it alone takes kAutoNeverMargin x the full refit or longer: no density
           // makes a delta faster
};
inline constexpr double kAutoNeverMargin = 1.5;
struct AutoPrediction {
  AutoChoice choice = AutoChoice::kFull;
  double encode_s = 0, delta_s = 0, full_s = 0;
};
AutoPrediction predict_auto(const AutoMeasures& m);

class DeltaSender {
 public:
  explicit DeltaSender(DeltaSenderOptions o);

  // Whether this rank keeps copies of what it sends (refit.delta on or auto), whatever executor
  // moves the pair.
  bool tracks() const { return o_.config->refit.delta != DeltaMode::kOff; }
  // Whether it keeps one of what it sends target i: tracks(), and not a pair `auto` gave up on (a
  // delta can never beat its full refit).
  bool tracks(std::size_t i) const { return tracks() && !pairs_[i].retired; }
  // Whether it holds a kept copy of target i's pair (none before the pair's first refit).
  bool keeps(std::size_t i) const { return pairs_[i].kept != nullptr; }
  // Whether this refit sends target i a delta (decided in prepare).
  bool sends_delta(std::size_t i) const { return pairs_[i].use; }

  // Before the engines pause: forgets this refit's offers and decisions, and whether each pair
  // wants a delta (`probe` may make this rank forget a base).
  void begin(const BeginMessage& begin, RefitProbe& probe);
  // Target i's pause answer: its offer of a base for this rank's pair, if any.
  void take_offer(std::size_t i, const PausedMessage& answer);
  // Once every pair's executor is known (`modes`, per target): the decision per pair (not on a
  // raw pass), a kept copy for each pair tracked, and this refit's traffic reset. True when the
  // pairs' layout changed (the caller's lists must be rebuilt: invalidate).
  Result<bool> prepare(const BeginMessage& begin, const std::vector<PairExecutor>& modes);
  // The refit's lists and layout are stale (RouteSender::invalidate).
  void invalidate();
  // A refit failed in flight: what the kept copies hold may not have reached the engines.
  void forget();
  // After a refit that succeeded on this side: every kept copy holds what it sent.
  void note_sent(const std::string& version, const std::vector<PairExecutor>& modes);

  // Peer access: target i's lists write the mapped `params` (they patch them) and read `shards`,
  // or (FP8) the pair's packed segment of each round, `segments[round]`.
  void build_peer_lists(std::size_t i, const std::vector<void*>& shards,
                        const std::vector<void*>& params,
                        const std::vector<const std::byte*>& segments);
  // Target i's routes in full by peer access, as byte copies of what its lists read (FP8: the
  // packed segments) into the mapped parameters, appended to `runs`.
  void append_peer_copies(std::size_t i, std::vector<CopyRun>& runs) const;
  // A delta to target i by peer access: only the changed elements are written. The bytes that
  // counts as sent. `pack_s`: the pair's share of packing its FP8 routes, counted in its encode.
  Result<std::int64_t> patch_peer(std::size_t i, double pack_s = 0);
  // Target i's routes went in full by peer access in `copy_s` seconds: the kept copy takes them.
  Status capture_peer(std::size_t i, double copy_s);

  // Point to point: the lists of every round of the tracked p2p targets, read from `shards`, and
  // `rounds` empty rounds of words and streams.
  void lay_out(std::size_t rounds, const std::vector<void*>& shards,
               const std::vector<PairExecutor>& modes);
  // The most bytes target i's stream of round k takes (0 when not tracked).
  std::size_t capacity(std::size_t i, std::size_t k) const;
  // The size words of one staging slot: `add_slot` allocates the next, `slot_words` the
  // `used`-th slot's (8 bytes per target), `drop_slots` frees them all.
  Status add_slot();
  std::byte* slot_words(std::size_t used) const;
  void drop_slots() { size_words_.clear(); }
  // Target i's part of round k of the staging slot: its size word (`word`) if it offered a base,
  // (FP8) its lists read from the packed `segment`, and, for a delta, its stream's send from
  // `stream` on the peer `peer`, appended to `ops` (its size set once encoded). False: the
  // segment goes in full (the caller sends it).
  bool lay_out_round(std::size_t i, std::size_t k, int peer, std::byte* word,
                     const std::byte* segment, std::byte* stream, const std::vector<void*>& shards,
                     std::vector<P2POp>& ops);
  // Before round k is sent: the words of the targets that get it in full, and each delta target's
  // stream encoded and its size written into `ops` (`probe` may corrupt the stream's payloads).
  Status write_round(int step, int k, std::vector<P2POp>& ops, RefitProbe& probe);
  // Round k's size words, sent before its segments and streams.
  const std::vector<P2POp>& size_ops(std::size_t k) const { return size_ops_[k]; }
  const std::vector<std::vector<P2POp>>& size_ops() const { return size_ops_; }
  // While round k is sent: the kept copies of the tracked p2p targets that get it in full.
  Status capture_full_round(int k, const std::vector<PairExecutor>& modes);
  // refit.delta auto, after a refit's point-to-point sends (`send_seconds` long).
  void note_p2p_rates(const std::vector<PairExecutor>& modes, double send_seconds);

  // Its delta fields, of the last transfer.
  const RankTraffic& traffic() const { return traffic_; }

 private:
  bool wants_delta(std::size_t i);
  Status decide_delta(int step, const std::vector<PairExecutor>& modes);
  std::int64_t pair_bytes(std::size_t i) const;  // the plan's bytes to target i
  void build_delta_round(std::size_t i, int round, const std::vector<void*>& shards,
                         const std::byte* segment, const std::vector<void*>* params);
  Status ensure_kept(std::size_t i);
  Status encode_round(std::size_t i, int round, std::byte* out, std::size_t capacity,
                      std::size_t* bytes);
  Status capture_round(std::size_t i, int round);

  DeltaSenderOptions o_;
  // Per target: what this rank last sent it (docs/delta.md, "State").
  struct DeltaPair {
    PairDeltaRoutes all;                  // every route of the pair (kept offsets, names)
    std::vector<PairDeltaRoutes> rounds;  // per round, its routes (sources and destinations)
    std::unique_ptr<PlaneBuffer> kept;
    std::vector<std::uint64_t> digest;  // per round, of the kept copy
    std::string version;                // the weight version the kept copy holds; "" for none
    PairExecutor kept_by = PairExecutor::kP2p;  // the executor that moved it
    bool wanted = false;  // refit.delta on, or auto predicting a delta faster, with a base kept
    // This refit's offer from the engine rank (PausedMessage::delta_bases, as trainer rank 0
    // relayed it): the version and, point to point, the digest of the base it holds.
    std::optional<DeltaBase> offer;
    bool use = false;  // this refit sends a delta (decide_delta)
    // refit.delta: auto, measured: the pair's density on its last delta, the link's payload rate
    // on its last full refit, this rank's encode rate, and refits in full since the last delta.
    double density = -1;
    double link_bytes_per_s = 0;
    double encode_elems_per_s = 0;
    int full_since_delta = 0;
    // auto: encoding the pair alone takes longer than its full refit, whatever the density; no
    // copy is kept from then on.
    bool retired = false;
    std::int64_t last_wire_bytes = 0;                    // of the last delta
    std::int64_t refit_elements = 0, refit_changed = 0;  // of this refit's delta
    std::int64_t refit_wire_bytes = 0;
    double refit_encode_s = 0;
  };
  std::vector<DeltaPair> pairs_;
  // Per round: the size words of its delta streams (sent first, so the engine knows each
  // stream's size), and the streams this rank encodes into the round's slot.
  std::vector<std::vector<P2POp>> size_ops_;
  struct DeltaSend {
    std::size_t target = 0;
    std::byte* stream = nullptr;
    std::size_t capacity = 0;
    std::byte* size_word = nullptr;
    std::size_t op = 0;  // its entry in the round's sends
  };
  std::vector<std::vector<DeltaSend>> sends_;
  // Per round: the words kDeltaFullSegment this rank writes before it sends the round (targets
  // that offered a base and get their routes in full).
  std::vector<std::vector<std::byte*>> full_words_;
  std::vector<int> built_uses_;  // per target, whether the lists were built for a delta
  bool retired_now_ = false;     // a pair was retired since the last prepare()
  std::vector<std::unique_ptr<PlaneBuffer>> size_words_;  // per staging slot, 8 bytes per target
  RankTraffic traffic_;                                   // its delta fields, of the last transfer
};

}  // namespace refit
