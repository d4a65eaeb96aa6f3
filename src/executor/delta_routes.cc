#include "executor/delta_routes.h"

#include <fmt/format.h>

namespace refit {
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
  const EngineShardLayout& layout =
      setup.engines[static_cast<std::size_t>(engine) % setup.engines.size()];
  const std::vector<std::int64_t> base = key_bases(layout);
  const TrainerShardLayout& mine = setup.trainers[static_cast<std::size_t>(trainer)];
  const std::optional<Fp8Table>& f = setup.wire.fp8;
  std::uint32_t tag = 0;
  for (const auto& segments : setup.plan.segments)
    for (const Segment& s : segments) {
      if (s.trainer != trainer || s.engine != engine) continue;
      for (std::size_t q = s.first_route; q < s.first_route + s.num_routes; ++q, ++tag) {
        const Route& r = setup.plan.routes[q];
        const std::int64_t pcols = matrix_shape(layout.params[r.engine_param].shape).cols;
        out.names.push_back(
            rectangle(setup.wire.spec.tensors()[r.hf_tensor].name, r, r.hf_row, r.hf_col));
        if (round >= 0 && r.round != round) continue;
        DeltaRoute d;
        d.wire_dtype = setup.plan.dtype_of(r);
        d.block.rows = r.rows;
        d.block.cols = r.cols;
        if (source == DeltaSource::kShards) {
          const std::int64_t tcols = matrix_shape(mine.tensors[r.trainer_tensor].shape).cols;
          d.src = shards != nullptr ? static_cast<const std::byte*>((*shards)[r.trainer_tensor])
                                    : nullptr;
          d.src_dtype = f && f->is_scale(r.hf_tensor) ? DType::kFloat32 : policy;
          d.block.src_offset = r.trainer_row * tcols + r.trainer_col;
          d.block.src_stride = tcols;
        } else {
          d.src = segment != nullptr ? segment + r.segment_offset : nullptr;
          d.src_dtype = d.wire_dtype;
          d.block.src_offset = 0;
          d.block.src_stride = r.cols;
        }
        if (params != nullptr) d.dst = static_cast<std::byte*>((*params)[r.engine_param]);
        d.block.dst_offset = r.engine_row * pcols + r.engine_col;
        d.block.dst_stride = pcols;
        d.key =
            static_cast<std::uint64_t>(base[r.engine_param] + r.engine_row * pcols + r.engine_col);
        d.key_stride = pcols;
        d.tag = tag;
        out.routes.push_back(d);
      }
    }
  assign_kept_offsets(out.routes);
  return out;
}

PairDeltaRoutes engine_delta_routes(const IncomingRoutes& in, const EngineShardLayout& layout,
                                    int trainer, const std::vector<void*>& params, int round) {
  PairDeltaRoutes out;
  const std::vector<std::int64_t> base = key_bases(layout);
  std::uint32_t tag = 0;
  for (std::size_t k = 0; k < in.rounds.size(); ++k)
    for (const IncomingSegment& seg : in.rounds[k]) {
      if (seg.trainer != trainer) continue;
      for (const Route& r : seg.routes) {
        const EngineParam& p = layout.params[r.engine_param];
        const std::int64_t pcols = matrix_shape(p.shape).cols;
        out.names.push_back(rectangle(p.name, r, r.engine_row, r.engine_col));
        if (round >= 0 && static_cast<int>(k) != round) {
          ++tag;
          continue;
        }
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
        d.tag = tag++;
        out.routes.push_back(d);
      }
    }
  return out;
}

}  // namespace refit
