// Parses HF config.json text into a ModelConfig; loads presets and model directories.
#include <fmt/format.h>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "common/file_io.h"
#include "common/log.h"
#include "io/safetensors.h"
#include "refit/config.h"
#include "refit/model_spec.h"

namespace refit {
namespace {

using nlohmann::json;

// Upper bounds far above any published model, so that size arithmetic never overflows and an
// absurd config.json is an error naming its key, not an allocation failure or a hang.
constexpr std::int64_t kMaxWidth = std::int64_t{1} << 20;         // hidden, head_dim
constexpr std::int64_t kMaxFfn = std::int64_t{1} << 22;           // (moe_)intermediate_size
constexpr std::int64_t kMaxVocab = (std::int64_t{1} << 31) - 1;   // vocab_size
constexpr std::int64_t kMaxCount = 4096;                          // layers, heads, sparse step
constexpr std::int64_t kMaxExperts = 65536;
constexpr std::int64_t kMaxTensors = 4'000'000;
constexpr double kMaxParameters = 1e15;

Result<std::int64_t> get_int(const json& j, const char* key, std::optional<std::int64_t> fallback,
                             std::int64_t max) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (fallback) return *fallback;
    return Status::InvalidArgument(fmt::format("config.json: missing required key \"{}\"", key));
  }
  if (!it->is_number_integer() || it->get<std::int64_t>() < 1)
    return Status::InvalidArgument(
        fmt::format("config.json: \"{}\" must be a positive integer, got {}", key, it->dump()));
  if (it->get<std::int64_t>() > max)
    return Status::InvalidArgument(fmt::format(
        "config.json: \"{}\" is {}; refit supports at most {}", key, it->dump(), max));
  return it->get<std::int64_t>();
}

Result<bool> get_bool(const json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean())
    return Status::InvalidArgument(
        fmt::format("config.json: \"{}\" must be true or false, got {}", key, it->dump()));
  return it->get<bool>();
}

double get_double(const json& j, const char* key, double fallback) {
  auto it = j.find(key);
  return (it != j.end() && it->is_number()) ? it->get<double>() : fallback;
}

// "LlamaForCausalLM, ..." of every Architecture but kOther.
std::string known_architectures() {
  std::string out;
  for (int a = 0; a < static_cast<int>(Architecture::kOther); ++a)
    out += (out.empty() ? "" : ", ") + std::string(architecture_name(static_cast<Architecture>(a)));
  return out;
}

// The tensor table of an architecture refit does not know, from the headers of `dir`'s
// safetensors: every tensor with elements, in natural name order. With tie_word_embeddings, a
// stored lm_head.weight is the embedding again: it is left out (sent once; engines tie it).
Result<ModelSpec> table_from_headers(ModelConfig c, const std::string& dir) {
  REFIT_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::open(dir));
  if (ckpt->empty())
    return Status::Unsupported(fmt::format(
        "{}: config.json names the architecture \"{}\", which refit has no built-in tensor table "
        "for, and the directory holds no safetensors to read one from; refit knows {}, and "
        "reads any other model's table from its safetensors headers",
        dir, c.architecture, known_architectures()));
  std::vector<std::string> names = ckpt->tensor_names();
  std::sort(names.begin(), names.end(), natural_name_less);
  if (names.size() > static_cast<std::size_t>(kMaxTensors))
    return Status::InvalidArgument(fmt::format("{}: the checkpoint holds {} tensors; refit supports "
                                               "at most {}",
                                               dir, names.size(), kMaxTensors));
  std::vector<TensorSpec> tensors;
  tensors.reserve(names.size());
  for (const auto& name : names) {
    REFIT_ASSIGN_OR_RETURN(const TensorRef ref, ckpt->find(name));
    const TensorInfo& info = *ref.info;
    if (c.tie_word_embeddings && name == "lm_head.weight") {
      log::info("{}: tie_word_embeddings is set: lm_head.weight is the embedding, sent once", dir);
      continue;
    }
    if (info.numel() == 0) {
      log::warn("{}: tensor {} has shape {} (no elements): not part of the refit", dir, name,
                shape_string(info.shape));
      continue;
    }
    tensors.push_back(TensorSpec{name, info.shape, ParamRole::kOther, layer_of_name(name), -1});
  }
  if (tensors.empty())
    return Status::InvalidArgument(
        fmt::format("{}: the checkpoint's safetensors hold no tensor with elements", dir));
  return ModelSpec(std::move(c), std::move(tensors), dir);
}

}  // namespace

