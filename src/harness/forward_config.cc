// The forward passes' facts beyond the tensor table (harness/forward.h, ForwardConfig), read from
// config.json with the defaults of transformers' configuration classes:
//  - Gemma2Config: query_pre_attn_scalar 256, attn_logit_softcapping 50, final_logit_softcapping
//    30, sliding_window 4096 on layers i with (i + 1) % 2 != 0, rope_theta 10000,
//    hidden_activation gelu_pytorch_tanh;
//  - Gemma3TextConfig: query_pre_attn_scalar 256, no soft-capping, sliding_window 4096 on layers
//    i with (i + 1) % sliding_window_pattern (6) != 0, rope_theta 1e6 on full layers and
//    rope_local_base_freq 10000 on sliding ones, rope_scaling on full layers only;
//  - MistralConfig: sliding_window 4096 on every layer; Phi3Config: sliding_window none,
//    partial_rotary_factor 1; Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE: sliding windows only with
//    use_sliding_window, on layers from max_window_layers on;
//  - DeepseekV3Config: rope_interleave true, n_group 8, topk_group 4, routed_scaling_factor 2.5;
//    Glm4MoeConfig: partial_rotary_factor 0.5, n_group 1, topk_group 1, routed_scaling_factor 1.
// layer_types, when config.json lists them, decide which layers slide. transformers 5's
// rope_parameters are read beside the older rope_theta / rope_scaling.
#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/file_io.h"
#include "harness/forward.h"

namespace refit {
namespace {

using nlohmann::json;

Result<double> number(const json& j, const char* key, double fallback) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number())
    return Status::InvalidArgument(
        fmt::format("config.json: \"{}\" must be a number, got {}", key, it->dump()));
  return it->get<double>();
}

// A soft-capping value: absent gives the default, null gives none.
Result<double> softcap(const json& j, const char* key, double fallback) {
  const auto it = j.find(key);
  if (it == j.end()) return fallback;
  if (it->is_null()) return 0.0;
  if (!it->is_number() || it->get<double>() <= 0)
    return Status::InvalidArgument(fmt::format(
        "config.json: \"{}\" must be a positive number or null, got {}", key, it->dump()));
  return it->get<double>();
}

// The window of sliding layers: absent gives the default, null none.
Result<std::int64_t> window_size(const json& j, std::int64_t fallback) {
  const auto it = j.find("sliding_window");
  if (it == j.end()) return fallback;
  if (it->is_null()) return 0;
  if (!it->is_number_integer() || it->get<std::int64_t>() < 1)
    return Status::InvalidArgument(fmt::format(
        "config.json: \"sliding_window\" must be a positive integer or null, got {}", it->dump()));
  return it->get<std::int64_t>();
}

// RoPE parameters {rope_theta, rope_type / type, factor} of one kind of layer: transformers 5's
// rope_parameters (flat, or keyed by layer type), else rope_theta / rope_scaling.
struct RopeParams {
  double theta;
  double factor = 1.0;
};
Result<RopeParams> rope_params(const json& j, const char* layer_type, double theta_default,
                               bool scaling_applies) {
  RopeParams r{theta_default};
  const json* p = nullptr;
  if (auto it = j.find("rope_parameters"); it != j.end() && it->is_object()) {
    p = &*it;
    if (layer_type != nullptr) {
      auto t = it->find(layer_type);
      p = (t != it->end() && t->is_object()) ? &*t : nullptr;
    }
  }
  if (p != nullptr) {
    REFIT_ASSIGN_OR_RETURN(r.theta, number(*p, "rope_theta", theta_default));
  } else {
    REFIT_ASSIGN_OR_RETURN(r.theta, number(j, "rope_theta", theta_default));
  }
  const json* scaling = p;
  if (scaling == nullptr) {
    auto it = j.find("rope_scaling");
    if (it != j.end() && it->is_object()) scaling = &*it;
  }
  if (scaling != nullptr && scaling_applies) {
    std::string type;
    for (const char* key : {"rope_type", "type"})
      if (auto t = scaling->find(key); t != scaling->end() && t->is_string())
        type = t->get<std::string>();
    if (type == "linear") {
      REFIT_ASSIGN_OR_RETURN(r.factor, number(*scaling, "factor", 1.0));
      if (!(r.factor > 0))
        return Status::InvalidArgument(
            "config.json: a linear rope scaling factor must be positive");
    }
    // Other types (llama3, longrope, yarn, dynamic) are not modelled (harness/forward.h).
  }
  return r;
}

