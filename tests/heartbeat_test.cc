// A rank's heartbeat and its liveness check: one store request per beat carries both, and a check
// busy with a failure never holds up a beat (docs/runtime.md, "Heartbeats").
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "control/store.h"
#include "refit/status.h"
#include "runtime/failure.h"
#include "test_util.h"

namespace refit {
namespace {

using namespace std::chrono_literals;

// A store whose try_get answers `delay` late (a store host busy with others), counting them;
// every other request goes straight through. The liveness check reads a lost peer's kept error
// with it.
class SlowFollowUps final : public Store {
 public:
  SlowFollowUps(Store& base, std::chrono::milliseconds delay) : base_(base), delay_(delay) {}
  Status set(const std::string& key, const std::string& value) override {
    return base_.set(key, value);
  }
  Status erase(const std::string& key) override { return base_.erase(key); }
  Result<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override {
    return base_.get(key, timeout);
  }
  Result<std::optional<std::string>> try_get(const std::string& key) override {
    std::this_thread::sleep_for(delay_);
    ++slow_;
    return base_.try_get(key);
  }
  Status wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    return base_.wait(keys, timeout);
  }
  Result<std::int64_t> add(const std::string& key, std::int64_t delta) override {
    return base_.add(key, delta);
  }
  int slow() const { return slow_.load(); }

