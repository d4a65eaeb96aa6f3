// The control plane at scale, across real processes on the CPU: a refit's store requests and
// mailbox messages per rank stay flat as the run grows (trainer rank 0 coordinates the engine
// ranks, docs/protocol.md "Scale"), and trainer rank 0's own share goes through relays
// (docs/protocol.md "Relays"), read from the JSON report's `control` counters; and a rank
// killed in a large run is named by every other rank, which all exit within the silence bound.
//
// The large run holds 64 processes (32 trainer ranks -> 8 engines x TP 4); REFIT_SCALE_TRAINERS
// sets another number of trainer ranks (and as many engine ranks, in engines of TP 4).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace refit {
namespace {

using testing::count_of;
using testing::run_cli;
using testing::seconds_since;
using testing::TempDir;

int large_trainers() {
  const char* v = std::getenv("REFIT_SCALE_TRAINERS");
  return v != nullptr && std::atoi(v) >= 8 ? std::atoi(v) / 4 * 4 : 32;
}

// `trainers` trainer ranks feeding trainers / 4 engines of TP 4 (as many engine ranks).
// `delta`: refit.delta.
std::string scale_config(int trainers, double timeout_s, const char* delta = "off") {
  return fmt::format(R"(model: tiny-qwen3
device: cpu
seed: 11
policy: {{backend: fsdp2, world_size: {}, dtype: float32}}
generation: {{backend: sglang, colocated: false, num_engines: {}, tp_size: 4}}
refit: {{target_precision: bf16, buffer_size_bytes: 65536, timeout_s: {}, checksum: true,
        delta: "{}"}}
)",
                     trainers, trainers / 4, timeout_s, delta);
}

struct ScaleRun {
  int ranks = 0;
  int steps = 0;
  nlohmann::json control;
  nlohmann::json delta;  // refit.delta on: the report's delta
  double seconds = 0;
  std::string output;
  double per_rank_refit(const char* key) const { return control.value(key, 0.0) / ranks / steps; }
};

ScaleRun run_scale(int trainers, int steps, const char* delta = "off") {
  TempDir dir;
  const std::string cfg = dir.write("config.yaml", scale_config(trainers, 60, delta));
  const std::string json = dir.path() + "/report.json";
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> args = {"run", cfg, "--steps", std::to_string(steps), "--verify",
                                   "--json", json};
  if (std::string(delta) != "off")
    args.insert(args.end(), {"--update", "adam:1e-5"});
  auto r = run_cli(args, 600);
  ScaleRun s{
      .ranks = 2 * trainers, .steps = steps, .seconds = seconds_since(t0), .output = r.output};
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(json);
  const nlohmann::json report = nlohmann::json::parse(in, nullptr, false);
  EXPECT_TRUE(report.is_object() && report.contains("control")) << r.output;
  if (report.is_object() && report.contains("control")) s.control = report["control"];
  if (report.is_object() && report.contains("delta")) s.delta = report["delta"];
  return s;
}

// Per rank and refit, the large run's refit traffic on the control plane is within 1.3 x that of
// a run a quarter its size; the messages that do move are those docs/protocol.md counts.
void expect_flat(const char* delta) {
  const int steps = 3;
  const ScaleRun small = run_scale(8, steps, delta);
  const ScaleRun large = run_scale(large_trainers(), steps, delta);
  ASSERT_FALSE(small.control.is_null());
  ASSERT_FALSE(large.control.is_null());
  for (const ScaleRun* s : {&small, &large}) {
    // With --verify and refit.checksum: 8E + 3(T - 1) messages per refit (T = E = ranks / 2).
    const int t = s->ranks / 2, e = s->ranks / 2;
    EXPECT_EQ(s->control.value("refit_mailbox_messages", 0), (8 * e + 3 * (t - 1)) * steps)
        << s->control.dump() << "\n"
        << s->output;
    // Trainer rank 0, the busiest rank, sends begin, proceed, commit and outcome to each engine's
    // relay (its TP rank 0 of 4), and engines-paused and refit-done to the first trainer group's
    // other ranks and to every other group's relay (groups of ceil(sqrt(T)) ranks).
    int k = 1;
    while (k * k < t) ++k;
    const int trainer_relays = (k - 1) + ((t + k - 1) / k - 1);
    EXPECT_EQ(s->control.value("busiest_refit_mailbox_messages", 0),
              (4 * e / 4 + 2 * trainer_relays) * steps)
        << s->control.dump();
    EXPECT_TRUE(s->output.find("verified bit-exact on every engine rank") != std::string::npos)
        << s->output;
    if (std::string(delta) != "off") {
      const nlohmann::json& d = s->delta;
      EXPECT_TRUE(d.is_object() && d["steps"].size() == static_cast<std::size_t>(steps))
          << d.dump();
      if (d.is_object() && d["steps"].size() == static_cast<std::size_t>(steps)) {
        EXPECT_EQ(d["steps"][0]["pairs"], 0) << d.dump();
        EXPECT_GT(d["steps"][1]["pairs"].get<int>(), 0) << d.dump();
        EXPECT_EQ(d["steps"][2]["pairs"], d["steps"][1]["pairs"]) << d.dump();
        EXPECT_LT(d["steps"][2]["wire_bytes"].get<std::int64_t>(),
                  d["steps"][2]["full_bytes"].get<std::int64_t>() / 2)
            << d.dump();
      }
    }
    std::printf("%d ranks: %s in %.1f s; per rank per refit: %.3f messages, %.3f store requests\n",
                s->ranks, s->control.dump().c_str(), s->seconds,
                s->per_rank_refit("refit_mailbox_messages"),
                s->per_rank_refit("refit_store_requests"));
  }
  EXPECT_GT(small.per_rank_refit("refit_mailbox_messages"), 0);
  EXPECT_LE(large.per_rank_refit("refit_mailbox_messages"),
            1.3 * small.per_rank_refit("refit_mailbox_messages"));
  EXPECT_GT(small.per_rank_refit("refit_store_requests"), 0);
  EXPECT_LE(large.per_rank_refit("refit_store_requests"),
            1.3 * small.per_rank_refit("refit_store_requests"));
}
TEST(RuntimeScale, ControlPlaneStaysFlat) { expect_flat("off"); }

