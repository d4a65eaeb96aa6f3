// The per-rank views of the transfer plan checked against a global reference: every trainer
// rank's and every engine rank's view, put together, must move exactly the elements the
// reference plan moves — the one every rank built before views existed, kept here (and only here)
// as the reference. The reference walks every rank's full layout; the element-by-element checks
// never call the plan's own intersection code.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/checksum.h"
#include "common/convert.h"
#include "executor/routes.h"
#include "plan/transfer_plan.h"
#include "plane/data_plane.h"
#include "refit/config.h"
#include "refit/model_spec.h"

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
  EngineLayout layout = EngineLayout::kFused;
  bool fp8 = false;
  std::string config_json;  // a random model instead of a preset
};

std::ostream& operator<<(std::ostream& os, const Case& c) {
  return os << fmt::format(
             "{} {} world {} (tp {} pp {} ep {}) -> {} x TP {}, buffer {}{}{}",
             c.config_json.empty() ? c.model : c.config_json, policy_backend_name(c.backend),
             c.world, c.megatron.tp, c.megatron.pp, c.megatron.ep, c.engines, c.tp, c.buffer,
             c.layout == EngineLayout::kHf ? ", layout hf" : "", c.fp8 ? ", fp8 4x4 blocks" : "");
}

Config config_of(const Case& c) {
  Config cfg;
  cfg.model = c.model;
  cfg.policy.backend = c.backend;
  cfg.policy.world_size = c.world;
  cfg.policy.megatron = c.megatron;
  cfg.generation.num_engines = c.engines;
  cfg.generation.tp_size = c.tp;
  cfg.generation.layout = c.layout;
  cfg.refit.buffer_size_bytes = c.buffer;
  if (c.fp8) {
    cfg.refit.target_precision = DType::kFloat8E4M3;
    cfg.refit.fp8 =
        Fp8Config{.scheme = Fp8Scheme::kBlock, .block_rows = 4, .block_cols = 4, .given = true};
  }
  return cfg;
}

Result<ModelSpec> spec_of(const Case& c) {
  if (c.config_json.empty()) return load_model_spec(c.model);
  REFIT_ASSIGN_OR_RETURN(ModelConfig mc, parse_hf_config(c.config_json));
  return ModelSpec(mc, "random");
}

// One element moved: (trainer rank, local tensor, row, col) -> (engine rank, parameter, row, col).
using Move = std::tuple<int, std::uint32_t, std::int64_t, std::int64_t, int, std::uint32_t,
                        std::int64_t, std::int64_t>;

