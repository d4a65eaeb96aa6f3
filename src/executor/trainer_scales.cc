#include "executor/trainer_scales.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"
#include "common/timer.h"
#include "common/quantize.h"

namespace refit {

Result<std::unique_ptr<TrainerScales>> TrainerScales::create(const RouteSetup& setup, int rank,
                                                             DataPlane& plane) {
  std::unique_ptr<TrainerScales> s(new TrainerScales(setup, rank, plane));
  const ModelSpec& wire = setup.wire().spec;
  const std::size_t first = setup.wire().fp8->model_tensors;
  for (std::size_t t = first; t < wire.tensors().size(); ++t) {
    s->offset_.push_back(s->total_);
    s->total_ += matrix_shape(wire.tensors()[t].shape).numel();
  }
  const auto bytes = static_cast<std::size_t>(std::max<std::int64_t>(s->total_, 1)) * 4;
  REFIT_ASSIGN_OR_RETURN(s->scales_, plane.allocate(bytes));
  REFIT_ASSIGN_OR_RETURN(s->amax_, plane.allocate(bytes));
  REFIT_ASSIGN_OR_RETURN(s->bad_, plane.allocate(16));
  return s;
}

std::vector<void*> TrainerScales::local_tensors() const {
  std::vector<void*> out;
  for (std::int64_t off : offset_) out.push_back(scales_->data() + off * 4);
  return out;
}

std::byte* TrainerScales::grid(std::uint32_t weight) const {
  const Fp8Table& f = *setup_.wire().fp8;
  const auto i = static_cast<std::size_t>(f.scale_of[weight]) - f.model_tensors;
  return scales_->data() + offset_[i] * 4;
}

Status TrainerScales::compute(const std::vector<void*>& shards, DType dtype,
                              Communicator* trainer_group) {
  const Fp8Table& f = *setup_.wire().fp8;
  const ModelSpec& wire = setup_.wire().spec;
  const TrainerShardLayout& mine = setup_.trainer;
  if (runs_for_ != shards) {
    runs_.clear();
    for (std::uint32_t t = 0; t < f.model_tensors; ++t) {
      if (!f.quantized(t)) continue;
      const MatrixShape block = f.block(wire, t);
      const MatrixShape hf = matrix_shape(wire.tensors()[t].shape);
      const auto i = static_cast<std::size_t>(f.scale_of[t]) - f.model_tensors;
      const std::vector<std::uint8_t>& from_grid = setup_.fp8_from_grid[t];
      const bool all = std::find(from_grid.begin(), from_grid.end(), 0) == from_grid.end();
      const std::int64_t nbc = (hf.cols + block.cols - 1) / block.cols;
      for (const auto& [local, piece] : mine.owned_by_hf[t]) {
        const Piece& p = mine.tensors[local].pieces[piece];
        const std::int64_t cols = matrix_shape(mine.tensors[local].shape).cols;
        // The part of piece p in rows [r0, r1) x cols [c0, c1) of the HF tensor.
        auto add = [&](std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1) {
          runs_.push_back(QuantRun{
              .run = {.src = static_cast<const std::byte*>(shards[local]),
                      .block = {.src_offset = (p.dst_row + r0 - p.src_row) * cols + p.dst_col +
                                              c0 - p.src_col,
                                .src_stride = cols,
                                .rows = r1 - r0,
                                .cols = c1 - c0}},
              .grid = amax_->data() + offset_[i] * 4,
              .hf_row = r0,
              .hf_col = c0,
              .block_rows = block.rows,
              .block_cols = block.cols,
              .scale_cols = nbc});
        };
        if (all) {
          add(p.src_row, p.src_row + p.rows, p.src_col, p.src_col + p.cols);
          continue;
        }
        // Only the blocks computed before the refit (RouteSetup::fp8_from_grid).
        for (std::int64_t kr = p.src_row / block.rows;
             p.rows > 0 && kr <= (p.src_row + p.rows - 1) / block.rows; ++kr)
          for (std::int64_t kc = p.src_col / block.cols;
               p.cols > 0 && kc <= (p.src_col + p.cols - 1) / block.cols; ++kc) {
            if (from_grid[static_cast<std::size_t>(kr * nbc + kc)] == 0) continue;
            add(std::max(p.src_row, kr * block.rows),
                std::min(p.src_row + p.rows, (kr + 1) * block.rows),
                std::max(p.src_col, kc * block.cols),
                std::min(p.src_col + p.cols, (kc + 1) * block.cols));
          }
      }
    }
    runs_for_ = shards;
  }
  const std::uint64_t clean[2] = {0, ~std::uint64_t{0}};
  REFIT_RETURN_IF_ERROR(plane_.write(bad_->data(), clean, sizeof(clean)));
  log_once(trainer_group);
  // Whether any rank has a block to scale before the refit: the pass below is collective, and each
  // rank knows only the blocks it holds (RouteSetup::fp8_any_from_grid), so the ranks agree once.
  if (!any_from_grid_) {
    std::uint8_t mine = setup_.fp8_any_from_grid ? 1 : 0;
    if (trainer_group != nullptr && trainer_group->size() > 1) {
      // On the plane's memory: the trainer group may be NCCL.
      const auto world = static_cast<std::size_t>(trainer_group->size());
      REFIT_ASSIGN_OR_RETURN(auto flag, plane_.allocate(1));
      REFIT_ASSIGN_OR_RETURN(auto flags, plane_.allocate(world));
      REFIT_RETURN_IF_ERROR(plane_.write(flag->data(), &mine, 1));
      REFIT_RETURN_IF_ERROR(
          trainer_group
              ->all_gather_v(flag->data(), flags->data(), std::vector<std::size_t>(world, 1))
              .with_context(fmt::format("trainer rank {}: agreeing on the FP8 scale pass", rank_)));
      std::vector<std::uint8_t> all(world, 0);
      REFIT_RETURN_IF_ERROR(plane_.read(all.data(), flags->data(), world));
      mine = *std::max_element(all.begin(), all.end());
    }
    any_from_grid_ = mine != 0;
  }
  // Every block is quantized in one pass by the copy that sends it: nothing to do before.
  if (!*any_from_grid_) return Status::Ok();
  const auto bytes = static_cast<std::size_t>(total_) * 4;
  std::vector<std::uint32_t> amax(static_cast<std::size_t>(total_), 0);
  Timer timer;
  REFIT_RETURN_IF_ERROR(plane_.write(amax_->data(), amax.data(), bytes));
  REFIT_RETURN_IF_ERROR(plane_.block_amax(runs_, dtype));
  const double amax_s = timer.seconds();
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
  log::debug("trainer rank {}: fp8 scales: amax {:.3f} ms, combine and scales {:.3f} ms", rank_,
             amax_s * 1e3, (timer.seconds() - amax_s) * 1e3);
  return plane_.write(scales_->data(), scales.data(), bytes);
}

void TrainerScales::log_once(Communicator* trainer_group) {
  if (logged_) return;
  logged_ = true;
  log::info("trainer rank {}: {} (combined over {} trainer rank(s))", rank_,
            fp8_plan_summary(setup_), trainer_group != nullptr ? trainer_group->size() : 1);
}

Status TrainerScales::check_in_pass() {
  std::uint64_t bad[2] = {0, 0};
  REFIT_RETURN_IF_ERROR(plane_.read(bad, bad_->data(), sizeof(bad)));
  if (bad[0] == 0) return Status::Ok();
  const Fp8Table& f = *setup_.wire().fp8;
  const ModelSpec& wire = setup_.wire().spec;
  const auto weight = static_cast<std::uint32_t>(bad[1] >> 32);
  const auto k = static_cast<std::int64_t>(bad[1] & 0xFFFFFFFFu);
  const std::int64_t cols =
      weight < f.model_tensors && f.quantized(weight)
          ? matrix_shape(wire.tensors()[static_cast<std::size_t>(f.scale_of[weight])].shape).cols
          : 1;
  return Status::InvalidArgument(fmt::format(
      "fp8: {} holds NaN or inf in block ({}, {}) ({} block(s) in all): a block without a finite "
      "amax has no FP8 scale; it was quantized in one pass as it was sent, so the refit fails in "
      "flight (the engines do not publish it)",
      weight < wire.tensors().size() ? wire.tensors()[weight].name : "?", k / cols, k % cols,
      bad[0]));
}

}  // namespace refit
