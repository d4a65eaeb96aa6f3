// The two sides' state machines (runtime/trainer_protocol.h, runtime/engine_protocol.h) in one
// process: a trainer rank and an engine rank on threads, with the real store, mailboxes, Gloo and
// CPU data plane handed in through their services (runtime/rank_core.h). Each test drives a
// refit through one path — publish, rollback, a refusal before any byte moved, a refit that fails
// in flight and the epoch that follows — and checks the engine's version state, its bytes and the
// messages each side sent, counted by a mailbox wrapped through the factory.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "common/convert.h"
#include "control/mailbox.h"
#include "control/ports.h"
#include "runtime/create.h"

namespace refit {
namespace {

using namespace std::chrono_literals;

// Messages a rank sent, by type: the mailbox the runtime got from its factory, counted.
struct SentCounts {
  std::mutex mu;
  std::map<MessageType, int> by_type;
  int of(MessageType t) {
    std::lock_guard<std::mutex> lock(mu);
    return by_type[t];
  }
  void reset() {
    std::lock_guard<std::mutex> lock(mu);
    by_type.clear();
  }
};

class CountingMailbox final : public Mailbox {
 public:
  CountingMailbox(std::unique_ptr<Mailbox> inner, SentCounts& counts)
      : inner_(std::move(inner)), counts_(counts) {}
  std::int64_t dropped() const override { return inner_->dropped(); }
  std::int64_t lane_messages() const override { return inner_->lane_messages(); }
  std::int64_t sent() const override { return inner_->sent(); }
  const std::string& id() const override { return inner_->id(); }
  Status send(const std::string& to, MessageType type, const std::string& payload) override {
    {
      std::lock_guard<std::mutex> lock(counts_.mu);
      ++counts_.by_type[type];
    }
    return inner_->send(to, type, payload);
  }
  Result<Message> receive(std::chrono::milliseconds timeout) override {
    return inner_->receive(timeout);
  }
  void set_epoch(std::uint32_t epoch) override { inner_->set_epoch(epoch); }
  std::uint32_t epoch() const override { return inner_->epoch(); }
  std::uint32_t kept_epoch() const override { return inner_->kept_epoch(); }
  void set_liveness_check(std::function<Status()> check,
                          std::chrono::milliseconds interval) override {
    inner_->set_liveness_check(std::move(check), interval);
  }

 private:
  std::unique_ptr<Mailbox> inner_;
  SentCounts& counts_;
};

// Stalls the engine before its commit answer in one step (alive: its heartbeat goes on), so that
// the trainer's wait times out with every rank alive: a refit that fails in flight.
class StallBeforeCommit final : public RefitProbe {
 public:
  StallBeforeCommit(int step, std::chrono::milliseconds how_long) : step_(step), for_(how_long) {}
  void before_commit(int step) override {
    if (step != step_) return;
    ++stalls;
    std::this_thread::sleep_for(for_);
  }
  std::atomic<int> stalls{0};

 private:
  const int step_;
  const std::chrono::milliseconds for_;
};

RankServices counted(SentCounts& counts, std::shared_ptr<RefitProbe> probe = nullptr) {
  auto services = default_services();
  EXPECT_TRUE(services.ok()) << services.status().to_string();
  RankServices s = std::move(services).value();
  auto open = s.open_mailbox;
  s.open_mailbox = [open, &counts](Store& store,
                                   MailboxOptions options) -> Result<std::unique_ptr<Mailbox>> {
    REFIT_ASSIGN_OR_RETURN(auto inner, open(store, std::move(options)));
    return std::unique_ptr<Mailbox>(std::make_unique<CountingMailbox>(std::move(inner), counts));
  };
  s.probe = std::move(probe);
  return s;
}

// One trainer rank and one engine rank (TP 1) of tiny-qwen3 in layout hf on the CPU: the engine's
// parameters are the HF tensors, so each holds bf16(trainer's shard) after a refit.
struct Pair {
  Config cfg;
  Endpoint ep;
  SentCounts trainer_sent, engine_sent;
  std::unique_ptr<Trainer> trainer;
  std::unique_ptr<Engine> engine;
  std::vector<std::vector<float>> shards;
  std::vector<std::vector<std::uint16_t>> params;

