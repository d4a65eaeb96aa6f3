// The executors: what moves a refit's bytes between one rank's memory and its peers', behind one
// interface per side. The running Trainer and Engine (runtime/) own everything around them:
// setup of the control plane, the engines' hellos, the commit, verification, failures and
// shutdown. Two executors exist on each side:
//  - the transfer plan (route_sender.h / route_receiver.h): every trainer rank moves its own
//    routes to the engine ranks that keep them, by peer access or point-to-point;
//  - gather (gather_sender.h / gather_receiver.h): every bucket is unsharded over the trainer
//    group and delivered whole by a transport (transport/).
// Tests act on a refit through a RefitProbe (fault injection, runtime/fault.h); executors call it
// at fixed points of real refits and never in raw (bench) passes.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "control/mailbox.h"
#include "control/messages.h"
#include "plane/data_plane.h"
#include "refit/session.h"
#include "refit/status.h"

namespace refit {

class Communicator;

// Points of a refit where a test may act. The default does nothing.
class RefitProbe {
 public:
  // The round number of a step that moves every round at once (peer access).
  static constexpr int kEveryRound = -1;
  virtual ~RefitProbe() = default;
  // Before this rank moves round `round` (a bucket, for gather) of refit `step`.
  virtual void before_round(int /*step*/, int /*round*/) {}
  // Once this rank joined the control plane, before it forms any group (setup).
  virtual void at_setup() {}
  // Every byte of refit `step` moved (engine: landed), before the commit (engine: its answer).
  virtual void before_commit(int /*step*/) {}
  // Round `round`'s bytes were written by `written` (elements of `dtype`) and have not reached
  // their engine yet (or, with peer access, the engine has not been told): may alter them.
  virtual Status after_write(int /*step*/, int /*round*/, DataPlane& /*plane*/,
                             const std::vector<CopyRun>& /*written*/, DType /*dtype*/) {
    return Status::Ok();
  }
  // The probe that does nothing.
  static RefitProbe& none();
};

// Seconds per stage of one transfer on a trainer rank (busy time; stages may overlap).
struct TransferTimes {
  double unshard = 0;    // collectives of the trainer group (gather)
  double cast_pack = 0;  // casts, packing, peer copies
  double transfer = 0;   // sends (point-to-point, broadcast) or waits for the engine (ipc)
};

// One trainer rank's side.
class TrainerExecutor {
 public:
  virtual ~TrainerExecutor() = default;
  // Mailbox ids ("engine/<g>") of the engine ranks this rank talks to; may be empty (a gather
  // rank that only takes part in the unshard).
  virtual const std::vector<std::string>& engine_ids() const = 0;
  // The hash of the plan both sides derive (the vLLM manifest), and its rounds (or buckets).
  virtual std::string plan_hash() const = 0;
  virtual int rounds() const = 0;
  // Every engine of engine_ids() said hello: last setup steps (SGLang route metadata).
  virtual Status attach() = 0;
  // Sends begin to every engine and moves every byte of this rank for refit `begin.step` from
  // `shards` (the registered local tensors); returns when every byte left this rank. The caller
  // then commits.
  virtual Status transfer(const BeginMessage& begin, const std::vector<void*>& shards,
                          TransferTimes& times) = 0;
  // Why the last transfer was aborted before any byte moved (an engine rank refused it: every
  // trainer rank decides alike); empty when it moved its bytes. The caller then does not commit.
  virtual const std::string& aborted() const {
    static const std::string none;
    return none;
  }
  // The registered storage changed: copy lists are rebuilt at the next transfer.
  virtual void invalidate() = 0;
  // Of the last transfer.
  virtual RankTraffic traffic() const = 0;
  // refit.checksum: the checksum (common/checksum.h) of what this rank sends engine_ids()[i] per
  // refit, computed now from `shards`. Unsupported where the executor has no routes (gather).
  virtual Result<std::uint64_t> checksum_to(std::size_t /*i*/,
                                            const std::vector<void*>& /*shards*/) {
    return Status::Unsupported("refit.checksum needs the transfer plan");
  }
  // A failure: close the collectives this executor owns, so peers blocked on them fail now.
  virtual void abort() {}
  // After a refit failed in flight with every rank alive (docs/runtime.md, "A refit that fails in
  // flight"; its collectives were aborted): waits for this executor's threads to finish their part
  // of it, forgets their failure, and uses `p2p`, the point-to-point group formed for the next
  // refit epoch (null when none), from now on.
  virtual Status recover(Communicator* /*p2p*/, std::chrono::milliseconds /*timeout*/) {
    return Status::Unsupported("a refit that failed in flight ends the session with this executor");
  }
  void set_probe(RefitProbe* probe) { probe_ = probe != nullptr ? probe : &RefitProbe::none(); }

