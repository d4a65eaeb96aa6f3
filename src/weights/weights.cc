#include "weights/weights.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <string>

#include "common/piece.h"
#include "io/safetensors.h"

namespace refit {
namespace {

inline std::uint64_t mix(std::uint64_t x) {  // splitmix64 finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// Uniform in [-0.5, 0.5) from 24 bits.
inline float unit(std::uint64_t bits24) {
  return static_cast<float>(static_cast<std::int32_t>(bits24 & 0xffffff) - (1 << 23)) *
         (1.0f / (1 << 24));
}

}  // namespace

Result<WeightUpdate> parse_weight_update(std::string_view text) {
  auto bad = [&](const std::string& why) {
    return Status::InvalidArgument(fmt::format(
        "--update {}: {}; accepted: drift (the default: every element moves by up to 1/128 per "
        "step) or adam:LR (each element moves by about LR per step, LR a number in (0, 1), e.g. "
        "adam:1e-6)",
        text, why));
  };
  if (text == "drift") return WeightUpdate{};
  if (text.substr(0, 5) != "adam:") return bad("unknown update");
  const std::string lr(text.substr(5));
  char* end = nullptr;
  const double v = std::strtod(lr.c_str(), &end);
  if (lr.empty() || end != lr.c_str() + lr.size() || !std::isfinite(v) || v <= 0 || v >= 1)
    return bad(fmt::format("'{}' is not a learning rate in (0, 1)", lr));
  return WeightUpdate{.kind = WeightUpdate::Kind::kAdam, .lr = static_cast<float>(v)};
}

std::string weight_update_name(const WeightUpdate& u) {
  switch (u.kind) {
    case WeightUpdate::Kind::kDrift:
      return "drift";
    case WeightUpdate::Kind::kAdam:
      return fmt::format("adam:{}", u.lr);
  }
  return "?";
}

WeightSource::WeightSource(const ModelSpec& spec, std::uint64_t seed, const Checkpoint* checkpoint)
    : spec_(spec), seed_(seed), checkpoint_(checkpoint) {
  if (checkpoint_ == nullptr) return;
  const std::vector<std::int64_t>& block = spec.config().quantization.weight_block_size;
  for (std::uint32_t t = 0; t < spec.tensors().size() && status_.ok(); ++t) {
    const TensorSpec& ts = spec.tensors()[t];
    const auto ref = checkpoint_->find(ts.name);
    if (!ref.ok() || ref->info->dtype != DType::kFloat8E4M3) continue;
    const MatrixShape m = matrix_shape(ts.shape);
    Fp8Base b{.cols = m.cols};
    auto grid = checkpoint_->find(ts.name + "_scale_inv");
    if (grid.ok()) {
      const MatrixShape g = matrix_shape(grid->info->shape);
      b.block_rows = block.size() == 2 ? block[0] : 0;
      b.block_cols = block.size() == 2 ? block[1] : 0;
      if (b.block_rows <= 0 || (m.rows + b.block_rows - 1) / b.block_rows != g.rows ||
          (m.cols + b.block_cols - 1) / b.block_cols != g.cols) {
        status_ = Status::InvalidArgument(fmt::format(
            "checkpoint: {} is F8_E4M3 with {} of shape {}, which is not one scale per "
            "quantization_config.weight_block_size block ({}) of its {}",
            ts.name, grid->info->name, shape_string(grid->info->shape),
            block.size() == 2 ? fmt::format("[{}, {}]", block[0], block[1]) : "not given",
            shape_string(ts.shape)));
        continue;
      }
      b.grid_cols = g.cols;
    } else {
      grid = checkpoint_->find(ts.name + "_scale");
      if (!grid.ok() || grid->info->numel() != 1) {
        status_ = Status::InvalidArgument(fmt::format(
            "checkpoint: {} is F8_E4M3 but the checkpoint holds neither {}_scale_inv (one scale "
            "per block) nor a one-element {}_scale; an FP8 weight cannot be read without its "
            "scales",
            ts.name, ts.name, ts.name));
        continue;
      }
      b.block_rows = m.rows;
      b.block_cols = m.cols;
    }
    b.scales.resize(static_cast<std::size_t>(grid->info->numel()));
    grid->read(b.scales.data(), DType::kFloat32);
    fp8_.emplace(t, std::move(b));
  }
}

void WeightSource::values(std::uint32_t tensor, std::int64_t begin, std::int64_t n, int step,
                          float* out) const {
  const std::uint64_t key = mix(seed_ * 0x9e3779b97f4a7c15ull + tensor + 1);
  const float s = static_cast<float>(step);
  const float* base = nullptr;
  std::vector<float> base_buf;
  if (checkpoint_ != nullptr) {
    auto ref = checkpoint_->find(spec_.tensors()[tensor].name);
    if (ref.ok()) {
      base_buf.resize(static_cast<std::size_t>(n));
      ref->read_range(begin, n, base_buf.data(), DType::kFloat32);
      if (const auto q = fp8_.find(tensor); q != fp8_.end()) {  // an FP8 checkpoint: dequantize
        const Fp8Base& b = q->second;
        for (std::int64_t k = 0; k < n; ++k) {
          const std::int64_t row = (begin + k) / b.cols, col = (begin + k) % b.cols;
          base_buf[static_cast<std::size_t>(k)] *= b.scales[static_cast<std::size_t>(
              row / b.block_rows * b.grid_cols + col / b.block_cols)];
        }
      }
      base = base_buf.data();
    }
  }
  if (update_.kind == WeightUpdate::Kind::kAdam) {
    // Exact in float32: u is a multiple of 2^-24 below 1/2 in magnitude, so 2u +- 1/2 has 24
    // significant bits at most.
    const float moved = s * update_.lr;
    for (std::int64_t k = 0; k < n; ++k) {
      const std::uint64_t h = mix(key ^ static_cast<std::uint64_t>(begin + k));
      const float b = base ? base[k] : unit(h >> 40) * 0.2f;
      const float u = unit(h);
      const float a = 2.0f * u + (u < 0 ? -0.5f : 0.5f);
      const float step_delta = moved * a;
      out[k] = b + step_delta;
    }
    return;
  }
  for (std::int64_t k = 0; k < n; ++k) {
    const std::uint64_t h = mix(key ^ static_cast<std::uint64_t>(begin + k));
    const float b = base ? base[k] : unit(h >> 40) * 0.2f;
    const float delta = unit(h) * (1.0f / 64);
    const float step_delta = s * delta;
    out[k] = b + step_delta;
  }
}

}  // namespace refit
