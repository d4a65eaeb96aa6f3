// What an FP8 engine must hold after a refit (docs/fp8.md): the reference quantizer
// (common/quantize.h) over every whole HF tensor, as the trainer's policy dtype holds it. Used by
// --verify on host memory, --dump's expected tensors and --check-logits, tensor by tensor; and its
// GPU twin (harness/fp8_reference_device.h) for --verify on `device: cuda`.
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine_layout.h"
#include "plane/data_plane.h"
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

// The first element in which an engine rank's parameters differ from what they must hold.
struct Fp8Mismatch {
  std::size_t param = 0;            // index into the layout's parameters
  std::int64_t element = 0;         // flat element index in the parameter
  std::uint32_t got = 0, want = 0;  // the element's bytes (little endian, its dtype's size)
};

// --verify of an FP8 refit on the GPU that holds the engine rank's parameters (plane: device
// cuda), with the same verdict as comparing every parameter with Fp8Reference::param:
//  - fp8 weights and their scales against the reference quantizer's GPU kernels, each HF tensor
//    generated whole on the device (or, for a checkpoint, built on the host and uploaded);
//  - the other parameters (bf16, float32) with DataPlane::find_mismatch.
// Errors: a weight whose block holds NaN or inf, CUDA failures, a wait past `timeout`.
Result<std::optional<Fp8Mismatch>> find_fp8_mismatch_on_device(
    DataPlane& plane, const RankModel& model, const WireModel& wire,
    const EngineShardLayout& layout, const std::vector<PieceTarget>& params, DType policy,
    std::uint64_t seed, int step, std::chrono::milliseconds timeout);

}  // namespace refit
