// The engine rank's side of the refit protocol (docs/protocol.md): its one state machine. Between
// refits it waits for a begin or the shutdown; during a refit it moves through the phases
//   begun -> paused (answered trainer rank 0) -> proceeding -> landed (the executor received
//   every byte) -> committed -> verified -> outcome applied
// (gather has no pause answer: it writes once paused), and the abort paths: a refit the trainer
// ranks aborted before any byte landed, one that failed at its end (the weights roll back or stay
// invalid, the session goes on), and one that failed in flight with every rank alive (every rank
// forms its groups anew). It sends and receives every message of those phases; the executor moves
// the bytes and the weights (runtime/engine_weights.h) take them. With the transfer plan and
// TP > 1, TP rank 0 is its engine's relay (runtime/relay.h): it forwards each phase's message to
// its TP peers and answers trainer rank 0 for all of them; a peer's control peer is its relay.
#pragma once

#include <atomic>
#include <chrono>
#include <optional>
#include <vector>

#include "control/inbox.h"
#include "control/messages.h"
#include "executor/executor.h"
#include "refit/session.h"
#include "runtime/engine_weights.h"
#include "runtime/rank_core.h"
#include "runtime/traffic.h"

namespace refit {

class EngineRefitProtocol {
 public:
  enum class Phase : std::uint8_t {
    kIdle,        // between refits
    kBegun,       // every feeder began
    kPaused,      // paused and answered; waiting for the proceed
    kProceeding,  // bytes may land
    kLanded,      // every byte landed; committing
    kCommitted,   // acknowledged; verifying, waiting for the outcome
  };

  EngineRefitProtocol(RankCore& core, EngineExecutor& executor, EngineWeights& weights);

  // Setup, once the executor exists: the hello to every feeder, then (SGLang protocol, transfer
  // plan) the feeders' route metadata. Setup messages travel only between the ranks of a pair.
  Status announce(HelloMessage hello);

  // How often the wait for the next refit looks at a stop request (Engine::request_stop): the
  // bound on how long serve_one() / serve() take to return after one, between refits.
  static constexpr std::chrono::milliseconds kStopPoll{100};

  // What serving one message between refits came to.
  struct Served {
    bool shutdown = false;  // the trainer shut the engines down; no refit follows
    bool stopped = false;   // a stop was requested before a refit began; nothing changed
    // The refit's own failure when the session goes on: refused before any byte moved, failed at
    // its end, or failed in flight with every rank alive; or the caller's wait ran out before
    // any refit began (code kTimeout). Ok after a committed refit.
    Status refit;
  };
  // Serves the next refit (or the shutdown). An error ends the session.
  // `wait`: how long to wait for a refit to begin (none: as long as the trainer lives); past it,
  // Served::refit is a timeout and nothing changed. `stop` (set from any thread): while no refit
  // has begun, looked at every kStopPoll; once seen it is cleared and Served::stopped returned.
  Result<Served> serve_one(std::optional<std::chrono::milliseconds> wait = std::nullopt,
                           std::atomic<bool>* stop = nullptr);
  // The session ended during a refit (a dead or stopped rank, a bug): with refit.keep_previous
  // the parameters go back to the kept complete version — unless a feeder wrote in place in this
  // refit: one that is still alive may still be writing.
  void roll_back_at_the_end(const Status& why);

  Phase phase() const { return phase_; }
  const RefitStats& last_stats() const { return stats_; }

 private:
  Result<Served> serve_refit(const Message& first);
  Status run_refit(const std::string& first_from, Status& refit_failure);
  Status finish(Status& refit_failure);
  Status shutdown(const Message& first);
  // A refit in flight failed with every rank alive: its failure (the session goes on), after the
  // weights were dealt with and this rank moved to the next refit epoch; nullopt when the session
  // must end.
  std::optional<Status> failed_in_flight(const Status& failure);
  Status catch_up();
  Status reform();
  FailureOrigin mine(const Status& st) const;
  // Messages of `type` from control_, one from each (Inbox::collect); a relay forwards each to
  // its TP peers as it arrives, once `check` passed (a message it refuses fails this rank, and
  // its peers learn that from the failure record, not from the message).
  Result<std::vector<Message>> hear(MessageType type, std::chrono::milliseconds timeout,
                                    std::string_view what,
                                    const std::function<Status(const Message&)>& check = {});
  // A relay forwards `m` (from trainer rank 0) to its TP peers; others do nothing.
  Status forward(const Message& m);
  // This rank's answer of `type` to `to`. A relay first collects its TP peers' answers of `type`
  // (each wait bounded by `timeout`, messages of the `later` types kept) and sends all of them in
  // one relayed message.
  Status reply(const std::vector<std::string>& to, MessageType type, const std::string& payload,
               std::chrono::milliseconds timeout, std::initializer_list<MessageType> later = {});

  RankCore& core_;
  EngineExecutor& executor_;
  EngineWeights& weights_;
  Inbox inbox_;
  std::vector<std::string> feeders_;  // mailbox ids of executor_.feeders(): bytes, hello, routes
  // Who begins, commits and ends each refit with this rank: trainer rank 0 with the transfer
  // plan (through this engine's relay, its TP rank 0, when TP > 1: runtime/relay.h), every feeder
  // with gather.
  std::vector<std::string> control_;
  std::vector<std::string> relayed_;  // on a relay: the TP peers it forwards to and answers for
  std::string published_export_;  // the digest of the export this rank put in the store
  Phase phase_ = Phase::kIdle;
  BeginMessage begin_;  // of the refit in flight
  // Where the refit in flight lands its bytes: the parameters, or the staging area (refit.staged).
  const Registry* landing_ = nullptr;
  RankTraffic traffic_;
  TrafficPublisher traffic_publisher_;
  RefitStats stats_;
};

}  // namespace refit
