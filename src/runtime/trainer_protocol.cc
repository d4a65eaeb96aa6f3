#include "runtime/trainer_protocol.h"

#include <fmt/format.h>

#include "common/log.h"
#include "control/store.h"
#include "runtime/agreement.h"

namespace refit {
namespace {

using enum MessageType;

}  // namespace

TrainerRefitProtocol::TrainerRefitProtocol(RankCore& core, TrainerExecutor& executor)
    : core_(core),
      executor_(executor),
      inbox_(core.mailbox(), core.config().generation.tp_size),
      targets_(mailbox_ids(executor.targets())),
      answers_from_(mailbox_ids(executor.answers_from())) {}

Status TrainerRefitProtocol::attach(const std::map<std::string, std::string>& settings,
                               std::int64_t total_parameters) {
  const Config& cfg = core_.config();
  const std::string ours = executor_.plan_hash();
  REFIT_RETURN_IF_ERROR(
      inbox_
          .collect(kHello, targets_, core_.timeout(), "engine hellos", {},
                   [&](const Message& hello) -> Status {
                     // The versions first: a rank of another version is reported as such.
                     REFIT_RETURN_IF_ERROR(
                         check_peer_versions(hello.payload, hello.from, core_.id()));
                     REFIT_ASSIGN_OR_RETURN(HelloMessage h, decode_hello(hello.payload, hello.from));
                     REFIT_RETURN_IF_ERROR(
                         check_agreed_settings(settings, h.settings, hello.from, core_.id()));
                     if (h.total_parameters != total_parameters)
                       return Status::InvalidArgument(fmt::format(
                           "setup: {} serves a model of {} parameters, the trainer's has {}; "
                           "both sides must load the same model",
                           hello.from, h.total_parameters, total_parameters));
                     // vLLM agrees on its manifest at setup; SGLang engines place what the
                     // metadata says (per bucket with executor gather, per route from the trainer
                     // ranks with the transfer plan).
                     if (cfg.generation.backend == EngineProtocol::kVllm && h.plan_hash != ours)
                       return Status::InvalidArgument(fmt::format(
                           "setup: vllm manifest mismatch: {} derived {} {} but the trainer's is "
                           "{}; both sides must use the same model, layouts, "
                           "refit.target_precision, refit.buffer_size_bytes and refit.executor",
                           hello.from, executor_.answers_from().empty() ? "bucket plan"
                                                                        : "transfer plan",
                           h.plan_hash, ours));
                     return Status::Ok();
                   })
          .status());
  executor_.targets_attached();
  for (std::size_t i = 0; i < targets_.size(); ++i)
    if (std::optional<RoutesMessage> routes = executor_.routes_for(i))
      REFIT_RETURN_IF_ERROR(core_.mailbox().send(targets_[i], kRoutes, encode(*routes)));
  return Status::Ok();
}

Status TrainerRefitProtocol::run(const BeginMessage& begin_in, const std::vector<void*>& shards,
                            TransferTimes& times, double& apply_s, Status& refit_failure) {
  const int step = begin_in.step;
  REFIT_RETURN_IF_ERROR(executor_.before_begin(begin_in, shards, times));
  for (std::size_t i = 0; i < targets_.size(); ++i) {
    BeginMessage b = begin_in;
    executor_.prepare_begin(i, b);
    REFIT_RETURN_IF_ERROR(core_.mailbox().send(targets_[i], kBegin, encode(b)));
  }
  phase_ = Phase::kBegun;
  log::debug("{}: sent the begin of step {}", core_.id(), step);
  if (!answers_from_.empty()) {
    // Every engine rank pauses and tells every trainer rank whether its parameters are
    // exported, or refuses: every trainer rank decides alike whether to proceed, before any
    // byte moves.
    REFIT_ASSIGN_OR_RETURN(const std::optional<FailureOrigin> refused, collect_paused(step));
    ProceedMessage proceed{.step = step, .refused = refused};
    REFIT_RETURN_IF_ERROR(send_to_each(core_.mailbox(), targets_, kProceed, encode(proceed)));
    if (refused) {
      REFIT_RETURN_IF_ERROR(abort(step, *refused));
      refit_failure = failed_refit(StatusCode::kAborted, step, begin_in.version, *refused);
      phase_ = Phase::kIdle;
      return Status::Ok();
    }
    log::debug("{}: told its engine ranks to proceed with step {}", core_.id(), step);
  }
  phase_ = Phase::kProceeding;
  REFIT_RETURN_IF_ERROR(executor_.send(begin_in, shards, times));
  phase_ = Phase::kSent;
  apply_s = 0;
  std::optional<FailureOrigin> failure;
  if (!targets_.empty()) REFIT_RETURN_IF_ERROR(commit(step, begin_in.raw, shards, apply_s, failure));
  phase_ = Phase::kCommitted;
  if (begin_in.verify) {
    REFIT_ASSIGN_OR_RETURN(const std::optional<FailureOrigin> verdict, collect_verdicts(step));
    if (!failure) failure = verdict;
  }
  const bool checksums = core_.config().refit.checksum && executor_.checksums() && !begin_in.raw;
  if (begin_in.verify || checksums) {
    // Every engine rank publishes, or none does: the ranks of one engine never hold two
    // versions, whichever rank's bytes failed.
    if (core_.group(RankCore::Group::kTrainer) != nullptr) {
      REFIT_ASSIGN_OR_RETURN(failure, agree(failure));
    }
    REFIT_RETURN_IF_ERROR(send_to_each(core_.mailbox(), targets_, kOutcome,
                                    encode(OutcomeMessage{.step = step, .failed = failure})));
    // Each engine acknowledges once it heard every feeder, so nothing this rank sends next can
    // reach an engine before another rank's outcome.
    REFIT_ASSIGN_OR_RETURN(const std::vector<Message> heard,
                           inbox_.collect(kOutcomeHeard, targets_, core_.timeout(),
                                          "outcome acknowledgements"));
    for (const Message& m : heard) {
      REFIT_ASSIGN_OR_RETURN(const OutcomeHeardMessage h, decode_outcome_heard(m.payload, m.from));
      log::debug("{}: {} holds weight version '{}' after refit step {}{}", core_.id(), m.from,
                 h.weight_version, h.step, h.valid ? "" : " (invalid)");
    }
  }
  if (failure)
    refit_failure = failed_refit(StatusCode::kCorruption, step, begin_in.version, *failure);
  REFIT_RETURN_IF_ERROR(inbox_.expect_none_kept(fmt::format("after refit step {}", step)));
  phase_ = Phase::kIdle;
  return Status::Ok();
}

void TrainerRefitProtocol::abandon() {
  inbox_.clear();
  phase_ = Phase::kIdle;
  outcomes_ = 0;
}

Result<std::optional<FailureOrigin>> TrainerRefitProtocol::collect_paused(int step) {
  // A trainer rank waits 2 x refit.timeout_s + 5 s for every answer (every rank alive) before
  // the session ends: engine ranks decide about their own slow hooks within refit.timeout_s.
  REFIT_ASSIGN_OR_RETURN(
      const std::vector<Message> got,
      inbox_.collect(kPaused, answers_from_, core_.timeout() * 2 + std::chrono::seconds(5),
                     "the engines' pause"));
  std::vector<PausedMessage> answers;
  std::optional<FailureOrigin> refused;
  for (const Message& m : got) {
    REFIT_ASSIGN_OR_RETURN(PausedMessage p, decode_paused(m.payload, m.from));
    // Each engine rank answers each begin once, before the refit goes on or is aborted; answers
    // of a refit that failed in flight are dropped by their epoch (Mailbox::set_epoch).
    if (p.step != step)
      return Status::Corruption(fmt::format("{}: {} paused for refit step {} while refit step {} "
                                            "is in flight",
                                            core_.id(), m.from, p.step, step));
    if (p.refused && !refused) refused = p.refused;  // the lowest engine rank's
    answers.push_back(std::move(p));
  }
  log::debug("{}: every engine rank answered the begin of step {}", core_.id(), step);
  REFIT_RETURN_IF_ERROR(executor_.take_answers(answers));
  return refused;
}

// Every trainer rank decided to abort this refit: every target was told, and acknowledges once it
// heard every feeder (so that this rank's next begin cannot overtake another feeder's abort).
Status TrainerRefitProtocol::abort(int step, const FailureOrigin& refused) {
  log::warn("{}: refit step {} aborted before any byte moved: {}: {}", core_.id(), step,
            refused.rank.name(), refused.error);
  return inbox_
      .collect(kAbortHeard, targets_, core_.timeout(),
               fmt::format("the engines to abort refit step {}", step))
      .status();
}

// Every target commits; the slowest one's apply time is the refit's. With refit.checksum, this
// rank checksums what it sent each engine while the engines checksum what landed, and compares
// their answer with its own.
Status TrainerRefitProtocol::commit(int step, bool raw, const std::vector<void*>& shards,
                               double& apply_s, std::optional<FailureOrigin>& failure) {
  if (!raw) core_.probe().before_commit(step);
  REFIT_RETURN_IF_ERROR(
      send_to_each(core_.mailbox(), targets_, kCommit, encode(CommitMessage{.step = step})));
  log::debug("{}: committed refit step {}", core_.id(), step);
  const bool checksums = core_.config().refit.checksum && executor_.checksums() && !raw;
  std::vector<std::string> sent(targets_.size());
  if (checksums)
    for (std::size_t i = 0; i < sent.size(); ++i) {
      REFIT_ASSIGN_OR_RETURN(const std::uint64_t sum, executor_.checksum_to(i, shards));
      sent[i] = fmt::format("{:016x}", sum);
    }
  // Each engine verifies right after its own commit, so its verdict can overtake another
  // engine's acknowledgement: it is kept for the verdicts.
  REFIT_ASSIGN_OR_RETURN(const std::vector<Message> acks,
                         inbox_.collect(kCommitted, targets_, core_.timeout(),
                                        "commit acknowledgements", {kVerified}));
  for (std::size_t i = 0; i < acks.size(); ++i) {
    REFIT_ASSIGN_OR_RETURN(const CommittedMessage c, decode_committed(acks[i].payload, acks[i].from));
    apply_s = std::max(apply_s, c.apply_s);
    if (!failure && checksums && sent[i] != c.checksum)
      failure = FailureOrigin{
          .rank = executor_.targets()[i],
          .code = StatusCode::kCorruption,
          .kind = FailureKind::kVerification,
          .error = fmt::format("checksum mismatch in refit step {}: the bytes {} sent (checksum "
                               "{}) arrived as checksum {} (refit.checksum)",
                               step, core_.id(), sent[i],
                               c.checksum.empty() ? "(none)" : c.checksum)};
  }
  log::debug("{}: every engine acknowledged the commit of refit step {}", core_.id(), step);
  return Status::Ok();
}

Result<std::optional<FailureOrigin>> TrainerRefitProtocol::collect_verdicts(int step) {
  const int tp = core_.config().generation.tp_size;
  REFIT_ASSIGN_OR_RETURN(const std::vector<Message> got,
                         inbox_.collect(kVerified, targets_, core_.timeout() * 4,
                                        "verification results"));
  std::optional<FailureOrigin> verdict;
  for (const Message& m : got) {
    Result<VerifiedMessage> v = decode_verified(m.payload, m.from);
    if (!v.ok()) {
      if (!verdict)
        verdict = FailureOrigin{.rank = *RankId::from_mailbox(m.from, tp),
                                .code = StatusCode::kCorruption,
                                .kind = FailureKind::kProtocol,
                                .error = v.status().message()};
      continue;
    }
    if (v->step != step)
      return Status::Corruption(fmt::format("{}: {} sent the verdict of refit step {} in step {}",
                                            core_.id(), m.from, v->step, step));
    if (!verdict && v->failed) verdict = v->failed;
  }
  return verdict;
}

Result<std::optional<FailureOrigin>> TrainerRefitProtocol::agree(
    const std::optional<FailureOrigin>& mine) {
  const int world = core_.config().policy.world_size;
  // Per refit epoch: ranks whose refit failed in flight before this point did not count it.
  if (outcomes_epoch_ != core_.epochs().current()) {
    outcomes_epoch_ = core_.epochs().current();
    outcomes_ = 0;
  }
  const std::string key = fmt::format("outcome/{}/{}/", outcomes_epoch_, ++outcomes_);
  // "ok", or "!" + the failure record (a key must hold something to exist).
  REFIT_RETURN_IF_ERROR(core_.store().set(key + std::to_string(core_.self().rank),
                                          mine ? "!" + encode_failure(*mine) : "ok"));
  std::optional<FailureOrigin> first;
  for (int r = 0; r < world; ++r) {
    REFIT_ASSIGN_OR_RETURN(std::string theirs,
                           get_while_alive(core_.store(), key + std::to_string(r), core_.timeout(),
                                           core_.alive()));
    if (first || theirs.empty() || theirs.front() != '!') continue;
    REFIT_ASSIGN_OR_RETURN(first, decode_failure(theirs.substr(1), RankId::trainer(r).name()));
  }
  return first;
}

// Engines acknowledge the shutdown before their feeder leaves, and trainer rank 0 (which hosts
// the store) leaves last, so no process loses the control plane while it still needs it.
Status TrainerRefitProtocol::shutdown() {
  REFIT_RETURN_IF_ERROR(send_to_each(core_.mailbox(), targets_, kShutdown, encode(ShutdownMessage{})));
  REFIT_ASSIGN_OR_RETURN(const std::vector<Message> left,
                         inbox_.collect(kLeaving, targets_, core_.timeout(), "engine exits"));
  for (const Message& m : left) REFIT_RETURN_IF_ERROR(decode_leaving(m.payload, m.from).status());
  return Status::Ok();
}

}  // namespace refit