Result<ModelConfig> parse_hf_config(std::string_view json_text) {
  json j = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return Status::InvalidArgument("config.json: not a JSON object");

  ModelConfig c;
  auto arch_it = j.find("architectures");
  if (arch_it == j.end() || !arch_it->is_array() || arch_it->empty() || !(*arch_it)[0].is_string())
    return Status::InvalidArgument(
        "config.json: \"architectures\" must be a list naming the model class");
  const std::string arch = (*arch_it)[0].get<std::string>();
  if (arch == "LlamaForCausalLM")
    c.arch = Architecture::kLlama;
  else if (arch == "Qwen2ForCausalLM")
    c.arch = Architecture::kQwen2;
  else if (arch == "Qwen3ForCausalLM")
    c.arch = Architecture::kQwen3;
  else if (arch == "MistralForCausalLM")
    c.arch = Architecture::kMistral;
  else if (arch == "Qwen3MoeForCausalLM")
    c.arch = Architecture::kQwen3Moe;
  else if (arch == "Gemma2ForCausalLM")
    c.arch = Architecture::kGemma2;
  else if (arch == "Gemma3ForCausalLM")
    c.arch = Architecture::kGemma3;
  else if (arch == "Phi3ForCausalLM")
    c.arch = Architecture::kPhi3;
  else if (arch == "Qwen2MoeForCausalLM")
    c.arch = Architecture::kQwen2Moe;
  else
    c.arch = Architecture::kOther;
  c.architecture = arch;
  if (c.arch == Architecture::kOther) {
    // No architecture facts: the table comes from the checkpoint's headers. Sizes are read when
    // present (for `refit spec` and the logs); a present but invalid one is still an error.
    REFIT_ASSIGN_OR_RETURN(c.tie_word_embeddings, get_bool(j, "tie_word_embeddings", false));
    REFIT_ASSIGN_OR_RETURN(c.hidden_size, get_int(j, "hidden_size", 0, kMaxWidth));
    REFIT_ASSIGN_OR_RETURN(c.num_layers, get_int(j, "num_hidden_layers", 0, kMaxCount));
    REFIT_ASSIGN_OR_RETURN(c.vocab_size, get_int(j, "vocab_size", 0, kMaxVocab));
    return c;
  }

  REFIT_ASSIGN_OR_RETURN(c.hidden_size, get_int(j, "hidden_size", std::nullopt, kMaxWidth));
  REFIT_ASSIGN_OR_RETURN(c.num_layers, get_int(j, "num_hidden_layers", std::nullopt, kMaxCount));
  REFIT_ASSIGN_OR_RETURN(c.num_heads, get_int(j, "num_attention_heads", std::nullopt, kMaxCount));
  REFIT_ASSIGN_OR_RETURN(c.num_kv_heads, get_int(j, "num_key_value_heads", c.num_heads, kMaxCount));
  REFIT_ASSIGN_OR_RETURN(c.intermediate_size, get_int(j, "intermediate_size", std::nullopt, kMaxFfn));
  REFIT_ASSIGN_OR_RETURN(c.vocab_size, get_int(j, "vocab_size", std::nullopt, kMaxVocab));
  if (c.hidden_size == 0 || c.num_heads == 0 || c.num_kv_heads == 0 || c.vocab_size == 0)
    return Status::InvalidArgument(
        "config.json: hidden_size, num_attention_heads, num_key_value_heads and vocab_size must "
        "be positive");
  if (c.num_heads % c.num_kv_heads != 0)
    return Status::InvalidArgument(fmt::format(
        "config.json: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
        c.num_heads, c.num_kv_heads));
  if (c.hidden_size % c.num_heads != 0 && !j.contains("head_dim"))
    return Status::InvalidArgument(
        fmt::format("config.json: no head_dim given and hidden_size ({}) is not a multiple of "
                    "num_attention_heads ({})",
                    c.hidden_size, c.num_heads));
  REFIT_ASSIGN_OR_RETURN(c.head_dim, get_int(j, "head_dim", c.hidden_size / c.num_heads, kMaxWidth));
  const bool gemma = c.arch == Architecture::kGemma2 || c.arch == Architecture::kGemma3;
  const bool moe = c.arch == Architecture::kQwen3Moe || c.arch == Architecture::kQwen2Moe;
  // Gemma ties its output head to the embedding (vLLM and SGLang require it).
  REFIT_ASSIGN_OR_RETURN(c.tie_word_embeddings, get_bool(j, "tie_word_embeddings", gemma));
  if (gemma && !c.tie_word_embeddings)
    return Status::Unsupported(fmt::format(
        "config.json: {} with tie_word_embeddings false; Gemma models tie their output head to "
        "the embedding (vLLM and SGLang require it)",
        arch));
  // Qwen2's and Qwen2-MoE's attention always has q/k/v bias; the others only when the config
  // says so (Phi-3 never).
  const bool always_bias = c.arch == Architecture::kQwen2 || c.arch == Architecture::kQwen2Moe;
  REFIT_ASSIGN_OR_RETURN(c.attention_bias, get_bool(j, "attention_bias", always_bias));
  if (always_bias) c.attention_bias = true;
  if (c.arch == Architecture::kPhi3 && c.attention_bias)
    return Status::Unsupported("config.json: Phi3ForCausalLM with attention_bias; Phi-3's fused "
                               "qkv_proj has no bias");
  c.qk_norm = c.arch == Architecture::kQwen3 || c.arch == Architecture::kQwen3Moe ||
              c.arch == Architecture::kGemma3;
  c.feedforward_norms = gemma;
  c.fused_in_checkpoint = c.arch == Architecture::kPhi3;
  c.rms_norm_eps = get_double(j, "rms_norm_eps", 1e-6);
  c.rope_theta = get_double(j, "rope_theta", 10000.0);

  if (moe) {
    REFIT_ASSIGN_OR_RETURN(c.num_experts, get_int(j, "num_experts", std::nullopt, kMaxExperts));
    if (c.arch == Architecture::kQwen2Moe) {
      REFIT_ASSIGN_OR_RETURN(c.shared_expert_intermediate_size,
                             get_int(j, "shared_expert_intermediate_size", 0, kMaxFfn));
    }
    REFIT_ASSIGN_OR_RETURN(c.num_experts_per_tok, get_int(j, "num_experts_per_tok", std::nullopt, kMaxExperts));
    REFIT_ASSIGN_OR_RETURN(c.moe_intermediate_size,
                           get_int(j, "moe_intermediate_size", std::nullopt, kMaxFfn));
    REFIT_ASSIGN_OR_RETURN(c.decoder_sparse_step, get_int(j, "decoder_sparse_step", 1, kMaxCount));
    REFIT_ASSIGN_OR_RETURN(c.norm_topk_prob, get_bool(j, "norm_topk_prob", false));
    if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
      if (!it->is_array())
        return Status::InvalidArgument(
            "config.json: \"mlp_only_layers\" must be a list of integers");
      for (const auto& v : *it) {
        if (!v.is_number_integer())
          return Status::InvalidArgument(
              "config.json: \"mlp_only_layers\" must be a list of integers");
        c.mlp_only_layers.push_back(v.get<std::int64_t>());
      }
    }
    if (c.num_experts == 0 || c.num_experts_per_tok == 0 || c.num_experts_per_tok > c.num_experts)
      return Status::InvalidArgument(
          fmt::format("config.json: need 0 < num_experts_per_tok ({}) <= num_experts ({})",
                      c.num_experts_per_tok, c.num_experts));
  }
  // What the table would hold, estimated in floating point (no overflow): refused when it could
  // never be a model, before any tensor is built.
  const double h = static_cast<double>(c.hidden_size), d = static_cast<double>(c.head_dim);
  const double experts = static_cast<double>(c.num_experts);
  const double ffn =
      moe ? experts * 3.0 * h * static_cast<double>(c.moe_intermediate_size) +
                3.0 * h * static_cast<double>(c.shared_expert_intermediate_size)
          : 3.0 * h * static_cast<double>(c.intermediate_size);
  const double attention =
      h * d * static_cast<double>(2 * c.num_heads + 2 * c.num_kv_heads);
  const double layers = static_cast<double>(c.num_layers);
  const double parameters =
      static_cast<double>(c.vocab_size) * h * (c.tie_word_embeddings ? 1.0 : 2.0) +
      layers * (attention + ffn);
  const double tensors = 3.0 + layers * (16.0 + 3.0 * experts);
  if (tensors > static_cast<double>(kMaxTensors))
    return Status::InvalidArgument(fmt::format(
        "config.json: num_hidden_layers ({}) and num_experts ({}) would make about {:.0f} tensors; "
        "refit supports at most {}",
        c.num_layers, c.num_experts, tensors, kMaxTensors));
  if (parameters > kMaxParameters)
    return Status::InvalidArgument(fmt::format(
        "config.json: hidden_size ({}), intermediate sizes, vocab_size ({}) and num_hidden_layers "
        "({}) would make about {:.3g} parameters; refit supports at most {:.0g}",
        c.hidden_size, c.vocab_size, c.num_layers, parameters, kMaxParameters));
  return c;
}

