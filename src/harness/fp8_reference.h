// What an FP8 engine must hold after a refit (docs/fp8.md): the reference quantizer
// (common/quantize.h) over every whole HF tensor, as the trainer's policy dtype holds it. Used by
// --verify, --dump's expected tensors and --check-logits on host memory, tensor by tensor.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "engine/engine_layout.h"
#include "spec/fp8.h"
#include "weights/setup.h"

namespace refit {

class Fp8Reference {
 public:
  Fp8Reference(const RankModel& model, const WireModel& wire, DType policy, int step)
      : model_(model), wire_(wire), policy_(policy), step_(step) {}
  // The bytes of wire tensor `t` whole, in its wire dtype: fp8 codes of a quantized weight,
  // float32 scales of a scale tensor, the policy values rounded to bf16 otherwise. An error
  // names a weight whose block holds NaN or inf.
  Result<const std::vector<std::byte>*> tensor(std::uint32_t t);
  // The bytes engine parameter `p` must hold (elements no piece covers are zero).
  Result<std::vector<std::byte>> param(const EngineParam& p);
  // Where element (row, col) of `p` comes from, for error messages: "<tensor>[r, c]", or
  // "the scale of block (i, j) of <weight>".
  std::string source(const EngineParam& p, std::int64_t row, std::int64_t col) const;

 private:
  const RankModel& model_;
  const WireModel& wire_;
  const DType policy_;
  const int step_;
  std::map<std::uint32_t, std::vector<std::byte>> cache_;  // wire tensor -> bytes
};

}  // namespace refit