  explicit Pair(std::function<void(Config&)> adjust = {},
                std::shared_ptr<RefitProbe> engine_probe = nullptr) {
    cfg.model = "tiny-qwen3";
    cfg.policy.world_size = 1;
    cfg.generation.tp_size = 1;
    cfg.generation.layout = EngineLayout::kHf;
    cfg.refit.timeout_s = 3;
    if (adjust) adjust(cfg);
    auto port = pick_free_port();
    EXPECT_TRUE(port.ok());
    ep.master_port = *port;
    auto t = std::async(std::launch::async, [&] {
      return create_trainer(cfg, 0, ep, counted(trainer_sent));
    });
    auto e = create_engine(cfg, 0, ep, counted(engine_sent, std::move(engine_probe)));
    auto tr = t.get();
    EXPECT_TRUE(tr.ok()) << tr.status().to_string();
    EXPECT_TRUE(e.ok()) << e.status().to_string();
    if (!tr.ok() || !e.ok()) return;
    trainer = std::move(tr).value();
    engine = std::move(e).value();
    for (const TensorSlot& s : trainer->tensors()) {
      shards.emplace_back(static_cast<std::size_t>(s.numel()));
      EXPECT_TRUE(trainer->register_tensor(s.name, shards.back().data(), s.dtype, s.shape).ok());
    }
    for (const TensorSlot& s : engine->params()) {
      params.emplace_back(static_cast<std::size_t>(s.numel()));
      EXPECT_TRUE(engine->register_param(s.name, params.back().data(), s.dtype, s.shape).ok());
    }
  }

