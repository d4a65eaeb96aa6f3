// The transfer plan checked element by element against an independent computation: every element
// of every engine rank's parameters that a layout piece covers is written by exactly one route,
// from a trainer rank whose local tensor holds that HF element at the route's source position; nothing else is written; per-rank byte counts and round bounds hold. The reference
// walks pieces element by element and never calls the plan's own intersection code.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "plan/transfer_plan.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "executor/routes.h"
#include "common/convert.h"
#include "plane/data_plane.h"

namespace refit {
namespace {

struct Case {
  std::string model = "tiny-qwen3";
  PolicyBackend backend = PolicyBackend::kFsdp2;
  int world = 2;
  MegatronParallel megatron;
  int engines = 1;
  int tp = 2;
  std::int64_t buffer = 1 << 20;
};

std::ostream& operator<<(std::ostream& os, const Case& c) {
  return os << fmt::format("{} {} world {} (tp {} pp {} ep {}) -> {} x TP {}, buffer {}", c.model,
                           policy_backend_name(c.backend), c.world, c.megatron.tp, c.megatron.pp,
                           c.megatron.ep, c.engines, c.tp, c.buffer);
}

Config config_of(const Case& c) {
  Config cfg;
  cfg.model = c.model;
  cfg.policy.backend = c.backend;
  cfg.policy.world_size = c.world;
  cfg.policy.megatron = c.megatron;
  cfg.generation.num_engines = c.engines;
  cfg.generation.tp_size = c.tp;
  cfg.refit.buffer_size_bytes = c.buffer;
  return cfg;
}

// (HF tensor, row, col) of the element at (row, col) of a tensor built from `pieces`, or nullopt.
std::optional<std::tuple<std::uint32_t, std::int64_t, std::int64_t>> hf_of(
    const std::vector<Piece>& pieces, std::int64_t row, std::int64_t col) {
  for (const Piece& p : pieces)
    if (row >= p.dst_row && row < p.dst_row + p.rows && col >= p.dst_col &&
        col < p.dst_col + p.cols)
      return std::make_tuple(p.hf_tensor, p.src_row + row - p.dst_row,
                             p.src_col + col - p.dst_col);
  return std::nullopt;
}

class TransferPlanTest : public ::testing::TestWithParam<Case> {};

TEST_P(TransferPlanTest, EveryEngineElementIsWrittenOnceFromAHolder) {
  const Case c = GetParam();
  const Config cfg = config_of(c);
  auto spec = load_model_spec(c.model);
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  auto setup = make_route_setup(cfg, *spec);
  ASSERT_TRUE(setup.ok()) << setup.status().to_string();
  const TransferPlan& plan = setup->plan;
  const std::int64_t tsize = 2;  // bf16

  // Owner of every HF element: (trainer rank, local tensor, local row, local col), from the
  // trainers' owned pieces.
  using Key = std::tuple<std::uint32_t, std::int64_t, std::int64_t>;
  std::map<Key, std::tuple<int, std::uint32_t, std::int64_t, std::int64_t>> owner;
  for (int r = 0; r < c.world; ++r) {
    const TrainerShardLayout& lay = setup->trainers[static_cast<std::size_t>(r)];
    for (std::uint32_t t = 0; t < lay.tensors.size(); ++t)
      for (std::uint32_t pi : lay.tensors[t].owned) {
        const Piece& p = lay.tensors[t].pieces[pi];
        for (std::int64_t i = 0; i < p.rows; ++i)
          for (std::int64_t j = 0; j < p.cols; ++j) {
            auto [it, fresh] = owner.emplace(Key{p.hf_tensor, p.src_row + i, p.src_col + j},
                                             std::make_tuple(r, t, p.dst_row + i, p.dst_col + j));
            ASSERT_TRUE(fresh) << "two owners of an element of tensor " << p.hf_tensor;
          }
      }
  }

  // Replay every route element by element.
  std::map<std::tuple<int, std::uint32_t, std::int64_t, std::int64_t>, int> writes;
  std::vector<std::int64_t> sent(static_cast<std::size_t>(c.world), 0);
  std::vector<std::int64_t> received(static_cast<std::size_t>(plan.engine_ranks), 0);
  for (const Route& rt : plan.routes) {
    const TrainerShardLayout& tl = setup->trainers[static_cast<std::size_t>(rt.trainer)];
    const EngineShardLayout& el = setup->engines[static_cast<std::size_t>(rt.engine % c.tp)];
    const auto& local = tl.tensors[rt.trainer_tensor];
    const auto& param = el.params[rt.engine_param];
    for (std::int64_t i = 0; i < rt.rows; ++i)
      for (std::int64_t j = 0; j < rt.cols; ++j) {
        const auto from = hf_of(local.pieces, rt.trainer_row + i, rt.trainer_col + j);
        const auto to = hf_of(param.pieces, rt.engine_row + i, rt.engine_col + j);
        ASSERT_TRUE(from && to) << "route element outside both layouts";
        ASSERT_EQ(*from, *to) << "route moves an element to another HF position";
        ASSERT_EQ(std::get<0>(*to), rt.hf_tensor);
        // The sender holds that very HF element at that position (its owner or a replica of it).
        ASSERT_TRUE(owner.count(*to)) << "an element no trainer rank owns";
        writes[{rt.engine, rt.engine_param, rt.engine_row + i, rt.engine_col + j}]++;
      }
    sent[static_cast<std::size_t>(rt.trainer)] += rt.numel() * tsize;
    received[static_cast<std::size_t>(rt.engine)] += rt.numel() * tsize;
  }

  // Every covered engine element exactly once; nothing else.
  std::size_t covered = 0;
  for (int g = 0; g < plan.engine_ranks; ++g) {
    const EngineShardLayout& el = setup->engines[static_cast<std::size_t>(g % c.tp)];
    std::int64_t mine = 0;
    for (std::uint32_t p = 0; p < el.params.size(); ++p)
      for (const Piece& pc : el.params[p].pieces)
        for (std::int64_t i = 0; i < pc.rows; ++i)
          for (std::int64_t j = 0; j < pc.cols; ++j) {
            auto it = writes.find({g, p, pc.dst_row + i, pc.dst_col + j});
            ASSERT_NE(it, writes.end()) << "engine rank " << g << " param " << el.params[p].name
                                        << " element (" << pc.dst_row + i << ", "
                                        << pc.dst_col + j << ") is never written";
            ASSERT_EQ(it->second, 1) << "written twice";
            ++covered;
            ++mine;
          }
    EXPECT_EQ(plan.engine_bytes[static_cast<std::size_t>(g)], mine * tsize)
        << "engine rank " << g << " must receive exactly its own shard";
    EXPECT_EQ(received[static_cast<std::size_t>(g)], mine * tsize);
  }
  EXPECT_EQ(writes.size(), covered) << "routes write elements no engine piece covers";

  // Every owned element goes once to every engine rank that keeps it.
  for (int r = 0; r < c.world; ++r)
    EXPECT_EQ(plan.trainer_bytes[static_cast<std::size_t>(r)], sent[static_cast<std::size_t>(r)]);
  std::int64_t total = 0;
  for (auto b : plan.trainer_bytes) total += b;
  std::int64_t engine_total = 0;
  for (auto b : plan.engine_bytes) engine_total += b;
  EXPECT_EQ(total, engine_total);

  // Rounds: no rank moves more than the buffer per round; segments are laid out end to end.
  for (int k = 0; k < plan.rounds; ++k) {
    std::map<int, std::int64_t> per_trainer, per_engine;
    for (const Segment& s : plan.segments[static_cast<std::size_t>(k)]) {
      per_trainer[s.trainer] += s.bytes;
      per_engine[s.engine] += s.bytes;
      std::int64_t offset = 0;
      for (std::size_t q = s.first_route; q < s.first_route + s.num_routes; ++q) {
        const Route& rt = plan.routes[q];
        EXPECT_EQ(rt.round, k);
        EXPECT_EQ(rt.trainer, s.trainer);
        EXPECT_EQ(rt.engine, s.engine);
        EXPECT_EQ(rt.segment_offset, offset);  // bytes; one dtype here, so no padding
        offset += rt.numel() * tsize;
      }
      EXPECT_EQ(offset, s.bytes);
    }
    for (auto [r, b] : per_trainer) EXPECT_LE(b, c.buffer) << "trainer " << r << " round " << k;
    for (auto [g, b] : per_engine) EXPECT_LE(b, c.buffer) << "engine " << g << " round " << k;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, TransferPlanTest,
    ::testing::Values(
        Case{.world = 1, .tp = 1}, Case{.world = 2, .tp = 2}, Case{.world = 3, .tp = 2},
        Case{.world = 3, .tp = 4}, Case{.world = 2, .engines = 2, .tp = 2},
        Case{.world = 5, .engines = 3, .tp = 1}, Case{.model = "tiny-qwen2", .world = 3, .tp = 2},
        Case{.model = "tiny-moe", .world = 2, .tp = 2},
        Case{.world = 3, .tp = 2, .buffer = 512},  // routes split by rows and by columns
        Case{.model = "tiny-qwen2",
             .backend = PolicyBackend::kMegatron,
             .world = 4,
             .megatron = {.tp = 2, .pp = 2, .ep = 1},
             .tp = 2},
        Case{.model = "tiny-moe",
             .backend = PolicyBackend::kMegatron,
             .world = 4,
             .megatron = {.tp = 1, .pp = 2, .ep = 2},
             .engines = 2,
             .tp = 2},
        Case{.model = "tiny-llama",
             .backend = PolicyBackend::kMegatron,
             .world = 4,
             .megatron = {.tp = 4, .pp = 1, .ep = 1},
             .tp = 1,
             .buffer = 4096}));

// Megatron TP 2 x DP 2 -> 2 engines of TP 2: both data-parallel replicas send (one per engine
// replica), instead of the owners sending everything twice.
TEST(TransferPlan, DataParallelReplicasShareTheSending) {
  auto spec = load_model_spec("tiny-llama");
  ASSERT_TRUE(spec.ok());
  Config cfg = config_of({.model = "tiny-llama",
                          .backend = PolicyBackend::kMegatron,
                          .world = 4,
                          .megatron = {.tp = 2, .pp = 1, .ep = 1},
                          .engines = 2,
                          .tp = 2});
  auto s = make_route_setup(cfg, *spec);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  // Ranks 0 and 2 (and 1 and 3) are data-parallel replicas of one TP rank.
  const auto& sent = s->plan.trainer_bytes;
  for (int r : {0, 1}) {
    const auto a = static_cast<double>(sent[static_cast<std::size_t>(r)]);
    const auto b = static_cast<double>(sent[static_cast<std::size_t>(r + 2)]);
    EXPECT_GT(b, 0) << "data-parallel rank " << r + 2 << " sends nothing";
    EXPECT_NEAR(a / b, 1.0, 0.1) << sent[0] << " " << sent[1] << " " << sent[2] << " " << sent[3];
  }
}

// SGLang route metadata: what a trainer rank sends an engine rank rebuilds exactly the segments
// the engine derives itself, and metadata that does not fit the engine's layout is refused.
TEST(TransferPlan, RouteMetadataRebuildsTheIncomingSegments) {
  auto spec = load_model_spec("tiny-qwen2");
  ASSERT_TRUE(spec.ok());
  Config cfg = config_of({.model = "tiny-qwen2", .world = 3, .tp = 2, .buffer = 2048});
  auto s = make_route_setup(cfg, *spec);
  ASSERT_TRUE(s.ok());
  for (int g = 0; g < 2; ++g) {
    const IncomingRoutes want = incoming_from_plan(s->plan, g);
    IncomingRoutes got;
    for (int r : s->plan.sources_of(g))
      ASSERT_TRUE(add_routes_metadata(got, routes_metadata(s->plan, s->engines[g], r, g), r,
                                      s->engines[g])
                      .ok());
    finish_incoming(got);
    ASSERT_EQ(got.rounds.size(), want.rounds.size());
    EXPECT_EQ(got.max_slot_bytes, want.max_slot_bytes);
    for (std::size_t k = 0; k < want.rounds.size(); ++k) {
      ASSERT_EQ(got.rounds[k].size(), want.rounds[k].size()) << "round " << k;
      for (std::size_t i = 0; i < want.rounds[k].size(); ++i) {
        const IncomingSegment &a = got.rounds[k][i], &b = want.rounds[k][i];
        EXPECT_EQ(a.trainer, b.trainer);
        EXPECT_EQ(a.bytes, b.bytes);
        ASSERT_EQ(a.routes.size(), b.routes.size());
        for (std::size_t q = 0; q < a.routes.size(); ++q) {
          EXPECT_EQ(a.routes[q].engine_param, b.routes[q].engine_param);
          EXPECT_EQ(a.routes[q].engine_row, b.routes[q].engine_row);
          EXPECT_EQ(a.routes[q].engine_col, b.routes[q].engine_col);
          EXPECT_EQ(a.routes[q].numel(), b.routes[q].numel());
          EXPECT_EQ(a.routes[q].segment_offset, b.routes[q].segment_offset);
        }
      }
    }
  }
  RoutesMessage m = routes_metadata(s->plan, s->engines[0], 0, 0);
  ASSERT_FALSE(m.routes.empty());
  RoutesMessage unknown = m, outside = m;
  unknown.routes[0].param = "model.no_such.weight";
  outside.routes[0].row = 1 << 20;
  IncomingRoutes in;
  Status st = add_routes_metadata(in, unknown, 0, s->engines[0]);
  EXPECT_NE(st.message().find("model.no_such.weight"), std::string::npos) << st.to_string();
  st = add_routes_metadata(in, outside, 0, s->engines[0]);
  EXPECT_NE(st.message().find("lie outside"), std::string::npos) << st.to_string();
}

// refit.checksum: a trainer rank's checksum of what it sends (its shards, cast) equals the engine
// rank's checksum of what landed from it, and one changed or swapped element breaks exactly that
// feeder's pair.
TEST(TransferPlan, ChecksumsOfBothSidesAgreeAndCatchOneElement) {
  auto spec = load_model_spec("tiny-qwen2");
  ASSERT_TRUE(spec.ok());
  Config cfg = config_of({.model = "tiny-qwen2", .world = 3, .tp = 2, .buffer = 2048});
  auto s = make_route_setup(cfg, *spec);
  ASSERT_TRUE(s.ok());
  auto plane = make_data_plane(cfg);
  ASSERT_TRUE(plane.ok());
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 0.05f);
  std::vector<std::vector<std::vector<float>>> shards(3);
  std::vector<std::vector<void*>> shard_ptrs(3);
  for (int r = 0; r < 3; ++r)
    for (const LocalTensor& t : s->trainers[static_cast<std::size_t>(r)].tensors) {
      auto& v = shards[static_cast<std::size_t>(r)].emplace_back(
          static_cast<std::size_t>(matrix_shape(t.shape).numel()));
      for (float& x : v) x = normal(rng);
      shard_ptrs[static_cast<std::size_t>(r)].push_back(v.data());
    }
  std::vector<std::vector<std::vector<std::uint16_t>>> params(2);
  std::vector<std::vector<void*>> param_ptrs(2);
  for (int g = 0; g < 2; ++g)
    for (const EngineParam& p : s->engines[static_cast<std::size_t>(g)].params) {
      auto& v = params[static_cast<std::size_t>(g)].emplace_back(
          static_cast<std::size_t>(matrix_shape(p.shape).numel()));
      param_ptrs[static_cast<std::size_t>(g)].push_back(v.data());
    }
  // The transfer, route by route, cast as the executors cast.
  for (const Route& q : s->plan.routes) {
    const auto tcols = matrix_shape(
        s->trainers[static_cast<std::size_t>(q.trainer)].tensors[q.trainer_tensor].shape).cols;
    const auto pcols = matrix_shape(
        s->engines[static_cast<std::size_t>(q.engine)].params[q.engine_param].shape).cols;
    convert_block(shard_ptrs[static_cast<std::size_t>(q.trainer)][q.trainer_tensor],
                  DType::kFloat32, q.trainer_row * tcols + q.trainer_col, tcols,
                  param_ptrs[static_cast<std::size_t>(q.engine)][q.engine_param],
                  DType::kBFloat16, q.engine_row * pcols + q.engine_col, pcols, q.rows, q.cols);
  }
  auto sums = [&](int g) {
    std::map<int, std::pair<std::uint64_t, std::uint64_t>> out;  // feeder -> (sent, landed)
    const auto landed = engine_checksum_runs(incoming_from_plan(s->plan, g),
                                             s->engines[static_cast<std::size_t>(g)],
                                             param_ptrs[static_cast<std::size_t>(g)]);
    for (int r : s->plan.sources_of(g)) {
      const auto sent = trainer_checksum_runs(*s, r, g, shard_ptrs[static_cast<std::size_t>(r)]);
      EXPECT_EQ(sent.size(), 1u);  // one dtype: bf16
      auto a = checksum_groups(**plane, sent, DType::kFloat32);
      auto b = checksum_groups(**plane, landed.at(r), std::nullopt);
      EXPECT_TRUE(a.ok() && b.ok());
      out[r] = {*a, *b};
    }
    return out;
  };
  for (int g = 0; g < 2; ++g) {
    ASSERT_EQ(s->plan.sources_of(g).size(), 3u);
    for (const auto& [r, ab] : sums(g)) EXPECT_EQ(ab.first, ab.second) << "trainer " << r;
  }
  // One element of engine rank 1, from the feeder of its first route: only that pair breaks.
  const Route* first = nullptr;
  for (const Route& q : s->plan.routes)
    if (q.engine == 1 && q.numel() > 1) {
      first = &q;
      break;
    }
  ASSERT_NE(first, nullptr);
  const auto pcols = matrix_shape(s->engines[1].params[first->engine_param].shape).cols;
  std::uint16_t& x = params[1][first->engine_param][static_cast<std::size_t>(
      first->engine_row * pcols + first->engine_col)];
  std::uint16_t& y = params[1][first->engine_param][static_cast<std::size_t>(
      first->engine_row * pcols + first->engine_col + 1)];
  x ^= 1;
  for (const auto& [r, ab] : sums(1))
    EXPECT_EQ(ab.first == ab.second, r != first->trainer) << "trainer " << r;
  x ^= 1;
  std::swap(x, y);  // the same values, misplaced
  ASSERT_NE(x, y);
  for (const auto& [r, ab] : sums(1))
    EXPECT_EQ(ab.first == ab.second, r != first->trainer) << "trainer " << r;
}

TEST(TransferPlan, ChecksumDoesNotDependOnHowElementsAreSplit) {
  Config cfg;
  auto plane = make_data_plane(cfg);
  ASSERT_TRUE(plane.ok());
  constexpr std::int64_t kRows = 3000, kCols = 1001;  // past the CPU plane's parallel threshold
  std::vector<float> data(static_cast<std::size_t>(kRows * kCols));
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  for (float& v : data) v = u(rng);
  const auto* src = reinterpret_cast<const std::byte*>(data.data());
  const std::vector<CopyRun> whole = {{src, nullptr, {0, kCols, 0, kCols, kRows, kCols}}};
  std::vector<CopyRun> split;
  for (std::int64_t r0 = kRows; r0 > 0; r0 -= 700) {  // backwards, uneven, and column-split
    const std::int64_t r = std::max<std::int64_t>(0, r0 - 700), rows = r0 - r;
    split.push_back({src, nullptr, {r * kCols + 500, kCols, r * kCols + 500, kCols, rows, kCols - 500}});
    split.push_back({src, nullptr, {r * kCols, kCols, r * kCols, kCols, rows, 500}});
  }
  for (DType as : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3}) {
    auto a = (*plane)->checksum(whole, DType::kFloat32, as);
    auto b = (*plane)->checksum(split, DType::kFloat32, as);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(*a, *b) << dtype_name(as);
    EXPECT_NE(*a, 0u);
  }
}

TEST(TransferPlan, HashCoversTheRoutes) {
  auto spec = load_model_spec("tiny-qwen3");
  ASSERT_TRUE(spec.ok());
  Config a = config_of({});
  Config b = config_of({.buffer = 4096});
  Config c = config_of({.tp = 1});
  auto pa = make_route_setup(a, *spec), pa2 = make_route_setup(a, *spec);
  auto pb = make_route_setup(b, *spec), pc = make_route_setup(c, *spec);
  ASSERT_TRUE(pa.ok() && pa2.ok() && pb.ok() && pc.ok());
  EXPECT_EQ(pa->plan.hash, pa2->plan.hash);
  EXPECT_NE(pa->plan.hash, pb->plan.hash);
  EXPECT_NE(pa->plan.hash, pc->plan.hash);
}

TEST(TransferPlan, EachEngineRankOfTpTReceivesAboutOneTth) {
  auto spec = load_model_spec("qwen3-8b");
  ASSERT_TRUE(spec.ok());
  for (int tp : {1, 2, 4, 8}) {
    Config cfg = config_of({.model = "qwen3-8b", .world = 2, .tp = tp});
    cfg.refit.buffer_size_bytes = 256 << 20;
    auto s = make_route_setup(cfg, *spec);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    const double model = static_cast<double>(spec->total_parameters()) * 2;
    for (auto b : s->plan.engine_bytes) {
      // 1/T of the model plus what every TP rank replicates (norms; kv heads beyond nkv = 8).
      EXPECT_GE(static_cast<double>(b), model / tp * 0.999) << "tp " << tp;
      EXPECT_LE(static_cast<double>(b), model / tp * 1.01) << "tp " << tp;
    }
  }
}

}  // namespace
}  // namespace refit