// Which layers slide: config.json's layer_types, else `sliding(i)`.
template <class F>
Result<std::vector<bool>> sliding_layers(const json& j, std::int64_t layers, F&& sliding) {
  std::vector<bool> out(static_cast<std::size_t>(layers));
  const auto it = j.find("layer_types");
  if (it != j.end() && !it->is_null()) {
    if (!it->is_array() || static_cast<std::int64_t>(it->size()) != layers)
      return Status::InvalidArgument(
          fmt::format("config.json: \"layer_types\" must list one entry per layer ({}), got {}",
                      layers, it->dump()));
    for (std::int64_t i = 0; i < layers; ++i) {
      const json& t = (*it)[static_cast<std::size_t>(i)];
      if (!t.is_string() || (t != "sliding_attention" && t != "full_attention"))
        return Status::InvalidArgument(fmt::format(
            "config.json: layer_types[{}] is {}; refit's forward knows sliding_attention and "
            "full_attention",
            i, t.dump()));
      out[static_cast<std::size_t>(i)] = t == "sliding_attention";
    }
    return out;
  }
  for (std::int64_t i = 0; i < layers; ++i) out[static_cast<std::size_t>(i)] = sliding(i);
  return out;
}

Result<Activation> activation(const json& j, const char* fallback) {
  std::string name = fallback;
  for (const char* key : {"hidden_act", "hidden_activation"})
    if (auto it = j.find(key); it != j.end() && it->is_string()) name = it->get<std::string>();
  if (name == "silu" || name == "swish") return Activation::kSilu;
  if (name == "gelu_pytorch_tanh" || name == "gelu_new" || name == "gelu_fast")
    return Activation::kGeluTanh;
  return Status::Unsupported(fmt::format(
      "config.json: hidden activation \"{}\"; refit's reference forward models silu and "
      "gelu_pytorch_tanh",
      name));
}

}  // namespace

bool has_reference_forward(Architecture arch) { return arch != Architecture::kOther; }

