// What an FP8 refit moves (refit.target_precision: fp8; docs/fp8.md): which Hugging Face tensors
// are quantized, their block shape, and the scale tensors that travel with them.
//
// A WireModel is the model as the engines hold it: the model's tensors (same indices as the
// ModelSpec), then one float32 scale tensor per quantized weight, each with the dtype the engine
// stores. Without fp8 it is the model itself, every tensor in refit.target_precision. Trainer
// layouts keep indexing the model's tensors; engine layouts and the transfer plan index the wire
// tensors, so a scale is planned, routed, hashed and verified like any other tensor.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/piece.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "refit/status.h"

namespace refit {

struct Fp8Table {
  Fp8Scheme scheme = Fp8Scheme::kBlock;
  std::int64_t block_rows = 128, block_cols = 128;  // block scheme
  std::string source;  // where the scheme came from: "refit.fp8", a config.json, or the defaults
  std::vector<std::string> ignored;  // modules left unquantized (the checkpoint's list)
  std::size_t model_tensors = 0;     // wire tensors [0, model_tensors) are the model's
  std::vector<std::int32_t> scale_of;   // per wire tensor: its scale tensor, or -1
  std::vector<std::int32_t> weight_of;  // per wire tensor: the weight it is the scale of, or -1
  // The block of quantized weight `t` (the whole tensor with the tensor scheme).
  MatrixShape block(const ModelSpec& wire, std::uint32_t t) const;
  bool quantized(std::uint32_t t) const { return scale_of[t] >= 0; }
  bool is_scale(std::uint32_t t) const { return weight_of[t] >= 0; }
  std::size_t num_quantized() const { return weight_of.size() - model_tensors; }
};

struct WireModel {
  ModelSpec spec;              // the model's tensors, then the scales
  std::vector<DType> dtype;    // per wire tensor: what the engine stores
  std::vector<MatrixShape> matrix;  // per wire tensor: the matrix view of its shape
  std::optional<Fp8Table> fp8;  // set when refit.target_precision is fp8
  // What every unquantized tensor is kept in but those engine_dtype keeps apart:
  // refit.target_precision, or kFp8UnquantizedDType with fp8.
  DType plain = DType::kBFloat16;
  // Bytes of one engine replica's copy of every wire tensor.
  std::int64_t payload_bytes() const;
  // The first model tensor the engines keep in a dtype other than `plain` and other than FP8
  // (engine_dtype), or nullopt.
  std::optional<std::uint32_t> first_kept_apart() const;
};

// The engine dtype of the tensors FP8 leaves alone (embeddings, lm_head, norms, biases, routers)
// but for those engine_dtype keeps in float32.
inline constexpr DType kFp8UnquantizedDType = DType::kBFloat16;

// The dtype the engines keep unquantized HF tensor `t` in, when the rest of the model is in
// `plain` (refit.target_precision, or kFp8UnquantizedDType with fp8): float32 for DeepSeek-V3's and
// GLM-4.5's router correction bias (both engines, both layouts) and for GLM-4.5's router weight
// in vLLM's fused layout (vLLM's Glm4MoE builds the gate as a float32 nn.Linear; SGLang's
// Glm4MoeGate takes the model dtype); `plain` otherwise. Every such cast is exact: a float32 or
// bfloat16 trainer value widens to float32 unchanged (docs/models.md, "Engine dtypes").
DType engine_dtype(const Config& config, const ModelSpec& spec, const TensorSpec& t, DType plain);

// The wire model of `config` over `spec`. Errors (setup): refit.fp8 contradicting the model
// directory's quantization_config, a quantization_config that is not FP8, an architecture whose
// linear weights refit cannot name.
Result<WireModel> wire_model(const Config& config, const ModelSpec& spec);

// Whether HF tensor `t` of `spec` is a linear weight FP8 quantizes (attention, MLP, experts,
// shared experts), before the ignore list.
bool fp8_linear_weight(const TensorSpec& t);

// The scale tensor's name of weight `name` ("...q_proj.weight" -> "...q_proj.weight_scale_inv",
// or "...weight_scale" with the tensor scheme). Engine parameters take the same suffix
// ("qkv_proj.weight_scale_inv", "w13_weight_scale_inv").
std::string fp8_scale_name(const std::string& name, Fp8Scheme scheme);

}  // namespace refit
