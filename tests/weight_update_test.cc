// `--update adam:LR` (weights/weights.h): the generated weights move by about LR per element and
// step, deterministically; `refit run` verifies them; every rank of a run must be given the same
// update, and an engine started with another one is refused at setup naming the flag.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>
#include <vector>

#include "common/convert.h"
#include "control/ports.h"
#include "refit/model_spec.h"
#include "test_util.h"
#include "weights/weights.h"

namespace refit {
namespace {

using testing::TempDir;

TEST(WeightUpdate, ParsesAndNamesTheFlag) {
  auto d = parse_weight_update("drift");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->kind, WeightUpdate::Kind::kDrift);
  auto a = parse_weight_update("adam:1e-6");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->kind, WeightUpdate::Kind::kAdam);
  EXPECT_FLOAT_EQ(a->lr, 1e-6f);
  EXPECT_EQ(*parse_weight_update(weight_update_name(*a)), *a);
  for (const char* bad : {"adam", "adam:", "adam:0", "adam:-1e-6", "adam:1", "adam:x", "sgd:1e-3",
                          "adam:1e-6x", "adam:nan"}) {
    auto r = parse_weight_update(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find(std::string("--update ") + bad), std::string::npos)
        << r.status().message();
  }
}

// Each element moves by between 0.5 and 1.5 LR per step (up to float32 rounding), about LR on
// average, with a random sign; step 0 is the drift's step 0; the bf16 cast changes for a fraction
// of the elements that grows with LR.
TEST(WeightUpdate, AdamMovesEveryElementByAboutLr) {
  auto spec = load_model_spec("tiny-qwen3");
  ASSERT_TRUE(spec.ok());
  WeightSource drift(*spec, 5, nullptr), adam(*spec, 5, nullptr), adam10(*spec, 5, nullptr);
  adam.set_update(WeightUpdate{.kind = WeightUpdate::Kind::kAdam, .lr = 1e-6f});
  adam10.set_update(WeightUpdate{.kind = WeightUpdate::Kind::kAdam, .lr = 1e-5f});
  const std::int64_t n = 1 << 16;
  std::vector<float> d0(n), a0(n), a1(n), a2(n), b1(n), b2(n);
  drift.values(3, 0, n, 0, d0.data());
  adam.values(3, 0, n, 0, a0.data());
  adam.values(3, 0, n, 1, a1.data());
  adam.values(3, 0, n, 2, a2.data());
  adam10.values(3, 0, n, 1, b1.data());
  adam10.values(3, 0, n, 2, b2.data());
  EXPECT_EQ(d0, a0);
  double sum = 0;
  std::int64_t up = 0, changed = 0, changed10 = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double step = static_cast<double>(a2[i]) - static_cast<double>(a1[i]);
    const double tol = std::ldexp(1.0, std::ilogb(std::fabs(a2[i])) - 22);  // a few float32 ulps
    ASSERT_LE(std::fabs(step), 1.5e-6 + tol) << i;
    ASSERT_GE(std::fabs(step), 0.5e-6 - tol) << i;
    sum += std::fabs(step);
    up += step > 0;
    changed += f32_to_bf16(a2[i]) != f32_to_bf16(a1[i]);
    changed10 += f32_to_bf16(b2[i]) != f32_to_bf16(b1[i]);
  }
  EXPECT_NEAR(sum / n, 1e-6, 0.05e-6);
  EXPECT_NEAR(static_cast<double>(up) / n, 0.5, 0.02);
  // Weights uniform in [-0.1, 0.1): about 1.3 % of the casts change per step at 1e-6, 9 % at 1e-5.
  EXPECT_GT(changed, n * 0.008);
  EXPECT_LT(changed, n * 0.02);
  EXPECT_GT(changed10, n * 0.07);
  EXPECT_LT(changed10, n * 0.12);
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

constexpr const char* kConfig =
    "model: tiny-qwen3\nseed: 3\npolicy: {backend: fsdp2, world_size: 2, dtype: float32}\n"
    "generation: {backend: sglang, num_engines: 1, tp_size: 2}\nrefit: {timeout_s: 15}\n";

TEST(WeightUpdate, RunVerifiesAdamWeights) {
  TempDir dir;
  const std::string cfg = dir.write("c.yaml", kConfig);
  auto r = testing::run_cli({"run", cfg, "--steps", "3", "--verify", "--update", "adam:1e-5"}, 120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verified bit-exact"), std::string::npos) << r.output;
  auto bad = testing::run_cli({"run", cfg, "--update", "adam:fast"}, 60);
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--update adam:fast"), std::string::npos) << bad.output;
}

// Ranks started one by one: an engine given another --update than trainer rank 0 is refused at
// setup (exit 2), naming the flag and both values, and no refit runs.
TEST(WeightUpdate, EngineWithAnotherUpdateIsRefused) {
  TempDir dir;
  const std::string cfg = dir.write("c.yaml", kConfig);
  // A store port below the ephemeral range (control/ports.h): a rank that dials a port from that
  // range before the store listens can be connected to itself.
  auto port = pick_free_port();
  ASSERT_TRUE(port.ok()) << port.status().to_string();
  const std::string exe = REFIT_CLI_PATH;
  std::ostringstream sh;
  sh << "cd " << dir.path() << " && export MASTER_ADDR=127.0.0.1 REFIT_PORT=" << *port << "; "
     << "RANK=0 WORLD_SIZE=2 " << exe << " trainer " << cfg
     << " --steps 2 --verify --update adam:1e-5"
     << " > t0.log 2>&1 & p0=$!; RANK=1 WORLD_SIZE=2 " << exe << " trainer " << cfg
     << " --steps 2 --verify --update adam:1e-5 > t1.log 2>&1 & p1=$!; ENGINE_RANK=0 " << exe
     << " engine " << cfg << " --update adam:1e-5 > e0.log 2>&1 & p2=$!; ENGINE_RANK=1 " << exe
     << " engine " << cfg << " > e1.log 2>&1 & p3=$!; "
     << "for p in $p0 $p1 $p2 $p3; do wait $p; echo $? >> codes; done";
  const int rc = std::system(("timeout -k 5 90 bash -c '" + sh.str() + "'").c_str());
  (void)rc;
  const std::string out = slurp(dir.path() + "/t0.log") + slurp(dir.path() + "/t1.log") +
                          slurp(dir.path() + "/e0.log") + slurp(dir.path() + "/e1.log");
  std::vector<int> codes;
  std::ifstream in(dir.path() + "/codes");
  for (int c; in >> c;) codes.push_back(c);
  ASSERT_EQ(codes.size(), 4u) << out;
  EXPECT_EQ(codes[3], 2) << out;
  for (int c : codes) EXPECT_NE(c, 0) << out;
  EXPECT_NE(out.find("--update: engine 0 tp rank 1 runs --update drift, but trainer rank 0 runs "
                     "--update adam:1e-05"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("step 1/2"), std::string::npos) << "no refit may complete:\n" << out;
}

}  // namespace
}  // namespace refit
