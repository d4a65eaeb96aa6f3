#include "runtime/engine_protocol.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <map>

#include "common/log.h"
#include "common/timer.h"
#include "runtime/relay.h"

namespace refit {
namespace {

using enum MessageType;

}  // namespace

EngineRefitProtocol::EngineRefitProtocol(RankCore& core, EngineExecutor& executor,
                                         EngineWeights& weights)
    : core_(core),
      executor_(executor),
      weights_(weights),
      inbox_(core.mailbox(), core.config().generation.tp_size),
      feeders_(mailbox_ids(executor.feeders())) {
  if (!executor.pause_handshake()) {
    control_ = feeders_;
    return;
  }
  const RankId self = core.self();
  const bool relayed = relay::engines_relayed(self.tp_size);
  control_ = {relayed && self.tp_rank() != 0 ? relay::engine_relay(self).mailbox()
                                             : RankId::trainer(0).mailbox()};
  relayed_ = mailbox_ids(relay::relayed_peers(self));
}

Result<std::vector<Message>> EngineRefitProtocol::hear(
    MessageType type, std::chrono::milliseconds timeout, std::string_view what,
    const std::function<Status(const Message&)>& check) {
  return inbox_.collect(type, control_, timeout, what, {}, [&](const Message& m) -> Status {
    if (check) REFIT_RETURN_IF_ERROR(check(m));
    return forward(m);
  });
}

Status EngineRefitProtocol::forward(const Message& m) {
  return send_to_each(core_.mailbox(), relayed_, m.type, m.payload);
}

Status EngineRefitProtocol::reply(const std::vector<std::string>& to, MessageType type,
                                  const std::string& payload, std::chrono::milliseconds timeout,
                                  std::initializer_list<MessageType> later) {
  if (relayed_.empty()) return send_to_each(core_.mailbox(), to, type, payload);
  REFIT_ASSIGN_OR_RETURN(
      std::vector<Message> answers,
      inbox_.collect(type, relayed_, timeout,
                     fmt::format("the {} of its TP peers", message_type_name(type)), later));
  answers.insert(answers.begin(),
                 Message{.type = type, .from = core_.self().mailbox(), .payload = payload});
  for (const std::string& t : to) REFIT_RETURN_IF_ERROR(send_relayed(core_.mailbox(), t, answers));
  return Status::Ok();
}

// This rank's own failure as it travels: its error without its name, which the record carries.
FailureOrigin EngineRefitProtocol::mine(const Status& st) const {
  const std::string own = core_.id() + ": ";
  const std::string& m = st.message();
  return FailureOrigin{.rank = core_.self(),
                       .code = st.code(),
                       .kind = st.kind(),
                       .error = m.rfind(own, 0) == 0 ? m.substr(own.size()) : m};
}

Status EngineRefitProtocol::announce(HelloMessage hello) {
  // Each feeder's hello carries this rank's digest of that pair's routes (transfer plan).
  for (std::size_t i = 0; i < feeders_.size(); ++i) {
    HelloMessage h = hello;
    h.routes_digest = executor_.routes_digest(i);
    core_.probe().before_hello(h);
    REFIT_RETURN_IF_ERROR(core_.mailbox().send(feeders_[i], kHello, encode(h)));
  }
  if (!executor_.wants_routes()) return Status::Ok();
  // Trainer rank 0's first begin may overtake another feeder's routes: it is kept.
  REFIT_ASSIGN_OR_RETURN(
      const std::vector<Message> got,
      inbox_.collect(kRoutes, feeders_, core_.timeout(), "the feeders' route metadata", {kBegin}));
  std::vector<RoutesMessage> routes;
  for (const Message& m : got) {
    REFIT_ASSIGN_OR_RETURN(RoutesMessage r, decode_routes(m.payload, m.from));
    routes.push_back(std::move(r));
  }
  return executor_.take_routes(routes);
}

// Between refits the wait has no bound but the trainer's life: the mailbox's liveness check
// (every 500 ms) ends it when the store's host is gone or any rank recorded a failure.
// refit.timeout_s bounds each step of a refit in flight, not the gap between refits, which lasts
// a rollout and a training step. With a stop flag the wait is cut into kStopPoll slices.
Result<EngineRefitProtocol::Served> EngineRefitProtocol::serve_one(
    std::optional<std::chrono::milliseconds> wait, std::atomic<bool>* stop) {
  using Clock = std::chrono::steady_clock;
  const bool bounded = wait.has_value();
  const Clock::time_point until = bounded ? Clock::now() + *wait : Clock::time_point::max();
  Clock::time_point quiet_until = Clock::now() + core_.timeout();  // the next "no refit" line
  // One wait of at most refit.timeout_s, or what is left of the caller's bound; at most
  // kStopPoll when a stop may come.
  auto next_wait = [&]() -> std::chrono::milliseconds {
    std::chrono::milliseconds w = core_.timeout();
    if (bounded) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
      w = std::clamp(left, std::chrono::milliseconds(0), w);
    }
    return stop != nullptr ? std::min(w, kStopPoll) : w;
  };
  const auto stop_requested = [stop] { return stop != nullptr && stop->exchange(false); };
  if (stop_requested()) return Served{.stopped = true};
  Result<Message> msg = inbox_.next({kBegin, kShutdown}, next_wait(), "the next refit");
  while (!msg.ok()) {
    if (msg.status().code() == StatusCode::kTimeout) {
      if (stop_requested()) return Served{.stopped = true};
      if (bounded && Clock::now() >= until)
        return Served{.refit = Status::Timeout(
                          fmt::format("{}: no refit began within {:.3f} s (serve_one's "
                                      "timeout); the weights and the session are unchanged",
                                      core_.id(), wait->count() / 1000.0))};
      if (Clock::now() >= quiet_until) {
        log::debug("{}: no refit for {} s; the trainer is alive, waiting on", core_.id(),
                   core_.config().refit.timeout_s);
        quiet_until = Clock::now() + core_.timeout();
      }
    } else if (executor_.can_recover() && core_.behind()) {
      REFIT_RETURN_IF_ERROR(catch_up());
    } else {
      break;
    }
    msg = inbox_.next({kBegin, kShutdown}, next_wait(), "the next refit");
  }
  if (!msg.ok())
    return msg.status().with_context(
        fmt::format("{} waiting for the next refit from {}", core_.id(), control_.front()));
  if (msg->type == kShutdown) {
    REFIT_RETURN_IF_ERROR(shutdown(*msg));
    return Served{.shutdown = true};
  }
  return serve_refit(*msg);
}