// The reference plan (the global builder every rank ran before per-rank views), element by
// element: for every HF tensor, every owned piece of every trainer rank, every engine replica e and
// TP rank k, the piece's copy (e + k) mod copies (copies: every rank's piece of the same block, in
// rank order) intersected with every engine piece of that tensor.
std::vector<Move> reference_moves(const std::vector<TrainerShardLayout>& trainers,
                                  const std::vector<const EngineShardLayout*>& engines,
                                  int num_engines, std::size_t tensors) {
  using Rect = std::tuple<std::uint32_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t>;
  struct Copy {
    int rank;
    std::uint32_t local, piece;
  };
  std::map<Rect, std::vector<Copy>> holders;
  for (int r = 0; r < static_cast<int>(trainers.size()); ++r) {
    const TrainerShardLayout& lay = trainers[static_cast<std::size_t>(r)];
    for (std::uint32_t l = 0; l < lay.tensors.size(); ++l)
      for (std::uint32_t p = 0; p < lay.tensors[l].pieces.size(); ++p) {
        const Piece& pc = lay.tensors[l].pieces[p];
        holders[Rect{pc.hf_tensor, pc.src_row, pc.src_col, pc.rows, pc.cols}].push_back(
            Copy{r, l, p});
      }
  }
  const int tp = static_cast<int>(engines.size());
  std::vector<Move> out;
  for (std::uint32_t t = 0; t < tensors; ++t)
    for (const TrainerShardLayout& lay : trainers)
      for (const auto& [local, piece] : lay.owned_by_hf[t]) {
        const Piece& own = lay.tensors[local].pieces[piece];
        const auto& copies =
            holders.at(Rect{own.hf_tensor, own.src_row, own.src_col, own.rows, own.cols});
        for (int e = 0; e < num_engines; ++e)
          for (int k = 0; k < tp; ++k) {
            const Copy& from = copies[static_cast<std::size_t>(e + k) % copies.size()];
            const Piece& src = trainers[static_cast<std::size_t>(from.rank)]
                                   .tensors[from.local]
                                   .pieces[from.piece];
            const EngineShardLayout& eng = *engines[static_cast<std::size_t>(k)];
            for (const auto& [param, epiece] : eng.pieces_by_hf[t]) {
              const Piece& keep = eng.params[param].pieces[epiece];
              for (std::int64_t i = std::max(src.src_row, keep.src_row);
                   i < std::min(src.src_row + src.rows, keep.src_row + keep.rows); ++i)
                for (std::int64_t j = std::max(src.src_col, keep.src_col);
                     j < std::min(src.src_col + src.cols, keep.src_col + keep.cols); ++j)
                  out.emplace_back(from.rank, from.local, src.dst_row + i - src.src_row,
                                   src.dst_col + j - src.src_col, e * tp + k, param,
                                   keep.dst_row + i - keep.src_row,
                                   keep.dst_col + j - keep.src_col);
            }
          }
      }
  std::sort(out.begin(), out.end());
  return out;
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

struct AllViews {
  std::shared_ptr<PlanInputs> inputs;
  std::vector<RouteSetup> trainers;
  std::vector<RouteSetup> engines;
};

Result<AllViews> all_views(const Config& cfg, const ModelSpec& spec) {
  AllViews v;
  REFIT_ASSIGN_OR_RETURN(v.inputs, PlanInputs::create(cfg, spec));
  for (int r = 0; r < cfg.policy.world_size; ++r) {
    REFIT_ASSIGN_OR_RETURN(RouteSetup s, make_trainer_route_setup(v.inputs, r));
    v.trainers.push_back(std::move(s));
  }
  for (int g = 0; g < cfg.engine_ranks(); ++g) {
    REFIT_ASSIGN_OR_RETURN(RouteSetup s, make_engine_route_setup(v.inputs, g));
    v.engines.push_back(std::move(s));
  }
  return v;
}

// Checks every rank's view of `c` against the reference; false (with failures recorded) or true.
void check_views(const Case& c) {
  SCOPED_TRACE(::testing::PrintToString(c));
  const Config cfg = config_of(c);
  auto spec = spec_of(c);
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  auto views = all_views(cfg, *spec);
  ASSERT_TRUE(views.ok()) << views.status().to_string();
  const PlanInputs& in = *views->inputs;
  const std::vector<DType>& dtypes = *in.dtypes();
  const std::size_t wire_tensors = in.wire().spec.tensors().size();

  // The views' moves, member by member, element by element.
  std::vector<Move> moves;
  std::vector<std::int64_t> sent(static_cast<std::size_t>(c.world), 0);
  for (const RouteSetup& s : views->trainers) {
    const TrainerShardLayout& tl = s.trainer;
    std::int64_t bytes = 0;
    for (const PairPlan& pair : s.view.pairs) {
      ASSERT_EQ(pair.trainer, s.view.rank);
      const EngineShardLayout& el = s.engine_layout(pair.engine);
      for (const Route& route : pair.routes)
        for (std::int32_t m = 0; m < route.count; ++m) {
          const Route rt = route.member(m);
          ASSERT_LT(rt.trainer_tensor, tl.tensors.size());
          ASSERT_LT(rt.engine_param, el.params.size());
          const auto& local = tl.tensors[rt.trainer_tensor];
          const auto& param = el.params[rt.engine_param];
          for (std::int64_t i = 0; i < rt.rows; ++i)
            for (std::int64_t j = 0; j < rt.cols; ++j) {
              const auto from = hf_of(local.pieces, rt.trainer_row + i, rt.trainer_col + j);
              const auto to = hf_of(param.pieces, rt.engine_row + i, rt.engine_col + j);
              ASSERT_TRUE(from && to) << "route element outside both layouts";
              ASSERT_EQ(*from, *to) << "route moves an element to another HF position";
              ASSERT_EQ(std::get<0>(*to), rt.hf_tensor);
              moves.emplace_back(pair.trainer, rt.trainer_tensor, rt.trainer_row + i,
                                 rt.trainer_col + j, pair.engine, rt.engine_param,
                                 rt.engine_row + i, rt.engine_col + j);
            }
          bytes += rt.numel() * static_cast<std::int64_t>(dtype_size(dtypes[rt.hf_tensor]));
        }
    }
    EXPECT_EQ(bytes, s.view.bytes) << "trainer rank " << s.view.rank;
    sent[static_cast<std::size_t>(s.view.rank)] = bytes;
  }
  std::sort(moves.begin(), moves.end());
  EXPECT_EQ(std::adjacent_find(moves.begin(), moves.end()), moves.end())
      << "an element moved twice";

  // Together, the views are the reference plan.
  std::vector<TrainerShardLayout> layouts;
  for (const RouteSetup& s : views->trainers) layouts.push_back(s.trainer);
  std::vector<const EngineShardLayout*> engines;
  for (int k = 0; k < c.tp; ++k) engines.push_back(&in.engine(k));
  const std::vector<Move> want = reference_moves(layouts, engines, c.engines, wire_tensors);
  EXPECT_EQ(moves.size(), want.size());
  EXPECT_TRUE(moves == want) << "the views move other elements than the reference plan";

  // Every covered engine element exactly once; each engine view receives exactly its shard, and
  // its pairs are its trainer ranks' pairs, route for route.
  std::map<std::tuple<int, std::uint32_t, std::int64_t, std::int64_t>, int> writes;
  for (const Move& m : moves)
    writes[{std::get<4>(m), std::get<5>(m), std::get<6>(m), std::get<7>(m)}]++;
  std::size_t covered = 0;
  for (const RouteSetup& s : views->engines) {
    const int g = s.view.rank;
    const EngineShardLayout& el = s.engine_layout(g);
    std::int64_t mine = 0;
    for (std::uint32_t p = 0; p < el.params.size(); ++p)
      for (const Piece& pc : el.params[p].pieces) {
        for (std::int64_t i = 0; i < pc.rows; ++i)
          for (std::int64_t j = 0; j < pc.cols; ++j) {
            auto it = writes.find({g, p, pc.dst_row + i, pc.dst_col + j});
            ASSERT_NE(it, writes.end()) << "engine rank " << g << " param " << el.params[p].name
                                        << " element (" << pc.dst_row + i << ", "
                                        << pc.dst_col + j << ") is never written";
            ASSERT_EQ(it->second, 1) << "written twice";
            ++covered;
          }
        mine += pc.rows * pc.cols * static_cast<std::int64_t>(dtype_size(dtypes[pc.hf_tensor]));
      }
    EXPECT_EQ(s.view.bytes, mine) << "engine rank " << g << " must receive exactly its own shard";
    for (const PairPlan& pair : s.view.pairs) {
      const PairPlan* theirs =
          views->trainers[static_cast<std::size_t>(pair.trainer)].view.pair_with(g);
      ASSERT_NE(theirs, nullptr) << "engine rank " << g << " expects trainer rank " << pair.trainer;
      EXPECT_EQ(pair.digest, theirs->digest);
      EXPECT_EQ(pair.round_bytes, theirs->round_bytes);
      ASSERT_EQ(pair.routes.size(), theirs->routes.size());
      for (std::size_t q = 0; q < pair.routes.size(); ++q) {
        const Route &a = pair.routes[q], &b = theirs->routes[q];
        EXPECT_TRUE(std::tie(a.hf_tensor, a.trainer_tensor, a.engine_param, a.rows, a.cols,
                             a.trainer_row, a.trainer_col, a.engine_row, a.engine_col, a.round,
                             a.segment_offset, a.count) ==
                        std::tie(b.hf_tensor, b.trainer_tensor, b.engine_param, b.rows, b.cols,
                                 b.trainer_row, b.trainer_col, b.engine_row, b.engine_col, b.round,
                                 b.segment_offset, b.count) &&
                    a.step == b.step)
            << "pair " << pair.trainer << " -> " << g << " route " << q;
      }
    }
    std::size_t sources = 0;
    for (const RouteSetup& t : views->trainers) sources += t.view.pair_with(g) != nullptr;
    EXPECT_EQ(sources, s.view.pairs.size()) << "engine rank " << g;
  }
  EXPECT_EQ(writes.size(), covered) << "routes write elements no engine piece covers";

  // Rounds: per rank and round, at most the buffer (a segment holds at most the pair budget); the
  // slices of a pair lie end to end, each at a multiple of its element size.
  for (const auto* side : {&views->trainers, &views->engines})
    for (const RouteSetup& s : *side) {
      std::map<int, std::int64_t> per_round;
      for (const PairPlan& pair : s.view.pairs) {
        std::vector<std::int64_t> end(static_cast<std::size_t>(pair.rounds()), 0);
        std::int64_t elems = 0;
        for_each_slice(s.view, pair, [&](const Route& sl) {
          ASSERT_LT(sl.round, pair.rounds());
          const auto esize = static_cast<std::int64_t>(dtype_size(dtypes[sl.hf_tensor]));
          auto& e = end[static_cast<std::size_t>(sl.round)];
          EXPECT_EQ(sl.segment_offset, (e + esize - 1) / esize * esize) << "a gap in a segment";
          e = sl.segment_offset + sl.numel() * esize;
          elems += sl.numel();
        });
        EXPECT_EQ(end, pair.round_bytes);
        std::int64_t route_elems = 0;
        for (const Route& r : pair.routes) route_elems += r.numel();
        EXPECT_EQ(elems, route_elems) << "slices must cover every member once";
        for (int k = 0; k < pair.rounds(); ++k) {
          const std::int64_t b = pair.round_bytes[static_cast<std::size_t>(k)];
          EXPECT_GT(b, 0);
          if (s.view.pair_budget >= 8) {
            EXPECT_LE(b, s.view.pair_budget);
          }
          per_round[k] += b;
        }
      }
      for (auto [k, b] : per_round) {
        if (s.view.pair_budget < 8) continue;
        EXPECT_LE(b, c.buffer) << (s.view.trainer_side ? "trainer" : "engine") << " rank "
                               << s.view.rank << " round " << k;
      }
    }
}

class TransferPlanTest : public ::testing::TestWithParam<Case> {};

TEST_P(TransferPlanTest, AllViewsTogetherAreTheReferencePlan) { check_views(GetParam()); }

INSTANTIATE_TEST_SUITE_P(
    Layouts, TransferPlanTest,
    ::testing::Values(
        Case{.world = 1, .tp = 1}, Case{.world = 2, .tp = 2}, Case{.world = 3, .tp = 2},
        Case{.world = 3, .tp = 4}, Case{.world = 2, .engines = 2, .tp = 2},
        Case{.world = 5, .engines = 3, .tp = 1}, Case{.model = "tiny-qwen2", .world = 3, .tp = 2},
        Case{.model = "tiny-moe", .world = 2, .tp = 2},
        Case{.model = "tiny-moe", .world = 3, .engines = 2, .tp = 2, .buffer = 700},
        Case{.model = "tiny-moe", .world = 2, .tp = 2, .layout = EngineLayout::kHf},
        Case{.model = "tiny-qwen2-moe", .world = 3, .tp = 2},
        Case{.model = "tiny-phi3", .world = 2, .tp = 2},
        Case{.model = "tiny-gemma3", .world = 3, .tp = 2},
        Case{.world = 3, .tp = 2, .buffer = 512},  // routes split by rows and by columns
        Case{.world = 3, .tp = 2, .buffer = 7},    // budgets smaller than an element
        Case{.model = "tiny-moe", .world = 2, .tp = 2, .fp8 = true},
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
        Case{.model = "tiny-moe",
             .backend = PolicyBackend::kMegatron,
             .world = 8,
             .megatron = {.tp = 2, .pp = 1, .ep = 2},
             .engines = 2,
             .tp = 2,
             .fp8 = true},
        Case{.model = "tiny-llama",
             .backend = PolicyBackend::kMegatron,
             .world = 4,
             .megatron = {.tp = 4, .pp = 1, .ep = 1},
             .tp = 1,
             .buffer = 4096}));

// Random shapes, world sizes, TP sizes, replicas, splits and buffers (a fixed seed, so a failure
// reproduces): Qwen3 dense and MoE tables, FSDP2 and Megatron, fused and hf engine layouts.
TEST(TransferPlan, RandomShapesAndSizesMatchTheReference) {
  std::mt19937 rng(20261202);
  auto pick = [&](std::vector<int> v) {
    return v[std::uniform_int_distribution<std::size_t>(0, v.size() - 1)(rng)];
  };
  int checked = 0;
  for (int attempt = 0; attempt < 400 && checked < 24; ++attempt) {
    const int kv = pick({1, 2, 4});
    const int heads = kv * pick({1, 2, 3});
    const int d = pick({4, 8});
    const bool moe = pick({0, 1}) == 1;
    const int layers = pick({1, 2, 3});
    Case c;
    c.config_json = fmt::format(
        R"({{"architectures": ["{}"], "hidden_size": {}, "intermediate_size": {},
            "num_hidden_layers": {}, "num_attention_heads": {}, "num_key_value_heads": {},
            "head_dim": {}, "vocab_size": {}, "num_experts": {}, "num_experts_per_tok": 2,
            "moe_intermediate_size": {}, "mlp_only_layers": {}, "tie_word_embeddings": {}}})",
        moe ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM", 8 * pick({2, 3, 4}), 8 * pick({2, 3, 5}),
        layers, heads, kv, d, pick({61, 97, 130}), pick({2, 3, 5, 9}), 4 * pick({2, 3, 4}),
        moe && layers > 1 ? "[0]" : "[]", pick({0, 1}) ? "true" : "false");
    c.tp = pick({1, 2, 4});
    c.engines = pick({1, 2, 3});
    c.buffer = pick({64, 300, 1000, 4096, 1 << 20});
    c.layout = pick({0, 0, 1}) ? EngineLayout::kHf : EngineLayout::kFused;
    if (pick({0, 1, 2}) == 0) {
      c.backend = PolicyBackend::kMegatron;
      c.megatron = {.tp = pick({1, 2}), .pp = pick({1, 2}), .ep = moe ? pick({1, 2}) : 1};
      c.world = c.megatron.tp * c.megatron.pp * pick({1, 2}) * c.megatron.ep;
    } else {
      c.world = pick({1, 2, 3, 5, 7});
    }
    const Config cfg = config_of(c);
    auto spec = spec_of(c);
    ASSERT_TRUE(spec.ok()) << spec.status().to_string() << "\n" << c.config_json;
    // Shapes a TP size or split cannot shard are refused at setup; draw again.
    if (!PlanInputs::create(cfg, *spec).ok() || !all_views(cfg, *spec).ok()) continue;
    check_views(c);
    if (::testing::Test::HasFailure()) return;
    ++checked;
  }
  EXPECT_GE(checked, 24) << "too few random cases could be sharded";
}

