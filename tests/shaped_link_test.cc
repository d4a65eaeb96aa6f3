// bench/shaped_link.sh end to end: two network namespaces joined by a shaped veth pair, trainer
// ranks on one, engine ranks on the other, a verified refit of a small model across the link; the
// link carried the plan's bytes and (almost) nothing else. Needs root; skips where namespaces or tc
// are not available.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <sstream>

#include "test_util.h"

namespace refit {
namespace {

TEST(NetworkNamespaces, ShapedLinkCarriesThePlansBytes) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to create network namespaces";
  testing::TempDir dir;
  const std::string cmd =
      std::string("bash ") + REFIT_SOURCE_DIR + "/bench/shaped_link.sh --rate 1gbit" +
      " --model tiny-qwen3 --steps 2 --verify --timeout 120 --refit " + REFIT_CLI_PATH + " --out " +
      dir.path() + "/run > " + dir.path() + "/out.log 2>&1";
  const int status = std::system(("timeout -k 5 200 " + cmd).c_str());
  std::ifstream in(dir.path() + "/out.log");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string out = ss.str();
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (rc == 3) GTEST_SKIP() << "no network namespaces or tc here: " << out;
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("verified: True"), std::string::npos) << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(\(([0-9.]+) x bytes_per_refit x steps\))")))
      << out;
  const double ratio = std::stod(m[1]);
  EXPECT_GE(ratio, 1.0) << out;  // every route crossed the link
  EXPECT_LE(ratio, 1.5) << out;  // and little else: the control plane and TCP's framing
}

// refit.delta on across the link: the first refit moves the plan's bytes, the next ones deltas,
// so the link carries far less than a full refit per step (and at least the first one). With
// refit.staged: the engines' generation pauses only for the apply, a part of each refit.
TEST(NetworkNamespaces, ShapedLinkCarriesDeltas) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to create network namespaces";
  testing::TempDir dir;
  const std::string cmd =
      std::string("bash ") + REFIT_SOURCE_DIR + "/bench/shaped_link.sh --rate 1gbit" +
      " --model tiny-qwen3 --steps 4 --verify --delta on --staged --update adam:1e-5 --timeout 120 "
      "--refit " +
      REFIT_CLI_PATH + " --out " + dir.path() + "/run > " + dir.path() + "/out.log 2>&1";
  const int status = std::system(("timeout -k 5 200 " + cmd).c_str());
  std::ifstream in(dir.path() + "/out.log");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string out = ss.str();
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (rc == 3) GTEST_SKIP() << "no network namespaces or tc here: " << out;
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("verified: True"), std::string::npos) << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(\(([0-9.]+) x bytes_per_refit x steps\))")))
      << out;
  const double ratio = std::stod(m[1]);
  EXPECT_GE(ratio, 0.25) << out;  // the first refit in full: a quarter of 4 full refits
  EXPECT_LE(ratio, 0.25 + 3 * 0.2 + 0.1) << out;  // three deltas of ~9 % changed, and the rest
  // Per step, from the report: the pause within the refit, and the wire bytes of each delta
  // against the first (full) refit.
  for (int step = 1; step <= 4; ++step) {
    ASSERT_TRUE(std::regex_search(
        out, m,
        std::regex("tiny-qwen3 +1gbit +" + std::to_string(step) +
                   R"( +([0-9.]+) +([0-9.]+) +[0-9.]+ +[0-9]+ +[0-9]+ +([0-9]+) +[0-9.]+% +([0-9.]+))")))
        << out;
    EXPECT_GT(std::stod(m[2]), 0) << out;               // generation paused, for the apply
    EXPECT_LE(std::stod(m[2]), std::stod(m[1])) << out;  // inside the refit
    if (step == 1) continue;
    EXPECT_GT(std::stoi(m[3]), 0) << out;     // pairs sent as a delta
    EXPECT_LT(std::stod(m[4]), 0.25) << out;  // wire bytes against the full refit's
  }
}

}  // namespace
}  // namespace refit