// Every control peer sends a shutdown and waits for this rank's answer before it leaves.
Status EngineRefitProtocol::shutdown(const Message& first) {
  REFIT_RETURN_IF_ERROR(decode_shutdown(first.payload, first.from).status());
  REFIT_RETURN_IF_ERROR(forward(first));
  std::vector<std::string> others;
  for (const std::string& f : control_)
    if (f != first.from) others.push_back(f);
  if (others.size() == control_.size())
    return Status::Internal(fmt::format("{}: unexpected shutdown from {}", core_.id(), first.from));
  // Before the first leaving: trainer rank 0 reads the record once every engine rank left.
  REFIT_RETURN_IF_ERROR(core_.publish_control_traffic());
  REFIT_RETURN_IF_ERROR(reply({first.from}, kLeaving, encode(LeavingMessage{}), core_.timeout()));
  // The other feeders' shutdowns arrive in any order; every feeder sent its own before waiting
  // for any answer, so collecting them all first cannot stall one.
  REFIT_ASSIGN_OR_RETURN(const std::vector<Message> rest,
                         inbox_.collect(kShutdown, others, core_.timeout(), "the shutdown"));
  for (const Message& m : rest) {
    REFIT_RETURN_IF_ERROR(decode_shutdown(m.payload, m.from).status());
    REFIT_RETURN_IF_ERROR(core_.mailbox().send(m.from, kLeaving, encode(LeavingMessage{})));
  }
  core_.leave();
  return Status::Ok();
}