// Rounds of routes whose members fit the pair budget, against the rule written member by member:
// a member goes at the end of the current segment, aligned to its element size, when it fits
// there, else at the start of the next round. Random counts, sizes, element sizes and budgets,
// with routes that fill many rounds whole (which place_routes takes a round at a time); both
// place_routes and for_each_slice (what the executors walk) must follow the rule.
TEST(TransferPlan, PlacementPacksWholeMembersInOrder) {
  std::mt19937 rng(20261203);
  auto draw = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  int whole_rounds = 0;  // trials with a route that fills three rounds or more by itself
  for (int trial = 0; trial < 300; ++trial) {
    const std::int64_t budget = draw(16, 4096);
    std::vector<Route> routes(static_cast<std::size_t>(draw(1, 12)));
    std::vector<std::int64_t> esize(routes.size());
    bool fills = false;
    for (std::size_t i = 0; i < routes.size(); ++i) {
      Route& r = routes[i];
      esize[i] = std::int64_t{1} << draw(0, 2);
      r.hf_tensor = static_cast<std::uint32_t>(i);
      r.rows = draw(1, 4);
      r.cols = draw(1, std::max<std::int64_t>(1, budget / (r.rows * esize[i])));
      r.count = static_cast<std::int32_t>(draw(1, 300));
      fills |= r.count >= 3 * (budget / (r.rows * r.cols * esize[i]));
    }
    whole_rounds += fills;
    // The rule, member by member: each member's (round, offset), each round's bytes.
    std::vector<std::vector<std::pair<int, std::int64_t>>> at(routes.size());
    std::vector<std::int64_t> want_rounds;
    std::int64_t want_bytes = 0, used = 0;
    int round = 0;
    for (std::size_t i = 0; i < routes.size(); ++i) {
      const std::int64_t es = esize[i], m = routes[i].member_numel() * es;
      for (std::int32_t j = 0; j < routes[i].count; ++j) {
        std::int64_t off = (used + es - 1) / es * es;
        if (off + m > budget) {
          ++round;
          off = 0;
        }
        at[i].emplace_back(round, off);
        used = off + m;
        want_rounds.resize(static_cast<std::size_t>(round) + 1, 0);
        want_rounds.back() = used;
        want_bytes += m;
      }
    }
    auto esize_of = [&](const Route& r) { return esize[r.hf_tensor]; };
    std::vector<std::int64_t> rounds;
    std::int64_t bytes = 0;
    place_routes(routes, esize_of, budget, rounds, bytes);
    ASSERT_EQ(rounds, want_rounds) << "trial " << trial << ", budget " << budget;
    ASSERT_EQ(bytes, want_bytes) << "trial " << trial;
    for (std::size_t i = 0; i < routes.size(); ++i) {
      EXPECT_EQ(routes[i].round, at[i].front().first) << "trial " << trial << " route " << i;
      EXPECT_EQ(routes[i].segment_offset, at[i].front().second)
          << "trial " << trial << " route " << i;
    }
    std::vector<std::size_t> seen(routes.size(), 0);
    for_each_slice(routes, esize_of, budget, [&](const Route& sl) {
      const std::size_t i = sl.hf_tensor;
      const std::int64_t m = sl.member_numel() * esize[i];
      for (std::int32_t k = 0; k < sl.count; ++k) {
        ASSERT_LT(seen[i], at[i].size()) << "trial " << trial << " route " << i;
        EXPECT_EQ(sl.round, at[i][seen[i]].first) << "trial " << trial << " route " << i;
        EXPECT_EQ(sl.segment_offset + k * m, at[i][seen[i]].second)
            << "trial " << trial << " route " << i << " member " << seen[i];
        ++seen[i];
      }
    });
    for (std::size_t i = 0; i < routes.size(); ++i)
      EXPECT_EQ(seen[i], at[i].size()) << "trial " << trial << " route " << i;
    if (::testing::Test::HasFailure()) return;
  }
  EXPECT_GE(whole_rounds, 100) << "too few trials with routes that fill rounds whole";
}