 protected:
  RefitProbe* probe_ = &RefitProbe::none();
};

// Where an engine rank's parameters can be mapped by peer trainer ranks (sent with paused), with
// its digest; nullptr when they are not exported. Built once per registration, valid until the
// next.
using ExportFn = std::function<const ExportedParams*()>;

// What an engine rank hands its executor for one refit.
struct EngineRefit {
  BeginMessage begin;                // the first begin that arrived
  std::string first_from;            // its sender
  const std::vector<void*>* params;  // the registered parameters
  // Checks the registration and calls the pause hook: exactly once, before any byte lands. An
  // error refuses the refit (the transfer plan; with gather it ends the session).
  std::function<Status()> pause;
  ExportFn exported;
  // The trainer ranks aborted the refit before any byte landed (`why`: the first refusal);
  // `paused`: this rank's pause succeeded (generation resumes). receive() then returns Ok.
  std::function<void(const std::string& why, bool paused)> abandon;
  // Feeders whose commit arrived during receive() (the caller waits for the others').
  std::vector<std::string>* early_commits = nullptr;
};

// One engine rank's side.
class EngineExecutor {
 public:
  virtual ~EngineExecutor() = default;
  // Mailbox ids ("trainer/<r>") of the trainer ranks that feed this rank.
  virtual const std::vector<std::string>& feeders() const = 0;
  virtual std::string plan_hash() const = 0;
  // The hello went out: last setup steps (SGLang route metadata from the feeders).
  virtual Status attach() = 0;
  // Receives and applies every byte of one refit; returns when all of it is in the parameters.
  // The caller then waits for the commit.
  virtual Status receive(const EngineRefit& refit) = 0;
  virtual void invalidate() = 0;
  // Of the last refit: bytes received, pairs per executor; seconds spent applying.
  virtual RankTraffic traffic() const = 0;
  virtual double apply_seconds() const = 0;
  // refit.checksum: the checksum (common/checksum.h) of what feeders()[i] sent this rank, computed
  // now from `params` (call once every byte landed: after the commits).
  virtual Result<std::uint64_t> checksum_from(std::size_t /*i*/,
                                              const std::vector<void*>& /*params*/) {
    return Status::Unsupported("refit.checksum needs the transfer plan");
  }
  virtual void abort() {}
  // As TrainerExecutor::recover.
  virtual Status recover(Communicator* /*p2p*/, std::chrono::milliseconds /*timeout*/) {
    return Status::Unsupported("a refit that failed in flight ends the session with this executor");
  }
  void set_probe(RefitProbe* probe) { probe_ = probe != nullptr ? probe : &RefitProbe::none(); }

 protected:
  RefitProbe* probe_ = &RefitProbe::none();
};

// Forms a group of the run (name, this process's rank, size) on the rank's data plane.
using JoinGroupFn = std::function<Result<std::unique_ptr<Communicator>>(const char*, int, int)>;

// "engine I tp rank T" for mailbox id "engine/<g>" (the id itself for anything else).
std::string engine_process(const std::string& mailbox_id, int tp_size);

// Sends `payload` as `type` to every id.
Status send_each(Mailbox& mailbox, const std::vector<std::string>& ids, MessageType type,
                 const std::string& payload);

// Waits for one message of `type` from each of `from` (any order; those of `arrived` already
// did). `check` sees each message; a message from anyone else, or a second one, is an error
// naming `who`.
Status expect_from_each(Mailbox& mailbox, const std::vector<std::string>& from, MessageType type,
                        const std::vector<std::string>& arrived, std::chrono::milliseconds timeout,
                        const std::string& who, const char* what,
                        const std::function<Status(const Message&)>& check = {});

}  // namespace refit