 private:
  Store& base_;
  const std::chrono::milliseconds delay_;
  std::atomic<int> slow_{0};
};

std::unique_ptr<Store> client(int port) {
  auto c = connect_store("127.0.0.1", port, 5s, nullptr);
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return c.ok() ? std::move(c).value() : nullptr;
}

// A store server and a test's connections to it: the rank's liveness probe and heartbeat, a peer
// rank's, and a watcher's.
struct Connections {
  std::unique_ptr<StoreServer> server;
  std::unique_ptr<Store> probe, beats, peer, watcher;
  bool ok() const { return server && probe && beats && peer && watcher; }
};

Connections connect_all() {
  Connections c;
  auto server = StoreServer::start("127.0.0.1", 0, nullptr);
  EXPECT_TRUE(server.ok()) << server.status().to_string();
  if (!server.ok()) return c;
  c.server = std::move(server).value();
  c.probe = client(c.server->port());
  c.beats = client(c.server->port());
  c.peer = client(c.server->port());
  c.watcher = client(c.server->port());
  return c;
}

// Trainer rank 0 beats for a while, then falls silent. Trainer rank 1's check then names it, and
// is slow about it: the follow-up read of its kept error takes 1.5 s and on_lost (where the
// runtime closes its collectives) 3 s more. Had the beats waited for the check, trainer rank 1's
// counter would stand still for 4.5 s; the watcher asks for counters still for 2 s.
TEST(Heartbeat, BeatsOnWhileItsCheckIsBusyWithAFailure) {
  Connections c = connect_all();
  ASSERT_TRUE(c.ok());
  auto& [server, probe, beats, peer, watcher] = c;
  SlowFollowUps slow(*probe, 1500ms);
  Heartbeat heartbeat(std::move(beats), &slow, RankId::trainer(1));
  std::atomic<int> lost{0};
  heartbeat.watch(RankId::trainer(1), {RankId::trainer(0), RankId::trainer(1)},
                  [&](const Status&) {
                    ++lost;
                    std::this_thread::sleep_for(3000ms);
                  });
  int stale = 0;
  for (int k = 0; k < 28; ++k) {  // 14 s: trainer rank 0 beats for the first 1 s
    if (k < 2) {
      ASSERT_TRUE(peer->add("heartbeat/trainer/0", 1).ok());
    }
    auto w = watcher->watch({}, "heartbeat/", 2000ms);
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    for (const Store::Stale& s : w->stale)
      if (s.key == "heartbeat/trainer/1") ++stale;
    std::this_thread::sleep_for(500ms);
  }
  EXPECT_EQ(stale, 0) << "trainer rank 1's beats waited for its check";
  EXPECT_EQ(slow.slow(), 1) << "the check did not read the lost rank's kept error";
  EXPECT_EQ(lost.load(), 1);
  const Status verdict = heartbeat.verdict();
  EXPECT_NE(verdict.to_string().find("trainer rank 0: aborted: stopped: no heartbeat"),
            std::string::npos)
      << verdict.to_string();
}

// Once it watches, each beat is the rank's one liveness request: the beat connection's requests
// are exactly the beats the store counted, and the probe connection serves nothing until a check
// fails. Reads that find every peer alive are not handed to the checking thread. Then a peer that
// exits is named from those reads alone.
TEST(Heartbeat, OneStoreRequestPerBeatCarriesTheLivenessCheck) {
  Connections c = connect_all();
  ASSERT_TRUE(c.ok());
  auto& [server, probe, beats, peer, watcher] = c;
  const Store* beat_connection = beats.get();
  const std::int64_t beats_before = beat_connection->requests();
  const std::int64_t probe_before = probe->requests();
  Heartbeat heartbeat(std::move(beats), probe.get(), RankId::engine(0, 1));
  std::atomic<int> lost{0};
  heartbeat.watch(RankId::engine(0, 1), {RankId::trainer(0), RankId::engine(0, 1)},
                  [&](const Status&) { ++lost; });
  for (int k = 0; k < 5; ++k) {  // trainer rank 0 beats for 2.5 s, every check finds it alive
    ASSERT_TRUE(peer->add("heartbeat/trainer/0", 1).ok());
    std::this_thread::sleep_for(500ms);
  }
  EXPECT_EQ(lost.load(), 0);
  EXPECT_EQ(probe->requests(), probe_before) << "the checks made requests of their own";
  EXPECT_EQ(heartbeat.judged(), 0) << "a read that found every peer alive woke the checking thread";
  peer.reset();  // trainer rank 0 exits: its connection closes without leaving
  for (int k = 0; k < 40 && lost.load() == 0; ++k) std::this_thread::sleep_for(100ms);
  heartbeat.stop();
  ASSERT_EQ(lost.load(), 1) << "the exit was not noticed within 4 s";
  EXPECT_GE(heartbeat.judged(), 1);
  EXPECT_NE(heartbeat.verdict().to_string().find(
                "trainer rank 0: aborted: exited: its connection to the control plane closed"),
            std::string::npos)
      << heartbeat.verdict().to_string();
  auto counted = watcher->try_get("heartbeat/" + RankId::engine(0, 1).mailbox());
  ASSERT_TRUE(counted.ok() && counted->has_value());
  const std::int64_t beaten = std::stoll(**counted);
  EXPECT_GE(beaten, 5);
  EXPECT_EQ(beat_connection->requests() - beats_before, beaten)
      << "a beat connection request that was not a beat";
  // The failure's follow-ups: the lost rank's kept error and the failure record.
  EXPECT_GT(probe->requests(), probe_before);
}

// A rank whose heartbeat key holds no counter (another process of the same rank left under it) is
// refused by the store: its check fails in its own name, not as a lost store.
TEST(Heartbeat, ABeatTheStoreRefusesFailsTheRankItself) {
  Connections c = connect_all();
  ASSERT_TRUE(c.ok());
  auto& [server, probe, beats, peer, watcher] = c;
  ASSERT_TRUE(probe->set("heartbeat/" + RankId::trainer(1).mailbox(), "left").ok());
  Heartbeat heartbeat(std::move(beats), probe.get(), RankId::trainer(1));
  std::atomic<int> lost{0};
  heartbeat.watch(RankId::trainer(1), {RankId::trainer(0), RankId::trainer(1)},
                  [&](const Status&) { ++lost; });
  for (int k = 0; k < 40 && lost.load() == 0; ++k) std::this_thread::sleep_for(100ms);
  ASSERT_EQ(lost.load(), 1) << "the refused beat was not noticed within 4 s";
  const std::string verdict = heartbeat.verdict().to_string();
  EXPECT_NE(verdict.find("trainer rank 1: the store refused its heartbeat"), std::string::npos)
      << verdict;
  EXPECT_NE(verdict.find("is not an integer: 'left'"), std::string::npos) << verdict;
  EXPECT_EQ(verdict.find("lost the control plane"), std::string::npos) << verdict;
}

// The store's process, forked before this test starts a thread, stands still 2 s at a time and
// runs 1 s between (a host busy with others): every read is answered up to 2 s late, and none is
// taken for a stopped store. Then it stops for good: the check names trainer rank 0's store,
// within kPeerSilence of its last answer and a beat interval.
TEST(Heartbeat, AStoreThatAnswersLateIsNotTakenForStoppedAndOneThatStopsIs) {
  testing::ForkedStoreServer server(120);
  ASSERT_TRUE(server.ok()) << "the store server process did not start";
  const int port = server.port();
  auto probe = client(port);
  auto beats = client(port);
  ASSERT_TRUE(probe && beats) << "cannot connect to the store";
  std::atomic<int> lost{0};
  {
    Heartbeat heartbeat(std::move(beats), probe.get(), RankId::trainer(1));
    heartbeat.watch(RankId::trainer(1), {RankId::trainer(1)}, [&](const Status&) { ++lost; });
    std::this_thread::sleep_for(1000ms);
    for (int k = 0; k < 3; ++k) {
      kill(server.pid(), SIGSTOP);
      std::this_thread::sleep_for(2000ms);
      kill(server.pid(), SIGCONT);
      std::this_thread::sleep_for(1000ms);
    }
    EXPECT_EQ(lost.load(), 0) << "a store answering 2 s late was taken for stopped: "
                              << heartbeat.verdict().to_string();
    kill(server.pid(), SIGSTOP);  // for good
    for (int k = 0; k < 100 && lost.load() == 0; ++k) std::this_thread::sleep_for(100ms);
    EXPECT_EQ(lost.load(), 1) << "the stopped store was not noticed within 10 s";
    EXPECT_NE(heartbeat.verdict().to_string().find(
                  "trainer rank 0: the store it hosts did not answer for 5.0 s"),
              std::string::npos)
        << heartbeat.verdict().to_string();
    server.kill();  // the heartbeat's last request in flight fails at once with its connection
  }
}

}  // namespace
}  // namespace refit