Result<EngineRefitProtocol::Served> EngineRefitProtocol::serve_refit(const Message& first) {
  const RankCore::RefitScope counted = core_.refit_scope();
  REFIT_ASSIGN_OR_RETURN(begin_, decode_begin(first.payload, first.from));
  weights_.refit_begins();
  if (std::find(control_.begin(), control_.end(), first.from) == control_.end())
    return Status::Internal(
        fmt::format("{}: begin of refit step {} from {}, which does not lead it", core_.id(),
                    begin_.step, first.from));
  REFIT_RETURN_IF_ERROR(forward(first));  // a relay: to its TP peers
  Timer t;
  Status refit_failure;
  Status st = run_refit(first.from, refit_failure);
  if (!st.ok()) {
    std::optional<Status> in_flight = failed_in_flight(st);
    if (!in_flight) return st;
    REFIT_RETURN_IF_ERROR(reform());
    refit_failure = *in_flight;
  }
  phase_ = Phase::kIdle;
  inbox_.clear();
  stats_.seconds = t.seconds();
  stats_.pause_s = begin_.raw ? 0 : weights_.pause_seconds();  // also of a refit that failed
  return Served{.refit = refit_failure};
}

// One refit, from its first begin: every feeder begins, this rank pauses (the transfer plan:
// answers every trainer rank and waits for every feeder's proceed), the executor receives every
// byte, every feeder commits, then finish(). A refit the trainer ranks aborted before any byte
// landed (this or another engine rank refused it) fails the refit, not the session.
Status EngineRefitProtocol::run_refit(const std::string& first_from, Status& refit_failure) {
  const int step = begin_.step;
  const bool raw = begin_.raw;
  const auto timeout = core_.timeout();
  std::vector<std::string> others;
  for (const std::string& f : control_)
    if (f != first_from) others.push_back(f);
  REFIT_RETURN_IF_ERROR(
      inbox_
          .collect(kBegin, others, timeout, "begins", {},
                   [&](const Message& m) -> Status {
                     REFIT_ASSIGN_OR_RETURN(BeginMessage b, decode_begin(m.payload, m.from));
                     if (b.step != step || b.raw != raw)
                       return Status::Corruption(fmt::format(
                           "{}: {} began step {}{}, {} began step {}{}", core_.id(), first_from,
                           step, raw ? " (raw)" : "", m.from, b.step, b.raw ? " (raw)" : ""));
                     return Status::Ok();
                   })
          .status());
  phase_ = Phase::kBegun;
  log::debug("{}: refit step {} began", core_.id(), step);

  if (executor_.pause_handshake()) {
    // Pause (the hook may refuse), answer, and write nothing before every feeder said to
    // proceed: each trainer rank decides once every engine rank answered it.
    // refit.staged: admitted, not paused; generation goes on while the bytes land.
    const bool staged = weights_.staged();
    const std::optional<std::string> held_version = weights_.base();
    const Status paused = raw      ? Status::Ok()
                          : staged ? weights_.admit(step, begin_.version)
                                   : weights_.pause(step, begin_.version);
    const ExportedParams* exported = nullptr;
    PausedMessage answer{.step = step};
    if (paused.ok()) {
      REFIT_ASSIGN_OR_RETURN(landing_, weights_.landing(core_.run_id()));
      exported = weights_.exported();
      REFIT_RETURN_IF_ERROR(executor_.prepare(exported != nullptr));
      // refit.delta: the bases this rank holds, offered per feeder; each trainer rank decides.
      executor_.offer_delta(begin_, held_version, answer);
    }
    // To trainer rank 0, which decides for every trainer rank. The export itself goes to the
    // store, once per digest; the answer carries the digest, and each feeder that does not hold
    // that export reads it from there.
    if (!paused.ok()) answer.refused = mine(paused);
    if (exported) {
      if (exported->digest != published_export_) {
        REFIT_RETURN_IF_ERROR(core_.store().set(
            export_key(core_.self().mailbox(), exported->digest),
            encode(PausedMessage{.step = step, .direct = *exported, .refused = std::nullopt})));
        // The export before it (up to megabytes of handles) was read, if at all, in the refit it
        // was answered in; every trainer rank finished that refit before this begin.
        if (!published_export_.empty())
          REFIT_RETURN_IF_ERROR(
              core_.store().erase(export_key(core_.self().mailbox(), published_export_)));
        published_export_ = exported->digest;
      }
      answer.direct = ExportedParams{.digest = exported->digest, .elided = true};
    }
    // A relay answers once its TP peers did, waiting as long as trainer rank 0 waits for it.
    REFIT_RETURN_IF_ERROR(
        reply(control_, kPaused, encode(answer), timeout * 2 + std::chrono::seconds(5)));
    phase_ = Phase::kPaused;
    log::debug("{}: paused for refit step {} and answered", core_.id(), step);
    // The wait is bounded by 3 x the timeout + 5 s: longer than trainer rank 0 waits for every
    // engine rank's answer (2 x the timeout + 5 s).
    std::optional<FailureOrigin> refused;
    REFIT_RETURN_IF_ERROR(hear(kProceed, timeout * 3 + std::chrono::seconds(5),
                               fmt::format("the proceed of refit step {}", step),
                               [&](const Message& m) -> Status {
                                 REFIT_ASSIGN_OR_RETURN(ProceedMessage p,
                                                        decode_proceed(m.payload, m.from));
                                 REFIT_RETURN_IF_ERROR(check_step(core_.id(), m.from,
                                                                  "the proceed", p.step, step));
                                 if (p.refused && !refused) refused = p.refused;
                                 return Status::Ok();
                               })
                              .status());
    if (refused) {
      if (!raw)
        weights_.abandon(step, paused.ok() && !staged,
                         refused->rank.name() + ": " + refused->error);
      refit_failure = Status::Aborted(fmt::format("refit step {} was aborted before any byte "
                                                  "landed: {}: {}",
                                                  step, refused->rank.name(), refused->error))
                          .with_origin(*refused);
      return reply(control_, kAbortHeard, encode(AbortHeardMessage{.step = step}), timeout);
    }
    if (!paused.ok())
      return Status::Internal(
          fmt::format("{}: refit step {} proceeded although "
                      "this rank refused it: {}",
                      core_.id(), step, paused.message()));
  } else {
    // Gather: no answer to wait for; a pause that fails ends the session.
    if (!raw) REFIT_RETURN_IF_ERROR(weights_.pause(step, begin_.version));
    landing_ = &weights_.params();
  }
  phase_ = Phase::kProceeding;
  log::debug("{}: refit step {} proceeds", core_.id(), step);
  weights_.landing_begins(raw);
  REFIT_RETURN_IF_ERROR(executor_.receive(begin_, landing_->ptrs()));
  REFIT_RETURN_IF_ERROR(hear(kCommit, timeout, "the commit", [&](const Message& m) -> Status {
                          REFIT_ASSIGN_OR_RETURN(CommitMessage c, decode_commit(m.payload, m.from));
                          return check_step(core_.id(), m.from, "the commit", c.step, step);
                        }).status());
  phase_ = Phase::kLanded;
  log::debug("{}: refit step {} committed", core_.id(), step);
  if (!raw) core_.probe().before_commit(step);
  traffic_ = executor_.traffic();
  // Every peer feeder has mapped the exported memory by now: its name may go.
  if (traffic_.peer_pairs > 0) weights_.release_export_name();
  return finish(refit_failure);
}

