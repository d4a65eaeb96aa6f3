#include "runtime/trainer_protocol.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"
#include "control/store.h"
#include "runtime/agreement.h"
#include "runtime/relay.h"

namespace refit {
namespace {

using enum MessageType;

}  // namespace

TrainerRefitProtocol::TrainerRefitProtocol(RankCore& core, TrainerExecutor& executor)
    : core_(core),
      executor_(executor),
      inbox_(core.mailbox(), core.config().generation.tp_size),
      targets_(mailbox_ids(executor.targets())),
      answers_from_(mailbox_ids(executor.answers_from())),
      coordinated_(!answers_from_.empty()),
      leader_(RankId::trainer(0).mailbox()) {
  if (!coordinated_) return;
  const int world = core.config().policy.world_size;
  const int rank = core.self().rank;
  leader_ = RankId::trainer(relay::trainer_leader(rank, world)).mailbox();
  if (rank != 0) {
    trainer_down_ = relay::trainer_relayed(rank, world);
    return;
  }
  for (int r = 1; r < world; ++r) followers_.push_back(RankId::trainer(r).mailbox());
  sums_from_.insert(core.self().mailbox());
  for (const std::string& id : relay::trainer_relays(world)) {
    trainer_down_.push_back(RankId::from_mailbox(id, 1)->rank);
    sums_from_.insert(id);
  }
  engine_relays_ = relay::engine_relays(executor.answers_from());
  std::map<std::string, std::vector<std::string>> groups =
      relay::engine_relay_groups(executor.answers_from());
  for (auto& [relay, members] : relay::trainer_relay_groups(world))
    groups[relay] = std::move(members);
  inbox_.accept_relayed(groups);
}

Status TrainerRefitProtocol::bytes_moved(const BeginMessage& begin) {
  if (begin.raw) return Status::Ok();
  return traffic_publisher_.publish(core_.store(), executor_.traffic());
}

Status TrainerRefitProtocol::tell_trainers(MessageType type, const std::string& payload) {
  for (int r : trainer_down_)
    REFIT_RETURN_IF_ERROR(core_.mailbox().send(RankId::trainer(r).mailbox(), type, payload));
  return Status::Ok();
}

Result<RefitDoneMessage> TrainerRefitProtocol::hear_refit_done(int step) {
  // Trainer rank 0 waits for every trainer rank's bytes, then each engine rank's commit, verdict
  // and outcome, each wait bounded by refit.timeout_s (the verdicts: 4 x): longer than that.
  REFIT_ASSIGN_OR_RETURN(
      const std::vector<Message> done,
      inbox_.collect(kRefitDone, {leader_}, core_.timeout() * 8 + std::chrono::seconds(5),
                     fmt::format("the end of refit step {}", step)));
  // Checked before a trainer relay hands it on: its group hears only a refit-done of this step.
  REFIT_ASSIGN_OR_RETURN(RefitDoneMessage d, decode_refit_done(done[0].payload, done[0].from));
  REFIT_RETURN_IF_ERROR(check_step(core_.id(), leader_, "the end", d.step, step));
  REFIT_RETURN_IF_ERROR(tell_trainers(kRefitDone, done[0].payload));
  return d;
}

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
                     const auto at = std::find(targets_.begin(), targets_.end(), hello.from);
                     if (at != targets_.end())
                       REFIT_RETURN_IF_ERROR(executor_.check_hello(
                           static_cast<std::size_t>(at - targets_.begin()), h));
                     return Status::Ok();
                   })
          .status());
  executor_.targets_attached();
  for (std::size_t i = 0; i < targets_.size(); ++i)
    if (std::optional<RoutesMessage> routes = executor_.routes_for(i))
      REFIT_RETURN_IF_ERROR(core_.mailbox().send(targets_[i], kRoutes, encode(*routes)));
  return Status::Ok();
}