// Compact routes: the routes of a pair do not grow with the number of experts, and a run of
// stacked experts is one route.
TEST(TransferPlan, RoutesPerPairDoNotGrowWithTheExperts) {
  std::map<int, std::size_t> max_routes;
  for (int experts : {4, 16, 64}) {
    const std::string json = fmt::format(
        R"({{"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 300, "num_experts": {},
            "num_experts_per_tok": 2, "moe_intermediate_size": 24}})",
        experts);
    for (const auto& [backend, world] :
         {std::pair{PolicyBackend::kFsdp2, 3}, std::pair{PolicyBackend::kMegatron, 4}}) {
      Case c{.backend = backend, .world = world, .engines = 2, .tp = 2, .config_json = json};
      if (backend == PolicyBackend::kMegatron) c.megatron = {.tp = 2, .pp = 1, .ep = 2};
      auto spec = spec_of(c);
      ASSERT_TRUE(spec.ok());
      auto views = all_views(config_of(c), *spec);
      ASSERT_TRUE(views.ok()) << views.status().to_string();
      std::size_t most = 0, longest = 0;
      for (const auto* side : {&views->trainers, &views->engines})
        for (const RouteSetup& s : *side)
          for (const PairPlan& p : s.view.pairs) {
            most = std::max(most, p.routes.size());
            for (const Route& r : p.routes) longest = std::max<std::size_t>(longest, r.count);
          }
      max_routes[experts * 10 + static_cast<int>(backend)] = most;
      // Every expert of the pair's EP rank in one route (Megatron: ep 2 halves them).
      EXPECT_EQ(longest, static_cast<std::size_t>(backend == PolicyBackend::kMegatron ? experts / 2
                                                                                      : experts))
          << experts << " experts";
    }
  }
  for (int b : {0, 1}) {
    EXPECT_EQ(max_routes[40 + b], max_routes[160 + b]);
    EXPECT_EQ(max_routes[40 + b], max_routes[640 + b]);
  }
}

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
  auto v = all_views(cfg, *spec);
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  // Ranks 0 and 2 (and 1 and 3) are data-parallel replicas of one TP rank.
  for (int r : {0, 1}) {
    const auto a = static_cast<double>(v->trainers[static_cast<std::size_t>(r)].view.bytes);
    const auto b = static_cast<double>(v->trainers[static_cast<std::size_t>(r + 2)].view.bytes);
    EXPECT_GT(b, 0) << "data-parallel rank " << r + 2 << " sends nothing";
    EXPECT_NEAR(a / b, 1.0, 0.1) << a << " " << b;
  }
}

