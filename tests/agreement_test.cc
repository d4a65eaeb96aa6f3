// The settings every rank must share (runtime/agreement.h): a difference names the key and both
// values; the tensor table enters as a hash, so another model with the same parameter count is
// still told apart.
#include <gtest/gtest.h>

#include "runtime/agreement.h"

namespace refit {
namespace {

Config base() {
  Config c;
  c.model = "tiny-qwen3";
  return c;
}

TEST(Agreement, EqualConfigsAgreeAndTimeoutMayDiffer) {
  auto spec = load_model_spec("tiny-qwen3");
  ASSERT_TRUE(spec.ok());
  Config a = base(), b = base();
  b.refit.timeout_s = 5;
  EXPECT_TRUE(check_agreed_settings(agreed_settings(a, *spec), agreed_settings(b, *spec),
                                    "engine/0", "trainer rank 0")
                  .ok());
}

TEST(Agreement, EachSharedKeyIsNamedWithBothValues) {
  auto spec = load_model_spec("tiny-qwen3");
  ASSERT_TRUE(spec.ok());
  struct Case {
    void (*change)(Config&);
    const char* words;
  };
  const Case cases[] = {
      {[](Config& c) { c.refit.buffer_size_bytes = 4096; },
       "disagree on refit.buffer_size_bytes: engine/0 has 4096, trainer rank 0 has 268435456"},
      {[](Config& c) { c.refit.num_buffers = 3; }, "disagree on refit.num_buffers"},
      {[](Config& c) { c.refit.executor = Executor::kGather; }, "disagree on refit.executor"},
      {[](Config& c) { c.refit.target_precision = DType::kFloat32; },
       "disagree on refit.target_precision"},
      {[](Config& c) { c.generation.num_engines = 2; }, "disagree on generation.num_engines"},
      {[](Config& c) { c.generation.tp_size = 1; }, "disagree on generation.tp_size"},
      {[](Config& c) { c.generation.colocated = true; }, "disagree on generation.colocated"},
      {[](Config& c) { c.generation.weight_transfer_mode = TransferMode::kIpc; },
       "disagree on generation.weight_transfer_mode"},
      {[](Config& c) { c.generation.backend = EngineProtocol::kVllm; },
       "disagree on generation.backend"},
      {[](Config& c) { c.policy.world_size = 3; }, "disagree on policy.world_size"},
      {[](Config& c) { c.policy.dtype = DType::kBFloat16; }, "disagree on policy.dtype"},
      {[](Config& c) { c.seed = 9; }, "disagree on seed"},
      {[](Config& c) { c.device = Device::kCuda; }, "disagree on device"},
      {[](Config& c) { c.refit.delta = DeltaMode::kAuto; },
       "disagree on refit.delta: engine/0 has auto, trainer rank 0 has off"},
      {[](Config& c) { c.refit.staged = true; }, "disagree on refit.staged"},
  };
  const Config ours = base();
  for (const Case& k : cases) {
    Config theirs = base();
    k.change(theirs);
    const Status st = check_agreed_settings(agreed_settings(ours, *spec),
                                            agreed_settings(theirs, *spec), "engine/0",
                                            "trainer rank 0");
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << k.words;
    EXPECT_NE(st.message().find(k.words), std::string::npos) << st.message();
  }
}

TEST(Agreement, AnotherTensorTableOrAMissingKeyIsNamed) {
  auto a = load_model_spec("tiny-qwen3");
  auto b = load_model_spec("tiny-qwen2");
  ASSERT_TRUE(a.ok() && b.ok());
  const Status model = check_agreed_settings(agreed_settings(base(), *a),
                                             agreed_settings(base(), *b), "engine/0", "trainer");
  EXPECT_NE(model.message().find("disagree on model: engine/0 has "), std::string::npos)
      << model.message();
  auto partial = agreed_settings(base(), *a);
  partial.erase("refit.executor");
  const Status missing =
      check_agreed_settings(agreed_settings(base(), *a), partial, "engine/0", "trainer");
  EXPECT_NE(missing.message().find("refit.executor: engine/0 has (not announced)"),
            std::string::npos)
      << missing.message();
}

}  // namespace
}  // namespace refit
