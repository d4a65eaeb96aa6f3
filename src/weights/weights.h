// Deterministic trainer weights (docs/design.md §5.2 `refit run`).
//
// The value of HF tensor t, element i after training step s is, with the default update
// (`drift`),
//     w(t, i, s) = base(t, i) + s * delta(t, i)        (fp32, no FMA contraction)
// where base comes from the model's safetensors when it has them, else from a hash of
// (seed, t, i), and delta, uniform in [-1/128, 1/128), from the same hash: every element moves
// far more than an ulp each step. With `adam:LR` (`--update`, docs/delta.md) each element moves by
// about LR per step instead, as an optimizer step does:
//     w(t, i, s) = base(t, i) + (s * LR) * a(t, i)      a = sign(u) * (0.5 + 2 |u|), u = delta * 64
// (|a| uniform in [0.5, 1.5), a random sign per element), so the fraction of the bf16 cast that
// changes per step is about that of a real run at that learning rate. Any process can compute any
// element, so an engine rank recomputes exactly what it must hold without talking to the trainer.
// Thread-safe (const).
//
// A checkpoint that ships FP8 (DeepSeek-V3, Kimi-K2: F8_E4M3 weights, each with a float32
// `<name>_scale_inv` of one scale per quantization_config.weight_block_size block, or a
// `<name>_scale` of one element) gives the dequantized base: float32(code) * scale, one float32
// multiply (docs/fp8.md, "FP8 checkpoints as the trainer's weights").
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "refit/dtype.h"
#include "refit/model_spec.h"
#include "refit/status.h"

namespace refit {

class Checkpoint;

// How the generated weights move from step to step (`refit run --update`).
struct WeightUpdate {
  enum class Kind { kDrift, kAdam };
  Kind kind = Kind::kDrift;
  float lr = 0;  // adam: the step per element, about
  // What the CUDA generator takes (WeightsParams::adam_lr, device/copy_kernels.h): the step of
  // adam, 0 for drift.
  float adam_lr() const { return kind == Kind::kAdam ? lr : 0.0f; }
  bool operator==(const WeightUpdate&) const = default;
};
// "drift" or "adam:LR"; errors name --update and what is accepted.
Result<WeightUpdate> parse_weight_update(std::string_view text);
// The canonical text ("drift", "adam:1e-06"), which parse_weight_update reads back.
std::string weight_update_name(const WeightUpdate& update);

class WeightSource {
 public:
  // `checkpoint` (optional, not owned, must outlive this) supplies base values.
  WeightSource(const ModelSpec& spec, std::uint64_t seed, const Checkpoint* checkpoint);

  // The update of every later values() call (default: drift). Set it before the weights are used.
  void set_update(const WeightUpdate& update) { update_ = update; }
  const WeightUpdate& update() const { return update_; }

  // w(t, i, step) for i in [begin, begin + n), as fp32.
  void values(std::uint32_t tensor, std::int64_t begin, std::int64_t n, int step, float* out) const;
  // Ok, or why an FP8 tensor of the checkpoint has no usable scale (naming it): checked at setup.
  const Status& status() const { return status_; }

 private:
  // The scale grid of an FP8 tensor of the checkpoint.
  struct Fp8Base {
    std::vector<float> scales;  // [grid_rows, grid_cols], row-major
    std::int64_t cols = 1;      // the weight's columns
    std::int64_t block_rows = 1, block_cols = 1, grid_cols = 1;
  };
  const ModelSpec& spec_;
  std::uint64_t seed_;
  const Checkpoint* checkpoint_;
  std::unordered_map<std::uint32_t, Fp8Base> fp8_;  // by tensor index
  Status status_;
  WeightUpdate update_;
};

}  // namespace refit