namespace {

// The parsed config.json of a preset or a model directory, and the directory ("" for a preset).
Result<std::pair<ModelConfig, std::string>> load_model_config(std::string_view model) {
  namespace fs = std::filesystem;
  if (auto preset = preset_config_json(model); preset.ok()) {
    REFIT_ASSIGN_OR_RETURN(ModelConfig c, parse_hf_config(*preset));
    return std::make_pair(std::move(c), std::string());
  }
  const fs::path dir(model);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    std::string names;
    for (const auto& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
    return Status::NotFound(fmt::format(
        "model \"{}\" is neither a built-in preset ({}) nor an existing directory", model, names));
  }
  const fs::path cfg = dir / "config.json";
  auto text = read_regular_file(cfg.string(), "model config", std::size_t{64} << 20);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound)
      return Status::NotFound(fmt::format("model directory {} has no config.json", dir.string()));
    return text.status();
  }
  auto c = parse_hf_config(*text);
  if (!c.ok()) return c.status().with_context(cfg.string());
  return std::make_pair(std::move(c).value(), dir.string());
}

// An explicit table: every name unique and non-empty, every dim >= 0.
Status check_table(const Config& config) {
  std::unordered_map<std::string_view, std::size_t> seen;
  for (std::size_t i = 0; i < config.tensor_table.size(); ++i) {
    const auto& [name, shape] = config.tensor_table[i];
    if (name.empty())
      return Status::InvalidArgument(fmt::format("tensor table: entry {} has no name", i));
    if (!seen.emplace(name, i).second)
      return Status::InvalidArgument(fmt::format("tensor table: tensor {} is listed twice", name));
    for (auto d : shape)
      if (d < 0 || d > (std::int64_t{1} << 40))
        return Status::InvalidArgument(
            fmt::format("tensor table: tensor {} has an invalid shape", name));
  }
  if (config.tensor_table.size() > static_cast<std::size_t>(kMaxTensors))
    return Status::InvalidArgument(fmt::format("tensor table: {} tensors; refit supports at most {}",
                                               config.tensor_table.size(), kMaxTensors));
  return Status::Ok();
}

}  // namespace

