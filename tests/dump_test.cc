// `refit run --dump DIR`: the three kinds of file, read back with the safetensors reader and
// checked against each other: trainer.safetensors cast to bf16 equals expected.safetensors, and
// every element of every engine-<g>.safetensors parameter equals the expected HF element its
// layout piece names (vocabulary padding zero) — the check a user would run with their own tools.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "common/convert.h"
#include "engine/engine_layout.h"
#include "io/safetensors.h"
#include "refit/model_spec.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::run_cli;
using testing::TempDir;

std::uint16_t bf16_at(const SafetensorsFile& f, const TensorInfo& t, std::int64_t i) {
  std::uint16_t v;
  std::memcpy(&v, f.data(t) + i * 2, 2);
  return v;
}

void expect_dump_matches(const std::string& executor) {
  TempDir dir;
  const int tp = 2, engines = 2;
  const std::string cfg = dir.write(
      "c.yaml", fmt::format("model: tiny-qwen2\nseed: 5\n"
                            "policy: {{backend: fsdp2, world_size: 3, dtype: float32}}\n"
                            "generation: {{backend: sglang, num_engines: {}, tp_size: {}}}\n"
                            "refit: {{buffer_size_bytes: 8192, timeout_s: 20, executor: {}}}\n",
                            engines, tp, executor));
  const std::string out = dir.path() + "/dump";
  auto r = run_cli({"run", cfg, "--steps", "2", "--dump", out}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;

  auto trainer = SafetensorsFile::open(out + "/trainer.safetensors");
  auto expected = SafetensorsFile::open(out + "/expected.safetensors");
  ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();
  ASSERT_TRUE(expected.ok()) << expected.status().to_string();
  EXPECT_EQ((*expected)->metadata().at("refit_step"), "2");
  auto spec = load_model_spec("tiny-qwen2");
  ASSERT_TRUE(spec.ok());
  ASSERT_EQ((*trainer)->tensors().size(), spec->tensors().size());

  // trainer (float32) cast to bf16 is expected, element for element.
  for (const TensorSpec& ts : spec->tensors()) {
    const TensorInfo* t = (*trainer)->find(ts.name);
    const TensorInfo* e = (*expected)->find(ts.name);
    ASSERT_TRUE(t && e) << ts.name;
    ASSERT_EQ(t->dtype, DType::kFloat32);
    ASSERT_EQ(e->dtype, DType::kBFloat16);
    ASSERT_EQ(t->shape, ts.shape);
    for (std::int64_t i = 0; i < t->numel(); ++i) {
      float f;
      std::memcpy(&f, (*trainer)->data(*t) + i * 4, 4);
      ASSERT_EQ(f32_to_bf16(f), bf16_at(**expected, *e, i)) << ts.name << " element " << i;
    }
  }

  // Every engine rank's parameters: pieces equal the expected HF elements, the rest is zero.
  for (int g = 0; g < engines * tp; ++g) {
    auto eng = SafetensorsFile::open(fmt::format("{}/engine-{}.safetensors", out, g));
    ASSERT_TRUE(eng.ok()) << eng.status().to_string();
    auto layout = engine_layout(*spec, tp, g % tp, EngineLayout::kFused, EngineProtocol::kVllm);
    ASSERT_TRUE(layout.ok());
    ASSERT_EQ((*eng)->tensors().size(), layout->params.size());
    for (const EngineParam& p : layout->params) {
      const TensorInfo* info = (*eng)->find(p.name);
      ASSERT_NE(info, nullptr) << "engine-" << g << " has no " << p.name;
      ASSERT_EQ(info->shape, p.shape) << p.name;
      const std::int64_t cols = matrix_shape(p.shape).cols;
      std::vector<bool> covered(static_cast<std::size_t>(info->numel()), false);
      for (const Piece& pc : p.pieces) {
        const TensorSpec& ts = spec->tensors()[pc.hf_tensor];
        const TensorInfo* e = (*expected)->find(ts.name);
        const std::int64_t hf_cols = matrix_shape(ts.shape).cols;
        for (std::int64_t i = 0; i < pc.rows; ++i)
          for (std::int64_t j = 0; j < pc.cols; ++j) {
            const std::int64_t at = (pc.dst_row + i) * cols + pc.dst_col + j;
            covered[static_cast<std::size_t>(at)] = true;
            ASSERT_EQ(bf16_at(**eng, *info, at),
                      bf16_at(**expected, *e, (pc.src_row + i) * hf_cols + pc.src_col + j))
                << "engine-" << g << " " << p.name << " element " << at << " (from " << ts.name
                << ")";
          }
      }
      for (std::size_t k = 0; k < covered.size(); ++k)
        if (!covered[k]) {
          ASSERT_EQ(bf16_at(**eng, *info, static_cast<std::int64_t>(k)), 0)
              << "padding of " << p.name;
        }
    }
  }
}

TEST(Dump, P2pEnginesMatchTheExpectedTensors) { expect_dump_matches("p2p"); }
TEST(Dump, PeerEnginesMatchTheExpectedTensors) { expect_dump_matches("peer"); }

TEST(Dump, UnwritableDirectoryIsASetupError) {
  auto r = run_cli({"run", "--dump", "/proc/refit-cannot-create-this"}, 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--dump /proc/refit-cannot-create-this"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace refit