// After every byte of a refit landed and every feeder committed: acknowledge (with
// refit.checksum, each feeder gets this rank's checksum of its bytes), then — with checksums or
// verification — run the verification hook and publish only on the trainer ranks' agreed
// outcome, so that no engine rank publishes while another's bytes failed. A failed outcome fails
// the refit, not the session: rollback (refit.keep_previous), or the weights stay invalid and
// generation paused.
Status EngineRefitProtocol::finish(Status& refit_failure) {
  const Config& cfg = core_.config();
  const int step = begin_.step;
  const bool raw = begin_.raw;
  const bool checksums = !raw && cfg.refit.checksum && executor_.checksums();
  // refit.staged: every engine rank of the refit applies, or the refit fails on every one.
  const bool staged = weights_.staged();
  const bool agreed = !raw && (begin_.verify || checksums || staged);
  // With the transfer plan, trainer rank 0 compares the sums; without it, each feeder its own.
  std::map<std::string, std::string> landed;  // per feeder, without the transfer plan
  std::optional<PairSums> landed_sums;        // with it
  if (checksums) {
    const bool plan = executor_.pause_handshake();
    if (plan) landed_sums.emplace();
    for (std::size_t i = 0; i < feeders_.size(); ++i) {
      REFIT_ASSIGN_OR_RETURN(const std::uint64_t sum, executor_.checksum_from(i, landing_->ptrs()));
      if (plan)
        landed_sums->add(sum, executor_.feeders()[i].rank);
      else
        landed[feeders_[i]] = fmt::format("{:016x}", sum);
    }
  }
  // A bench's bare pass copies the staging area in without hooks.
  if (staged && raw) REFIT_RETURN_IF_ERROR(weights_.copy_staged());
  // Every byte landed: the engine's load_weights takes them before anything is published or
  // verified. Its failure ends the session (the engine's weights are torn). Staged: at the apply.
  if (!raw && !staged) REFIT_RETURN_IF_ERROR(weights_.landed(step));
  REFIT_RETURN_IF_ERROR(traffic_publisher_.publish(core_.store(), traffic_));
  if (!raw && !agreed) weights_.publish(step, begin_.version);
  stats_.apply_s = executor_.apply_seconds();
  stats_.pause_s = raw ? 0 : weights_.pause_seconds();
  stats_.bytes = traffic_.bytes_received;
  stats_.checksums_matched = 0;
  // A TP peer's verdict may overtake another's acknowledgement on a relay: it is kept.
  REFIT_RETURN_IF_ERROR(reply(control_, kCommitted,
                              encode(CommittedMessage{.step = step,
                                                      .apply_s = stats_.apply_s,
                                                      .pause_s = stats_.pause_s,
                                                      .checksums = encode_pair_checksums(landed),
                                                      .checksum_sums = landed_sums}),
                              core_.timeout(), {kVerified}));
  phase_ = Phase::kCommitted;
  log::debug("{}: acknowledged the commit of refit step {}", core_.id(), step);
  if (!agreed) return Status::Ok();
  // refit.staged: generation pauses only now, to copy the staging area into the parameters. That
  // lies inside the trainers' wait for the verdicts (4 x refit.timeout_s), past a pause hook's own
  // bound. A refit that already failed in flight elsewhere leaves them as they are. A pause hook
  // that refuses is this rank's verdict: the refit fails on every rank, the parameters here
  // unchanged.
  Status refused;
  if (staged) {
    if (core_.behind())
      return Status::Aborted(fmt::format(
          "{}: refit step {} failed in flight on another rank before this rank applied it; its "
          "parameters keep weight version '{}'",
          core_.id(), step, weights_.version().label()));
    REFIT_RETURN_IF_ERROR(weights_.apply_staged(
        step, begin_.version,
        [this](const std::vector<void*>& params) { return executor_.replay_deltas(params); },
        refused));
    if (refused.ok()) REFIT_RETURN_IF_ERROR(weights_.landed(step));
  }
  Status v = refused;
  if (begin_.verify || staged) {
    if (v.ok() && begin_.verify) {
      v = weights_.verify(step, begin_.version);
      // A verify hook that is missing is a setup problem (kSetup); any other failure is the
      // verification's own.
      if (!v.ok() && v.kind() != FailureKind::kSetup) v = v.with_kind(FailureKind::kVerification);
    }
    VerifiedMessage verdict{.step = step};
    if (!v.ok()) verdict.failed = mine(v);
    REFIT_RETURN_IF_ERROR(reply(control_, kVerified, encode(verdict), core_.timeout() * 4));
  }
  // Every control peer sends the same outcome; it waits for every engine's verification.
  std::optional<FailureOrigin> failed;
  REFIT_RETURN_IF_ERROR(
      hear(kOutcome, core_.timeout() * 5, "the outcome", [&](const Message& m) -> Status {
        REFIT_ASSIGN_OR_RETURN(OutcomeMessage o, decode_outcome(m.payload, m.from));
        REFIT_RETURN_IF_ERROR(check_step(core_.id(), m.from, "the outcome", o.step, step));
        if (o.failed && !failed) failed = o.failed;
        return Status::Ok();
      }).status());
  if (!failed && v.ok()) {
    if (checksums) {
      stats_.checksums_matched = static_cast<int>(feeders_.size());
      log::debug("{}: refit.checksum: step {} arrived intact from {} feeder(s)", core_.id(), step,
                 feeders_.size());
    }
    weights_.publish(step, begin_.version);
  } else {
    const Status why = !v.ok()
                           ? v
                           : Status::Corruption(fmt::format("refit step {} failed: {}: {}", step,
                                                            failed->rank.name(), failed->error))
                                 .with_origin(*failed);
    // A rank whose pause hook refused the staged apply holds its version still.
    refit_failure = refused.ok() ? weights_.fail(step, why) : why;
    executor_.refit_failed();
  }
  stats_.pause_s = weights_.pause_seconds();
  // Acknowledged to every control peer, which waits for it before its next message: one that ran
  // ahead (its next begin, or the shutdown) cannot overtake another one's outcome.
  return reply(control_, kOutcomeHeard,
               encode(OutcomeHeardMessage{.step = step,
                                          .valid = weights_.version().valid(),
                                          .weight_version = weights_.version().label(),
                                          .pause_s = stats_.pause_s}),
               core_.timeout());
}