Status TrainerRefitProtocol::run(const BeginMessage& begin, const std::vector<void*>& shards,
                                 TransferTimes& times, double& apply_s, Status& refit_failure) {
  apply_s = 0;
  pause_s_ = 0;
  Status st = !coordinated_            ? run_fed(begin, shards, times, apply_s, refit_failure)
              : core_.self().rank == 0 ? lead(begin, shards, times, apply_s, refit_failure)
                                       : follow(begin, shards, times, apply_s, refit_failure);
  REFIT_RETURN_IF_ERROR(st);
  REFIT_RETURN_IF_ERROR(inbox_.expect_none_kept(fmt::format("after refit step {}", begin.step)));
  phase_ = Phase::kIdle;
  return Status::Ok();
}

Status TrainerRefitProtocol::run_fed(const BeginMessage& begin_in, const std::vector<void*>& shards,
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
  phase_ = Phase::kProceeding;
  REFIT_RETURN_IF_ERROR(executor_.send(begin_in, shards, times));
  REFIT_RETURN_IF_ERROR(bytes_moved(begin_in));
  phase_ = Phase::kSent;
  std::optional<FailureOrigin> failure;
  if (!targets_.empty()) REFIT_RETURN_IF_ERROR(commit(step, begin_in.raw, shards, apply_s, failure));
  phase_ = Phase::kCommitted;
  if (begin_in.verify) {
    REFIT_ASSIGN_OR_RETURN(const std::optional<FailureOrigin> verdict,
                           collect_verdicts(step, targets_));
    if (!failure) failure = verdict;
  }
  if (begin_in.verify) {
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
      REFIT_RETURN_IF_ERROR(
          check_step(core_.id(), m.from, "the outcome acknowledgement", h.step, step));
      pause_s_ = std::max(pause_s_, h.pause_s);
    }
  }
  if (failure)
    refit_failure = failed_refit(StatusCode::kCorruption, step, begin_in.version, *failure);
  return Status::Ok();
}