  bool ok() const { return trainer && engine; }
  // The "training step": every element of every shard a function of the step.
  void train(int step) {
    for (std::size_t t = 0; t < shards.size(); ++t)
      for (std::size_t i = 0; i < shards[t].size(); ++i)
        shards[t][i] = static_cast<float>(step) + static_cast<float>((i * 7 + t) % 97) / 128.0f;
  }
  // Whether every engine parameter holds bf16 of the shards of `step`.
  bool holds(int step) const {
    for (std::size_t t = 0; t < params.size(); ++t)
      for (std::size_t i = 0; i < params[t].size(); ++i) {
        const float want = static_cast<float>(step) + static_cast<float>((i * 7 + t) % 97) / 128.0f;
        if (params[t][i] != f32_to_bf16(want)) return false;
      }
    return true;
  }
  // One refit: the engine serves it on a thread while the trainer runs it here.
  std::pair<Status, Result<bool>> refit(int step, bool verify) {
    auto served = std::async(std::launch::async, [this] { return engine->serve_one(); });
    Status st = trainer->refit(step, std::to_string(step), verify);
    return {st, served.get()};
  }
  // A training step and a refit that publishes its weights: both sides succeed, and the engine
  // holds them under the step's label.
  void refit_publishes(int step, bool verify) {
    train(step);
    auto [st, served] = refit(step, verify);
    ASSERT_TRUE(st.ok()) << st.to_string();
    ASSERT_TRUE(served.ok()) << served.status().to_string();
    EXPECT_EQ(engine->weight_version(), std::to_string(step));
    EXPECT_TRUE(holds(step));
  }
  // The engine's pause hook refuses ("generation cannot pause now") while `refuse` is set.
  void pause_refused_while(const bool& refuse) {
    engine->on_pause([&refuse]() -> Status {
      return refuse ? Status::Unsupported("generation cannot pause now") : Status::Ok();
    });
  }
  void shutdown() {
    auto served = std::async(std::launch::async, [this] { return engine->serve_one(); });
    EXPECT_TRUE(trainer->shutdown().ok());
    auto s = served.get();
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    EXPECT_FALSE(*s) << "the shutdown is not a refit";
  }
};

TEST(RuntimeInProcess, PublishesAndCountsEachPhaseMessage) {
  Pair p;
  ASSERT_TRUE(p.ok());
  int verified = 0;
  p.engine->on_verify([&](int step, const std::string& version) {
    ++verified;
    EXPECT_EQ(version, std::to_string(step));
    return p.holds(step) ? Status::Ok() : Status::Corruption("not the trainer's bytes");
  });
  EXPECT_EQ(p.engine->weight_version(), "0");
  p.trainer_sent.reset();
  p.engine_sent.reset();
  p.train(1);
  auto [st, served] = p.refit(1, /*verify=*/true);
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_TRUE(served.ok()) << served.status().to_string();
  EXPECT_TRUE(*served);
  EXPECT_EQ(verified, 1);
  EXPECT_EQ(p.engine->weight_version(), "1");
  EXPECT_TRUE(p.engine->is_valid());
  EXPECT_TRUE(p.holds(1));
  EXPECT_GT(p.engine->last_stats().bytes, 0);
  EXPECT_EQ(p.engine->last_stats().bytes, p.trainer->bytes_per_refit());
  // The trainer's side: begin, proceed, commit and outcome to its one target.
  EXPECT_EQ(p.trainer_sent.of(MessageType::kBegin), 1);
  EXPECT_EQ(p.trainer_sent.of(MessageType::kProceed), 1);
  EXPECT_EQ(p.trainer_sent.of(MessageType::kCommit), 1);
  EXPECT_EQ(p.trainer_sent.of(MessageType::kOutcome), 1);
  EXPECT_EQ(p.trainer_sent.of(MessageType::kAbortHeard), 0);
  // The engine's: paused to every trainer rank, committed, verified and outcome-heard.
  EXPECT_EQ(p.engine_sent.of(MessageType::kPaused), 1);
  EXPECT_EQ(p.engine_sent.of(MessageType::kCommitted), 1);
  EXPECT_EQ(p.engine_sent.of(MessageType::kVerified), 1);
  EXPECT_EQ(p.engine_sent.of(MessageType::kOutcomeHeard), 1);
  EXPECT_EQ(p.engine_sent.of(MessageType::kAbortHeard), 0);

  // Without verification or checksums there is no outcome phase: published at the commit.
  p.trainer_sent.reset();
  p.engine_sent.reset();
  p.train(2);
  auto [st2, served2] = p.refit(2, /*verify=*/false);
  ASSERT_TRUE(st2.ok()) << st2.to_string();
  ASSERT_TRUE(served2.ok());
  EXPECT_EQ(p.engine->weight_version(), "2");
  EXPECT_TRUE(p.holds(2));
  EXPECT_EQ(p.trainer_sent.of(MessageType::kOutcome), 0);
  EXPECT_EQ(p.engine_sent.of(MessageType::kOutcomeHeard), 0);
  EXPECT_EQ(p.engine_sent.of(MessageType::kVerified), 0);
  p.shutdown();
  EXPECT_EQ(p.engine_sent.of(MessageType::kLeaving), 1);
}

TEST(RuntimeInProcess, FailedVerificationRollsBackBytesAndLabel) {
  Pair p([](Config& c) { c.refit.keep_previous = true; });
  ASSERT_TRUE(p.ok());
  int resumed = 0;
  p.engine->on_resume([&] { ++resumed; });
  p.engine->on_verify([](int step, const std::string&) {
    return step == 2 ? Status::Corruption("verify: step 2 is wrong") : Status::Ok();
  });
  p.refit_publishes(1, true);
  EXPECT_EQ(resumed, 1);
  p.train(2);
  auto [st, served] = p.refit(2, true);
  // The refit's failure on both sides, blamed on the engine rank; the session goes on.
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
  ASSERT_NE(st.origin(), nullptr);
  EXPECT_EQ(st.origin()->rank, RankId::engine(0, 1));
  EXPECT_NE(st.message().find("verify: step 2 is wrong"), std::string::npos) << st.message();
  EXPECT_EQ(st.kind(), FailureKind::kVerification) << failure_kind_name(st.kind());
  ASSERT_FALSE(served.ok());
  EXPECT_EQ(served.status().kind(), FailureKind::kVerification);
  EXPECT_TRUE(p.trainer->session_ok());
  EXPECT_TRUE(p.engine->session_ok());
  // Rolled back: step 1's bytes and label, generation resumed.
  EXPECT_EQ(p.engine->weight_version(), "1");
  EXPECT_TRUE(p.engine->is_valid());
  EXPECT_TRUE(p.holds(1));
  EXPECT_EQ(resumed, 2);
  // The next refit publishes normally.
  p.refit_publishes(3, true);
  p.shutdown();
}

TEST(RuntimeInProcess, RefusedPauseKeepsTheWeightsAndAbortsBeforeAnyByte) {
  Pair p;
  ASSERT_TRUE(p.ok());
  bool refuse = false;
  p.pause_refused_while(refuse);
  p.refit_publishes(1, false);
  refuse = true;
  p.trainer_sent.reset();
  p.engine_sent.reset();
  p.train(2);
  auto [st, served] = p.refit(2, false);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kAborted);
  ASSERT_NE(st.origin(), nullptr);
  EXPECT_EQ(st.origin()->rank, RankId::engine(0, 1));
  EXPECT_NE(st.message().find("generation cannot pause now"), std::string::npos) << st.message();
  EXPECT_FALSE(served.ok());
  // Nothing was written: step 1's weights under step 1's label.
  EXPECT_EQ(p.engine->weight_version(), "1");
  EXPECT_TRUE(p.engine->is_valid());
  EXPECT_TRUE(p.holds(1));
  EXPECT_EQ(p.trainer_sent.of(MessageType::kCommit), 0);
  EXPECT_EQ(p.engine_sent.of(MessageType::kAbortHeard), 1);
  EXPECT_EQ(p.engine_sent.of(MessageType::kCommitted), 0);
  refuse = false;
  p.train(3);
  ASSERT_TRUE(p.refit(3, false).first.ok());
  EXPECT_TRUE(p.holds(3));
  p.shutdown();
}

// The engine stalls before its commit answer for longer than the trainer waits: the refit fails
// in flight with every rank alive (the engine learns it waiting for the outcome), both move to
// the next refit epoch and form their groups anew, and the next refit runs in it.
TEST(RuntimeInProcess, RefitThatFailsInFlightMovesBothToTheNextEpoch) {
  auto stall = std::make_shared<StallBeforeCommit>(2, 7500ms);  // 2.5 x refit.timeout_s
  Pair p({}, stall);
  ASSERT_TRUE(p.ok());
  p.engine->on_verify([](int, const std::string&) { return Status::Ok(); });
  p.refit_publishes(1, true);
  p.train(2);
  auto [st, served] = p.refit(2, true);
  EXPECT_EQ(stall->stalls.load(), 1) << "the stall did not run";
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kAborted);
  EXPECT_NE(st.message().find("failed in flight"), std::string::npos) << st.message();
  EXPECT_NE(st.origin(), nullptr);
  EXPECT_TRUE(p.trainer->session_ok()) << st.to_string();
  ASSERT_FALSE(served.ok());
  EXPECT_NE(served.status().message().find("failed in flight"), std::string::npos)
      << served.status().message();
  EXPECT_TRUE(p.engine->session_ok()) << served.status().to_string();
  // Its bytes may have landed and nothing was published: invalid until a refit succeeds.
  EXPECT_FALSE(p.engine->is_valid());
  // The next refit runs in epoch 1 on the groups formed anew.
  p.refit_publishes(3, false);
  p.shutdown();
}

