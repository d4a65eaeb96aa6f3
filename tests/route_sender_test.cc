// The trainer side of the transfer plan against an engine whose pause answer names a region whose
// parameters lie outside it (a bug, or a forged message on the control plane): the sender must
// refuse before writing a byte, naming the parameter. The runtime hands the executor the answers
// (runtime/trainer_protocol.h); the executor maps and writes.
#include <gtest/gtest.h>

#include <vector>

#include "executor/route_sender.h"
#include "executor/routes.h"
#include "plane/data_plane.h"
#include "plane/shared_memory.h"
#include "refit/model_spec.h"
#include "runtime/slots.h"

namespace refit {
namespace {

// A list rebuilt for new mappings starts empty, the casts to an engine's own dtypes included (a
// group left behind would write the old mapping at every refit).
TEST(RouteCopies, ClearLeavesNoGroup) {
  RouteCopies c;
  std::byte src[8] = {}, dst[8] = {};
  const CopyRun run{.src = src, .dst = dst, .block = {.rows = 1, .cols = 2}};
  c.cast.push_back(run);
  c.apart.push_back({DType::kFloat32, {run}});
  c.scales.push_back(run);
  c.quant_runs.push_back(run);
  c.clear();
  EXPECT_TRUE(c.empty());
  EXPECT_TRUE(c.apart.empty());
  EXPECT_TRUE(c.quant_runs.empty());
}

TEST(RouteSender, RefusesExportedOffsetsOutsideTheRegion) {
  Config cfg;
  cfg.model = "tiny-qwen3";
  cfg.policy.world_size = 1;
  cfg.generation.tp_size = 1;
  cfg.generation.colocated = true;
  cfg.refit.timeout_s = 10;
  auto spec = load_model_spec(cfg.model);
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  auto setup = make_trainer_route_setup(cfg, *spec, 0);
  ASSERT_TRUE(setup.ok()) << setup.status().to_string();
  auto plane = make_data_plane(cfg);
  ASSERT_TRUE(plane.ok());

  // The engine's region, as allocate_params lays it out, and the trainer's shards.
  const EngineShardLayout& lay = setup->engine_layout(0);
  std::vector<TensorSlot> slots;
  for (const EngineParam& p : lay.params) slots.push_back(TensorSlot{p.name, p.shape, p.dtype});
  std::size_t total = 0;
  std::vector<std::size_t> offsets = slot_offsets(slots, &total);
  std::string handle;
  auto region = (*plane)->allocate_exported(total, "/refit-test-route-sender-" + unguessable_suffix(), &handle);
  ASSERT_TRUE(region.ok()) << region.status().to_string();
  std::vector<std::vector<float>> shard_memory;
  std::vector<void*> shards;
  for (const LocalTensor& t : setup->trainer.tensors) {
    shard_memory.emplace_back(static_cast<std::size_t>(matrix_shape(t.shape).numel()), 1.0f);
    shards.push_back(shard_memory.back().data());
  }
  const std::vector<std::byte> before(region->get()->data(), region->get()->data() + total);
  offsets.back() = total - 2;  // the last parameter starts inside and runs past the end

  RouteSenderOptions o;
  o.config = &cfg;
  o.rank = 0;
  o.setup = &*setup;
  o.plane = plane->get();
  o.targets = control_targets(*setup);
  o.target_same_host.assign(o.targets.size(), true);
  ASSERT_EQ(o.targets, std::vector<int>{0});
  auto sender = RouteSender::create(o);
  ASSERT_TRUE(sender.ok());

  ASSERT_EQ((*sender)->answers_from().size(), 1u);
  std::vector<PausedMessage> answers(1);
  answers[0].step = 1;
  answers[0].direct = ExportedParams{.handle = handle, .bytes = total, .offsets = offsets};
  TransferTimes times;
  const BeginMessage begin{.step = 1, .version = "1"};
  ASSERT_TRUE((*sender)->before_begin(begin, shards, times).ok());
  ASSERT_TRUE((*sender)->take_answers(answers).ok());
  const Status st = (*sender)->send(begin, shards, times);
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.to_string();
  EXPECT_NE(st.message().find("outside it, refusing to write"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find(lay.params.back().name), std::string::npos) << st.message();
  const std::vector<std::byte> after(region->get()->data(), region->get()->data() + total);
  EXPECT_TRUE(before == after) << "the sender wrote into the region";
}

}  // namespace
}  // namespace refit
