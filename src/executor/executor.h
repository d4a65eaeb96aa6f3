// The executors: what moves a refit's bytes between one rank's memory and its peers', behind one
// interface per side. An executor moves bytes and nothing else: the runtime (runtime/) runs the
// refit protocol around it and sends and receives every message of a refit's phases — begin,
// paused, proceed, commit, committed, verified, outcome (docs/protocol.md). Two executors exist on
// each side:
//  - the transfer plan (route_sender.h / route_receiver.h): every trainer rank moves its own
//    routes to the engine ranks that keep them, by peer access or point-to-point;
//  - gather (gather_sender.h / gather_receiver.h): every bucket is unshard over the trainer
//    group and delivered whole by a transport (transport/), whose per-bucket headers and slot
//    acknowledgements (bucket, bucket-done) travel on the mailbox: gather's data path.
// The runtime asks an executor what it can do (capabilities) instead of reading the config.
// Tests act on a refit through a RefitProbe (executor/probe.h); executors call its round points
// during real refits and never in raw (bench) passes.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "control/messages.h"
#include "executor/probe.h"
#include "plane/data_plane.h"
#include "refit/rank.h"
#include "refit/session.h"
#include "refit/status.h"

namespace refit {

class Communicator;

// Seconds per stage of one transfer on a trainer rank (busy time; stages may overlap).
struct TransferTimes {
  double unshard = 0;    // collectives of the trainer group (gather)
  double cast_pack = 0;  // casts, packing, peer copies
  double transfer = 0;   // sends (point-to-point, broadcast) or waits for the engine (ipc)
};

// What the runtime asks of either side's executor besides its bytes: its failure and recovery,
// its probe, and its setup time.
class ExecutorBase {
 public:
  virtual ~ExecutorBase() = default;
  // A failure: close the collectives this executor owns, so peers blocked on them fail now.
  virtual void abort() {}
  // Whether a refit that failed in flight with every rank alive leaves this executor usable
  // (docs/runtime.md, "A refit that fails in flight"), and the recovery: wait for its threads to
  // finish their part of the failed refit, forget their failure, and use `p2p`, the
  // point-to-point group formed for the next refit epoch (null when none), from now on.
  virtual bool can_recover() const { return false; }
  virtual Status recover(Communicator* /*p2p*/, std::chrono::milliseconds /*timeout*/) {
    return Status::Unsupported("a refit that failed in flight ends the session with this executor");
  }
  void set_probe(RefitProbe* probe) { probe_ = probe != nullptr ? probe : &RefitProbe::none(); }
  // The seconds this rank's setup took (Trainer::create / Engine::create), which traffic()
  // reports.
  void set_setup_seconds(double seconds) { setup_seconds_ = seconds; }