// Storage of one tensor that reaches into another's is refused on both sides, naming both; the
// refused registration leaves nothing behind.
TEST(RuntimeInProcess, OverlappingRegistrationsAreRefusedNamingBoth) {
  Pair p;
  ASSERT_TRUE(p.ok());
  const std::vector<TensorSlot>& params = p.engine->params();
  ASSERT_GE(params.size(), 2u);
  const TensorSlot &a = params[0], &b = params[1];
  ASSERT_EQ(a.dtype, b.dtype);
  std::vector<std::uint16_t> backing(static_cast<std::size_t>(a.numel() + b.numel()));
  ASSERT_TRUE(p.engine->register_param(a.name, backing.data(), a.dtype, a.shape).ok());
  // b starts on a's last element.
  Status st = p.engine->register_param(b.name, backing.data() + a.numel() - 1, b.dtype, b.shape);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.kind(), FailureKind::kSetup);
  EXPECT_NE(st.message().find("tensor " + b.name), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("overlaps tensor " + a.name), std::string::npos) << st.message();
  // Right after a's end it fits; so does registering a itself again over its own bytes.
  EXPECT_TRUE(p.engine->register_param(b.name, backing.data() + a.numel(), b.dtype, b.shape).ok());
  EXPECT_TRUE(p.engine->register_param(a.name, backing.data(), a.dtype, a.shape).ok());

  const std::vector<TensorSlot>& tensors = p.trainer->tensors();
  ASSERT_GE(tensors.size(), 2u);
  const TensorSlot &x = tensors[0], &y = tensors[1];
  Status tr = p.trainer->register_tensor(y.name, p.shards[0].data(), y.dtype, y.shape);
  ASSERT_FALSE(tr.ok());
  EXPECT_NE(tr.message().find("overlaps tensor " + x.name), std::string::npos) << tr.message();
  EXPECT_NE(tr.message().find("trainer rank 0"), std::string::npos) << tr.message();

  // Back to the pair's own storage: a refit is bit-exact.
  ASSERT_TRUE(p.engine->register_param(a.name, p.params[0].data(), a.dtype, a.shape).ok());
  ASSERT_TRUE(p.engine->register_param(b.name, p.params[1].data(), b.dtype, b.shape).ok());
  p.train(1);
  auto [ok, served] = p.refit(1, false);
  ASSERT_TRUE(ok.ok()) << ok.to_string();
  EXPECT_TRUE(p.holds(1));
  p.shutdown();
}