// SGLang route metadata: what a trainer rank sends an engine rank rebuilds exactly the pair the
// engine derives itself, and metadata that does not fit the engine's layout is refused.
TEST(TransferPlan, RouteMetadataRebuildsTheIncomingPairs) {
  for (const char* model : {"tiny-qwen2", "tiny-moe"}) {
    auto spec = load_model_spec(model);
    ASSERT_TRUE(spec.ok());
    Config cfg = config_of({.model = model, .world = 3, .tp = 2, .buffer = 2048});
    auto v = all_views(cfg, *spec);
    ASSERT_TRUE(v.ok());
    for (int g = 0; g < 2; ++g) {
      const RouteSetup& e = v->engines[static_cast<std::size_t>(g)];
      const IncomingRoutes want = incoming_from_view(e.view);
      IncomingRoutes got;
      got.pair_budget = e.view.pair_budget;
      for (int r : e.view.peers()) {
        const PairPlan* pair = v->trainers[static_cast<std::size_t>(r)].view.pair_with(g);
        ASSERT_NE(pair, nullptr);
        const Status st = add_routes_metadata(got, routes_metadata(*pair, e.engine_layout(g)), r,
                                              e.engine_layout(g));
        ASSERT_TRUE(st.ok()) << st.to_string();
      }
      finish_incoming(got);
      EXPECT_EQ(got.rounds, want.rounds);
      EXPECT_EQ(got.max_slot_bytes, want.max_slot_bytes);
      ASSERT_EQ(got.pairs.size(), want.pairs.size());
      for (std::size_t i = 0; i < want.pairs.size(); ++i) {
        const IncomingPair &a = got.pairs[i], &b = want.pairs[i];
        EXPECT_EQ(a.trainer, b.trainer);
        EXPECT_EQ(a.bytes, b.bytes);
        EXPECT_EQ(a.round_bytes, b.round_bytes);
        ASSERT_EQ(a.routes.size(), b.routes.size());
        for (std::size_t q = 0; q < a.routes.size(); ++q) {
          EXPECT_EQ(a.routes[q].engine_param, b.routes[q].engine_param);
          EXPECT_EQ(a.routes[q].engine_row, b.routes[q].engine_row);
          EXPECT_EQ(a.routes[q].engine_col, b.routes[q].engine_col);
          EXPECT_EQ(a.routes[q].numel(), b.routes[q].numel());
          EXPECT_EQ(a.routes[q].count, b.routes[q].count);
          EXPECT_EQ(a.routes[q].step.engine_row, b.routes[q].step.engine_row);
          EXPECT_EQ(a.routes[q].segment_offset, b.routes[q].segment_offset);
        }
      }
    }
    const RouteSetup& e0 = v->engines[0];
    const PairPlan* pair = v->trainers[0].view.pair_with(0);
    ASSERT_NE(pair, nullptr);
    RoutesMessage m = routes_metadata(*pair, e0.engine_layout(0));
    ASSERT_FALSE(m.routes.empty());
    RoutesMessage unknown = m, outside = m, moved = m;
    unknown.routes[0].param = "model.no_such.weight";
    outside.routes[0].row = 1 << 20;
    moved.routes.back().offset += 2;
    for (const auto& [bad, what] :
         {std::pair{&unknown, "model.no_such.weight"}, std::pair{&outside, "lie outside"},
          std::pair{&moved, "would leave a gap or overlap"}}) {
      IncomingRoutes in;
      in.pair_budget = e0.view.pair_budget;
      const Status st = add_routes_metadata(in, *bad, 0, e0.engine_layout(0));
      EXPECT_NE(st.message().find(what), std::string::npos) << st.to_string();
    }
    // A compact route whose last member would leave its parameter.
    for (RouteMetadata& r : m.routes)
      if (r.count > 1) {
        r.count += 1000;
        IncomingRoutes in;
        in.pair_budget = e0.view.pair_budget;
        const Status st = add_routes_metadata(in, m, 0, e0.engine_layout(0));
        EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.to_string();
        break;
      }
  }
}