std::optional<Status> EngineRefitProtocol::failed_in_flight(const Status& failure) {
  if (!executor_.can_recover()) return std::nullopt;
  const Phase was = phase_;
  const std::optional<FailureOrigin> cause = core_.settle_in_flight(begin_.step, failure);
  if (!cause) return std::nullopt;
  phase_ = Phase::kIdle;
  const Status failed = refit::failed_in_flight(begin_.step, begin_.version, *cause);
  if (!weights_.version().valid() && (was == Phase::kBegun || was == Phase::kPaused)) {
    // No feeder proceeded, so no byte landed: the weights are the previous version's, and
    // generation resumes on them (a late serve_one, a generation that outlasted the trainer's
    // wait for the pause).
    weights_.abandon(begin_.step, /*paused=*/was == Phase::kPaused && !weights_.staged(),
                     failed.message());
  } else if (!weights_.version().valid() && was != Phase::kIdle) {
    // Bytes may have landed. A feeder that writes in place may still be writing (stalled, it has
    // not seen the failure yet): no rollback then, the weights stay invalid and generation paused
    // until a refit succeeds, which that feeder takes part in only after it stopped.
    if (executor_.traffic().peer_pairs > 0 && !weights_.staged())
      weights_.forget_kept("after a refit that failed in flight while feeders wrote in place");
    (void)weights_.fail(begin_.step, failed);
  }
  return failed;
}