// refit.delta: an engine rank that registers a parameter anew between refits (its storage moved:
// a reallocation, a freshly loaded copy) holds no base of a delta any more. The next refit moves
// in full, so the new storage holds every element, also those no step changed.
TEST(RuntimeInProcess, ParameterRegisteredAnewMakesTheNextDeltaRefitFull) {
  Pair p([](Config& c) {
    c.refit.executor = Executor::kP2p;
    c.refit.delta = DeltaMode::kOn;
  });
  ASSERT_TRUE(p.ok());
  auto delta_pairs = [&p] {
    Result<std::vector<RankTraffic>> t = p.trainer->traffic();
    EXPECT_TRUE(t.ok()) << t.status().to_string();
    return t.ok() && !t->empty() ? (*t)[0].delta_pairs : -1;
  };
  p.refit_publishes(1, false);
  EXPECT_EQ(delta_pairs(), 0) << "the first refit moves in full";
  p.refit_publishes(2, false);
  EXPECT_EQ(delta_pairs(), 1) << "the second refit is a delta";

  // The first parameter moves to new storage that holds nothing of the old.
  const TensorSlot slot = p.engine->params()[0];
  std::vector<std::uint16_t> moved(p.params[0].size(), 0);
  ASSERT_TRUE(p.engine->register_param(slot.name, moved.data(), slot.dtype, slot.shape).ok());
  p.params[0].swap(moved);  // p.params[0] is the registered storage now; `moved` keeps the old

  // Step 3 trains nothing new: a delta would move no element and leave the new storage zero.
  p.train(2);
  auto [st, served] = p.refit(3, false);
  ASSERT_TRUE(st.ok()) << st.to_string();
  ASSERT_TRUE(served.ok()) << served.status().to_string();
  EXPECT_EQ(delta_pairs(), 0) << "the refit after the registration moves in full";
  EXPECT_TRUE(p.holds(2));
  p.shutdown();
}

// A version a refit already published is refused before any message, and the session goes on; a
// failed refit published nothing, so its retry may reuse its version.
TEST(RuntimeInProcess, AVersionAlreadyPublishedIsRefusedAndARetryMayReuseAFailedOne) {
  Pair p;
  ASSERT_TRUE(p.ok());
  int fail_once = 1;
  p.engine->on_verify([&](int step, const std::string&) {
    return step == 2 && fail_once-- > 0 ? Status::Corruption("step 2 fails once") : Status::Ok();
  });
  p.refit_publishes(1, false);
  p.trainer_sent.reset();
  Status again = p.trainer->refit(5, "1", false);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.kind(), FailureKind::kSetup);
  EXPECT_NE(again.message().find("weight version '1', which refit step 1 already published"),
            std::string::npos)
      << again.message();
  EXPECT_EQ(p.trainer_sent.of(MessageType::kBegin), 0) << "refused before any message";
  EXPECT_TRUE(p.trainer->session_ok());
  // Step 2 fails its verification once; its retry reuses version "2".
  p.train(2);
  auto [failed, served] = p.refit(2, true);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.kind(), FailureKind::kVerification);
  auto [retried, served2] = p.refit(2, true);
  ASSERT_TRUE(retried.ok()) << retried.to_string();
  EXPECT_EQ(p.engine->weight_version(), "2");
  p.shutdown();
}

