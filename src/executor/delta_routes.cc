#include "executor/delta_routes.h"

#include <fmt/format.h>

#include "delta/format.h"

namespace refit {

std::string digest_hex(std::uint64_t digest) { return fmt::format("{:016x}", digest); }

std::size_t delta_directory_bytes(std::size_t routes) {
  return delta_format::kHeaderBytes + sizeof(delta_format::RouteEntry) * routes;
}

namespace {

// Where each parameter's elements start in the rank's key space (the keys of refit.checksum).
std::vector<std::int64_t> key_bases(const EngineShardLayout& layout) {
  std::vector<std::int64_t> base;
  std::int64_t at = 0;
  for (const EngineParam& p : layout.params) {
    base.push_back(at);
    at += matrix_shape(p.shape).numel();
  }
  return base;
}

std::string rectangle(const std::string& name, const Route& r, std::int64_t row, std::int64_t col) {
  return fmt::format("{} rows [{}, +{}) x cols [{}, +{})", name, row, r.rows, col, r.cols);
}

}  // namespace

std::function<std::string(std::uint32_t)> PairDeltaRoutes::describe() const {
  return [this](std::uint32_t tag) {
    return tag < names.size() ? fmt::format("route {} ({})", tag, names[tag])
                              : fmt::format("route {}", tag);
  };
}

PairDeltaRoutes trainer_delta_routes(const RouteSetup& setup, DType policy, int trainer, int engine,
                                     DeltaSource source, const std::vector<void*>* shards,
                                     const std::byte* segment, const std::vector<void*>* params,
                                     int round) {
  PairDeltaRoutes out;
  const PlanView& view = setup.view;
  const PairPlan* pair = view.pair_with(engine);
  if (!view.trainer_side || view.rank != trainer || pair == nullptr) return out;
  const EngineShardLayout& layout = setup.engine_layout(engine);
  const std::vector<std::int64_t> base = key_bases(layout);
  const TrainerShardLayout& mine = setup.trainer;
  const WireModel& wire = setup.wire();
  const std::optional<Fp8Table>& f = wire.fp8;
  std::uint32_t tag = 0;
  // Slice by slice in the pair's order (the order of the engine's IncomingRoutes), each compact
  // slice member by member, where the p2p sender packs them.
  for_each_slice(view, *pair, [&](const Route& slice) {
    const DType wire_dtype = view.dtype_of(slice);
    const auto esize = static_cast<std::int64_t>(dtype_size(wire_dtype));
    std::int64_t at = slice.segment_offset;
    for (std::int32_t j = 0; j < slice.count; ++j, ++tag) {
      const Route r = slice.member(j);
      const std::int64_t here = at;
      at += r.numel() * esize;
      const std::int64_t pcols = matrix_shape(layout.params[r.engine_param].shape).cols;
      out.names.push_back(rectangle(wire.spec.tensors()[r.hf_tensor].name, r, r.hf_row, r.hf_col));
      if (round >= 0 && slice.round != round) continue;
      DeltaRoute d;
      d.wire_dtype = wire_dtype;
      d.block.rows = r.rows;
      d.block.cols = r.cols;
      if (source == DeltaSource::kShards) {
        const std::int64_t tcols = matrix_shape(mine.tensors[r.trainer_tensor].shape).cols;
        d.src =
            shards != nullptr ? static_cast<const std::byte*>((*shards)[r.trainer_tensor]) : nullptr;
        d.src_dtype = f && f->is_scale(r.hf_tensor) ? DType::kFloat32 : policy;
        d.block.src_offset = r.trainer_row * tcols + r.trainer_col;
        d.block.src_stride = tcols;
      } else {
        d.src = segment != nullptr ? segment + here : nullptr;
        d.src_dtype = d.wire_dtype;
        d.block.src_offset = 0;
        d.block.src_stride = r.cols;
      }
      if (params != nullptr) d.dst = static_cast<std::byte*>((*params)[r.engine_param]);
      d.block.dst_offset = r.engine_row * pcols + r.engine_col;
      d.block.dst_stride = pcols;
      d.key = static_cast<std::uint64_t>(base[r.engine_param] + r.engine_row * pcols + r.engine_col);
      d.key_stride = pcols;
      d.tag = tag;
      out.routes.push_back(d);
    }
  });
  assign_kept_offsets(out.routes);
  return out;
}

PairDeltaRoutes engine_delta_routes(const IncomingRoutes& in, const EngineShardLayout& layout,
                                    int trainer, const std::vector<void*>& params, int round) {
  PairDeltaRoutes out;
  const std::vector<std::int64_t> base = key_bases(layout);
  std::uint32_t tag = 0;
  for (const IncomingPair& pair : in.pairs) {
    if (pair.trainer != trainer) continue;
    for_each_incoming_slice(pair, in.pair_budget, layout, [&](const Route& slice) {
      for (std::int32_t j = 0; j < slice.count; ++j, ++tag) {
        const Route r = slice.member(j);
        const EngineParam& p = layout.params[r.engine_param];
        const std::int64_t pcols = matrix_shape(p.shape).cols;
        out.names.push_back(rectangle(p.name, r, r.engine_row, r.engine_col));
        if (round >= 0 && slice.round != round) continue;
        DeltaRoute d;
        d.wire_dtype = p.dtype;
        d.src_dtype = p.dtype;
        d.dst = static_cast<std::byte*>(params[r.engine_param]);
        d.block = {.src_offset = 0,
                   .src_stride = r.cols,
                   .dst_offset = r.engine_row * pcols + r.engine_col,
                   .dst_stride = pcols,
                   .rows = r.rows,
                   .cols = r.cols};
        d.key =
            static_cast<std::uint64_t>(base[r.engine_param] + r.engine_row * pcols + r.engine_col);
        d.key_stride = pcols;
        d.tag = tag;
        out.routes.push_back(d);
      }
    });
  }
  return out;
}

}  // namespace refit
