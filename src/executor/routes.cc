#include "executor/routes.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <string_view>

#include "common/env.h"
#include "control/store.h"
#include "executor/trainer_scales.h"

namespace refit {

namespace {

// RouteSetup::fp8_from_grid: a block is computed before the refit unless every trainer piece and
// every route that holds part of it holds it whole, and no replica sends it.
void mark_fp8_blocks(RouteSetup& s) {
  const Fp8Table& f = *s.wire.fp8;
  const ModelSpec& wire = s.wire.spec;
  s.fp8_from_grid.assign(wire.tensors().size(), {});
  std::vector<MatrixShape> block(f.model_tensors), hf(f.model_tensors);
  std::vector<std::int64_t> nbc(f.model_tensors, 0);
  for (std::uint32_t w = 0; w < f.model_tensors; ++w) {
    if (!f.quantized(w)) continue;
    block[w] = f.block(wire, w);
    hf[w] = matrix_shape(wire.tensors()[w].shape);
    const std::int64_t nbr = (hf[w].rows + block[w].rows - 1) / block[w].rows;
    nbc[w] = (hf[w].cols + block[w].cols - 1) / block[w].cols;
    s.fp8_from_grid[w].assign(static_cast<std::size_t>(nbr * nbc[w]),
                              block[w].numel() > kFp8FusedBlockElems ? 1 : 0);
  }
  // Marks the blocks that the rectangle [r0, +rows) x [c0, +cols) of weight w holds in part.
  auto mark = [&](std::uint32_t w, std::int64_t r0, std::int64_t c0, std::int64_t rows,
                  std::int64_t cols) {
    if (rows <= 0 || cols <= 0) return;
    const MatrixShape b = block[w], m = hf[w];
    const std::int64_t r1 = r0 + rows, c1 = c0 + cols;
    const std::int64_t kr0 = r0 / b.rows, kr1 = (r1 - 1) / b.rows;
    const std::int64_t kc0 = c0 / b.cols, kc1 = (c1 - 1) / b.cols;
    auto& g = s.fp8_from_grid[w];
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
  for (const TrainerShardLayout& lay : s.trainers)
    for (std::uint32_t l = 0; l < lay.tensors.size(); ++l) {
      const LocalTensor& t = lay.tensors[l];
      for (std::uint32_t p = 0; p < t.pieces.size(); ++p) {
        const Piece& pc = t.pieces[p];
        if (pc.hf_tensor >= f.model_tensors || !f.quantized(pc.hf_tensor)) continue;
        if (std::find(t.owned.begin(), t.owned.end(), p) == t.owned.end()) {
          // A copy another rank owns (data-parallel replica): its routes would quantize blocks
          // whose scale its owner sends, so every block of the weight is computed before.
          std::fill(s.fp8_from_grid[pc.hf_tensor].begin(), s.fp8_from_grid[pc.hf_tensor].end(), 1);
          continue;
        }
        mark(pc.hf_tensor, pc.src_row, pc.src_col, pc.rows, pc.cols);
      }
    }
  for (const Route& r : s.plan.routes)
    if (r.hf_tensor < f.model_tensors && f.quantized(r.hf_tensor))
      mark(r.hf_tensor, r.hf_row, r.hf_col, r.rows, r.cols);
  for (const auto& g : s.fp8_from_grid)
    s.fp8_any_from_grid |= std::find(g.begin(), g.end(), 1) != g.end();
}

}  // namespace

Result<RouteSetup> make_route_setup(const Config& config, const ModelSpec& spec) {
  RouteSetup s;
  REFIT_ASSIGN_OR_RETURN(s.wire, wire_model(config, spec));
  const ModelSpec& wire = s.wire.spec;
  const int world = config.policy.world_size;
  for (int r = 0; r < world; ++r) {
    REFIT_ASSIGN_OR_RETURN(auto lay, trainer_layout(spec, config.policy, r));
    s.user_tensors = lay.tensors.size();
    // FP8 scales: every trainer rank holds every scale tensor whole (it computes them, or gets
    // them from the trainer group, trainer_scales.h), and sends the blocks whose first element it
    // owns: an owned piece of the weight becomes the rectangle of blocks that start inside it.
    for (std::size_t t = spec.tensors().size(); t < wire.tensors().size(); ++t) {
      const auto w = static_cast<std::uint32_t>(s.wire.fp8->weight_of[t]);
      const MatrixShape b = s.wire.fp8->block(wire, w);
      LocalTensor scale{.name = wire.tensors()[t].name, .shape = wire.tensors()[t].shape};
      auto up = [](std::int64_t a, std::int64_t d) { return (a + d - 1) / d; };
      for (const auto& [local, piece] : lay.owned_by_hf[w]) {
        const Piece& p = lay.tensors[local].pieces[piece];
        const std::int64_t r0 = up(p.src_row, b.rows), r1 = up(p.src_row + p.rows, b.rows);
        const std::int64_t c0 = up(p.src_col, b.cols), c1 = up(p.src_col + p.cols, b.cols);
        if (r0 >= r1 || c0 >= c1) continue;
        scale.owned.push_back(static_cast<std::uint32_t>(scale.pieces.size()));
        scale.pieces.push_back(Piece{.hf_tensor = static_cast<std::uint32_t>(t),
                                     .src_row = r0, .src_col = c0,
                                     .rows = r1 - r0, .cols = c1 - c0,
                                     .dst_row = r0, .dst_col = c0});
      }
      lay.tensors.push_back(std::move(scale));
    }
    lay.index_owned(wire.tensors().size());
    s.trainers.push_back(std::move(lay));
  }
  for (int t = 0; t < config.generation.tp_size; ++t) {
    REFIT_ASSIGN_OR_RETURN(auto lay, engine_wire_layout(config, spec, s.wire, t));
    s.engines.push_back(std::move(lay));
  }
  s.plan = make_transfer_plan(wire, s.trainers, s.engines, config.generation.num_engines,
                              s.wire.dtype, config.refit.buffer_size_bytes);
  if (s.wire.fp8) mark_fp8_blocks(s);
  return s;
}

std::string fp8_plan_summary(const RouteSetup& s) {
  if (!s.wire.fp8) return {};
  const Fp8Table& f = *s.wire.fp8;
  std::int64_t before = 0, in_pass = 0;
  for (const auto& g : s.fp8_from_grid)
    for (std::uint8_t b : g) (b ? before : in_pass) += 1;
  return fmt::format(
      "fp8 ({} from {}): {} weights quantized at the sender; of {} blocks, {} scaled in the "
      "quantizing pass, {} before the refit",
      f.scheme == Fp8Scheme::kBlock ? fmt::format("blocks {}x{}", f.block_rows, f.block_cols)
                                    : std::string("one scale per tensor"),
      f.source, f.num_quantized(), before + in_pass, in_pass, before);
}

void RouteCopies::clear() {
  cast.clear();
  scales.clear();
  quant.clear();
  quant_runs.clear();
}

void RouteCopies::add(const RouteSetup& setup, const Route& r, const std::byte* src,
                      std::byte* dst, const Block2D& block, const TrainerScales* grids) {
  const CopyRun run{.src = src, .dst = dst, .block = block};
  const std::optional<Fp8Table>& f = setup.wire.fp8;
  if (f && f->quantized(r.hf_tensor)) {
    const ModelSpec& wire = setup.wire.spec;
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
  } else if (const DType to = setup.plan.dtype_of(r); to == setup.wire.plain) {
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

Status publish_host(Store& store, const std::string& who) {
  return store.set("host/" + who, env::host_identity());
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

std::vector<int> control_targets(const TransferPlan& plan, int rank) {
  std::vector<int> out = plan.targets_of(rank);
  if (rank == 0) {
    for (int g = 0; g < plan.engine_ranks; ++g)
      if (plan.sources_of(g).empty()) out.push_back(g);
    std::sort(out.begin(), out.end());
  }
  return out;
}

std::vector<int> control_sources(const TransferPlan& plan, int engine_rank) {
  std::vector<int> out = plan.sources_of(engine_rank);
  if (out.empty()) out.push_back(0);
  return out;
}

Status check_pair_at_setup(const Config& config, bool same_host, int trainer, int engine_rank) {
  if (config.refit.executor != Executor::kPeer || same_host) return Status::Ok();
  return choose_pair_executor(config, same_host, /*engine_exported=*/true,
                              /*have_p2p_group=*/false, trainer, engine_rank)
      .status();
}

std::int64_t IncomingRoutes::bytes_from(int trainer) const {
  std::int64_t n = 0;
  for (const auto& round : rounds)
    for (const IncomingSegment& s : round)
      if (s.trainer == trainer) n += s.bytes;
  return n;
}

void finish_incoming(IncomingRoutes& in) {
  in.max_slot_bytes = 0;
  for (auto& round : in.rounds) {
    std::stable_sort(round.begin(), round.end(),
                     [](const IncomingSegment& a, const IncomingSegment& b) {
                       return a.trainer < b.trainer;
                     });
    std::int64_t slot = 0;
    for (const IncomingSegment& s : round) slot += aligned_segment_bytes(s.bytes);
    in.max_slot_bytes = std::max(in.max_slot_bytes, slot);
  }
}

IncomingRoutes incoming_from_plan(const TransferPlan& plan, int engine_rank) {
  IncomingRoutes in;
  in.rounds.resize(static_cast<std::size_t>(plan.rounds));
  for (int k = 0; k < plan.rounds; ++k)
    for (const Segment& s : plan.segments[static_cast<std::size_t>(k)]) {
      if (s.engine != engine_rank) continue;
      IncomingSegment seg{.trainer = s.trainer, .bytes = s.bytes};
      seg.routes.assign(plan.routes.begin() + static_cast<std::ptrdiff_t>(s.first_route),
                        plan.routes.begin() + static_cast<std::ptrdiff_t>(s.first_route + s.num_routes));
      in.rounds[static_cast<std::size_t>(k)].push_back(std::move(seg));
    }
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

std::vector<ChecksumGroup> trainer_checksum_runs(const RouteSetup& setup, int trainer, int engine,
                                                 const std::vector<void*>& shards) {
  const EngineShardLayout& layout =
      setup.engines[static_cast<std::size_t>(engine) % setup.engines.size()];
  const std::vector<std::int64_t> key_base = param_key_bases(layout);
  const TrainerShardLayout& mine = setup.trainers[static_cast<std::size_t>(trainer)];
  std::vector<ChecksumGroup> groups;
  for (const Route& r : setup.plan.routes) {
    if (r.trainer != trainer || r.engine != engine || r.numel() == 0) continue;
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
  for (const auto& round : in.rounds)
    for (const IncomingSegment& seg : round) {
      std::vector<ChecksumGroup>& mine = runs[seg.trainer];
      for (const Route& r : seg.routes) {
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

RoutesMessage routes_metadata(const TransferPlan& plan, const EngineShardLayout& layout, int trainer,
                              int engine_rank) {
  RoutesMessage m;
  for (const auto& round : plan.segments)
    for (const Segment& s : round) {
      if (s.trainer != trainer || s.engine != engine_rank) continue;
      for (std::size_t q = s.first_route; q < s.first_route + s.num_routes; ++q) {
        const Route& r = plan.routes[q];
        m.routes.push_back(RouteMetadata{.round = r.round,
                                         .param = layout.params[r.engine_param].name,
                                         .row = r.engine_row,
                                         .col = r.engine_col,
                                         .rows = r.rows,
                                         .cols = r.cols,
                                         .offset = r.segment_offset});
      }
    }
  return m;
}

Status add_routes_metadata(IncomingRoutes& in, const RoutesMessage& m, int trainer,
                           const EngineShardLayout& layout) {
  std::map<std::string_view, std::uint32_t> index;
  for (std::uint32_t p = 0; p < layout.params.size(); ++p) index.emplace(layout.params[p].name, p);
  IncomingSegment* seg = nullptr;
  int seg_round = -1;
  for (std::size_t i = 0; i < m.routes.size(); ++i) {
    const RouteMetadata& r = m.routes[i];
    auto bad = [&](const std::string& what) {
      return Status::Corruption(fmt::format("routes from trainer rank {}: route {} ({} round {}): {}",
                                            trainer, i, r.param, r.round, what));
    };
    const auto it = index.find(r.param);
    if (it == index.end()) return bad("this engine rank has no such parameter");
    const MatrixShape shape = matrix_shape(layout.params[it->second].shape);
    if (r.rows <= 0 || r.cols <= 0 || r.row + r.rows > shape.rows || r.col + r.cols > shape.cols)
      return bad(fmt::format("rows [{}, +{}) x cols [{}, +{}) lie outside its [{}, {}]", r.row,
                             r.rows, r.col, r.cols, shape.rows, shape.cols));
    if (r.round < seg_round) return bad("rounds go backwards");
    if (static_cast<std::size_t>(r.round) >= in.rounds.size())
      in.rounds.resize(static_cast<std::size_t>(r.round) + 1);
    if (r.round != seg_round) {
      in.rounds[static_cast<std::size_t>(r.round)].push_back(IncomingSegment{.trainer = trainer});
      seg = &in.rounds[static_cast<std::size_t>(r.round)].back();
      seg_round = r.round;
    }
    // Routes lie end to end, each at the next multiple of its element size (transfer_plan.h).
    const auto esize = static_cast<std::int64_t>(dtype_size(layout.params[it->second].dtype));
    if (r.offset != (seg->bytes + esize - 1) / esize * esize)
      return bad(fmt::format("its segment offset {} leaves a gap or overlaps (the segment holds {} "
                             "bytes before it)",
                             r.offset, seg->bytes));
    seg->routes.push_back(Route{.trainer = trainer,
                                .engine_param = it->second,
                                .rows = r.rows,
                                .cols = r.cols,
                                .engine_row = r.row,
                                .engine_col = r.col,
                                .round = r.round,
                                .segment_offset = r.offset});
    seg->bytes = r.offset + r.rows * r.cols * esize;
  }
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