// Trainer rank 0 with the transfer plan: begins every engine rank, decides from every answer,
// tells the other trainer ranks, moves its own bytes, waits until every trainer rank's bytes
// moved, commits every engine rank, compares checksums, collects verdicts, sends the outcome and
// tells the other trainer ranks how the refit ended.
Status TrainerRefitProtocol::lead(const BeginMessage& begin, const std::vector<void*>& shards,
                                  TransferTimes& times, double& apply_s, Status& refit_failure) {
  const int step = begin.step;
  const std::vector<std::string>& engines = answers_from_;
  REFIT_RETURN_IF_ERROR(executor_.before_begin(begin, shards, times));
  REFIT_RETURN_IF_ERROR(send_to_each(core_.mailbox(), engine_relays_, kBegin, encode(begin)));
  phase_ = Phase::kBegun;
  log::debug("{}: sent the begin of step {} to {} engine rank(s)", core_.id(), step,
             engines.size());
  REFIT_ASSIGN_OR_RETURN(std::vector<PausedMessage> answers, collect_paused(step));
  EnginesPausedMessage all{.step = step};
  for (const PausedMessage& p : answers) {
    if (p.refused && !all.refused) all.refused = p.refused;  // the lowest engine rank's
    all.exports.push_back(p.direct ? std::optional<std::string>(p.direct->digest) : std::nullopt);
  }
  // refit.delta: each engine rank's offers of a base, by the trainer rank they are for; each
  // other trainer rank hears only those for its own pairs.
  const int world = core_.config().policy.world_size;
  std::vector<std::vector<DeltaBase>> offers(static_cast<std::size_t>(world));
  bool offered = false;
  for (std::size_t g = 0; g < answers.size(); ++g)
    for (const DeltaBase& b : answers[g].delta_bases) {
      if (b.rank >= world)
        return Status::Corruption(
            fmt::format("{}: {} offered a delta base to trainer rank {} of {}", core_.id(),
                        engines[g], b.rank, world));
      offers[static_cast<std::size_t>(b.rank)].push_back(DeltaBase{
          .rank = static_cast<int>(g), .digest = b.digest, .version = answers[g].delta_version});
      offered = offered || b.rank != 0;
    }
  REFIT_RETURN_IF_ERROR(send_to_each(core_.mailbox(), engine_relays_, kProceed,
                                     encode(ProceedMessage{.step = step, .refused = all.refused})));
  if (!offered) {
    REFIT_RETURN_IF_ERROR(tell_trainers(kEnginesPaused, encode(all)));
  } else {
    // A trainer relay gets its group's offers too, to hand on.
    for (int r : trainer_down_) {
      all.delta = std::move(offers[static_cast<std::size_t>(r)]);
      all.group_delta.clear();
      for (int m : relay::trainer_relayed(r, world))
        all.group_delta[m] = std::move(offers[static_cast<std::size_t>(m)]);
      REFIT_RETURN_IF_ERROR(
          core_.mailbox().send(RankId::trainer(r).mailbox(), kEnginesPaused, encode(all)));
    }
    all.delta.clear();
    all.group_delta.clear();
  }
  if (all.refused) {
    REFIT_RETURN_IF_ERROR(abort(step, *all.refused));
    // Every engine rank heard the abort: the other trainer ranks return the refusal now.
    REFIT_RETURN_IF_ERROR(tell_trainers(
        kRefitDone, encode(RefitDoneMessage{.step = step, .failed = all.refused})));
    refit_failure = failed_refit(StatusCode::kAborted, step, begin.version, *all.refused);
    return Status::Ok();
  }
  log::debug("{}: told every engine rank to proceed with step {}", core_.id(), step);
  REFIT_RETURN_IF_ERROR(take_answers(step, answers));
  phase_ = Phase::kProceeding;
  REFIT_RETURN_IF_ERROR(executor_.send(begin, shards, times));
  REFIT_RETURN_IF_ERROR(bytes_moved(begin));
  phase_ = Phase::kSent;
  const bool checksums = core_.config().refit.checksum && executor_.checksums() && !begin.raw;
  // refit.checksum: per target, the PairSums of what every trainer rank sent it. They come from
  // the ranks trainer rank 0 hears directly: a trainer relay's cover its whole group.
  std::map<std::string, PairSums> expected;
  auto take_sent = [&](const std::string& from, const SentMessage& s) {
    if (sums_from_.count(from) != 0)
      for (const auto& [target, sums] : s.sums) expected[target].add(sums);
  };
  REFIT_RETURN_IF_ERROR(
      inbox_
          .collect(kSent, followers_, core_.timeout(),
                   fmt::format("the other trainer ranks' bytes of refit step {}", step), {},
                   [&](const Message& m) -> Status {
                     REFIT_ASSIGN_OR_RETURN(SentMessage s, decode_sent(m.payload, m.from));
                     REFIT_RETURN_IF_ERROR(
                         check_step(core_.id(), m.from, "the bytes", s.step, step));
                     take_sent(m.from, s);
                     return Status::Ok();
                   })
          .status());
  if (!begin.raw) core_.probe().before_commit(step);
  if (checksums) {
    REFIT_ASSIGN_OR_RETURN(SentMessage mine, sent_message(step, shards));
    take_sent(core_.self().mailbox(), mine);
  }
  REFIT_RETURN_IF_ERROR(
      send_to_each(core_.mailbox(), engine_relays_, kCommit, encode(CommitMessage{.step = step})));
  log::debug("{}: committed refit step {}", core_.id(), step);
  // Each engine verifies right after its own commit, so its verdict can overtake another
  // engine's acknowledgement: it is kept for the verdicts.
  REFIT_ASSIGN_OR_RETURN(
      const std::vector<Message> acks,
      inbox_.collect(kCommitted, engines, core_.timeout(), "commit acknowledgements", {kVerified}));
  std::optional<FailureOrigin> failure;
  for (const Message& ack : acks) {
    REFIT_ASSIGN_OR_RETURN(const CommittedMessage c, decode_committed(ack.payload, ack.from));
    REFIT_RETURN_IF_ERROR(check_step(core_.id(), ack.from, "the commit acknowledgement", c.step,
                                     step));
    apply_s = std::max(apply_s, c.apply_s);
    pause_s_ = std::max(pause_s_, c.pause_s);
    if (!checksums || failure) continue;
    // An engine rank no trainer rank sent to expects the empty sums.
    const auto want = expected.find(ack.from);
    const PairSums sent = want != expected.end() ? want->second : PairSums();
    if (c.checksum_sums == sent) continue;
    failure = checksum_mismatch(step, ack.from, c.checksum_sums, sent);
  }
  log::debug("{}: every engine rank acknowledged the commit of refit step {}", core_.id(), step);
  phase_ = Phase::kCommitted;
  // refit.staged: each engine rank's verdict says whether it applied (its pause hook may refuse).
  const bool staged = core_.config().refit.staged && !begin.raw;
  if (begin.verify || staged) {
    REFIT_ASSIGN_OR_RETURN(const std::optional<FailureOrigin> verdict,
                           collect_verdicts(step, engines));
    if (!failure) failure = verdict;
  }
  if (begin.verify || checksums || staged) {
    // Every engine rank publishes, or none does: the ranks of one engine never hold two
    // versions, whichever rank's bytes failed.
    REFIT_RETURN_IF_ERROR(send_to_each(core_.mailbox(), engine_relays_, kOutcome,
                                       encode(OutcomeMessage{.step = step, .failed = failure})));
    REFIT_ASSIGN_OR_RETURN(
        const std::vector<Message> heard,
        inbox_.collect(kOutcomeHeard, engines, core_.timeout(), "outcome acknowledgements"));
    for (const Message& m : heard) {
      REFIT_ASSIGN_OR_RETURN(const OutcomeHeardMessage h, decode_outcome_heard(m.payload, m.from));
      REFIT_RETURN_IF_ERROR(
          check_step(core_.id(), m.from, "the outcome acknowledgement", h.step, step));
      pause_s_ = std::max(pause_s_, h.pause_s);
      log::debug("{}: {} holds weight version '{}' after refit step {}{}", core_.id(), m.from,
                 h.weight_version, h.step, h.valid ? "" : " (invalid)");
    }
  }
  REFIT_RETURN_IF_ERROR(tell_trainers(
      kRefitDone, encode(RefitDoneMessage{
                      .step = step, .failed = failure, .apply_s = apply_s, .pause_s = pause_s_})));
  if (failure) refit_failure = failed_refit(StatusCode::kCorruption, step, begin.version, *failure);
  return Status::Ok();
}

