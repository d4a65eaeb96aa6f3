// `refit spec MODEL [--json]`: the HF parameter table of a preset or model directory.
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "refit/model_spec.h"

namespace refit::cli {
namespace {

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

void run_spec(const std::string& model, bool as_json) {
  auto spec = load_model_spec(model);
  exit_if_error(spec.status(), kExitSetup);
  const auto& c = spec->config();
  if (as_json) {
    nlohmann::ordered_json j;
    j["model"] = model;
    j["architecture"] = c.architecture;
    auto& params = j["parameters"] = nlohmann::ordered_json::array();
    for (const auto& t : spec->tensors()) params.push_back({{"name", t.name}, {"shape", t.shape}});
    j["num_tensors"] = spec->tensors().size();
    j["total_parameters"] = spec->total_parameters();
    std::fputs((j.dump(1) + "\n").c_str(), stdout);
    return;
  }
  std::printf("%s  (%s, %zu tensors)\n", model.c_str(),
              std::string(c.architecture).c_str(), spec->tensors().size());
  for (const auto& t : spec->tensors())
    std::printf("  %-60s %-16s %14lld\n", t.name.c_str(), shape_string(t.shape).c_str(),
                static_cast<long long>(t.numel()));
  std::printf("total_parameters: %lld\n", static_cast<long long>(spec->total_parameters()));
}

}  // namespace

void add_spec_commands(CLI::App& app) {
  auto model = std::make_shared<std::string>();
  auto as_json = std::make_shared<bool>(false);
  auto* spec =
      app.add_subcommand("spec", "Print the HF parameter table of a preset or model directory");
  spec->add_option("MODEL", *model, "preset name or HF model directory")->required();
  spec->add_flag("--json", *as_json, "print JSON: parameters (name, shape) and total_parameters");
  spec->callback([model, as_json] { run_spec(*model, *as_json); });
}

}  // namespace refit::cli