// refit.checksum: a trainer rank's checksum of what it sends (its shards, cast) equals the engine
// rank's checksum of what landed from it, and one changed or swapped element breaks exactly that
// feeder's pair.
TEST(TransferPlan, ChecksumsOfBothSidesAgreeAndCatchOneElement) {
  auto spec = load_model_spec("tiny-moe");
  ASSERT_TRUE(spec.ok());
  Config cfg = config_of({.model = "tiny-moe", .world = 3, .tp = 2, .buffer = 2048});
  auto v = all_views(cfg, *spec);
  ASSERT_TRUE(v.ok());
  auto plane = make_data_plane(cfg);
  ASSERT_TRUE(plane.ok());
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 0.05f);
  std::vector<std::vector<std::vector<float>>> shards(3);
  std::vector<std::vector<void*>> shard_ptrs(3);
  for (int r = 0; r < 3; ++r)
    for (const LocalTensor& t : v->trainers[static_cast<std::size_t>(r)].trainer.tensors) {
      auto& x = shards[static_cast<std::size_t>(r)].emplace_back(
          static_cast<std::size_t>(matrix_shape(t.shape).numel()));
      for (float& e : x) e = normal(rng);
      shard_ptrs[static_cast<std::size_t>(r)].push_back(x.data());
    }
  std::vector<std::vector<std::vector<std::uint16_t>>> params(2);
  std::vector<std::vector<void*>> param_ptrs(2);
  for (int g = 0; g < 2; ++g)
    for (const EngineParam& p : v->engines[static_cast<std::size_t>(g)].engine_layout(g).params) {
      auto& x = params[static_cast<std::size_t>(g)].emplace_back(
          static_cast<std::size_t>(matrix_shape(p.shape).numel()));
      param_ptrs[static_cast<std::size_t>(g)].push_back(x.data());
    }
  // The transfer, member by member, cast as the executors cast.
  for (const RouteSetup& t : v->trainers)
    for (const PairPlan& pair : t.view.pairs)
      for (const Route& route : pair.routes)
        for (std::int32_t m = 0; m < route.count; ++m) {
          const Route q = route.member(m);
          const auto tcols = matrix_shape(t.trainer.tensors[q.trainer_tensor].shape).cols;
          const auto pcols =
              matrix_shape(t.engine_layout(pair.engine).params[q.engine_param].shape).cols;
          convert_block(shard_ptrs[static_cast<std::size_t>(pair.trainer)][q.trainer_tensor],
                        DType::kFloat32, q.trainer_row * tcols + q.trainer_col, tcols,
                        param_ptrs[static_cast<std::size_t>(pair.engine)][q.engine_param],
                        DType::kBFloat16, q.engine_row * pcols + q.engine_col, pcols, q.rows,
                        q.cols);
        }
  auto sums = [&](int g) {
    std::map<int, std::pair<std::uint64_t, std::uint64_t>> out;  // feeder -> (sent, landed)
    const RouteSetup& e = v->engines[static_cast<std::size_t>(g)];
    const auto landed = engine_checksum_runs(incoming_from_view(e.view), e.engine_layout(g),
                                             param_ptrs[static_cast<std::size_t>(g)]);
    for (int r : e.view.peers()) {
      const auto sent = trainer_checksum_runs(v->trainers[static_cast<std::size_t>(r)], g,
                                              shard_ptrs[static_cast<std::size_t>(r)]);
      EXPECT_EQ(sent.size(), 1u);  // one dtype: bf16
      auto a = checksum_groups(**plane, sent, DType::kFloat32);
      auto b = checksum_groups(**plane, landed.at(r), std::nullopt);
      EXPECT_TRUE(a.ok() && b.ok());
      out[r] = {*a, *b};
    }
    return out;
  };
  for (int g = 0; g < 2; ++g) {
    ASSERT_EQ(v->engines[static_cast<std::size_t>(g)].view.pairs.size(), 3u);
    for (const auto& [r, ab] : sums(g)) EXPECT_EQ(ab.first, ab.second) << "trainer " << r;
  }
  // One element of engine rank 1, in the last member of a compact route: only that pair breaks.
  const PairPlan* pair = nullptr;
  const Route* compact = nullptr;
  for (const PairPlan& p : v->engines[1].view.pairs)
    for (const Route& q : p.routes)
      if (q.count > 1 && q.cols > 1 && compact == nullptr) compact = &q, pair = &p;
  ASSERT_NE(compact, nullptr);
  const Route last = compact->member(compact->count - 1);
  const auto pcols =
      matrix_shape(v->engines[1].engine_layout(1).params[last.engine_param].shape).cols;
  std::uint16_t& x = params[1][last.engine_param]
                           [static_cast<std::size_t>(last.engine_row * pcols + last.engine_col)];
  std::uint16_t& y =
      params[1][last.engine_param]
            [static_cast<std::size_t>(last.engine_row * pcols + last.engine_col + 1)];
  x ^= 1;
  for (const auto& [r, ab] : sums(1))
    EXPECT_EQ(ab.first == ab.second, r != pair->trainer) << "trainer " << r;
  x ^= 1;
  std::swap(x, y);  // the same values, misplaced
  ASSERT_NE(x, y);
  for (const auto& [r, ab] : sums(1))
    EXPECT_EQ(ab.first == ab.second, r != pair->trainer) << "trainer " << r;
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