// Every trainer rank but 0 with the transfer plan: hears every engine rank's answer from trainer
// rank 0, moves its bytes, says so, and hears how the refit ended.
Status TrainerRefitProtocol::follow(const BeginMessage& begin, const std::vector<void*>& shards,
                                    TransferTimes& times, double& apply_s, Status& refit_failure) {
  const int step = begin.step;
  REFIT_RETURN_IF_ERROR(executor_.before_begin(begin, shards, times));
  phase_ = Phase::kBegun;
  // Longer than trainer rank 0 waits for the engines' answers (2 x refit.timeout_s + 5 s).
  REFIT_ASSIGN_OR_RETURN(
      const std::vector<Message> got,
      inbox_.collect(kEnginesPaused, {leader_}, core_.timeout() * 3 + std::chrono::seconds(5),
                     fmt::format("the engines' answers to refit step {}", step)));
  REFIT_ASSIGN_OR_RETURN(EnginesPausedMessage all,
                         decode_engines_paused(got[0].payload, got[0].from));
  if (all.step != step || all.exports.size() != answers_from_.size())
    return Status::Corruption(fmt::format(
        "{}: {} sent the engines' answers of refit step {} ({} engine rank(s)) in step {} ({})",
        core_.id(), leader_, all.step, all.exports.size(), step, answers_from_.size()));
  // A trainer relay hands them on, each rank of its group with its own offers.
  if (all.group_delta.empty()) {
    REFIT_RETURN_IF_ERROR(tell_trainers(kEnginesPaused, got[0].payload));
  } else {
    EnginesPausedMessage theirs = all;
    theirs.group_delta.clear();
    for (int m : trainer_down_) {
      const auto it = all.group_delta.find(m);
      theirs.delta = it == all.group_delta.end() ? std::vector<DeltaBase>{} : it->second;
      REFIT_RETURN_IF_ERROR(
          core_.mailbox().send(RankId::trainer(m).mailbox(), kEnginesPaused, encode(theirs)));
    }
    all.group_delta.clear();
  }
  if (all.refused) {
    log::warn("{}: refit step {} aborted before any byte moved: {}: {}", core_.id(), step,
              all.refused->rank.name(), all.refused->error);
    // Not over before every engine rank acknowledged the abort: should that fail, trainer rank 0
    // fails the refit in flight, and every trainer rank with it, still in this call.
    REFIT_RETURN_IF_ERROR(hear_refit_done(step).status());
    log::debug("{}: every engine rank heard the abort of refit step {}", core_.id(), step);
    refit_failure = failed_refit(StatusCode::kAborted, step, begin.version, *all.refused);
    return Status::Ok();
  }
  std::vector<PausedMessage> answers(all.exports.size());
  for (std::size_t g = 0; g < answers.size(); ++g) {
    answers[g].step = step;
    if (all.exports[g])
      answers[g].direct = ExportedParams{.digest = std::move(*all.exports[g]), .elided = true};
  }
  // refit.delta: the offers of this rank's engine ranks, as each engine rank made them.
  for (const DeltaBase& b : all.delta) {
    if (b.rank >= static_cast<int>(answers.size()) || b.version.empty())
      return Status::Corruption(fmt::format(
          "{}: {} relayed a delta base of engine rank {} (weight version '{}'); there are {} "
          "engine ranks",
          core_.id(), leader_, b.rank, b.version, answers.size()));
    PausedMessage& p = answers[static_cast<std::size_t>(b.rank)];
    p.delta_version = b.version;
    p.delta_bases = {DeltaBase{.rank = core_.self().rank, .digest = b.digest}};
  }
  REFIT_RETURN_IF_ERROR(take_answers(step, answers));
  phase_ = Phase::kProceeding;
  REFIT_RETURN_IF_ERROR(executor_.send(begin, shards, times));
  REFIT_RETURN_IF_ERROR(bytes_moved(begin));
  phase_ = Phase::kSent;
  if (!begin.raw) core_.probe().before_commit(step);
  SentMessage sent{.step = step};
  if (core_.config().refit.checksum && executor_.checksums() && !begin.raw) {
    REFIT_ASSIGN_OR_RETURN(sent, sent_message(step, shards));
  }
  if (trainer_down_.empty()) {
    REFIT_RETURN_IF_ERROR(core_.mailbox().send(leader_, kSent, encode(sent)));
  } else {
    // A trainer relay: its group's sent, its own first, in one relayed message.
    std::vector<std::string> group;
    for (int m : trainer_down_) group.push_back(RankId::trainer(m).mailbox());
    REFIT_ASSIGN_OR_RETURN(std::vector<Message> all_sent,
                           inbox_.collect(kSent, group, core_.timeout(),
                                          fmt::format("its group's bytes of refit step {}", step)));
    // Its own sums become the group's: trainer rank 0 adds the relay's sums alone, so the
    // members' go on without theirs (one per target each: T x E in all).
    for (Message& m : all_sent) {
      REFIT_ASSIGN_OR_RETURN(SentMessage theirs, decode_sent(m.payload, m.from));
      if (theirs.sums.empty()) continue;
      for (const auto& [target, sums] : theirs.sums) sent.sums[target].add(sums);
      theirs.sums.clear();
      m.payload = encode(theirs);
    }
    all_sent.insert(
        all_sent.begin(),
        Message{.type = kSent, .from = core_.self().mailbox(), .payload = encode(sent)});
    REFIT_RETURN_IF_ERROR(send_relayed(core_.mailbox(), leader_, all_sent));
  }
  REFIT_ASSIGN_OR_RETURN(const RefitDoneMessage d, hear_refit_done(step));
  phase_ = Phase::kCommitted;
  apply_s = d.apply_s;
  pause_s_ = d.pause_s;
  if (d.failed)
    refit_failure = failed_refit(StatusCode::kCorruption, step, begin.version, *d.failed);
  return Status::Ok();
}

