// The --json report of real runs: the contract's keys, a failed run's report blaming the killed
// rank, an unwritable path refused before any rank starts, and the per-rank traffic of the
// transfer plan (docs/runtime.md, "Report").
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace refit {
namespace {

using testing::run_cli;
using testing::TempDir;
using Cell = testing::RunConfig;
using testing::config_yaml;

TEST(RuntimeReport, JsonHasTheContractKeys) {
  TempDir dir;
  const std::string json = dir.path() + "/report.json";
  auto r =
      run_cli({"run", dir.write("c.yaml", config_yaml({})), "--steps", "3", "--json", json}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(json);
  std::stringstream ss;
  ss << in.rdbuf();
  for (const char* key :
       {"\"ok\": true", "\"steps\": 3", "\"verified\": false", "\"bytes_per_refit\"",
        "\"buckets_per_refit\"", "\"refit_seconds\"", "\"gbps\"", "\"phases\"", "\"unshard\"",
        "\"cast_pack\"", "\"transfer\"", "\"apply\"", "\"config\""})
    EXPECT_NE(ss.str().find(key), std::string::npos) << key << "\n" << ss.str();
}

// A failed run writes its report too (docs/runtime.md, "Report"): ok false, the error and the
// process blamed, none of the measurements — and no earlier run's report survives.
TEST(RuntimeReport, FailedRunReportBlamesTheKilledRank) {
  TempDir dir;
  const std::string json = dir.write("report.json", R"({"schema_version": 3, "ok": true})");
  auto r = run_cli({"run", dir.write("c.yaml", config_yaml({.timeout_s = 5})), "--steps", "2",
                    "--fault", "kill-engine:1:0", "--json", json},
                   120);
  ASSERT_EQ(r.exit_code, 1) << r.output;
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j.at("schema_version").get<int>(), 7);
  EXPECT_FALSE(j.at("ok").get<bool>()) << j.dump(2);
  const auto& e = j.at("error");
  EXPECT_EQ(e.at("role"), "engine") << j.dump(2);
  EXPECT_EQ(e.at("rank").get<int>(), 1) << j.dump(2);
  EXPECT_EQ(e.at("process"), "engine 0 tp rank 1") << j.dump(2);
  EXPECT_NE(e.at("message").get<std::string>().find("killed by signal 9"), std::string::npos)
      << j.dump(2);
  EXPECT_FALSE(j.contains("refit_seconds")) << j.dump(2);
  EXPECT_EQ(j.at("config").at("model"), "tiny-qwen3");
}

TEST(RuntimeReport, UnwritablePathExits2BeforeAnyRankStarts) {
  TempDir dir;
  const std::string cfg = dir.write("c.yaml", config_yaml({}));
  for (const std::string& path : {dir.path() + "/missing/report.json", dir.path()}) {
    auto r = run_cli({"run", cfg, "--json", path}, 60);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("--json " + path), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("refit(s) completed"), std::string::npos) << r.output;
  }
}

// The report's per-rank traffic: each engine rank of TP T receives its own shard (about 1/T of
// the model), every replica the whole model once; trainer ranks send what engines receive.
TEST(RuntimeReport, RanksArrayShowsShardSizedReceives) {
  for (const char* executor : {"peer", "p2p"}) {
    TempDir dir;
    const std::string json = dir.path() + "/report.json";
    Cell c{.world_size = 3, .num_engines = 2, .tp = 2, .executor = executor};
    auto r =
        run_cli({"run", dir.write("c.yaml", config_yaml(c)), "--steps", "1", "--json", json}, 120);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::ifstream in(json);
    const auto j = nlohmann::json::parse(in);
    EXPECT_EQ(j.at("schema_version").get<int>(), 7);
    EXPECT_TRUE(j.at("ok").get<bool>());
    EXPECT_FALSE(j.contains("error"));
    EXPECT_EQ(j.at("executor").get<std::string>(), executor);
    const double model = j.at("bytes_per_refit").get<double>();
    long long sent = 0, received = 0;
    int trainers = 0, engines = 0, pairs_t = 0, pairs_e = 0;
    for (const auto& rank : j.at("ranks")) {
      const bool trainer = rank.at("role") == "trainer";
      sent += rank.at("bytes_sent").get<long long>();
      received += rank.at("bytes_received").get<long long>();
      const int pairs = rank.at("peer_pairs").get<int>() + rank.at("p2p_pairs").get<int>();
      // Every rank derived its own view of the plan at setup, and says what it holds.
      EXPECT_GT(rank.at("setup_seconds").get<double>(), 0) << rank.dump();
      EXPECT_GT(rank.at("plan_bytes").get<long long>(), 0) << rank.dump();
      if (trainer) {
        ++trainers;
        pairs_t += pairs;
      } else {
        ++engines;
        pairs_e += pairs;
        const double b = rank.at("bytes_received").get<double>();
        // TP rank 1 holds fewer real vocabulary rows (1000 padded to 1024, split 512 / 488).
        EXPECT_GT(b, model / 2 * 0.97) << executor << " engine rank " << rank.at("rank");
        EXPECT_LT(b, model / 2 * 1.05) << executor << " engine rank " << rank.at("rank");
      }
    }
    EXPECT_EQ(trainers, 3);
    EXPECT_EQ(engines, 4);
    EXPECT_EQ(sent, received) << executor;
    EXPECT_EQ(pairs_t, pairs_e) << executor;
    EXPECT_NEAR(static_cast<double>(received), 2 * model, 0.05 * model) << executor;
  }
}

}  // namespace
}  // namespace refit
