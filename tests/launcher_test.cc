// The launcher of `refit run` (harness/launcher.h) with plain shell children: which child it names
// as the run's failure when several end between two of its polls.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <string>
#include <vector>

#include "harness/launcher.h"
#include "test_util.h"

namespace refit {
namespace {

// A rank killed by a signal and a rank that exits because of it (as every rank does once it sees
// another's death) end within a millisecond of each other, mostly between two polls of the
// launcher; the kernel hands zombies back in the order the children were started, so the one that
// merely followed came back first. The launcher names the one the signal ended.
TEST(Launcher, NamesTheRankASignalEndedOverOneThatExitedAfterIt) {
  testing::TempDir dir;
  const std::string fifo = dir.path() + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (int round = 0; round < 5; ++round) {
    std::vector<ChildSpec> children = {
        // Started first; exits with code 1 as soon as the other's end of the FIFO closes.
        {.name = "follower", .args = {"-c", "cat '" + fifo + "' > /dev/null; exit 1"}},
        // Holds the FIFO open, then kills itself.
        {.name = "culprit", .args = {"-c", "exec 3> '" + fifo + "'; sleep 0.2; kill -9 $$"}},
    };
    auto r = launch_and_wait("/bin/sh", children, /*timeout_s=*/10);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_FALSE(r->ok);
    EXPECT_EQ(r->first_failed, 1) << r->summary;
    EXPECT_TRUE(r->first_killed) << r->summary;
    EXPECT_EQ(r->summary.rfind("culprit was killed by signal 9", 0), 0u) << r->summary;
  }
}

}  // namespace
}  // namespace refit
