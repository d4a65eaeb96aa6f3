#include "spec/fp8.h"

#include <fmt/format.h>

#include <algorithm>

namespace refit {
namespace {

std::string module_of(const std::string& name) {
  constexpr std::string_view kWeight = ".weight";
  return name.size() > kWeight.size() && name.ends_with(kWeight)
             ? name.substr(0, name.size() - kWeight.size())
             : name;
}

// An ignore-list entry names a module, or a run of whole components of its name: "lm_head",
// "model.layers.0.mlp", "mlp.gate", "self_attn" (transformers matches by containment, vLLM by
// prefix; both of those forms are whole components).
bool ignored_by(const std::string& module, const std::string& entry) {
  if (entry.empty()) return false;
  if (module == entry || module.starts_with(entry + ".") || module.ends_with("." + entry))
    return true;
  return module.find("." + entry + ".") != std::string::npos;
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

}  // namespace

bool fp8_linear_weight(const TensorSpec& t) {
  switch (t.role) {
    case ParamRole::kQProj:
    case ParamRole::kKProj:
    case ParamRole::kVProj:
    case ParamRole::kOProj:
    case ParamRole::kQkvProj:
    case ParamRole::kGateProj:
    case ParamRole::kUpProj:
    case ParamRole::kDownProj:
    case ParamRole::kGateUpProj:
    case ParamRole::kExpertGate:
    case ParamRole::kExpertUp:
    case ParamRole::kExpertDown:
    case ParamRole::kSharedGate:
    case ParamRole::kSharedUp:
    case ParamRole::kSharedDown:
    case ParamRole::kQAProj:  // MLA: DeepSeek-V3's FP8 checkpoints quantize every projection
    case ParamRole::kQBProj:
    case ParamRole::kKvAProj:
    case ParamRole::kKvBProj:
      return true;
    case ParamRole::kOther: {
      // No architecture facts: a 2-D weight of a module whose last name component is a
      // projection (q_proj, kv_a_proj_with_mqa, gate_proj, down_proj, ...), docs/fp8.md.
      if (t.shape.size() != 2 || !t.name.ends_with(".weight")) return false;
      const std::string module = module_of(t.name);
      const std::string last = module.substr(module.rfind('.') + 1);
      return last.find("proj") != std::string::npos;
    }
    case ParamRole::kEmbedding:
    case ParamRole::kLmHead:
    case ParamRole::kFinalNorm:
    case ParamRole::kInputNorm:
    case ParamRole::kPostAttnNorm:
    case ParamRole::kQBias:
    case ParamRole::kKBias:
    case ParamRole::kVBias:
    case ParamRole::kQNorm:
    case ParamRole::kKNorm:
    case ParamRole::kRouter:
    case ParamRole::kPreFfnNorm:
    case ParamRole::kPostFfnNorm:
    case ParamRole::kSharedExpertGate:
    case ParamRole::kRouterBias:
    case ParamRole::kQALayerNorm:
    case ParamRole::kKvALayerNorm:
      return false;
  }
  return false;
}

std::string fp8_scale_name(const std::string& name, Fp8Scheme scheme) {
  return name + (scheme == Fp8Scheme::kBlock ? "_scale_inv" : "_scale");
}

DType engine_dtype(const Config& config, const ModelSpec& spec, const TensorSpec& t, DType plain) {
  if (t.role == ParamRole::kRouterBias) return DType::kFloat32;
  if (t.role == ParamRole::kRouter && spec.config().arch == Architecture::kGlm4Moe &&
      config.generation.backend == EngineProtocol::kVllm &&
      config.generation.layout == EngineLayout::kFused)
    return DType::kFloat32;
  return plain;
}

std::optional<std::uint32_t> WireModel::first_kept_apart() const {
  const std::size_t n = fp8 ? fp8->model_tensors : spec.tensors().size();
  for (std::uint32_t t = 0; t < n; ++t)
    if (dtype[t] != plain && dtype[t] != DType::kFloat8E4M3) return t;
  return std::nullopt;
}

std::int64_t WireModel::payload_bytes() const {
  std::int64_t total = 0;
  for (std::size_t t = 0; t < spec.tensors().size(); ++t)
    total += spec.tensors()[t].numel() * static_cast<std::int64_t>(dtype_size(dtype[t]));
  return total;
}

MatrixShape Fp8Table::block(const ModelSpec& wire, std::uint32_t t) const {
  if (scheme == Fp8Scheme::kBlock) return {block_rows, block_cols};
  return matrix_shape(wire.tensors()[t].shape);
}

Result<WireModel> wire_model(const Config& config, const ModelSpec& spec) {
  WireModel w;
  const QuantizationConfig& qc = spec.config().quantization;
  const bool fp8 = config.refit.target_precision == DType::kFloat8E4M3;
  const bool fp8_checkpoint = qc.present && qc.quant_method.find("fp8") != std::string::npos;
  if (!fp8) {
    if (fp8_checkpoint)
      return Status::Unsupported(fmt::format(
          "refit.target_precision: {}'s config.json has an FP8 quantization_config (quant_method "
          "\"{}\"), so its engines hold FP8 weights and scales; got {}; allowed: fp8",
          config.model, qc.quant_method, dtype_name(config.refit.target_precision)));
    w.spec = spec;
    w.plain = config.refit.target_precision;
    w.dtype.reserve(spec.tensors().size());
    w.matrix.reserve(spec.tensors().size());
    for (const TensorSpec& t : spec.tensors()) {
      w.dtype.push_back(engine_dtype(config, spec, t, config.refit.target_precision));
      w.matrix.push_back(matrix_shape(t.shape));
    }
    return w;
  }
  Fp8Table f;
  const Fp8Config& want = config.refit.fp8;
  f.scheme = want.scheme;
  f.block_rows = want.block_rows;
  f.block_cols = want.block_cols;
  f.source = want.given ? "refit.fp8" : "the defaults of refit.fp8";
  if (qc.present) {
    if (!fp8_checkpoint)
      return Status::Unsupported(fmt::format(
          "refit.target_precision: fp8, but {}'s config.json quantization_config has quant_method "
          "\"{}\"; refit writes FP8 e4m3fn weights with float32 scales only; allowed: a model "
          "without quantization_config, or an fp8 one",
          config.model, qc.quant_method));
    const Fp8Scheme theirs =
        qc.weight_block_size.empty() ? Fp8Scheme::kTensor : Fp8Scheme::kBlock;
    const std::string theirs_text =
        theirs == Fp8Scheme::kBlock
            ? fmt::format("block [{}, {}]", qc.weight_block_size[0], qc.weight_block_size[1])
            : "tensor";
    const std::string ours_text =
        want.scheme == Fp8Scheme::kBlock
            ? fmt::format("block [{}, {}]", want.block_rows, want.block_cols)
            : "tensor";
    if (want.given && theirs_text != ours_text)
      return Status::InvalidArgument(fmt::format(
          "refit.fp8: {}; got {}, but {}'s config.json quantization_config says {} "
          "(weight_block_size); allowed: {}, or remove refit.fp8 to take the checkpoint's",
          "the engines load the checkpoint's scheme", ours_text, config.model, theirs_text,
          theirs_text));
    f.scheme = theirs;
    if (theirs == Fp8Scheme::kBlock) {
      f.block_rows = qc.weight_block_size[0];
      f.block_cols = qc.weight_block_size[1];
    }
    f.source = fmt::format("{}/config.json quantization_config", config.model);
    f.ignored = qc.ignored;
  }
  const auto& tensors = spec.tensors();
  bool any_linear = false;
  for (const TensorSpec& t : tensors) any_linear |= fp8_linear_weight(t);
  if (!any_linear)
    return Status::Unsupported(fmt::format(
        "refit.target_precision: fp8 quantizes the linear weights of attention, MLP and experts, "
        "and {} ({}) has none refit can name; got fp8; allowed: bf16",
        config.model, spec.config().architecture));
  std::vector<TensorSpec> all = tensors;
  f.model_tensors = tensors.size();
  f.scale_of.assign(tensors.size(), -1);
  f.weight_of.assign(tensors.size(), -1);
  w.plain = kFp8UnquantizedDType;
  w.dtype.reserve(tensors.size());
  for (const TensorSpec& t : tensors)
    w.dtype.push_back(engine_dtype(config, spec, t, kFp8UnquantizedDType));
  for (std::uint32_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    if (!fp8_linear_weight(t)) continue;
    const std::string module = module_of(t.name);
    if (std::any_of(f.ignored.begin(), f.ignored.end(),
                    [&](const std::string& e) { return ignored_by(module, e); }))
      continue;
    const MatrixShape m = matrix_shape(t.shape);
    std::vector<std::int64_t> shape =
        f.scheme == Fp8Scheme::kBlock
            ? std::vector<std::int64_t>{ceil_div(m.rows, f.block_rows),
                                        ceil_div(m.cols, f.block_cols)}
            : std::vector<std::int64_t>{1};
    f.scale_of[i] = static_cast<std::int32_t>(all.size());
    f.weight_of.push_back(static_cast<std::int32_t>(i));
    f.scale_of.push_back(-1);
    w.dtype[i] = DType::kFloat8E4M3;
    w.dtype.push_back(DType::kFloat32);
    // kOther: layouts and the forward pass never take a scale for a weight by its role.
    all.push_back(TensorSpec{fp8_scale_name(t.name, f.scheme), std::move(shape), ParamRole::kOther,
                             t.layer, t.expert});
  }
  w.spec = ModelSpec(spec.config(), std::move(all), spec.source());
  w.matrix.reserve(w.spec.tensors().size());
  for (const TensorSpec& t : w.spec.tensors()) w.matrix.push_back(matrix_shape(t.shape));
  w.fp8 = std::move(f);
  return w;
}

Result<std::int64_t> bytes_per_refit(const Config& config, const ModelSpec& spec) {
  REFIT_ASSIGN_OR_RETURN(WireModel w, wire_model(config, spec));
  return w.payload_bytes();
}

}  // namespace refit