// The CPU plane's checksum is its definition (common/checksum.h): the sum over the elements of
// checksum_term(the element's index in the destination, the bits of its cast value), for every
// width of cast value, on strided blocks.
TEST(TransferPlan, ChecksumIsTheSumOfItsTerms) {
  Config cfg;
  auto plane = make_data_plane(cfg);
  ASSERT_TRUE(plane.ok());
  constexpr std::int64_t kRows = 37, kCols = 45, kSrcStride = 50, kDstStride = 61, kDstAt = 7;
  std::vector<float> data(static_cast<std::size_t>(kRows * kSrcStride));
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(-3.f, 3.f);
  for (float& v : data) v = u(rng);
  const std::vector<CopyRun> runs = {{reinterpret_cast<const std::byte*>(data.data()), nullptr,
                                      {0, kSrcStride, kDstAt, kDstStride, kRows, kCols}}};
  for (DType as : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3}) {
    std::uint64_t want = 0;
    for (std::int64_t r = 0; r < kRows; ++r)
      for (std::int64_t c = 0; c < kCols; ++c) {
        std::uint32_t bits = 0;  // little endian: the cast value's bytes, zero-extended
        convert(&data[static_cast<std::size_t>(r * kSrcStride + c)], DType::kFloat32, &bits, as, 1);
        want += checksum_term(static_cast<std::uint64_t>(kDstAt + r * kDstStride + c), bits);
      }
    auto got = (*plane)->checksum(runs, DType::kFloat32, as);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_EQ(*got, want) << dtype_name(as);
  }
}