// A label the engine rank published before (in an earlier session: note_published) at another
// step is refused in its pause answer, before the pause hook and before any byte, naming the
// label, both steps and the engine rank; the weights keep their version and the session goes on.
// The same step may reuse its label (the retry of a refit the trainer did not see succeed).
TEST(RuntimeInProcess, AVersionTheEngineAlreadyPublishedIsRefusedInItsPauseAnswer) {
  Pair p;
  ASSERT_TRUE(p.ok());
  int pauses = 0;
  p.engine->on_pause([&] { ++pauses; });
  p.refit_publishes(1, false);
  p.engine->note_published({{"old", 7}, {"1", 9}});  // "1" keeps the step that published it
  EXPECT_EQ(p.engine->published(), (std::map<std::string, int>{{"1", 1}, {"old", 7}}));
  pauses = 0;
  p.trainer_sent.reset();
  p.engine_sent.reset();
  p.train(2);
  auto served = std::async(std::launch::async, [&] { return p.engine->serve_one(); });
  Status st = p.trainer->refit(2, "old", false);
  Result<bool> engine_side = served.get();
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.kind(), FailureKind::kSetup) << st.to_string();
  ASSERT_NE(st.origin(), nullptr);
  EXPECT_EQ(st.origin()->rank, RankId::engine(0, 1));
  const std::string want =
      "refit step 2 would publish weight version 'old', which this engine rank already published "
      "at refit step 7 for other weights";
  EXPECT_NE(st.message().find("engine 0 tp rank 0 reported: " + want), std::string::npos)
      << st.message();
  ASSERT_FALSE(engine_side.ok());
  EXPECT_EQ(engine_side.status().kind(), FailureKind::kSetup);
  EXPECT_NE(engine_side.status().message().find("engine 0 tp rank 0: " + want), std::string::npos)
      << engine_side.status().message();
  EXPECT_TRUE(p.trainer->session_ok());
  EXPECT_TRUE(p.engine->session_ok());
  EXPECT_EQ(pauses, 0) << "refused before the pause hook";
  EXPECT_EQ(p.trainer_sent.of(MessageType::kCommit), 0);
  EXPECT_EQ(p.engine_sent.of(MessageType::kCommitted), 0);
  EXPECT_EQ(p.engine->weight_version(), "1");
  EXPECT_TRUE(p.engine->is_valid());
  EXPECT_TRUE(p.holds(1));
  // Step 7 may publish "old" again: same step, same label.
  p.train(7);
  served = std::async(std::launch::async, [&] { return p.engine->serve_one(); });
  ASSERT_TRUE(p.trainer->refit(7, "old", false).ok());
  ASSERT_TRUE(served.get().ok());
  EXPECT_EQ(p.engine->weight_version(), "old");
  EXPECT_TRUE(p.holds(7));
  EXPECT_EQ(pauses, 1);
  p.shutdown();
}

// serve_one with a bound: past it with no refit begun, a timeout and nothing changed.
TEST(RuntimeInProcess, ServeOneWithABoundTimesOutAndChangesNothing) {
  Pair p;
  ASSERT_TRUE(p.ok());
  Result<bool> waited = p.engine->serve_one(std::chrono::milliseconds(200));
  ASSERT_FALSE(waited.ok());
  EXPECT_EQ(waited.status().code(), StatusCode::kTimeout);
  EXPECT_EQ(waited.status().kind(), FailureKind::kTimeout);
  EXPECT_NE(waited.status().message().find("no refit began"), std::string::npos)
      << waited.status().message();
  EXPECT_TRUE(p.engine->session_ok());
  EXPECT_EQ(p.engine->weight_version(), "0");
  EXPECT_TRUE(p.engine->is_valid());
  // A refit begun while the engine waits with a bound is served.
  p.train(1);
  auto served = std::async(std::launch::async,
                           [&] { return p.engine->serve_one(std::chrono::milliseconds(30000)); });
  Status st = p.trainer->refit(1, "1", false);
  ASSERT_TRUE(st.ok()) << st.to_string();
  Result<bool> got = served.get();
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_TRUE(*got);
  EXPECT_TRUE(p.holds(1));
  p.shutdown();
}

// serve() on its own thread, stopped from another one between refits: it returns ok without a
// shutdown (no leaving sent), nothing changed, and the session serves the next refit.
TEST(RuntimeInProcess, RequestStopEndsServeBetweenRefitsAndTheSessionGoesOn) {
  Pair p;
  ASSERT_TRUE(p.ok());
  auto serving = std::async(std::launch::async, [&] { return p.engine->serve(); });
  p.train(1);
  Status st = p.trainer->refit(1, "1", false);  // serve() is in its loop: it served this one
  ASSERT_TRUE(st.ok()) << st.to_string();
  p.engine->request_stop();
  // A bound against a hang only (a serve() that ignored the stop waits for the shutdown).
  if (serving.wait_for(60s) != std::future_status::ready) {
    EXPECT_TRUE(p.trainer->shutdown().ok());
    FAIL() << "serve() did not return after request_stop()";
  }
  Status served = serving.get();
  ASSERT_TRUE(served.ok()) << served.to_string();
  EXPECT_EQ(p.engine_sent.of(MessageType::kLeaving), 0)
      << "it returned for the stop, not a shutdown";
  EXPECT_TRUE(p.engine->session_ok());
  EXPECT_EQ(p.engine->weight_version(), "1");
  EXPECT_TRUE(p.holds(1));
  // The request was used up: the next refit is served.
  p.train(2);
  auto [st2, served2] = p.refit(2, /*verify=*/false);
  ASSERT_TRUE(st2.ok()) << st2.to_string();
  ASSERT_TRUE(served2.ok()) << served2.status().to_string();
  EXPECT_TRUE(*served2);
  EXPECT_TRUE(p.holds(2));
  p.shutdown();
}

