#include "executor/trainer_scales.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"
#include "common/quantize.h"

namespace refit {

Result<std::unique_ptr<TrainerScales>> TrainerScales::create(const RouteSetup& setup, int rank,
                                                             DataPlane& plane) {
  std::unique_ptr<TrainerScales> s(new TrainerScales(setup, rank, plane));
  const ModelSpec& wire = setup.wire.spec;
  const std::size_t first = setup.wire.fp8->model_tensors;
  for (std::size_t t = first; t < wire.tensors().size(); ++t) {
    s->offset_.push_back(s->total_);
    s->total_ += matrix_shape(wire.tensors()[t].shape).numel();
  }
  const auto bytes = static_cast<std::size_t>(std::max<std::int64_t>(s->total_, 1)) * 4;
  REFIT_ASSIGN_OR_RETURN(s->scales_, plane.allocate(bytes));
  REFIT_ASSIGN_OR_RETURN(s->amax_, plane.allocate(bytes));
  return s;
}

std::vector<void*> TrainerScales::local_tensors() const {
  std::vector<void*> out;
  for (std::int64_t off : offset_) out.push_back(scales_->data() + off * 4);
  return out;
}

std::byte* TrainerScales::grid(std::uint32_t weight) const {
  const Fp8Table& f = *setup_.wire.fp8;
  const auto i = static_cast<std::size_t>(f.scale_of[weight]) - f.model_tensors;
  return scales_->data() + offset_[i] * 4;
}

Status TrainerScales::compute(const std::vector<void*>& shards, DType dtype,
                              Communicator* trainer_group) {
  const Fp8Table& f = *setup_.wire.fp8;
  const ModelSpec& wire = setup_.wire.spec;
  const TrainerShardLayout& mine = setup_.trainers[static_cast<std::size_t>(rank_)];
  if (runs_for_ != shards) {
    runs_.clear();
    for (std::uint32_t t = 0; t < f.model_tensors; ++t) {
      if (!f.quantized(t)) continue;
      const MatrixShape block = f.block(wire, t);
      const MatrixShape hf = matrix_shape(wire.tensors()[t].shape);
      const auto i = static_cast<std::size_t>(f.scale_of[t]) - f.model_tensors;
      for (const auto& [local, piece] : mine.owned_by_hf[t]) {
        const Piece& p = mine.tensors[local].pieces[piece];
        const std::int64_t cols = matrix_shape(mine.tensors[local].shape).cols;
        runs_.push_back(QuantRun{
            .run = {.src = static_cast<const std::byte*>(shards[local]),
                    .block = {.src_offset = p.dst_row * cols + p.dst_col,
                              .src_stride = cols,
                              .rows = p.rows,
                              .cols = p.cols}},
            .grid = amax_->data() + offset_[i] * 4,
            .hf_row = p.src_row,
            .hf_col = p.src_col,
            .block_rows = block.rows,
            .block_cols = block.cols,
            .scale_cols = (hf.cols + block.cols - 1) / block.cols});
      }
    }
    runs_for_ = shards;
  }
  const auto bytes = static_cast<std::size_t>(total_) * 4;
  std::vector<std::uint32_t> amax(static_cast<std::size_t>(total_), 0);
  REFIT_RETURN_IF_ERROR(plane_.write(amax_->data(), amax.data(), bytes));
  REFIT_RETURN_IF_ERROR(plane_.block_amax(runs_, dtype));
  if (trainer_group != nullptr && trainer_group->size() > 1) {
    const auto world = static_cast<std::size_t>(trainer_group->size());
    if (!gathered_) {
      REFIT_ASSIGN_OR_RETURN(gathered_, plane_.allocate(std::max<std::size_t>(bytes * world, 1)));
    }
    REFIT_RETURN_IF_ERROR(
        trainer_group
            ->all_gather_v(amax_->data(), gathered_->data(), std::vector<std::size_t>(world, bytes))
            .with_context(fmt::format("trainer rank {}: combining the FP8 block amax", rank_)));
    std::vector<std::uint32_t> all(static_cast<std::size_t>(total_) * world);
    REFIT_RETURN_IF_ERROR(plane_.read(all.data(), gathered_->data(), bytes * world));
    for (std::size_t r = 0; r < world; ++r)
      for (std::size_t k = 0; k < amax.size(); ++k)
        amax[k] = std::max(amax[k], all[r * amax.size() + k]);
  } else {
    REFIT_RETURN_IF_ERROR(plane_.read(amax.data(), amax_->data(), bytes));
  }
  std::vector<float> scales(amax.size());
  for (std::size_t k = 0; k < amax.size(); ++k) {
    scales[k] = fp8_scale_from_amax(from_bits(amax[k]));
    if (!std::isnan(scales[k])) continue;
    // Name the weight and the block.
    const auto at = static_cast<std::int64_t>(k);
    const auto it = std::upper_bound(offset_.begin(), offset_.end(), at) - 1;
    const auto i = static_cast<std::size_t>(it - offset_.begin());
    const std::uint32_t scale_tensor = static_cast<std::uint32_t>(f.model_tensors + i);
    const std::uint32_t weight = static_cast<std::uint32_t>(f.weight_of[scale_tensor]);
    const std::int64_t cols = matrix_shape(wire.tensors()[scale_tensor].shape).cols;
    const MatrixShape block = f.block(wire, weight);
    const std::int64_t b = at - *it;
    return Status::InvalidArgument(fmt::format(
        "fp8: {} holds NaN or inf in block ({}, {}) (rows [{}, +{}), cols [{}, +{})): a block "
        "without a finite amax has no FP8 scale; nothing was sent (refit step refused on every "
        "trainer rank)",
        wire.tensors()[weight].name, b / cols, b % cols, b / cols * block.rows, block.rows,
        b % cols * block.cols, block.cols));
  }
  if (!logged_) {
    logged_ = true;
    log::info("trainer rank {}: fp8 ({} from {}): {} weights quantized at the sender, {} scales "
              "combined over {} trainer rank(s)",
              rank_,
              f.scheme == Fp8Scheme::kBlock ? fmt::format("blocks {}x{}", f.block_rows, f.block_cols)
                                            : std::string("one scale per tensor"),
              f.source, f.num_quantized(), total_,
              trainer_group != nullptr ? trainer_group->size() : 1);
  }
  return plane_.write(scales_->data(), scales.data(), bytes);
}

}  // namespace refit
