// Deterministic trainer weights (docs/design.md §5.2 `refit run`).
//
// The value of HF tensor t, element i after training step s is
//     w(t, i, s) = base(t, i) + s * delta(t, i)        (fp32, no FMA contraction)
// where base comes from the model's safetensors when it has them, else from a hash of
// (seed, t, i), and delta from the same hash. Any process can compute any element, so an engine
// rank recomputes exactly what it must hold without talking to the trainer. Thread-safe (const).
#pragma once

#include <cstdint>
#include <memory>

#include "refit/dtype.h"
#include "refit/model_spec.h"

namespace refit {

class Checkpoint;

class WeightSource {
 public:
  // `checkpoint` (optional, not owned, must outlive this) supplies base values.
  WeightSource(const ModelSpec& spec, std::uint64_t seed, const Checkpoint* checkpoint);

  // w(t, i, step) for i in [begin, begin + n), as fp32.
  void values(std::uint32_t tensor, std::int64_t begin, std::int64_t n, int step, float* out) const;

 private:
  const ModelSpec& spec_;
  std::uint64_t seed_;
  const Checkpoint* checkpoint_;
};

}  // namespace refit