// A stop requested while a refit runs (here from its pause hook) lets that refit finish; serve()
// returns after it. One requested while nothing serves ends the next serve_one() before it waits.
TEST(RuntimeInProcess, RequestStopDuringARefitLetsItFinishFirst) {
  Pair p;
  ASSERT_TRUE(p.ok());
  int pauses = 0;
  p.engine->on_pause([&] {
    ++pauses;
    p.engine->request_stop();
    return Status::Ok();
  });
  auto serving = std::async(std::launch::async, [&] { return p.engine->serve(); });
  p.train(1);
  Status st = p.trainer->refit(1, "1", false);
  ASSERT_TRUE(st.ok()) << st.to_string();
  if (serving.wait_for(60s) != std::future_status::ready) {
    EXPECT_TRUE(p.trainer->shutdown().ok());
    FAIL() << "serve() did not return after the refit during which a stop was requested";
  }
  Status served = serving.get();
  ASSERT_TRUE(served.ok()) << served.to_string();
  EXPECT_EQ(pauses, 1);
  EXPECT_EQ(p.engine->weight_version(), "1");
  EXPECT_TRUE(p.engine->is_valid());
  EXPECT_TRUE(p.holds(1));
  EXPECT_EQ(p.engine_sent.of(MessageType::kLeaving), 0);
  p.engine->on_pause(nullptr);

  p.engine->request_stop();  // nothing serves now
  Result<bool> next = p.engine->serve_one();
  ASSERT_TRUE(next.ok()) << next.status().to_string();
  EXPECT_FALSE(*next);
  EXPECT_TRUE(p.engine->session_ok());
  EXPECT_EQ(p.engine->weight_version(), "1");
  p.shutdown();
}

// Calls `at_commit` on the engine's thread once every byte of a refit landed, before the engine
// answers the commit (and, with refit.staged, before it pauses to apply).
class AtCommit final : public RefitProbe {
 public:
  void before_commit(int step) override {
    if (at_commit) at_commit(step);
  }
  std::function<void(int)> at_commit;
};

// refit.staged: every byte of a refit lands in the staging area while the engine goes on
// generating on its old weights; generation pauses only once all of it landed, to copy it in.
void expect_staged_apply(bool peer) {
  auto probe = std::make_shared<AtCommit>();
  Pair p(
      [peer](Config& c) {
        c.refit.staged = true;
        // The staging area is exported memory, so that trainer ranks on this host write it by
        // peer access (what auto picks) even where the registered parameters are not: p2p is
        // asked for explicitly.
        c.refit.executor = peer ? Executor::kPeer : Executor::kP2p;
      },
      probe);
  ASSERT_TRUE(p.ok());
  int pauses = 0, resumes = 0, landed_unpaused = 0;
  p.engine->on_pause([&] {
    ++pauses;
    // Nothing of the refit reached the parameters before the pause (zeros before the first).
    if (pauses > 1) {
      EXPECT_TRUE(p.holds(pauses - 1)) << "refit " << pauses;
    }
  });
  p.engine->on_resume([&] { ++resumes; });
  probe->at_commit = [&](int step) {
    // Every byte of `step` landed: generation was not paused for it, and the parameters and
    // their version are the previous refit's.
    EXPECT_EQ(pauses, step - 1);
    EXPECT_EQ(p.engine->weight_version(), std::to_string(step - 1));
    if (step > 1) {
      EXPECT_TRUE(p.holds(step - 1));
    }
    ++landed_unpaused;
  };
  for (int step = 1; step <= 3; ++step) {
    SCOPED_TRACE(step);
    p.trainer_sent.reset();
    p.engine_sent.reset();
    p.train(step);
    auto [st, served] = p.refit(step, /*verify=*/false);
    ASSERT_TRUE(st.ok()) << st.to_string();
    ASSERT_TRUE(served.ok()) << served.status().to_string();
    EXPECT_EQ(landed_unpaused, step);
    EXPECT_EQ(pauses, step);
    EXPECT_EQ(resumes, step);
    EXPECT_EQ(p.engine->weight_version(), std::to_string(step));
    EXPECT_TRUE(p.holds(step));
    // Every engine rank applies or none does: a verdict and an outcome even without verification.
    EXPECT_EQ(p.engine_sent.of(MessageType::kVerified), 1);
    EXPECT_EQ(p.trainer_sent.of(MessageType::kOutcome), 1);
    // The pause lies inside the refit, on both sides.
    const double pause = p.engine->last_stats().pause_s;
    EXPECT_GT(pause, 0);
    EXPECT_EQ(p.trainer->last_stats().pause_s, pause);
    EXPECT_LT(pause, p.trainer->last_stats().seconds);
  }
  const std::vector<RankTraffic> traffic = p.trainer->traffic().value();
  ASSERT_EQ(traffic.size(), 2U);
  EXPECT_EQ(traffic[0].peer_pairs, peer ? 1 : 0);
  EXPECT_EQ(traffic[0].p2p_pairs, peer ? 0 : 1);
  p.shutdown();
}

