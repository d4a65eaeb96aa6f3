// The trainer rank's side of the refit protocol (docs/protocol.md): its one state machine. A refit
// moves through the phases
//   begun -> (transfer plan: every engine rank answered; proceed or abort) -> sent (the executor
//   moved every byte) -> committed (every engine rank acknowledged) -> verified -> outcome sent
// and the abort paths: a refit an engine rank refused before any byte moved, and one whose bytes
// failed their checksum or verification (the engines publish on every rank or none). It sends
// and receives every message of those phases; the executor moves the bytes.
//
// With the transfer plan, trainer rank 0 coordinates: it alone sends the engine ranks their begin,
// proceed, commit and outcome and collects each one's answers; every other trainer rank hears the
// engines' answers and the refit's end from trainer rank 0 (one message each) and tells it when
// its bytes moved. Both directions pass through relays (runtime/relay.h): each engine's TP rank 0
// for its TP peers, each trainer group's first rank for its group. A refit's control messages grow
// with the number of ranks, not with trainer x engine pairs; the bytes still move per pair. With
// gather each engine rank has one feeder, which talks to it directly.
#pragma once

#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "control/inbox.h"
#include "control/messages.h"
#include "executor/executor.h"
#include "runtime/rank_core.h"
#include "runtime/traffic.h"

namespace refit {

class TrainerRefitProtocol {
 public:
  enum class Phase : std::uint8_t {
    kIdle,
    kBegun,       // begins sent (transfer plan: waiting for every engine rank's answer)
    kProceeding,  // the executor moves the bytes
    kSent,        // every byte left this rank; committing
    kCommitted,   // every target acknowledged; verdicts and the outcome
  };

  TrainerRefitProtocol(RankCore& core, TrainerExecutor& executor);

  // Setup: every target's hello, checked against this rank's own versions, `settings`, model size
  // and (vLLM) plan hash, then what the executor tells each target (SGLang route metadata).
  Status attach(const std::map<std::string, std::string>& settings,
                std::int64_t total_parameters);

  // One refit of `begin.step` from `shards` (or, with begin.raw, the bench's bare pass). Ok with
  // `refit_failure` set when the refit failed but the session goes on: an engine rank refused it
  // before any byte moved, or its bytes failed their checksum or verification. `apply_s`: the
  // slowest target's apply time.
  Status run(const BeginMessage& begin, const std::vector<void*>& shards, TransferTimes& times,
             double& apply_s, Status& refit_failure);
  // The failure of a refit in flight was settled (every rank moves to the next refit epoch):
  // nothing of it is waited for any more.
  void abandon();

  // Tells every target that no refit follows and waits until each left.
  Status shutdown();

  Phase phase() const { return phase_; }
  // Of the last refit: the longest pause of generation on an engine rank (RefitStats::pause_s).
  double pause_seconds() const { return pause_s_; }

 private:
  // Gather: this rank begins and commits with its own targets.
  Status run_fed(const BeginMessage& begin, const std::vector<void*>& shards, TransferTimes& times,
                 double& apply_s, Status& refit_failure);
  // The transfer plan, on trainer rank 0 (lead) and on every other trainer rank (follow).
  Status lead(const BeginMessage& begin, const std::vector<void*>& shards, TransferTimes& times,
              double& apply_s, Status& refit_failure);
  Status follow(const BeginMessage& begin, const std::vector<void*>& shards, TransferTimes& times,
                double& apply_s, Status& refit_failure);
  // The executor moved this rank's bytes of a refit (not a raw pass): records its traffic in the
  // store, before this rank says so, so that every trainer rank's record of the refit is there
  // once trainer rank 0 heard from all of them.
  Status bytes_moved(const BeginMessage& begin);
  // Sends `payload` as `type` to trainer_down_.
  Status tell_trainers(MessageType type, const std::string& payload);
  // Every trainer rank but 0: trainer rank 0's refit-done of `step` (checked, then handed on to
  // trainer_down_).
  Result<RefitDoneMessage> hear_refit_done(int step);
  // Every engine rank's answer to the begin of `step` (trainer rank 0), in engine rank order.
  Result<std::vector<PausedMessage>> collect_paused(int step);
  // Hands the executor every engine rank's answer, the exports it does not hold read in full
  // from the store (one request).
  Status take_answers(int step, std::vector<PausedMessage>& answers);
  Status abort(int step, const FailureOrigin& refused);
  // Every target commits; with refit.checksum the first checksum mismatch is `failure`.
  Status commit(int step, bool raw, const std::vector<void*>& shards, double& apply_s,
                std::optional<FailureOrigin>& failure);
  // This rank's sent of refit `step` with refit.checksum: per target, the PairSums of its
  // checksum of what it sent there (SentMessage).
  Result<SentMessage> sent_message(int step, const std::vector<void*>& shards);
  // Engine rank `engine`'s sums of what landed (`landed`) differ from what its feeders sent
  // (`sent`): the failure, naming the damaged pair where one pair alone explains it.
  FailureOrigin checksum_mismatch(int step, const std::string& engine,
                                  const std::optional<PairSums>& landed,
                                  const PairSums& sent) const;
  // The first failing verdict of `from`.
  Result<std::optional<FailureOrigin>> collect_verdicts(int step,
                                                        const std::vector<std::string>& from);
  // Gather: every trainer rank's failure of this refit through the store, so that every trainer
  // rank fails with the same cause: the lowest rank's failure wins.
  Result<std::optional<FailureOrigin>> agree(const std::optional<FailureOrigin>& mine);

  RankCore& core_;
  TrainerExecutor& executor_;
  Inbox inbox_;
  std::vector<std::string> targets_;       // mailbox ids of executor_.targets()
  std::vector<std::string> answers_from_;  // of executor_.answers_from()
  // The transfer plan: trainer rank 0 coordinates (answers_from_ is every engine rank).
  bool coordinated_ = false;
  // Who this rank hears the engines' answers and the refit's end from, and tells that its bytes
  // moved: trainer rank 0, or its group's relay (runtime/relay.h).
  std::string leader_;
  std::vector<std::string> followers_;  // on trainer rank 0: every other trainer rank
  // On trainer rank 0: who its messages to the other trainer ranks go to (the first group's
  // ranks and the other groups' relays). On a trainer relay: the ranks of its group it hands
  // them on to and answers for.
  std::vector<int> trainer_down_;
  // On trainer rank 0: whose sent sums it adds (refit.checksum): its own and trainer_down_'s, a
  // trainer relay's covering its group.
  std::set<std::string> sums_from_;
  // On trainer rank 0: where each phase's message to the engine ranks goes — their relays with
  // TP > 1 (runtime/relay.h), else every engine rank.
  std::vector<std::string> engine_relays_;
  TrafficPublisher traffic_publisher_;
  Phase phase_ = Phase::kIdle;
  double pause_s_ = 0;  // pause_seconds()
  int outcomes_ = 0;  // refits of this epoch whose outcome the ranks shared: namespaces their keys
  std::uint32_t outcomes_epoch_ = 0;
  std::deque<std::string> outcome_keys_;  // the keys this rank wrote for its last two outcomes
};

}  // namespace refit
