#include "executor/routes.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <string_view>

#include "common/timer.h"
#include "control/store.h"
#include "executor/trainer_scales.h"

namespace refit {

namespace {

// RouteSetup::fp8_from_grid of a trainer rank: a block is computed before the refit unless every
// trainer piece and every route slice that holds part of it holds it whole, and no replica sends
// it (the peer executor copies whole members, but marks follow the slices of the point-to-point
// executor, which either may serve).
// Every route of a block this rank owns whole is its own (each element has one holder but for
// replicas, which mark the whole weight), so its own pieces and routes decide every block it holds.
void mark_fp8_blocks(RouteSetup& s) {
  const Fp8Table& f = *s.wire().fp8;
  const ModelSpec& wire = s.wire().spec;
  const TrainerIndex& index = s.inputs->trainers();
  s.fp8_from_grid.assign(wire.tensors().size(), {});
  std::vector<MatrixShape> block(f.model_tensors), hf(f.model_tensors);
  std::vector<std::int64_t> nbc(f.model_tensors, 0);
  for (const LocalTensor& t : s.trainer.tensors)
    for (const Piece& pc : t.pieces) {
      const std::uint32_t w = pc.hf_tensor;
      if (w >= f.model_tensors || !f.quantized(w) || !s.fp8_from_grid[w].empty()) continue;
      block[w] = f.block(wire, w);
      hf[w] = matrix_shape(wire.tensors()[w].shape);
      const std::int64_t nbr = (hf[w].rows + block[w].rows - 1) / block[w].rows;
      nbc[w] = (hf[w].cols + block[w].cols - 1) / block[w].cols;
      const bool all = block[w].numel() > kFp8FusedBlockElems || index.has_copies(w);
      s.fp8_from_grid[w].assign(static_cast<std::size_t>(nbr * nbc[w]), all ? 1 : 0);
    }
  // Marks the blocks that the rectangle [r0, +rows) x [c0, +cols) of weight w holds in part.
  auto mark = [&](std::uint32_t w, std::int64_t r0, std::int64_t c0, std::int64_t rows,
                  std::int64_t cols) {
    auto& g = s.fp8_from_grid[w];
    if (rows <= 0 || cols <= 0 || g.empty()) return;
    const MatrixShape b = block[w], m = hf[w];
    const std::int64_t r1 = r0 + rows, c1 = c0 + cols;
    const std::int64_t kr0 = r0 / b.rows, kr1 = (r1 - 1) / b.rows;
    const std::int64_t kc0 = c0 / b.cols, kc1 = (c1 - 1) / b.cols;
    auto row = [&](std::int64_t kr) {
      for (std::int64_t kc = kc0; kc <= kc1; ++kc) g[static_cast<std::size_t>(kr * nbc[w] + kc)] = 1;
    };
    auto col = [&](std::int64_t kc) {
      for (std::int64_t kr = kr0; kr <= kr1; ++kr) g[static_cast<std::size_t>(kr * nbc[w] + kc)] = 1;
    };
    if (r0 % b.rows != 0) row(kr0);
    if (r1 % b.rows != 0 && r1 != m.rows) row(kr1);
    if (c0 % b.cols != 0) col(kc0);
    if (c1 % b.cols != 0 && c1 != m.cols) col(kc1);
  };
  for (const LocalTensor& t : s.trainer.tensors)
    for (std::uint32_t p : t.owned) {
      const Piece& pc = t.pieces[p];
      if (pc.hf_tensor < f.model_tensors && f.quantized(pc.hf_tensor))
        mark(pc.hf_tensor, pc.src_row, pc.src_col, pc.rows, pc.cols);
    }
  // Every slice of every route: a round cuts a member larger than the pair budget into rows.
  for (const PairPlan& pair : s.view.pairs)
    for_each_slice(s.view, pair, [&](const Route& sl) {
      for (std::int32_t j = 0; j < sl.count; ++j) {
        const std::uint32_t w = sl.member(j).hf_tensor;
        if (w < f.model_tensors && f.quantized(w)) mark(w, sl.hf_row, sl.hf_col, sl.rows, sl.cols);
      }
    });
  for (const auto& g : s.fp8_from_grid)
    s.fp8_any_from_grid |= std::find(g.begin(), g.end(), 1) != g.end();
  // The blocks this rank sends the scale of: those that start in its owned pieces.
  for (const LocalTensor& t : s.trainer.tensors)
    for (std::uint32_t p : t.owned) {
      const Piece& pc = t.pieces[p];
      const std::uint32_t w = pc.hf_tensor;
      if (w >= f.model_tensors || !f.quantized(w)) continue;
      const MatrixShape b = block[w];
      auto up = [](std::int64_t a, std::int64_t d) { return (a + d - 1) / d; };
      for (std::int64_t kr = up(pc.src_row, b.rows); kr < up(pc.src_row + pc.rows, b.rows); ++kr)
        for (std::int64_t kc = up(pc.src_col, b.cols); kc < up(pc.src_col + pc.cols, b.cols); ++kc)
          (s.fp8_from_grid[w][static_cast<std::size_t>(kr * nbc[w] + kc)] ? s.fp8_blocks_before
                                                                          : s.fp8_blocks_in_pass) +=
              1;
    }
}

// The trainer rank's layout must hold exactly the pieces the index says it holds, and own exactly
// the blocks whose lowest holder it is: the plan is derived from the index, the copies from the
// layout.
Status check_layout_against_index(const RouteSetup& s, int rank) {
  const TrainerIndex& index = s.inputs->trainers();
  std::vector<Holder> pieces, holders;
  std::vector<std::size_t> seen(s.wire().spec.tensors().size(), 0);
  for (std::uint32_t l = 0; l < s.trainer.tensors.size(); ++l) {
    const LocalTensor& t = s.trainer.tensors[l];
    for (std::uint32_t p = 0; p < t.pieces.size(); ++p) {
      const Piece& pc = t.pieces[p];
      pieces.clear();
      index.pieces_of(rank, pc.hf_tensor, pieces);
      const bool found = std::any_of(pieces.begin(), pieces.end(), [&](const Holder& h) {
        return h.local == l && h.piece == p && same_block(h.rect, pc) &&
               h.rect.dst_row == pc.dst_row && h.rect.dst_col == pc.dst_col;
      });
      // The block's lowest holder: this rank when the tensor has no copies (each block has one
      // holder, and the index says this rank holds it).
      int lowest = index.world();
      if (found && !s.inputs->has_copies(pc.hf_tensor)) {
        lowest = rank;
      } else if (found) {
        holders.clear();
        index.holders(pc.hf_tensor, Box::of(pc), holders);
        for (const Holder& h : holders)
          if (same_block(h.rect, pc)) lowest = std::min(lowest, h.rank);
      }
      const bool owned = std::find(t.owned.begin(), t.owned.end(), p) != t.owned.end();
      if (!found || owned != (lowest == rank))
        return Status::Internal(fmt::format(
            "plan: trainer rank {}'s layout and the plan's index disagree on its piece {} of {} "
            "(local tensor {}){}",
            rank, p, s.wire().spec.tensors()[pc.hf_tensor].name, t.name,
            found ? fmt::format(": owned {}, lowest holder {}", owned, lowest) : ""));
      ++seen[pc.hf_tensor];
    }
  }
  for (std::uint32_t t = 0; t < seen.size(); ++t) {
    pieces.clear();
    index.pieces_of(rank, t, pieces);
    if (pieces.size() != seen[t])
      return Status::Internal(
          fmt::format("plan: trainer rank {} holds {} pieces of {}, the plan's index says {}", rank,
                      seen[t], s.wire().spec.tensors()[t].name, pieces.size()));
  }
  return Status::Ok();
}

}  // namespace

Result<RouteSetup> make_trainer_route_setup(std::shared_ptr<PlanInputs> inputs, int rank) {
  Timer timer;
  RouteSetup s;
  s.inputs = std::move(inputs);
  const Config& config = s.inputs->config();
  const WireModel& w = s.wire();
  const ModelSpec& wire = w.spec;
  const std::size_t model_tensors = w.fp8 ? w.fp8->model_tensors : wire.tensors().size();
  // The layout's pieces name model tensors: its spec is the model's (the wire model's first
  // tensors are the model's, in order).
  REFIT_ASSIGN_OR_RETURN(TrainerShardLayout lay,
                         trainer_layout(s.inputs->model(), config.policy, rank));
  s.user_tensors = lay.tensors.size();
  // FP8 scales: every trainer rank holds every scale tensor whole (it computes them, or gets them
  // from the trainer group, trainer_scales.h), and sends the blocks whose first element it owns:
  // an owned piece of the weight becomes the rectangle of blocks that start inside it.
  for (std::size_t t = model_tensors; t < wire.tensors().size(); ++t) {
    const auto weight = static_cast<std::uint32_t>(w.fp8->weight_of[t]);
    const MatrixShape b = w.fp8->block(wire, weight);
    LocalTensor scale{.name = wire.tensors()[t].name, .shape = wire.tensors()[t].shape};
    auto up = [](std::int64_t a, std::int64_t d) { return (a + d - 1) / d; };
    for (const auto& [local, piece] : lay.owned_by_hf[weight]) {
      const Piece& p = lay.tensors[local].pieces[piece];
      const std::int64_t r0 = up(p.src_row, b.rows), r1 = up(p.src_row + p.rows, b.rows);
      const std::int64_t c0 = up(p.src_col, b.cols), c1 = up(p.src_col + p.cols, b.cols);
      if (r0 >= r1 || c0 >= c1) continue;
      scale.owned.push_back(static_cast<std::uint32_t>(scale.pieces.size()));
      scale.pieces.push_back(Piece{.hf_tensor = static_cast<std::uint32_t>(t),
                                   .src_row = r0,
                                   .src_col = c0,
                                   .rows = r1 - r0,
                                   .cols = c1 - c0,
                                   .dst_row = r0,
                                   .dst_col = c0});
    }
    lay.tensors.push_back(std::move(scale));
  }
  // The layout indexed the model's tensors; the scales (when any) are wire tensors past them.
  if (wire.tensors().size() != model_tensors) lay.index_owned(wire.tensors().size());
  s.trainer = std::move(lay);
  if (s.user_tensors != s.inputs->trainers().user_tensors(rank))
    return Status::Internal(
        fmt::format("plan: trainer rank {} has {} local tensors, the plan's index says {}", rank,
                    s.user_tensors, s.inputs->trainers().user_tensors(rank)));
  REFIT_RETURN_IF_ERROR(check_layout_against_index(s, rank));
  REFIT_ASSIGN_OR_RETURN(s.view, trainer_view(*s.inputs, rank));
  if (w.fp8) mark_fp8_blocks(s);
  s.seconds = timer.seconds();
  return s;
}

Result<RouteSetup> make_engine_route_setup(std::shared_ptr<PlanInputs> inputs, int engine_rank) {
  Timer timer;
  RouteSetup s;
  s.inputs = std::move(inputs);
  REFIT_ASSIGN_OR_RETURN(s.view, engine_view(*s.inputs, engine_rank));
  s.seconds = timer.seconds();
  return s;
}

Result<RouteSetup> make_trainer_route_setup(const Config& config, const ModelSpec& spec, int rank) {
  Timer timer;
  REFIT_ASSIGN_OR_RETURN(auto inputs, PlanInputs::create(config, spec));
  REFIT_ASSIGN_OR_RETURN(RouteSetup s, make_trainer_route_setup(std::move(inputs), rank));
  s.seconds = timer.seconds();
  return s;
}

Result<RouteSetup> make_engine_route_setup(const Config& config, const ModelSpec& spec,
                                           int engine_rank) {
  Timer timer;
  REFIT_ASSIGN_OR_RETURN(auto inputs, PlanInputs::create(config, spec));
  REFIT_ASSIGN_OR_RETURN(RouteSetup s, make_engine_route_setup(std::move(inputs), engine_rank));
  s.seconds = timer.seconds();
  return s;
}

std::string fp8_plan_summary(const Fp8Table& f, std::int64_t in_pass, std::int64_t before) {
  return fmt::format(
      "fp8 ({} from {}): {} weights quantized at the sender; of {} blocks, {} scaled in the "
      "quantizing pass, {} before the refit",
      f.scheme == Fp8Scheme::kBlock ? fmt::format("blocks {}x{}", f.block_rows, f.block_cols)
                                    : std::string("one scale per tensor"),
      f.source, f.num_quantized(), in_pass + before, in_pass, before);
}

std::string fp8_plan_summary(const RouteSetup& s) {
  if (!s.wire().fp8) return {};
  return fp8_plan_summary(*s.wire().fp8, s.fp8_blocks_in_pass, s.fp8_blocks_before);
}

void RouteCopies::clear() {
  cast.clear();
  apart.clear();
  scales.clear();
  quant.clear();
  quant_runs.clear();
}

void RouteCopies::add(const RouteSetup& setup, const Route& r, const std::byte* src,
                      std::byte* dst, const Block2D& block, const TrainerScales* grids) {
  const CopyRun run{.src = src, .dst = dst, .block = block};
  const std::optional<Fp8Table>& f = setup.wire().fp8;
  if (f && f->quantized(r.hf_tensor)) {
    const ModelSpec& wire = setup.wire().spec;
    const MatrixShape b = f->block(wire, r.hf_tensor);
    const std::vector<std::uint8_t>& from_grid = setup.fp8_from_grid[r.hf_tensor];
    const bool in_pass = std::find(from_grid.begin(), from_grid.end(), 0) != from_grid.end();
    quant.push_back(QuantRun{
        .run = run,
        .grid = grids->grid(r.hf_tensor),
        .hf_row = r.hf_row,
        .hf_col = r.hf_col,
        .block_rows = b.rows,
        .block_cols = b.cols,
        .scale_cols = (matrix_shape(wire.tensors()[r.hf_tensor].shape).cols + b.cols - 1) / b.cols,
        .from_grid = in_pass ? from_grid.data() : nullptr,
        .bad = grids->bad(),
        .tag = r.hf_tensor});
    quant_runs.push_back(run);
  } else if (f && f->is_scale(r.hf_tensor)) {
    scales.push_back(run);
  } else if (const DType to = setup.view.dtype_of(r); to == setup.wire().plain) {
    cast_to = to;
    cast.push_back(run);
  } else {
    auto group =
        std::find_if(apart.begin(), apart.end(), [&](const auto& g) { return g.first == to; });
    if (group == apart.end()) group = apart.insert(apart.end(), {to, {}});
    group->second.push_back(run);
  }
}

Status RouteCopies::run(DataPlane& plane, DType policy, bool raw) const {
  if (!raw && !quant.empty()) {
    REFIT_RETURN_IF_ERROR(plane.copy_and_quantize(cast, policy, cast_to, quant, policy));
  } else {
    if (!cast.empty()) REFIT_RETURN_IF_ERROR(plane.copy(cast, raw ? cast_to : policy, cast_to));
    if (!quant.empty())
      REFIT_RETURN_IF_ERROR(plane.copy(quant_runs, DType::kFloat8E4M3, DType::kFloat8E4M3));
  }
  for (const auto& [to, runs] : apart)
    REFIT_RETURN_IF_ERROR(plane.copy(runs, raw ? to : policy, to));
  if (!scales.empty())
    REFIT_RETURN_IF_ERROR(plane.copy(scales, DType::kFloat32, DType::kFloat32));
  return Status::Ok();
}

std::pair<const std::vector<CopyRun>*, DType> RouteCopies::written() const {
  if (quant_runs.size() > cast.size()) return {&quant_runs, DType::kFloat8E4M3};
  if (cast.empty() && !scales.empty()) return {&scales, DType::kFloat32};
  if (cast.empty() && !apart.empty()) return {&apart.front().second, apart.front().first};
  return {&cast, cast_to};
}

bool uses_transfer_plan(const Config& config) {
  return config.refit.executor != Executor::kGather;
}

bool needs_p2p_group(const Config& config) {
  if (!uses_transfer_plan(config) || config.refit.executor == Executor::kPeer) return false;
  return !(config.device == Device::kCuda && config.generation.colocated);
}

Status publish_host(Store& store, const std::string& who, const std::string& host_identity) {
  return store.set("host/" + who, host_identity);
}

Result<std::vector<std::string>> read_hosts(Store& store, const std::vector<std::string>& who,
                                            std::chrono::milliseconds timeout,
                                            const std::function<Status()>& alive) {
  std::vector<std::string> out;
  for (const std::string& w : who) {
    auto h = get_while_alive(store, "host/" + w, timeout, alive);
    if (!h.ok()) return h.status().with_context(fmt::format("reading the host of {}", w));
    out.push_back(std::move(h).value());
  }
  return out;
}

std::vector<int> control_targets(const RouteSetup& setup) {
  std::vector<int> out = setup.view.peers();
  if (setup.view.rank == 0) {
    // An engine TP rank whose layout holds no piece receives nothing from anyone.
    const PlanInputs& in = *setup.inputs;
    for (int g = 0; g < in.engine_ranks(); ++g) {
      const EngineShardLayout& lay = in.engine(g % in.tp_size());
      const bool none = std::all_of(lay.params.begin(), lay.params.end(),
                                    [](const EngineParam& p) { return p.pieces.empty(); });
      if (none) out.push_back(g);
    }
    std::sort(out.begin(), out.end());
  }
  return out;
}

std::vector<int> control_sources(const RouteSetup& setup) {
  std::vector<int> out = setup.view.peers();
  if (out.empty()) out.push_back(0);
  return out;
}

std::string pair_routes_digest(const RouteSetup& setup, int peer) {
  const PairPlan* pair = setup.view.pair_with(peer);
  return pair != nullptr ? pair->digest_hex() : std::string("none");
}

std::int64_t pair_bytes(const RouteSetup& setup, int peer) {
  const PairPlan* pair = setup.view.pair_with(peer);
  return pair != nullptr ? pair->bytes : 0;
}

Status routes_digest_mismatch(int trainer, const RankId& engine, const std::string& ours,
                              const std::string& theirs) {
  return Status::InvalidArgument(fmt::format(
      "setup: transfer plan mismatch: trainer rank {} and engine rank {} ({}) derived different "
      "routes for their pair (routes digest {} on trainer rank {}, {} on engine rank {}); both "
      "sides must derive the plan from the same model, layouts and settings, with the same refit "
      "version",
      trainer, engine.rank, engine.name(), ours, trainer, theirs.empty() ? "none" : theirs,
      engine.rank));
}

Status check_pair_at_setup(const Config& config, bool same_host, int trainer, int engine_rank) {
  if (config.refit.executor != Executor::kPeer || same_host) return Status::Ok();
  return choose_pair_executor(config, same_host, /*engine_exported=*/true,
                              /*have_p2p_group=*/false, trainer, engine_rank)
      .status();
}

std::int64_t IncomingRoutes::bytes_from(int trainer) const {
  for (const IncomingPair& p : pairs)
    if (p.trainer == trainer) return p.bytes;
  return 0;
}

void for_each_incoming_slice(const IncomingPair& pair, std::int64_t budget,
                             const EngineShardLayout& layout,
                             const std::function<void(const Route&)>& f) {
  for_each_slice(
      pair.routes,
      [&](const Route& r) {
        return static_cast<std::int64_t>(dtype_size(layout.params[r.engine_param].dtype));
      },
      budget, f);
}

void finish_incoming(IncomingRoutes& in) {
  std::sort(in.pairs.begin(), in.pairs.end(),
            [](const IncomingPair& a, const IncomingPair& b) { return a.trainer < b.trainer; });
  in.rounds = 0;
  for (const IncomingPair& p : in.pairs)
    in.rounds = std::max(in.rounds, static_cast<int>(p.round_bytes.size()));
  std::vector<std::int64_t> slot(static_cast<std::size_t>(in.rounds), 0);
  for (const IncomingPair& p : in.pairs)
    for (std::size_t k = 0; k < p.round_bytes.size(); ++k)
      slot[k] += aligned_segment_bytes(p.round_bytes[k]);
  in.max_slot_bytes = 0;
  for (std::int64_t b : slot) in.max_slot_bytes = std::max(in.max_slot_bytes, b);
}

IncomingRoutes incoming_from_view(const PlanView& view) {
  IncomingRoutes in;
  in.pair_budget = view.pair_budget;
  for (const PairPlan& p : view.pairs)
    in.pairs.push_back(IncomingPair{
        .trainer = p.trainer, .routes = p.routes, .round_bytes = p.round_bytes, .bytes = p.bytes});
  finish_incoming(in);
  return in;
}

namespace {

// Where each parameter's elements start in the rank's key space (common/checksum.h).
std::vector<std::int64_t> param_key_bases(const EngineShardLayout& layout) {
  std::vector<std::int64_t> base;
  std::int64_t at = 0;
  for (const EngineParam& p : layout.params) {
    base.push_back(at);
    at += matrix_shape(p.shape).numel();
  }
  return base;
}

// A route's elements at `data` (a tensor of `cols` columns, the route's top-left at (row, col)),
// keyed by their place in engine parameter `r.engine_param`.
CopyRun checksum_run(const Route& r, const void* data, std::int64_t row, std::int64_t col,
                     std::int64_t cols, const EngineShardLayout& layout,
                     const std::vector<std::int64_t>& key_base) {
  const std::int64_t pcols = matrix_shape(layout.params[r.engine_param].shape).cols;
  return CopyRun{.src = static_cast<const std::byte*>(data),
                 .dst = nullptr,
                 .block = {.src_offset = row * cols + col,
                           .src_stride = cols,
                           .dst_offset = key_base[r.engine_param] + r.engine_row * pcols + r.engine_col,
                           .dst_stride = pcols,
                           .rows = r.rows,
                           .cols = r.cols}};
}

// The group of `groups` for `dtype`, made when missing.
std::vector<CopyRun>& group_of(std::vector<ChecksumGroup>& groups, DType dtype) {
  for (ChecksumGroup& g : groups)
    if (g.dtype == dtype) return g.runs;
  return groups.emplace_back(ChecksumGroup{.dtype = dtype}).runs;
}

}  // namespace

std::vector<ChecksumGroup> trainer_checksum_runs(const RouteSetup& setup, int engine,
                                                 const std::vector<void*>& shards) {
  const EngineShardLayout& layout = setup.engine_layout(engine);
  const std::vector<std::int64_t> key_base = param_key_bases(layout);
  const TrainerShardLayout& mine = setup.trainer;
  std::vector<ChecksumGroup> groups;
  const PairPlan* pair = setup.view.pair_with(engine);
  if (pair == nullptr) return groups;
  for (const Route& route : pair->routes)
    for (std::int32_t j = 0; j < route.count; ++j) {
      const Route r = route.member(j);
      if (r.numel() == 0) continue;
      const std::int64_t tcols = matrix_shape(mine.tensors[r.trainer_tensor].shape).cols;
      group_of(groups, layout.params[r.engine_param].dtype)
          .push_back(checksum_run(r, shards[r.trainer_tensor], r.trainer_row, r.trainer_col, tcols,
                                  layout, key_base));
    }
  return groups;
}

std::map<int, std::vector<ChecksumGroup>> engine_checksum_runs(const IncomingRoutes& in,
                                                               const EngineShardLayout& layout,
                                                               const std::vector<void*>& params) {
  const std::vector<std::int64_t> key_base = param_key_bases(layout);
  std::map<int, std::vector<ChecksumGroup>> runs;
  for (const IncomingPair& pair : in.pairs) {
    std::vector<ChecksumGroup>& mine = runs[pair.trainer];
    for (const Route& route : pair.routes)
      for (std::int32_t j = 0; j < route.count; ++j) {
        const Route r = route.member(j);
        if (r.numel() == 0) continue;
        const std::int64_t pcols = matrix_shape(layout.params[r.engine_param].shape).cols;
        group_of(mine, layout.params[r.engine_param].dtype)
            .push_back(checksum_run(r, params[r.engine_param], r.engine_row, r.engine_col, pcols,
                                    layout, key_base));
      }
  }
  return runs;
}

Result<std::uint64_t> checksum_groups(DataPlane& plane, const std::vector<ChecksumGroup>& groups,
                                      std::optional<DType> src) {
  std::uint64_t sum = 0;  // the terms' sum modulo 2^64, whatever the grouping (common/checksum.h)
  for (const ChecksumGroup& g : groups) {
    REFIT_ASSIGN_OR_RETURN(const std::uint64_t part,
                           plane.checksum(g.runs, src.value_or(g.dtype), g.dtype));
    sum += part;
  }
  return sum;
}

RoutesMessage routes_metadata(const PairPlan& pair, const EngineShardLayout& layout) {
  RoutesMessage m;
  m.routes.reserve(pair.routes.size());
  for (const Route& r : pair.routes)
    m.routes.push_back(RouteMetadata{.round = r.round,
                                     .param = layout.params[r.engine_param].name,
                                     .row = r.engine_row,
                                     .col = r.engine_col,
                                     .rows = r.rows,
                                     .cols = r.cols,
                                     .offset = r.segment_offset,
                                     .count = r.count,
                                     .param_step = r.step.engine_param,
                                     .row_step = r.step.engine_row,
                                     .col_step = r.step.engine_col});
  return m;
}

Status add_routes_metadata(IncomingRoutes& in, const RoutesMessage& m, int trainer,
                           const EngineShardLayout& layout) {
  std::map<std::string_view, std::uint32_t> index;
  for (std::uint32_t p = 0; p < layout.params.size(); ++p) index.emplace(layout.params[p].name, p);
  IncomingPair pair{.trainer = trainer};
  pair.routes.reserve(m.routes.size());
  const auto nparams = static_cast<std::int64_t>(layout.params.size());
  for (std::size_t i = 0; i < m.routes.size(); ++i) {
    const RouteMetadata& r = m.routes[i];
    auto bad = [&](const std::string& what) {
      return Status::Corruption(fmt::format("routes from trainer rank {}: route {} ({} round {}): {}",
                                            trainer, i, r.param, r.round, what));
    };
    const auto it = index.find(r.param);
    if (it == index.end()) return bad("this engine rank has no such parameter");
    if (r.rows <= 0 || r.cols <= 0 || r.count <= 0)
      return bad(fmt::format("{} x {} elements in {} member(s): nothing to place", r.rows, r.cols,
                             r.count));
    // Every member: a parameter of this rank, of the first one's dtype, holding the rectangle.
    const DType dtype = layout.params[it->second].dtype;
    for (std::int64_t j = 0; j < r.count; ++j) {
      const std::int64_t p = it->second + j * r.param_step;
      const std::int64_t row = r.row + j * r.row_step, col = r.col + j * r.col_step;
      if (p < 0 || p >= nparams)
        return bad(fmt::format("member {} names parameter {} of this rank's {}", j, p, nparams));
      const EngineParam& param = layout.params[static_cast<std::size_t>(p)];
      const MatrixShape shape = matrix_shape(param.shape);
      if (param.dtype != dtype)
        return bad(fmt::format("member {} writes {} ({}), the first member's parameter is {}", j,
                               param.name, dtype_name(param.dtype), dtype_name(dtype)));
      if (row < 0 || col < 0 || row + r.rows > shape.rows || col + r.cols > shape.cols)
        return bad(
            fmt::format("member {}: rows [{}, +{}) x cols [{}, +{}) lie outside {}'s [{}, {}]", j,
                        row, r.rows, col, r.cols, param.name, shape.rows, shape.cols));
    }
    pair.routes.push_back(
        Route{.trainer = trainer,
              .engine_param = it->second,
              .rows = r.rows,
              .cols = r.cols,
              .engine_row = r.row,
              .engine_col = r.col,
              .round = r.round,
              .segment_offset = r.offset,
              .count = static_cast<std::int32_t>(r.count),
              .step = RouteStep{.engine_param = static_cast<std::int32_t>(r.param_step),
                                .engine_row = r.row_step,
                                .engine_col = r.col_step}});
  }
  // The placement the pair budget gives must be the one the trainer rank states: segments end to
  // end, in the same rounds.
  std::vector<std::pair<int, std::int64_t>> stated;
  stated.reserve(pair.routes.size());
  for (const Route& r : pair.routes) stated.emplace_back(r.round, r.segment_offset);
  place_routes(
      pair.routes,
      [&](const Route& r) {
        return static_cast<std::int64_t>(dtype_size(layout.params[r.engine_param].dtype));
      },
      in.pair_budget, pair.round_bytes, pair.bytes);
  Status placement = Status::Ok();
  for (std::size_t i = 0; i < pair.routes.size() && placement.ok(); ++i) {
    const Route& r = pair.routes[i];
    if (stated[i].first != r.round || stated[i].second != r.segment_offset)
      placement = Status::Corruption(fmt::format(
          "routes from trainer rank {}: route {} ({}): stated at round {} offset {}, but the pair "
          "budget of {} bytes places it at round {} offset {}: the segments would leave a gap or "
          "overlap",
          trainer, i, layout.params[r.engine_param].name, stated[i].first, stated[i].second,
          in.pair_budget, r.round, r.segment_offset));
  }
  REFIT_RETURN_IF_ERROR(placement);
  in.pairs.push_back(std::move(pair));
  return Status::Ok();
}

Result<PairExecutor> choose_pair_executor(const Config& config, bool same_host,
                                          bool engine_exported, bool have_p2p_group, int trainer,
                                          int engine_rank) {
  const Executor want = config.refit.executor;
  const bool peer_ok = same_host && engine_exported;
  if (want != Executor::kP2p && peer_ok) return PairExecutor::kPeer;
  if (want != Executor::kPeer && have_p2p_group) return PairExecutor::kP2p;
  const std::string pair = fmt::format("trainer rank {} -> engine rank {}", trainer, engine_rank);
  if (!same_host)
    return Status::InvalidArgument(fmt::format(
        "refit.executor: {}: {} are on different hosts, so peer access is impossible; use "
        "refit.executor: auto or p2p",
        executor_name(want), pair));
  return Status::InvalidArgument(fmt::format(
      "refit.executor: {}: {}: the engine's parameters are not exported memory (peer access "
      "writes into memory refit allocated: Engine::allocate_params()), and {}; allocate the "
      "parameters with allocate_params(), or set refit.executor: gather",
      executor_name(want), pair,
      want == Executor::kPeer ? "executor peer forms no point-to-point group"
                              : "no point-to-point group exists (device: cuda with colocated "
                                "ranks sharing GPUs)"));
}

}  // namespace refit
