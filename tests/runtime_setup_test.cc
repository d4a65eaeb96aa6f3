// Setup-time refusals of `refit run`, before any refit: a vLLM plan-hash mismatch, a pair whose
// two ranks derive different routes, ranks of two refit versions, an invalid config, and faults the run could never reach.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "refit/version.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::run_cli;
using testing::TempDir;
using Cell = testing::RunConfig;
using testing::config_yaml;

testing::CliResult run_cell(const Cell& c,
                            std::vector<std::string> extra = {"--steps", "2", "--verify"}) {
  return testing::run_config(c, extra);
}

TEST(RuntimeSetup, VllmPlanHashMismatchIsRefused) {
  auto r =
      run_cell({.engine = "vllm", .timeout_s = 5}, {"--steps", "1", "--fault", "plan-mismatch"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("manifest mismatch"), std::string::npos) << r.output;
}

// The transfer plan with SGLang engines (which compare no plan hash): each engine rank announces
// a wrong digest of every pair's routes, and every pair refuses at setup, naming both ranks.
TEST(RuntimeSetup, RoutesDigestMismatchIsRefusedNamingBothRanks) {
  auto r =
      run_cell({.engine = "sglang", .timeout_s = 5}, {"--steps", "1", "--fault", "plan-mismatch"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("setup: transfer plan mismatch: trainer rank "), std::string::npos)
      << r.output;
  EXPECT_TRUE(r.output.find("and engine rank 0 (engine 0 tp rank 0) derived different routes") !=
                  std::string::npos ||
              r.output.find("and engine rank 1 (engine 0 tp rank 1) derived different routes") !=
                  std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("0000000000000000 on engine rank"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step 1/1"), std::string::npos) << "no refit may run: " << r.output;
}

// Two ranks of different refit versions: the engine announces "<version>+mismatch" in its hello
// and the trainer refuses it at setup, naming both sides and both versions.
TEST(RuntimeSetup, VersionMismatchIsRefusedNamingBothSides) {
  auto r = run_cell({.timeout_s = 5}, {"--steps", "1", "--fault", "version-mismatch"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("version mismatch"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(fmt::format("runs refit {}+mismatch (wire protocol {})", version(),
                                      wire_version())),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find(fmt::format("trainer rank 0 runs refit {} (wire protocol {})", version(),
                                      wire_version())),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("step 1/1"), std::string::npos) << r.output;  // no refit ran
}

TEST(RuntimeSetup, InvalidConfigExits2BeforeStarting) {
  auto r = run_cell({.colocated = true, .world_size = 3, .tp = 2}, {"--steps", "1"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("world_size"), std::string::npos) << r.output;
}

// A fault the run could never reach is refused before any rank starts (it would silently do
// nothing), naming the limit: ranks that do not exist, rounds or buckets past the plan.
TEST(RuntimeSetup, FaultsOutsideThePlanExit2) {
  struct Case {
    Cell cell;
    const char* fault;
    const char* words;
  };
  const Case cases[] = {
      {{.world_size = 2},
       "kill-trainer:2:0",
       "there is no trainer rank 2 (policy.world_size is 2)"},
      {{.tp = 2}, "kill-engine:2:0", "there is no engine rank 2"},
      {{.executor = "gather"}, "corrupt:999", "bucket 999 is past the plan"},
      {{.buffer = 4096, .executor = "p2p"}, "kill-engine:0:99999", "round 99999 is past the plan"},
  };
  for (const Case& c : cases) {
    auto r = run_cell(c.cell, {"--steps", "1", "--fault", c.fault});
    EXPECT_EQ(r.exit_code, 2) << c.fault << "\n" << r.output;
    EXPECT_NE(r.output.find(c.words), std::string::npos) << c.fault << "\n" << r.output;
    EXPECT_EQ(r.output.find("step 1/1"), std::string::npos) << "a rank ran: " << r.output;
  }
}

}  // namespace
}  // namespace refit