 protected:
  RefitProbe* probe_ = &RefitProbe::none();
  double setup_seconds_ = 0;
};

// Which executors refit.executor chose, as a rank's setup asks before it makes them
// (executor_kind, decided once from the config): the pair that moves the bytes, and whether it
// needs the point-to-point group formed first.
struct ExecutorKind {
  bool transfer_plan = false;  // RouteSender / RouteReceiver; else GatherSender / GatherReceiver
  bool p2p_group = false;      // not for executor peer, nor CUDA ranks sharing GPUs (routes.h)
};
ExecutorKind executor_kind(const Config& config);

// One trainer rank's side.
class TrainerExecutor : public ExecutorBase {
 public:
  // The engine ranks this rank begins and commits each refit with; may be empty (a gather rank
  // that only takes part in the unshard).
  virtual const std::vector<RankId>& targets() const = 0;
  // The engine ranks that answer each begin before any byte moves: every engine rank with the
  // transfer plan (trainer rank 0 collects the answers and decides for every trainer rank); none
  // with gather, whose engines pause on the begin and cannot refuse.
  virtual const std::vector<RankId>& answers_from() const = 0;
  // The hash of the plan both sides derive (the vLLM manifest), and its rounds (or buckets).
  virtual std::string plan_hash() const = 0;
  virtual int rounds() const = 0;
  // Setup: what target `i` must know before the first refit (SGLang protocol on the transfer
  // plan: every route this rank sends it); nullopt for nothing.
  virtual std::optional<RoutesMessage> routes_for(std::size_t /*i*/) const { return std::nullopt; }
  // Setup: what the executor checks of target `i`'s hello (the transfer plan: the target's
  // digest of the pair's routes equals this rank's).
  virtual Status check_hello(std::size_t /*i*/, const HelloMessage& /*hello*/) const {
    return Status::Ok();
  }
  // Every target said hello (setup is complete on their side): setup-time names may go.
  virtual void targets_attached() {}
  // What the executor adds to target `i`'s begin: gather, the bucket count.
  virtual void prepare_begin(std::size_t /*i*/, BeginMessage& /*begin*/) const {}
  // The transfer plan: the digest of target `i`'s export this rank holds ("" for none); an answer
  // with another digest makes the runtime read that export from the store (export_key).
  // The view lasts until the next take_answers.
  virtual std::string_view export_held(std::size_t /*i*/) const { return {}; }
  // Work before any engine pauses (FP8 scales): a failure refuses the refit on this rank before
  // the engines stop generating.
  virtual Status before_begin(const BeginMessage& /*begin*/, const std::vector<void*>& /*shards*/,
                              TransferTimes& /*times*/) {
    return Status::Ok();
  }
  // Every engine rank of answers_from() answered (in that order; exports in full for the targets
  // whose digest changed): keep what the targets exported. refit.delta: each answer's
  // delta_version and delta_bases are its offers (on a trainer rank but 0: only those for this
  // rank's pairs, as trainer rank 0 relayed them).
  virtual Status take_answers(std::vector<PausedMessage>& /*answers*/) { return Status::Ok(); }
  // Moves every byte of this rank for refit `begin.step` from `shards` (the registered local
  // tensors); returns when every byte left this rank.
  virtual Status send(const BeginMessage& begin, const std::vector<void*>& shards,
                      TransferTimes& times) = 0;
  // The registered storage changed: copy lists are rebuilt at the next transfer.
  virtual void invalidate() = 0;
  // Of the last transfer.
  virtual RankTraffic traffic() const = 0;
  // refit.checksum: whether this executor checksums what it sends, and the checksum
  // (common/checksum.h) of what this rank sends targets()[i] per refit, computed now from
  // `shards`.
  virtual bool checksums() const { return false; }
  virtual Result<std::uint64_t> checksum_to(std::size_t /*i*/,
                                            const std::vector<void*>& /*shards*/) {
    return Status::Unsupported("refit.checksum needs the transfer plan");
  }
};

// One engine rank's side.
class EngineExecutor : public ExecutorBase {
 public:
  // The trainer ranks that begin and commit each refit with this rank.
  virtual const std::vector<RankId>& feeders() const = 0;
  // Whether this rank answers each begin with paused and writes only after it was told to
  // proceed (the transfer plan, where trainer rank 0 coordinates every engine rank; gather writes
  // once it paused).
  virtual bool pause_handshake() const = 0;
  virtual std::string plan_hash() const = 0;
  // Transfer plan: this rank's digest of the routes feeders()[i] sends it ("" with gather), for
  // the hello to that feeder.
  virtual std::string routes_digest(std::size_t /*i*/) const { return {}; }
  // Setup: whether the feeders send their route metadata (SGLang protocol on the transfer plan),
  // and what they sent, one per feeder in feeders() order.
  virtual bool wants_routes() const { return false; }
  virtual Status take_routes(const std::vector<RoutesMessage>& /*per_feeder*/) {
    return Status::Ok();
  }
  // Generation paused: whether the parameters are exported for peer access decides each pair's
  // executor (errors name the pair and the fix).
  virtual Status prepare(bool /*params_exported*/) { return Status::Ok(); }
  // Receives and applies every byte of refit `begin.step` into `params` (the registered
  // parameters); returns when all of it is in them.
  virtual Status receive(const BeginMessage& begin, const std::vector<void*>& params) = 0;
  // refit.delta, once the pair executors are known (after prepare): the bases this rank offers
  // its feeders for refit `begin` in its pause answer (PausedMessage::delta_version,
  // delta_bases), `held` being the weight version it held complete before the refit (nullopt:
  // none). Each trainer rank decides per pair whether it sends a delta; a point-to-point pair
  // that was offered a base learns the decision from the word before each round's bytes. A raw
  // pass makes this rank forget its bases.
  virtual void offer_delta(const BeginMessage& /*begin*/,
                           const std::optional<std::string>& /*held*/, PausedMessage& /*answer*/) {}
  // The refit failed once bytes may have landed (rolled back, or the weights stay invalid): no
  // base of a delta is held any more.
  virtual void refit_failed() {}
  // The registered storage changed (register_param, allocate_params): copy lists are rebuilt at
  // the next refit, and no base of a delta is held any more.
  virtual void invalidate() = 0;
  // refit.staged, once every byte of the last refit landed in the staging area: writes onto
  // `params` (the parameters, which hold the base the staging area held before the refit) what
  // that refit's delta streams changed there, and returns true. False, with nothing written, when
  // some of its bytes landed another way (in full, by peer access, or through an apply that does
  // not log): the staging area must then be copied whole.
  virtual Result<bool> replay_deltas(const std::vector<void*>& /*params*/) { return false; }
  // Of the last refit: bytes received, pairs per executor; seconds spent applying.
  virtual RankTraffic traffic() const = 0;
  virtual double apply_seconds() const = 0;
  // refit.checksum: whether this executor checksums what landed, and the checksum of what
  // feeders()[i] sent this rank, computed now from `params` (once every byte landed).
  virtual bool checksums() const { return false; }
  virtual Result<std::uint64_t> checksum_from(std::size_t /*i*/,
                                              const std::vector<void*>& /*params*/) {
    return Status::Unsupported("refit.checksum needs the transfer plan");
  }
};

// Forms a group of the run (name, this process's rank, size) on the rank's data plane.
using JoinGroupFn = std::function<Result<std::unique_ptr<Communicator>>(const char*, int, int)>;

class Mailbox;
class Store;

// What a gather executor uses of its rank (RankCore::gather_links): the control plane, whose
// mailbox carries gather's bucket headers, the data plane, the run's id (its shared-memory
// names) and how to form its update group.
struct GatherLinks {
  Mailbox* mailbox = nullptr;
  Store* store = nullptr;
  DataPlane* plane = nullptr;
  std::string run_id;
  JoinGroupFn join_group;  // forms the update group (broadcast)
};

// The mailbox ids of `ranks`.
std::vector<std::string> mailbox_ids(const std::vector<RankId>& ranks);

}  // namespace refit