Result<ForwardConfig> forward_config(const ModelSpec& spec, std::string_view config_json) {
  const ModelConfig& c = spec.config();
  json j = json::parse(config_json, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    return Status::InvalidArgument("config.json: not a JSON object");
  // Multimodal configs keep the text model's keys under text_config.
  if (auto t = j.find("text_config"); t != j.end() && t->is_object()) j = *t;
  const std::int64_t layers = std::max<std::int64_t>(c.num_layers, 0);
  ForwardConfig f;
  f.window.assign(static_cast<std::size_t>(layers), 0);
  f.rope_theta.assign(static_cast<std::size_t>(layers), c.rope_theta);
  f.rope_factor.assign(static_cast<std::size_t>(layers), 1.0);
  std::vector<bool> sliding(static_cast<std::size_t>(layers), false);
  std::int64_t window = 0;
  double theta = 10000.0, local_theta = 10000.0;
  const char* act = "silu";
  const Architecture arch = c.arch;
  if (arch == Architecture::kGemma2 || arch == Architecture::kGemma3) {
    const bool g2 = arch == Architecture::kGemma2;
    REFIT_ASSIGN_OR_RETURN(const double qpas, number(j, "query_pre_attn_scalar", 256.0));
    if (!(qpas > 0))
      return Status::InvalidArgument("config.json: \"query_pre_attn_scalar\" must be positive");
    f.attn_scale = 1.0 / std::sqrt(qpas);
    REFIT_ASSIGN_OR_RETURN(f.attn_softcap, softcap(j, "attn_logit_softcapping", g2 ? 50.0 : 0.0));
    REFIT_ASSIGN_OR_RETURN(f.final_softcap, softcap(j, "final_logit_softcapping", g2 ? 30.0 : 0.0));
    REFIT_ASSIGN_OR_RETURN(window, window_size(j, 4096));
    std::int64_t pattern = 2;
    if (!g2) {
      REFIT_ASSIGN_OR_RETURN(const double pat, number(j, "sliding_window_pattern", 6));
      pattern = static_cast<std::int64_t>(pat);
      if (pattern < 1)
        return Status::InvalidArgument("config.json: \"sliding_window_pattern\" must be positive");
    }
    REFIT_ASSIGN_OR_RETURN(
        sliding, sliding_layers(j, layers, [&](std::int64_t i) { return (i + 1) % pattern != 0; }));
    theta = g2 ? 10000.0 : 1e6;
    REFIT_ASSIGN_OR_RETURN(local_theta, number(j, "rope_local_base_freq", g2 ? theta : 10000.0));
    f.offset_norms = true;
    f.sandwich_norms = true;
    f.embed_scale = std::sqrt(static_cast<double>(c.hidden_size));
    act = "gelu_pytorch_tanh";
  } else if (arch == Architecture::kMistral) {
    REFIT_ASSIGN_OR_RETURN(window, window_size(j, 4096));
    REFIT_ASSIGN_OR_RETURN(sliding, sliding_layers(j, layers, [](std::int64_t) { return true; }));
  } else if (arch == Architecture::kPhi3) {
    REFIT_ASSIGN_OR_RETURN(window, window_size(j, 0));
    REFIT_ASSIGN_OR_RETURN(sliding, sliding_layers(j, layers, [](std::int64_t) { return true; }));
    REFIT_ASSIGN_OR_RETURN(const double partial, number(j, "partial_rotary_factor", 1.0));
    if (!(partial > 0 && partial <= 1))
      return Status::InvalidArgument("config.json: \"partial_rotary_factor\" must be in (0, 1]");
    f.rotary_dim = static_cast<std::int64_t>(static_cast<double>(c.head_dim) * partial);
  } else if (arch == Architecture::kQwen2 || arch == Architecture::kQwen3 ||
             arch == Architecture::kQwen3Moe || arch == Architecture::kQwen2Moe) {
    auto use = j.find("use_sliding_window");
    const bool on = use != j.end() && use->is_boolean() && use->get<bool>();
    REFIT_ASSIGN_OR_RETURN(window, window_size(j, 4096));
    REFIT_ASSIGN_OR_RETURN(const double from, number(j, "max_window_layers", 28));
    REFIT_ASSIGN_OR_RETURN(sliding, sliding_layers(j, layers, [&](std::int64_t i) {
                             return on && static_cast<double>(i) >= from;
                           }));
  } else if (arch == Architecture::kDeepseekV3 || arch == Architecture::kGlm4Moe) {
    const bool ds = arch == Architecture::kDeepseekV3;
    if (ds) {
      auto it = j.find("rope_interleave");
      f.rope_interleaved = it == j.end() || it->is_null() || (it->is_boolean() && it->get<bool>());
    } else {
      REFIT_ASSIGN_OR_RETURN(const double partial, number(j, "partial_rotary_factor", 0.5));
      if (!(partial > 0 && partial <= 1))
        return Status::InvalidArgument("config.json: \"partial_rotary_factor\" must be in (0, 1]");
      f.rotary_dim = static_cast<std::int64_t>(static_cast<double>(c.head_dim) * partial);
    }
    f.sigmoid_router = true;
    REFIT_ASSIGN_OR_RETURN(const double groups, number(j, "n_group", ds ? 8 : 1));
    REFIT_ASSIGN_OR_RETURN(const double keep, number(j, "topk_group", ds ? 4 : 1));
    REFIT_ASSIGN_OR_RETURN(f.routed_scaling, number(j, "routed_scaling_factor", ds ? 2.5 : 1.0));
    f.n_group = static_cast<std::int64_t>(groups);
    f.topk_group = static_cast<std::int64_t>(keep);
    if (f.n_group < 1 || c.num_experts % f.n_group != 0)
      return Status::InvalidArgument(
          fmt::format("config.json: \"n_group\" ({}) must divide n_routed_experts ({})", f.n_group,
                      c.num_experts));
    if (f.topk_group < 1 || f.topk_group > f.n_group)
      return Status::InvalidArgument(
          fmt::format("config.json: \"topk_group\" ({}) must be in [1, n_group = {}]", f.topk_group,
                      f.n_group));
  }
  REFIT_ASSIGN_OR_RETURN(f.activation, activation(j, act));
  REFIT_ASSIGN_OR_RETURN(
      const RopeParams global,
      rope_params(j, c.arch == Architecture::kGemma3 ? "full_attention" : nullptr, theta, true));
  RopeParams local = global;
  if (c.arch == Architecture::kGemma3) {
    REFIT_ASSIGN_OR_RETURN(local, rope_params(j, "sliding_attention", local_theta, false));
    // Older configs: rope_local_base_freq; rope_scaling applies to the global layers only.
    if (j.find("rope_parameters") == j.end()) local = RopeParams{local_theta};
  }
  for (std::int64_t i = 0; i < layers; ++i) {
    const auto u = static_cast<std::size_t>(i);
    const RopeParams& r = sliding[u] ? local : global;
    f.rope_theta[u] = r.theta;
    f.rope_factor[u] = r.factor;
    f.window[u] = sliding[u] ? window : 0;
  }
  if (f.rotary_dim % 2 != 0)
    return Status::InvalidArgument(
        fmt::format("config.json: the rotary part of a head ({} of {}) must be even", f.rotary_dim,
                    c.head_dim));
  return f;
}

Result<std::string> model_config_json(const std::string& model) {
  if (auto preset = preset_config_json(model); preset.ok()) return *preset;
  return read_regular_file((std::filesystem::path(model) / "config.json").string(), "model config",
                           std::size_t{64} << 20);
}

}  // namespace refit