Status TrainerRefitProtocol::take_answers(int step, std::vector<PausedMessage>& answers) {
  // The exports of this rank's targets whose digest it does not hold, in one store request.
  const std::vector<RankId>& targets = executor_.targets();
  std::vector<std::string> keys;
  std::vector<std::size_t> which;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    const auto g = static_cast<std::size_t>(targets[i].rank);
    if (g >= answers.size()) continue;
    const std::optional<ExportedParams>& d = answers[g].direct;
    if (!d || !d->elided || d->digest == executor_.export_held(i)) continue;
    keys.push_back(export_key(targets[i].mailbox(), d->digest));
    which.push_back(g);
  }
  if (!keys.empty()) {
    REFIT_ASSIGN_OR_RETURN(const std::vector<std::optional<std::string>> full,
                           core_.store().try_get_many(keys));
    for (std::size_t k = 0; k < keys.size(); ++k) {
      if (!full[k])
        return Status::Corruption(fmt::format(
            "{}: refit step {}: the store holds no export under {} (its engine rank answered "
            "with that digest)",
            core_.id(), step, keys[k]));
      REFIT_ASSIGN_OR_RETURN(PausedMessage p, decode_paused(*full[k], keys[k]));
      if (!p.direct || p.direct->elided || p.direct->digest != answers[which[k]].direct->digest)
        return Status::Corruption(
            fmt::format("{}: store key {} holds another export", core_.id(), keys[k]));
      answers[which[k]].direct = std::move(p.direct);
    }
  }
  return executor_.take_answers(answers);
}

