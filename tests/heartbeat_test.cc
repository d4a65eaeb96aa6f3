// A rank's heartbeat and its liveness check run on threads of their own: a check that waits on a
// store slow to answer never holds up a beat (docs/runtime.md, "Heartbeats").
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "control/store.h"
#include "refit/status.h"
#include "runtime/failure.h"

namespace refit {
namespace {

using namespace std::chrono_literals;

// A store whose ping and watch answer `delay` late (a store host busy with others), counting
// them; every other request goes straight through.
class SlowChecks final : public Store {
 public:
  SlowChecks(Store& base, std::chrono::milliseconds delay) : base_(base), delay_(delay) {}
  Status set(const std::string& key, const std::string& value) override {
    return base_.set(key, value);
  }
  Result<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override {
    return base_.get(key, timeout);
  }
  Result<std::optional<std::string>> try_get(const std::string& key) override {
    return base_.try_get(key);
  }
  Status wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    return base_.wait(keys, timeout);
  }
  Result<std::int64_t> add(const std::string& key, std::int64_t delta) override {
    return base_.add(key, delta);
  }
  Result<Watched> watch(const std::vector<std::string>& keys, const std::string& prefix,
                        std::chrono::milliseconds silence) override {
    std::this_thread::sleep_for(delay_);
    ++slow_;
    return base_.watch(keys, prefix, silence);
  }
  Status ping(std::chrono::milliseconds timeout) override {
    std::this_thread::sleep_for(delay_);
    ++slow_;
    return base_.ping(timeout);
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

// Each check of trainer rank 1 takes 3 s (a ping and a watch, 1.5 s each). Had the beats waited
// for the checks, trainer rank 1's counter would stand still for 3 s at a time; the watcher asks
// for counters still for 2 s. The check must have run meanwhile and found every peer alive.
TEST(Heartbeat, BeatsOnWhileItsLivenessCheckWaitsOnASlowStore) {
  auto server = StoreServer::start("127.0.0.1", 0, nullptr);
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  auto probe = client((*server)->port());
  auto beats = client((*server)->port());
  auto peer = client((*server)->port());
  auto watcher = client((*server)->port());
  ASSERT_TRUE(probe && beats && peer && watcher);
  SlowChecks slow(*probe, 1500ms);
  Heartbeat heartbeat(std::move(beats), &slow, RankId::trainer(1));
  std::atomic<bool> lost{false};
  heartbeat.watch(RankId::trainer(1), {RankId::trainer(0), RankId::trainer(1)},
                  [&](const Status&) { lost = true; });
  int stale = 0;
  for (int k = 0; k < 14; ++k) {  // 7 s: two checks and more
    ASSERT_TRUE(peer->add("heartbeat/trainer/0", 1).ok());  // trainer rank 0 beats too
    auto w = watcher->watch({}, "heartbeat/", 2000ms);
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    for (const Store::Stale& s : w->stale)
      if (s.key == "heartbeat/trainer/1") ++stale;
    std::this_thread::sleep_for(500ms);
  }
  EXPECT_EQ(stale, 0) << "trainer rank 1's beats waited for its checks";
  EXPECT_GE(slow.slow(), 4) << "the liveness check did not run";
  EXPECT_FALSE(lost.load());
  EXPECT_TRUE(heartbeat.verdict().ok()) << heartbeat.verdict().to_string();
}

}  // namespace
}  // namespace refit