// After a refit failed in flight: the point-to-point group of the new refit epoch (every rank
// forms it now), and the executor's apply thread drained onto it.
Status EngineRefitProtocol::reform() {
  return core_.reform_groups(
      [this](Communicator* p2p) { return executor_.recover(p2p, core_.timeout()); });
}

// Between refits: the last refit failed in flight on other ranks after this rank published its
// part (its weights are complete), or a peer already moved to the next refit epoch. This rank
// moves on too.
Status EngineRefitProtocol::catch_up() {
  log::warn(
      "{}: the refit of epoch {} failed in flight on another rank after this rank published "
      "weight version '{}' (its bytes are complete); forming the groups anew",
      core_.id(), core_.epochs().current(), weights_.version().label());
  core_.advance_epoch();
  inbox_.clear();
  return reform();
}

void EngineRefitProtocol::roll_back_at_the_end(const Status& why) {
  if (phase_ == Phase::kIdle) return;
  phase_ = Phase::kIdle;
  if (weights_.version().valid() || !weights_.has_kept()) return;
  if (executor_.traffic().peer_pairs > 0 && !weights_.staged()) {
    log::warn(
        "{}: refit.keep_previous: no rollback at the end of the session: feeders wrote in "
        "place in refit step {}",
        core_.id(), begin_.step);
    return;
  }
  (void)weights_.fail(begin_.step, why);
}

}  // namespace refit