Result<SentMessage> TrainerRefitProtocol::sent_message(int step, const std::vector<void*>& shards) {
  SentMessage sent{.step = step};
  for (std::size_t i = 0; i < targets_.size(); ++i) {
    REFIT_ASSIGN_OR_RETURN(const std::uint64_t sum, executor_.checksum_to(i, shards));
    sent.sums[targets_[i]].add(sum, core_.self().rank);
  }
  return sent;
}

// Engine rank `engine`'s sums of what landed (`landed`; unset: it sent none) differ from its
// feeders' (`sent`): the pair that alone explains the difference is named (PairSums), else the
// engine rank.
FailureOrigin TrainerRefitProtocol::checksum_mismatch(int step, const std::string& engine,
                                                      const std::optional<PairSums>& landed,
                                                      const PairSums& sent) const {
  const int tp = core_.config().generation.tp_size;
  FailureOrigin failure{.rank = *RankId::from_mailbox(engine, tp), .code = StatusCode::kCorruption};
  if (!landed) {
    failure.error = fmt::format("checksum mismatch in refit step {}: it sent no checksums of what "
                                "landed (refit.checksum)",
                                step);
    return failure;
  }
  // Several damaged pairs give a quotient that names a trainer rank of the run with probability
  // about world / 2^61.
  const std::optional<int> feeder = PairSums::damaged_feeder(sent, *landed);
  if (feeder && *feeder < core_.config().policy.world_size) {
    failure.error = fmt::format(
        "checksum mismatch in refit step {}: the bytes {} sent did not arrive as sent (refit.checksum)",
        step, RankId::trainer(*feeder).name());
    return failure;
  }
  failure.error = fmt::format(
      "checksum mismatch in refit step {}: the bytes of more than one of its feeders did not "
      "arrive as sent (refit.checksum)",
      step);
  return failure;
}

void TrainerRefitProtocol::abandon() {
  inbox_.clear();
  phase_ = Phase::kIdle;
  outcomes_ = 0;
}

Result<std::vector<PausedMessage>> TrainerRefitProtocol::collect_paused(int step) {
  // Trainer rank 0 waits 2 x refit.timeout_s + 5 s for every answer (every rank alive) before the
  // session ends: engine ranks decide about their own slow hooks within refit.timeout_s.
  REFIT_ASSIGN_OR_RETURN(
      const std::vector<Message> got,
      inbox_.collect(kPaused, answers_from_, core_.timeout() * 2 + std::chrono::seconds(5),
                     "the engines' pause"));
  std::vector<PausedMessage> answers;
  for (const Message& m : got) {
    REFIT_ASSIGN_OR_RETURN(PausedMessage p, decode_paused(m.payload, m.from));
    // Each engine rank answers each begin once, before the refit goes on or is aborted; answers
    // of a refit that failed in flight are dropped by their epoch (Mailbox::set_epoch).
    REFIT_RETURN_IF_ERROR(check_step(core_.id(), m.from, "its pause", p.step, step));
    answers.push_back(std::move(p));
  }
  log::debug("{}: every engine rank answered the begin of step {}", core_.id(), step);
  return answers;
}

