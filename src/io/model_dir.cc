// Model directories and presets as ModelSpecs (refit/model_spec.h load_model_spec,
// refit/config.h config_model_spec): the table derived from config.json for an architecture refit
// knows, read from the checkpoint's safetensors headers for any other, or given explicitly
// (Config::tensor_table: a module's state dict). Lives in io/ because it reads checkpoints.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/file_io.h"
#include "common/log.h"
#include "io/safetensors.h"
#include "refit/config.h"
#include "refit/model_spec.h"

namespace refit {
namespace {

// "LlamaForCausalLM, ..." of every Architecture but kOther.
std::string known_architectures() {
  std::string out;
  for (int a = 0; a < static_cast<int>(Architecture::kOther); ++a)
    out += (out.empty() ? "" : ", ") + std::string(architecture_name(static_cast<Architecture>(a)));
  return out;
}

// A table without architecture facts, from (name, shape) entries (safetensors headers, or an
// explicit table): natural name order, every role kOther; a tied lm_head.weight (the embedding
// again: sent once, engines tie it) and tensors without elements are left out. `where` names
// the source in messages.
Result<ModelSpec> other_table(ModelConfig c,
                              std::vector<std::pair<std::string, std::vector<std::int64_t>>> entries,
                              const std::string& where, std::string source) {
  if (entries.size() > static_cast<std::size_t>(kMaxModelTensors))
    return Status::InvalidArgument(fmt::format("{}: {} tensors; refit supports at most {}", where,
                                               entries.size(), kMaxModelTensors));
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return natural_name_less(a.first, b.first); });
  std::vector<TensorSpec> tensors;
  tensors.reserve(entries.size());
  for (auto& [name, shape] : entries) {
    if (c.tie_word_embeddings && name == "lm_head.weight") continue;
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    if (n == 0) {
      log::warn("{}: tensor {} has shape {} (no elements): not part of the refit", where, name,
                shape_string(shape));
      continue;
    }
    const std::int64_t layer = layer_of_name(name);
    tensors.push_back(TensorSpec{std::move(name), std::move(shape), ParamRole::kOther, layer, -1});
  }
  if (tensors.empty())
    return Status::InvalidArgument(fmt::format("{}: no tensor with elements", where));
  return ModelSpec(std::move(c), std::move(tensors), std::move(source));
}

// The table of an architecture refit does not know, from the headers of `dir`'s safetensors.
Result<ModelSpec> table_from_headers(ModelConfig c, const std::string& dir) {
  REFIT_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::open(dir));
  if (ckpt->empty())
    return Status::Unsupported(fmt::format(
        "{}: config.json names the architecture \"{}\", which refit has no built-in tensor table "
        "for, and the directory holds no safetensors to read one from; refit knows {}, and "
        "reads any other model's table from its safetensors headers",
        dir, c.architecture, known_architectures()));
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> entries;
  for (const auto& name : ckpt->tensor_names()) {
    REFIT_ASSIGN_OR_RETURN(const TensorRef ref, ckpt->find(name));
    entries.emplace_back(name, ref.info->shape);
  }
  return other_table(std::move(c), std::move(entries), dir + ": the checkpoint's safetensors", dir);
}

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
  if (config.tensor_table.size() > static_cast<std::size_t>(kMaxModelTensors))
    return Status::InvalidArgument(fmt::format("tensor table: {} tensors; refit supports at most {}",
                                               config.tensor_table.size(), kMaxModelTensors));
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
  return other_table(std::move(c), config.tensor_table, "tensor table", source);
}

}  // namespace refit