// The plan's identity follows its inputs; a pair's digest follows its routes.
TEST(TransferPlan, IdentityAndDigestsCoverTheInputs) {
  auto spec = load_model_spec("tiny-qwen3");
  ASSERT_TRUE(spec.ok());
  auto identity = [&](const Config& c) {
    auto in = PlanInputs::create(c, *spec);
    EXPECT_TRUE(in.ok());
    return (*in)->identity();
  };
  const Config a = config_of({});
  Config hf = a;
  hf.generation.layout = EngineLayout::kHf;
  EXPECT_EQ(identity(a), identity(a));
  for (const Config& other : {config_of({.buffer = 4096}), config_of({.tp = 1}),
                              config_of({.world = 3}), config_of({.engines = 2}), hf})
    EXPECT_NE(identity(a), identity(other));
  auto digests = [&](const Config& c) {
    auto s = make_trainer_route_setup(c, *spec, 0);
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    std::vector<std::uint64_t> d;
    for (const PairPlan& p : s->view.pairs) d.push_back(p.digest);
    return d;
  };
  EXPECT_EQ(digests(a), digests(a));
  const auto d = digests(a);
  ASSERT_EQ(d.size(), 2u);
  EXPECT_NE(d[0], d[1]);
  EXPECT_NE(digests(config_of({.buffer = 4096})), d);
}

TEST(TransferPlan, EachEngineRankOfTpTReceivesAboutOneTth) {
  auto spec = load_model_spec("qwen3-8b");
  ASSERT_TRUE(spec.ok());
  for (int tp : {1, 2, 4, 8}) {
    Config cfg = config_of({.model = "qwen3-8b", .world = 2, .tp = tp});
    cfg.refit.buffer_size_bytes = 256 << 20;
    auto in = PlanInputs::create(cfg, *spec);
    ASSERT_TRUE(in.ok()) << in.status().to_string();
    const double model = static_cast<double>(spec->total_parameters()) * 2;
    for (int g = 0; g < tp; ++g) {
      auto v = engine_view(**in, g);
      ASSERT_TRUE(v.ok());
      // 1/T of the model plus what every TP rank replicates (norms; kv heads beyond nkv = 8).
      EXPECT_GE(static_cast<double>(v->bytes), model / tp * 0.999) << "tp " << tp;
      EXPECT_LE(static_cast<double>(v->bytes), model / tp * 1.01) << "tp " << tp;
      EXPECT_EQ(v->pairs.size(), 2u);
    }
  }
}

}  // namespace
}  // namespace refit