// Trainer rank 0 decided to abort this refit: every engine rank was told, and acknowledges.
Status TrainerRefitProtocol::abort(int step, const FailureOrigin& refused) {
  log::warn("{}: refit step {} aborted before any byte moved: {}: {}", core_.id(), step,
            refused.rank.name(), refused.error);
  return inbox_
      .collect(kAbortHeard, answers_from_, core_.timeout(),
               fmt::format("the engines to abort refit step {}", step), {},
               [&](const Message& m) -> Status {
                 REFIT_ASSIGN_OR_RETURN(const AbortHeardMessage h,
                                        decode_abort_heard(m.payload, m.from));
                 return check_step(core_.id(), m.from, "the abort acknowledgement", h.step, step);
               })
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
    REFIT_RETURN_IF_ERROR(check_step(core_.id(), acks[i].from, "the commit acknowledgement",
                                     c.step, step));
    apply_s = std::max(apply_s, c.apply_s);
    pause_s_ = std::max(pause_s_, c.pause_s);
    REFIT_ASSIGN_OR_RETURN(const auto by_feeder, decode_pair_checksums(c.checksums, acks[i].from));
    const auto landed = by_feeder.find(core_.self().mailbox());
    const std::string got = landed == by_feeder.end() ? std::string() : landed->second;
    if (!failure && checksums && sent[i] != got)
      failure = FailureOrigin{
          .rank = executor_.targets()[i],
          .code = StatusCode::kCorruption,
          .kind = FailureKind::kVerification,
          .error = fmt::format("checksum mismatch in refit step {}: the bytes {} sent (checksum "
                               "{}) arrived as checksum {} (refit.checksum)",
                               step, core_.id(), sent[i], got.empty() ? "(none)" : got)};
  }
  log::debug("{}: every engine acknowledged the commit of refit step {}", core_.id(), step);
  return Status::Ok();
}

Result<std::optional<FailureOrigin>> TrainerRefitProtocol::collect_verdicts(
    int step, const std::vector<std::string>& from) {
  const int tp = core_.config().generation.tp_size;
  REFIT_ASSIGN_OR_RETURN(
      const std::vector<Message> got,
      inbox_.collect(kVerified, from, core_.timeout() * 4, "verification results"));
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
    REFIT_RETURN_IF_ERROR(check_step(core_.id(), m.from, "the verdict", v->step, step));
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
  // The key of two outcomes ago goes: every rank read it before it wrote its key of the last
  // outcome, which this rank read before it came here.
  outcome_keys_.push_back(key + std::to_string(core_.self().rank));
  if (outcome_keys_.size() > 2) {
    REFIT_RETURN_IF_ERROR(core_.store().erase(outcome_keys_.front()));
    log::debug("{}: erased its outcome key '{}'", core_.id(), outcome_keys_.front());
    outcome_keys_.pop_front();
  }
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
  // The transfer plan: trainer rank 0 alone shuts the engine ranks down.
  const std::vector<std::string> none;
  const std::vector<std::string>& to = !coordinated_            ? targets_
                                       : core_.self().rank == 0 ? answers_from_
                                                                : none;
  REFIT_RETURN_IF_ERROR(send_to_each(core_.mailbox(), coordinated_ ? engine_relays_ : targets_,
                                     kShutdown, encode(ShutdownMessage{})));
  REFIT_ASSIGN_OR_RETURN(const std::vector<Message> left,
                         inbox_.collect(kLeaving, to, core_.timeout(), "engine exits"));
  for (const Message& m : left) REFIT_RETURN_IF_ERROR(decode_leaving(m.payload, m.from).status());
  return Status::Ok();
}

}  // namespace refit
