// The fault-injection probe (harness/fault_probe.h) at the executors' probe points, in isolation: which
// round kills which rank, and which byte a corruption flips. The end-to-end faults run in
// runtime_faults_test.cc through the CLI.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "harness/fault.h"
#include "plane/data_plane.h"
#include "harness/fault_probe.h"

namespace refit {
namespace {

// Runs `body` in a forked child; returns the signal that ended it (0 when it exited normally).
int signal_of_child(const std::function<void()>& body) {
  const pid_t pid = fork();
  if (pid == 0) {
    body();
    _exit(0);
  }
  int status = 0;
  EXPECT_EQ(waitpid(pid, &status, 0), pid);
  return WIFSIGNALED(status) ? WTERMSIG(status) : 0;
}

TEST(FaultProbe, KillFiresOnItsRankAtTheFirstRoundFromK) {
  const Fault f{.kind = Fault::Kind::kKillTrainer, .rank = 1, .bucket = 3};
  auto on_rank = [&](int rank, bool trainer, int step, std::vector<int> rounds) {
    return signal_of_child([&] {
      auto p = make_fault_probe(f, trainer, rank);
      for (int k : rounds) p->before_round(step, k);
    });
  };
  EXPECT_EQ(on_rank(1, true, 1, {0, 1, 2}), 0);      // before round 3
  EXPECT_EQ(on_rank(1, true, 1, {0, 5}), SIGKILL);   // rounds it sends in may skip 3
  EXPECT_EQ(on_rank(0, true, 1, {3, 4}), 0);         // another rank
  EXPECT_EQ(on_rank(1, false, 1, {3, 4}), 0);        // an engine rank of the same number
  EXPECT_EQ(on_rank(1, true, 2, {3, 4}), 0);         // faults fire in step 1 only
  EXPECT_EQ(on_rank(1, true, 1, {RefitProbe::kEveryRound}), SIGKILL);  // one copy, every round
  const Fault e{.kind = Fault::Kind::kKillEngine, .rank = 2, .bucket = 0};
  EXPECT_EQ(signal_of_child([&] { make_fault_probe(e, false, 2)->before_round(1, 0); }), SIGKILL);
}

TEST(FaultProbe, CorruptFlipsOneByteOfTheChosenRun) {
  Config cfg;
  auto plane = make_data_plane(cfg);
  ASSERT_TRUE(plane.ok()) << plane.status().to_string();
  std::vector<float> mem(64, 1.0f);
  auto* base = reinterpret_cast<std::byte*>(mem.data());
  // Two runs of float32: elements [0, 8) and [32, 48) as 2 rows of 8.
  const std::vector<CopyRun> runs = {
      {.src = nullptr, .dst = base, .block = {.dst_offset = 0, .dst_stride = 8, .rows = 1, .cols = 8}},
      {.src = nullptr, .dst = base, .block = {.dst_offset = 32, .dst_stride = 8, .rows = 2, .cols = 8}}};
  auto changed = [&] {
    std::vector<int> at;
    for (int i = 0; i < 64; ++i)
      if (mem[static_cast<std::size_t>(i)] != 1.0f) at.push_back(i);
    std::fill(mem.begin(), mem.end(), 1.0f);
    return at;
  };
  const Fault f{.kind = Fault::Kind::kCorrupt, .bucket = 1};
  auto trainer = make_fault_probe(f, true, 0);
  ASSERT_TRUE(trainer->after_write(1, 0, **plane, runs, DType::kFloat32).ok());
  EXPECT_TRUE(changed().empty());  // round 0 is not round 1
  ASSERT_TRUE(trainer->after_write(1, 1, **plane, runs, DType::kFloat32).ok());
  EXPECT_EQ(changed(), std::vector<int>{4});  // round 1: its first run, mid-row
  ASSERT_TRUE(trainer->after_write(1, RefitProbe::kEveryRound, **plane, runs, DType::kFloat32).ok());
  EXPECT_EQ(changed(), std::vector<int>{36});  // every round at once: run K = 1
  ASSERT_TRUE(trainer->after_write(2, 1, **plane, runs, DType::kFloat32).ok());
  EXPECT_TRUE(changed().empty());  // step 2
  auto engine = make_fault_probe(f, false, 0);
  ASSERT_TRUE(engine->after_write(1, 1, **plane, runs, DType::kFloat32).ok());
  EXPECT_TRUE(changed().empty());  // engines never corrupt
  // Other kinds act at setup: the probe does nothing at any point.
  auto none = make_fault_probe(Fault{.kind = Fault::Kind::kPlanMismatch}, true, 0);
  none->before_round(1, 0);
  ASSERT_TRUE(none->after_write(1, 0, **plane, runs, DType::kFloat32).ok());
  EXPECT_TRUE(changed().empty());
}

}  // namespace
}  // namespace refit
