// The trainer rank's side of the refit protocol (docs/protocol.md): its one state machine. A refit
// moves through the phases
//   begun -> (transfer plan: every engine rank answered; proceed or abort) -> sent (the executor
//   moved every byte) -> committed (every target acknowledged) -> verified -> outcome sent
// and the abort paths: a refit an engine rank refused before any byte moved, and one whose bytes
// failed their checksum or verification (every trainer rank agrees on the first failure, and
// every engine rank publishes or none). It sends and receives every message of those phases; the
// executor moves the bytes.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "control/inbox.h"
#include "control/messages.h"
#include "executor/executor.h"
#include "runtime/rank_core.h"

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

 private:
  // Every engine rank's answer to the begin of `step`: the lowest engine rank's refusal, if any.
  Result<std::optional<FailureOrigin>> collect_paused(int step);
  Status abort(int step, const FailureOrigin& refused);
  // Every target commits; with refit.checksum the first checksum mismatch is `failure`.
  Status commit(int step, bool raw, const std::vector<void*>& shards, double& apply_s,
                std::optional<FailureOrigin>& failure);
  // The first failing verdict of the targets.
  Result<std::optional<FailureOrigin>> collect_verdicts(int step);
  // Every trainer rank's failure of this refit through the store, so that every trainer rank
  // fails with the same cause: the lowest rank's failure wins.
  Result<std::optional<FailureOrigin>> agree(const std::optional<FailureOrigin>& mine);

  RankCore& core_;
  TrainerExecutor& executor_;
  Inbox inbox_;
  std::vector<std::string> targets_;      // mailbox ids of executor_.targets()
  std::vector<std::string> answers_from_;  // of executor_.answers_from()
  Phase phase_ = Phase::kIdle;
  int outcomes_ = 0;  // refits of this epoch whose outcome the ranks shared: namespaces their keys
  std::uint32_t outcomes_epoch_ = 0;
};

}  // namespace refit