TEST(RuntimeInProcess, StagedApplyPausesOnlyOnceEveryByteLandedP2p) { expect_staged_apply(false); }
TEST(RuntimeInProcess, StagedApplyPausesOnlyOnceEveryByteLandedPeer) { expect_staged_apply(true); }

// refit.staged: a pause hook that refuses the apply fails the refit (every engine rank's verdict
// counts); the parameters were never written, so they keep their version without a rollback,
// and the next refit, which cannot use the torn staging area as a base, is exact.
TEST(RuntimeInProcess, StagedApplyRefusedKeepsTheWeightsWithoutARollback) {
  Pair p([](Config& c) {
    c.refit.staged = true;
    c.refit.delta = DeltaMode::kOn;
  });
  ASSERT_TRUE(p.ok());
  bool refuse = false;
  p.pause_refused_while(refuse);
  p.refit_publishes(1, false);
  refuse = true;
  p.train(2);
  auto [st, served] = p.refit(2, false);
  ASSERT_FALSE(st.ok());
  ASSERT_NE(st.origin(), nullptr);
  EXPECT_EQ(st.origin()->rank, RankId::engine(0, 1));
  EXPECT_NE(st.message().find("generation cannot pause now"), std::string::npos) << st.message();
  EXPECT_TRUE(p.trainer->session_ok());
  ASSERT_FALSE(served.ok());
  EXPECT_TRUE(p.engine->session_ok());
  EXPECT_EQ(p.engine->weight_version(), "1");
  EXPECT_TRUE(p.engine->is_valid());
  EXPECT_TRUE(p.holds(1));
  EXPECT_EQ(p.engine->last_stats().pause_s, 0);
  refuse = false;
  p.refit_publishes(3, false);
  p.shutdown();
}

// refit.staged: a refit that fails in flight while its bytes land never touched the parameters:
// the engine keeps serving the previous version. The engine stalls once every byte landed, before
// it would pause, for longer than the trainer takes to give up and record the failure (its wait,
// 3 s, then up to 2 x refit.timeout_s to tell a slow rank from a dead one).
TEST(RuntimeInProcess, StagedRefitThatFailsInFlightLeavesTheWeightsValid) {
  auto stall = std::make_shared<StallBeforeCommit>(2, 13500ms);  // 4.5 x refit.timeout_s
  int pauses = 0;
  Pair p([](Config& c) { c.refit.staged = true; }, stall);
  ASSERT_TRUE(p.ok());
  p.engine->on_pause([&] { ++pauses; });
  p.engine->on_verify([](int, const std::string&) { return Status::Ok(); });
  p.refit_publishes(1, true);
  p.train(2);
  auto [st, served] = p.refit(2, true);
  EXPECT_EQ(stall->stalls.load(), 1) << "the stall did not run";
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("failed in flight"), std::string::npos) << st.message();
  EXPECT_TRUE(p.trainer->session_ok()) << st.to_string();
  ASSERT_FALSE(served.ok());
  EXPECT_TRUE(p.engine->session_ok()) << served.status().to_string();
  EXPECT_EQ(pauses, 1) << "generation paused for a refit that had failed";
  EXPECT_TRUE(p.engine->is_valid());
  EXPECT_EQ(p.engine->weight_version(), "1");
  EXPECT_TRUE(p.holds(1));
  p.refit_publishes(3, false);
  p.shutdown();
}

}  // namespace
}  // namespace refit
