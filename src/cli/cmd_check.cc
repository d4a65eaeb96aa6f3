// `refit check CONFIG` (setup-time validation, exit 0 or 2) and `refit matrix [--json]`.
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "config/support.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "executor/routes.h"
#include "weights/setup.h"

namespace refit::cli {
namespace {

void print(const std::string& text) { std::fputs(text.c_str(), stdout); }

std::string cell_label(const MatrixCell& cell) {
  return fmt::format("{} -> {}, {}", policy_backend_name(cell.policy),
                     engine_protocol_name(cell.engine), transfer_mode_label(cell.mode));
}

std::string mb(std::int64_t bytes) { return fmt::format("{:.3f} MB", static_cast<double>(bytes) / 1e6); }

// The transfer plan: per trainer/engine pair, the executor and the bytes; per rank, the totals.
void print_transfer_plan(const Config& c, const ModelSpec& spec) {
  if (!uses_transfer_plan(c)) {
    print(fmt::format(
        "executor: gather — every bucket all-gathered over the trainer group, then {} to every "
        "engine rank (each receives the whole model)\n",
        c.generation.weight_transfer_mode == TransferMode::kBroadcast
            ? "broadcast from trainer rank 0"
            : "handed over through the colocated trainer rank's ipc slots"));
    return;
  }
  auto routes = make_route_setup(c, spec);
  exit_if_error(routes.status(), kExitSetup);
  const TransferPlan& plan = routes->plan;
  std::string pair_executor;
  switch (c.refit.executor) {
    case Executor::kAuto:
      pair_executor = needs_p2p_group(c)
                          ? "peer on one host (refit run: every pair), p2p across hosts"
                          : "peer (CUDA IPC; colocated ranks share GPUs)";
      break;
    case Executor::kPeer:
      pair_executor = "peer";
      break;
    case Executor::kP2p:
      pair_executor = "p2p";
      break;
    case Executor::kGather:
      break;
  }
  print(fmt::format("transfer plan {}: {} routes in {} round(s) of <= {} bytes per rank; "
                    "executor {}: {}\n",
                    plan.hash_hex(), plan.routes.size(), plan.rounds, plan.buffer_bytes,
                    executor_name(c.refit.executor), pair_executor));
  for (int r = 0; r < plan.trainer_ranks; ++r)
    for (int g : plan.targets_of(r))
      print(fmt::format("  trainer rank {} -> engine rank {} (engine {} tp rank {}): {}\n", r, g,
                        g / c.generation.tp_size, g % c.generation.tp_size,
                        mb(plan.pair_bytes(r, g))));
  for (int r = 0; r < plan.trainer_ranks; ++r)
    print(fmt::format("  trainer rank {} sends {}\n", r,
                      mb(plan.trainer_bytes[static_cast<std::size_t>(r)])));
  if (routes->wire.fp8) print("  " + fp8_plan_summary(*routes) + "\n");
  const std::int64_t model_bytes = routes->wire.payload_bytes();
  for (int g = 0; g < plan.engine_ranks; ++g) {
    const std::int64_t b = plan.engine_bytes[static_cast<std::size_t>(g)];
    print(fmt::format("  engine rank {} receives {} ({:.3f} of the model)\n", g, mb(b),
                      model_bytes > 0 ? static_cast<double>(b) / static_cast<double>(model_bytes)
                                      : 0.0));
  }
}

void run_check(const std::string& path, bool print_config) {
  auto config = load_config_file(path);
  exit_if_error(config.status(), kExitSetup);
  // Errors after parsing carry the config path too, so every setup error names its file.
  auto spec = load_model_spec(config->model);
  if (!spec.ok()) exit_if_error(spec.status().with_context(path + ": model"), kExitSetup);
  const Status valid = validate_config(*config, *spec);
  if (!valid.ok()) exit_if_error(valid.with_context(path), kExitSetup);
  // A model directory's checkpoint: every safetensors header opened and checked against the
  // tensor table now, not when the ranks start.
  auto model = load_rank_model(*config);
  if (!model.ok()) exit_if_error(model.status().with_context(path + ": model"), kExitSetup);

  const Config& c = *config;
  const MatrixCell* cell =
      find_matrix_cell(c.policy.backend, c.generation.backend, c.generation.weight_transfer_mode);
  if (cell == nullptr) throw CliExit(kExitSetup, "internal: validated config has no matrix cell");
  // The matrix cell's note describes the full-bucket path; the transfer plan is printed below.
  print(fmt::format("ok: {} — supported\n  {}\n", cell_label(*cell),
                    uses_transfer_plan(c) ? "moved along the transfer plan (below)" : cell->note));
  const std::int64_t params = spec->total_parameters();
  print(fmt::format("model: {} ({}): {} tensors, {} parameters\n", c.model,
                    spec->config().architecture, spec->tensors().size(), params));
  if ((*model)->checkpoint)
    print(fmt::format("checkpoint: {}: every safetensors header checked against the table\n",
                      c.model));
  std::string trainer =
      fmt::format("trainer: {}, {} ranks, {} master weights", policy_backend_name(c.policy.backend),
                  c.policy.world_size, dtype_name(c.policy.dtype));
  if (c.policy.backend == PolicyBackend::kMegatron) {
    const auto& m = c.policy.megatron;
    trainer += fmt::format(" (tp {}, pp {}, ep {}, dp {})", m.tp, m.pp, m.ep,
                           c.policy.world_size / (m.tp * m.pp));
  }
  print(trainer + "\n");
  print(fmt::format("engines: {} x {} with tp_size {} = {} engine ranks ({} processes in all)\n",
                    c.generation.num_engines, engine_protocol_name(c.generation.backend),
                    c.generation.tp_size, c.engine_ranks(),
                    c.policy.world_size + c.engine_ranks()));
  print(c.generation.layout == EngineLayout::kHf
            ? "engine layout: hf (every engine rank receives every tensor whole, under its "
              "Hugging Face name)\n"
            : "engine layout: fused (the engine's own parameters, TP-sharded)\n");
  print(fmt::format("refit: {} on {}, {} bytes per refit, {} buffers of {} bytes, timeout {} s\n",
                    dtype_name(c.refit.target_precision), device_name(c.device),
                    params * static_cast<std::int64_t>(dtype_size(c.refit.target_precision)),
                    c.refit.num_buffers, c.refit.buffer_size_bytes, c.refit.timeout_s));
  print_transfer_plan(c, *spec);
  if (c.device == Device::kCuda)
    print(
        "note: this build has CUDA; whether enough GPUs are present is checked when ranks start\n");
  if (print_config) print("resolved config:\n" + config_to_yaml(c));
}

// A markdown table with padded columns.
std::string table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> width(rows.front().size(), 3);
  for (const auto& r : rows)
    for (std::size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  std::string out;
  auto line = [&](const std::vector<std::string>& r) {
    for (std::size_t i = 0; i < r.size(); ++i) out += fmt::format("| {:<{}} ", r[i], width[i]);
    out += "|\n";
  };
  line(rows.front());
  for (std::size_t i = 0; i < width.size(); ++i) out += "|" + std::string(width[i] + 2, '-');
  out += "|\n";
  for (std::size_t i = 1; i < rows.size(); ++i) line(rows[i]);
  return out;
}

void run_matrix(bool as_json) {
  const auto& cells = support_matrix();
  const std::vector<EngineProtocol> engines = {EngineProtocol::kVllm, EngineProtocol::kSglang};
  const std::vector<TransferMode> modes = {TransferMode::kIpc, TransferMode::kBroadcast};
  const std::vector<PolicyBackend> policies = {PolicyBackend::kFsdp2, PolicyBackend::kMegatron};
  if (as_json) {
    nlohmann::ordered_json j;
    auto& jc = j["cells"] = nlohmann::ordered_json::array();
    for (const auto& c : cells)
      jc.push_back({{"policy", policy_backend_name(c.policy)},
                    {"engine", engine_protocol_name(c.engine)},
                    {"weight_transfer_mode", transfer_mode_name(c.mode)},
                    {"colocated", c.mode == TransferMode::kIpc},
                    {"supported", c.supported},
                    {"note", c.note}});
    auto& jp = j["target_precisions"] = nlohmann::ordered_json::array();
    for (const auto& p : precision_support())
      jp.push_back({{"engine", engine_protocol_name(p.engine)},
                    {"precision", dtype_name(p.precision)},
                    {"supported", p.supported},
                    {"note", p.note}});
    print(j.dump(2) + "\n");
    return;
  }

  std::vector<std::vector<std::string>> rows = {{"policy backend"}};
  for (auto e : engines)
    for (auto m : modes)
      rows[0].push_back(
          fmt::format("{} {}", engine_protocol_display_name(e), transfer_mode_label(m)));
  for (auto p : policies) {
    std::vector<std::string> row = {std::string(policy_backend_display_name(p))};
    for (auto e : engines)
      for (auto m : modes) {
        const MatrixCell* cell = find_matrix_cell(p, e, m);
        row.push_back(cell == nullptr   ? "not supported"
                      : cell->supported ? "supported"
                                        : "not supported");
      }
    rows.push_back(std::move(row));
  }
  print("Support matrix (policy backend x engine protocol x transfer mode):\n\n" + table(rows));

  std::vector<std::vector<std::string>> prec = {{"target precision"}};
  for (auto e : engines) prec[0].emplace_back(engine_protocol_display_name(e));
  for (DType d : parseable_target_precisions()) {
    std::vector<std::string> row = {d == DType::kBFloat16 ? "bf16 (bfloat16)"
                                                          : fmt::format("fp8 ({})", dtype_name(d))};
    for (auto e : engines) {
      std::string text = "not supported";
      for (const auto& p : precision_support())
        if (p.engine == e && p.precision == d)
          text = p.supported ? "supported" : "not supported: " + p.note;
      row.push_back(text);
    }
    prec.push_back(std::move(row));
  }
  print("\nTarget precision per engine protocol (refit.target_precision):\n\n" + table(prec));

  print("\nNotes:\n");
  for (const auto& c : cells) print(fmt::format("  {}: {}\n", cell_label(c), c.note));
  print(
      "\nOutside the matrix, rejected by `refit check`: ipc with colocated: false, broadcast with "
      "colocated: true.\n");
}

}  // namespace

void add_check_commands(CLI::App& app) {
  auto path = std::make_shared<std::string>();
  auto print_config = std::make_shared<bool>(false);
  auto* check = app.add_subcommand(
      "check", "Validate a config at setup: keys, model, support matrix; exit 0 or 2");
  check->add_option("CONFIG", *path, "YAML config file (docs/config.md)")->required();
  check->add_flag("--print-config", *print_config,
                  "also print the resolved config (every key, defaults filled in)");
  check->callback([path, print_config] { run_check(*path, *print_config); });

  auto as_json = std::make_shared<bool>(false);
  auto* matrix = app.add_subcommand("matrix", "Print the support matrix as this build knows it");
  matrix->add_flag("--json", *as_json, "print JSON: cells and target_precisions");
  matrix->callback([as_json] { run_matrix(*as_json); });
}

}  // namespace refit::cli