// With refit.delta the engine ranks offer their bases in their pause answers and trainer rank 0
// relays each trainer rank its own pairs' offers: the same messages, per rank and refit as flat,
// while the refits after the first move deltas of every pair.
TEST(RuntimeScale, ControlPlaneStaysFlatWithDeltas) { expect_flat("on"); }

// The trainer group forms only where a refit runs collectives of the trainer ranks: gather's
// buckets and FP8's scales. The transfer plan otherwise forms none (its trainer ranks meet through
// the store at setup and shutdown), and every kind still verifies.
TEST(RuntimeScale, TheTrainerGroupFormsOnlyForItsCollectives) {
  struct Case {
    testing::RunConfig config;
    std::size_t groups;  // trainer ranks that form it
  };
  const Case cases[] = {
      {{.world_size = 4}, 0},
      {{.world_size = 4, .executor = "gather"}, 4},
      {{.world_size = 4, .executor = "p2p", .precision = "fp8", .fp8 = "{block: [16, 16]}"}, 4},
  };
  ::setenv("REFIT_LOG", "debug", 1);
  for (const Case& c : cases) {
    auto r = testing::run_config(c.config, {"--steps", "2", "--verify"});
    SCOPED_TRACE(testing::config_yaml(c.config));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("verified bit-exact on every engine rank"), std::string::npos);
    EXPECT_EQ(count_of(r.output, "formed the trainer group (4 ranks)"), c.groups) << r.output;
  }
  ::unsetenv("REFIT_LOG");
}

// The point-to-point group connects a pair on its first use. Where every pair moves by peer
// access (executor auto, one host, exported parameters), no rank connects any (so none runs Gloo's
// event loop); with executor p2p each of the 4 trainer and 2 engine ranks connects all its pairs in
// one batch, at the first refit, and none again at the second. Every refit verifies.
TEST(RuntimeScale, PairsConnectOnlyWhereTheyMoveBytesPointToPoint) {
  struct Case {
    std::string executor;
    std::size_t batches;  // ranks that connect their pairs
  };
  ::setenv("REFIT_LOG", "debug", 1);
  for (const Case& c : {Case{"auto", 0}, Case{"p2p", 6}}) {
    const testing::RunConfig config{.world_size = 4, .executor = c.executor};
    auto r = testing::run_config(config, {"--steps", "2", "--verify"});
    SCOPED_TRACE(testing::config_yaml(config));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("verified bit-exact on every engine rank"), std::string::npos);
    EXPECT_EQ(count_of(r.output, "more pair(s) on first use"), c.batches) << r.output;
  }
  ::unsetenv("REFIT_LOG");
}

// An engine rank killed in the middle of a large run: the launcher names it, and every other
// rank ends naming it as the cause (no rank exits 0), within the silence bound plus teardown.
TEST(RuntimeScale, KilledRankIsNamedByEveryRank) {
  const int trainers = large_trainers();
  const int ranks = 2 * trainers;
  TempDir dir;
  const std::string cfg = dir.write("config.yaml", scale_config(trainers, 60));
  const std::string victim = "engine 1 tp rank 2";  // engine rank 6
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_cli({"run", cfg, "--steps", "3", "--fault", "kill-engine:6:1"}, 600);
  const double secs = seconds_since(t0);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "processes left running:\n" << r.output;
  EXPECT_NE(r.output.find(victim + " was killed by signal 9"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("exited with code 0"), std::string::npos) << r.output;
  // Each surviving rank's own account names the victim.
  EXPECT_GE(count_of(r.output, "aborted because " + victim), static_cast<std::size_t>(ranks - 1))
      << r.output;
  // Not the timeout (60 s): the silence bound (5.5 s) after the kill, plus setup and teardown.
  EXPECT_EQ(r.output.find("did not complete within"), std::string::npos) << r.output;
  std::printf("%d ranks: every rank ended naming %s %.1f s after the start\n", ranks,
              victim.c_str(), secs);
}

}  // namespace
}  // namespace refit