Result<ModelSpec> load_model_spec(std::string_view model) {
  REFIT_ASSIGN_OR_RETURN(auto loaded, load_model_config(model));
  auto& [c, dir] = loaded;
  if (c.arch == Architecture::kOther) return table_from_headers(std::move(c), dir);
  return ModelSpec(std::move(c), dir.empty() ? std::string(model) : dir);
}

Result<ModelSpec> config_model_spec(const Config& config) {
  if (config.tensor_table.empty()) return load_model_spec(config.model);
  REFIT_RETURN_IF_ERROR(check_table(config));
  REFIT_ASSIGN_OR_RETURN(auto loaded, load_model_config(config.model));
  auto& [c, dir] = loaded;
  const std::string source = dir.empty() ? config.model : dir;
  if (c.arch != Architecture::kOther) {
    // The derived table (its order and roles) must be the given one, tensor for tensor.
    ModelSpec derived(std::move(c), source);
    std::vector<std::string> problems;
    std::size_t listed = 0;
    for (const auto& [name, shape] : config.tensor_table) {
      const auto at = derived.find(name);
      if (!at) {
        problems.push_back(fmt::format("{} is not a tensor of {}", name, derived.config().architecture));
        continue;
      }
      ++listed;
      if (derived.tensors()[*at].shape != shape)
        problems.push_back(fmt::format("{} has shape {}, config.json says {}", name,
                                       shape_string(shape),
                                       shape_string(derived.tensors()[*at].shape)));
    }
    if (listed < derived.tensors().size())
      for (const auto& t : derived.tensors())
        if (std::none_of(config.tensor_table.begin(), config.tensor_table.end(),
                         [&](const auto& e) { return e.first == t.name; }))
          problems.push_back(fmt::format("{} is missing", t.name));
    if (problems.empty()) return derived;
    std::string text;
    for (std::size_t i = 0; i < problems.size() && i < 4; ++i) text += (i ? "; " : "") + problems[i];
    if (problems.size() > 4) text += fmt::format("; and {} more", problems.size() - 4);
    // The module names its tensors its own way (transformers 5 fuses MoE experts into
    // mlp.experts.gate_up_proj): an FSDP2 trainer and the hf layout need no architecture facts,
    // so the module's table is the table. Anything that needs the facts gets the mismatch.
    if (config.generation.layout != EngineLayout::kHf ||
        config.policy.backend != PolicyBackend::kFsdp2)
      return Status::InvalidArgument(fmt::format(
          "tensor table: does not match {} ({}): {} (with policy.backend fsdp2 and "
          "generation.layout hf the table is taken as given)",
          source, derived.config().architecture, text));
    log::info("tensor table: not {}'s checkpoint names ({}); taken as given, without "
              "architecture facts (fsdp2 trainer, generation.layout hf)",
              derived.config().architecture, text);
    c = derived.config();
    c.arch = Architecture::kOther;
  }
  std::vector<TensorSpec> tensors;
  for (const auto& [name, shape] : config.tensor_table) {
    if (c.tie_word_embeddings && name == "lm_head.weight") continue;
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    if (n == 0) continue;
    tensors.push_back(TensorSpec{name, shape, ParamRole::kOther, layer_of_name(name), -1});
  }
  std::sort(tensors.begin(), tensors.end(),
            [](const TensorSpec& a, const TensorSpec& b) { return natural_name_less(a.name, b.name); });
  if (tensors.empty())
    return Status::InvalidArgument("tensor table: no tensor with elements");
  return ModelSpec(std::move(c), std::move(tensors), source);
}

}  // namespace refit
