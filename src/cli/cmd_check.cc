// `refit check CONFIG` (setup-time validation, exit 0 or 2) and `refit matrix [--json]`.
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "config/support.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "executor/routes.h"
#include "weights/setup.h"

namespace refit::cli {
namespace {

// f(rank) for every rank in [0, n), on up to one worker thread per core (at most 32): each worker
// derives one view at a time. f must not throw.
template <class F>
void for_each_rank_in_parallel(int n, F&& f) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int workers = std::max(1, std::min({n, cores, 32}));
  std::atomic<int> next{0};
  auto work = [&] {
    for (int r = next.fetch_add(1); r < n; r = next.fetch_add(1)) f(r);
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < workers; ++i) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

void print(const std::string& text) { std::fputs(text.c_str(), stdout); }

std::string cell_label(const MatrixCell& cell) {
  return fmt::format("{} -> {}, {}", policy_backend_name(cell.policy),
                     engine_protocol_name(cell.engine), transfer_mode_label(cell.mode));
}

std::string mb(std::int64_t bytes) { return fmt::format("{:.3f} MB", static_cast<double>(bytes) / 1e6); }

std::string pair_executor_text(const Config& c) {
  switch (c.refit.executor) {
    case Executor::kAuto:
      return needs_p2p_group(c) ? "peer on one host (refit run: every pair), p2p across hosts"
                                : "peer (CUDA IPC; colocated ranks share GPUs)";
    case Executor::kPeer:
      return "peer";
    case Executor::kP2p:
      return "p2p";
    case Executor::kGather:
      break;
  }
  return "";
}

std::string engine_name(const Config& c, int g) {
  return fmt::format("engine rank {} (engine {} tp rank {})", g, g / c.generation.tp_size,
                     g % c.generation.tp_size);
}

// Plans of at most this many pairs print every pair's bytes; larger ones print per-rank totals.
constexpr std::size_t kPairLinesUpTo = 256;

// The transfer plan, streamed: every trainer rank's view in turn (each pair lives in exactly one),
// with per-rank totals; then every engine rank's own view, whose pair digests must equal the
// trainer side's — what every pair checks at setup.
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
  auto inputs = PlanInputs::create(c, spec);
  exit_if_error(inputs.status(), kExitSetup);
  PlanInputs& in = **inputs;
  print(fmt::format(
      "transfer plan {:016x}: at most {} bytes per pair and round "
      "(refit.buffer_size_bytes / max(trainer ranks, engine ranks)); executor {}: "
      "{}\n",
      in.identity(), in.pair_budget(), executor_name(c.refit.executor), pair_executor_text(c)));
  const auto E = static_cast<std::size_t>(in.engine_ranks());
  struct EngineTotals {
    std::int64_t bytes = 0;
    std::size_t sources = 0, routes = 0;
    int rounds = 0;
  };
  std::vector<EngineTotals> engines(E);
  std::vector<std::vector<std::pair<int, std::uint64_t>>> digests(E);  // per engine: (trainer, d)
  std::size_t pairs = 0, routes = 0, heaviest_routes = 0;
  int rounds = 0, heaviest = 0;
  std::int64_t fp8_in_pass = 0, fp8_before = 0;
  struct TrainerTotals {
    std::int64_t bytes = 0;
    std::size_t targets = 0, routes = 0, heap = 0;
    int rounds = 0;
  };
  std::vector<TrainerTotals> trainers(static_cast<std::size_t>(in.trainer_ranks()));
  std::vector<std::string> pair_lines;
  // Every trainer rank's view, derived on worker threads from the shared inputs (every engine
  // layout is prepared first; the inputs are read-only from there on), then summed in rank order.
  for (int k = 0; k < in.tp_size(); ++k) exit_if_error(in.prepare_engine(k), kExitSetup);
  struct PairSummary {
    int engine = 0;
    std::int64_t bytes = 0;
    std::size_t routes = 0;
    int rounds = 0;
    std::uint64_t digest = 0;
  };
  struct TrainerResult {
    Status status;
    TrainerTotals totals;
    std::vector<PairSummary> pairs;
    std::int64_t fp8_in_pass = 0, fp8_before = 0;
  };
  std::vector<TrainerResult> results(static_cast<std::size_t>(in.trainer_ranks()));
  for_each_rank_in_parallel(in.trainer_ranks(), [&](int r) {
    TrainerResult& out = results[static_cast<std::size_t>(r)];
    // FP8 marks need the rank's own layout (what the rank derives at setup); the rest its view.
    Result<RouteSetup> setup =
        in.wire().fp8 ? make_trainer_route_setup(*inputs, r) : Result<RouteSetup>(RouteSetup{});
    if (!setup.ok()) {
      out.status = setup.status();
      return;
    }
    if (!in.wire().fp8) {
      auto view = trainer_view(in, r);
      if (!view.ok()) {
        out.status = view.status();
        return;
      }
      setup->view = std::move(view).value();
    }
    const PlanView& v = setup->view;
    out.fp8_in_pass = setup->fp8_blocks_in_pass;
    out.fp8_before = setup->fp8_blocks_before;
    for (const PairPlan& p : v.pairs)
      out.pairs.push_back(PairSummary{.engine = p.engine,
                                      .bytes = p.bytes,
                                      .routes = p.routes.size(),
                                      .rounds = p.rounds(),
                                      .digest = p.digest});
    out.totals = TrainerTotals{.bytes = v.bytes,
                               .targets = v.pairs.size(),
                               .routes = v.routes(),
                               .heap = v.heap_bytes(),
                               .rounds = v.rounds};
  });
  for (int r = 0; r < in.trainer_ranks(); ++r) {
    const TrainerResult& res = results[static_cast<std::size_t>(r)];
    exit_if_error(res.status, kExitSetup);
    fp8_in_pass += res.fp8_in_pass;
    fp8_before += res.fp8_before;
    for (const PairSummary& p : res.pairs) {
      EngineTotals& e = engines[static_cast<std::size_t>(p.engine)];
      e.bytes += p.bytes;
      e.sources += 1;
      e.routes += p.routes;
      e.rounds = std::max(e.rounds, p.rounds);
      digests[static_cast<std::size_t>(p.engine)].emplace_back(r, p.digest);
      if (pair_lines.size() <= kPairLinesUpTo)
        pair_lines.push_back(
            fmt::format("  trainer rank {} -> {}: {}\n", r, engine_name(c, p.engine), mb(p.bytes)));
    }
    const TrainerTotals& t = res.totals;
    trainers[static_cast<std::size_t>(r)] = t;
    pairs += t.targets;
    routes += t.routes;
    rounds = std::max(rounds, t.rounds);
    if (t.routes > heaviest_routes) heaviest_routes = t.routes, heaviest = r;
  }
  results.clear();
  results.shrink_to_fit();
  if (pairs <= kPairLinesUpTo)
    for (const std::string& l : pair_lines) print(l);
  else
    print(fmt::format("  {} pairs (per pair: refit check --rank trainer:R or engine:G)\n", pairs));
  for (int r = 0; r < in.trainer_ranks(); ++r) {
    const TrainerTotals& t = trainers[static_cast<std::size_t>(r)];
    print(fmt::format(
        "  trainer rank {} sends {} to {} engine rank(s): {} routes in {} round(s), "
        "plan view {}\n",
        r, mb(t.bytes), t.targets, t.routes, t.rounds, mb(static_cast<std::int64_t>(t.heap))));
  }
  if (const auto& f = in.wire().fp8)
    print("  " + fp8_plan_summary(*f, fp8_in_pass, fp8_before) + "\n");
  const std::int64_t model_bytes = in.wire().payload_bytes();
  std::size_t heaviest_engine_routes = 0;
  int heaviest_engine = 0;
  // Every engine rank's view, on worker threads too, each checked against its trainer ranks'.
  struct EngineResult {
    Status status;
    bool same = false;
    std::size_t routes = 0, heap = 0;
  };
  std::vector<EngineResult> checked(E);
  for_each_rank_in_parallel(in.engine_ranks(), [&](int g) {
    EngineResult& out = checked[static_cast<std::size_t>(g)];
    auto v = engine_view(in, g);
    if (!v.ok()) {
      out.status = v.status();
      return;
    }
    const EngineTotals& t = engines[static_cast<std::size_t>(g)];
    const auto& want = digests[static_cast<std::size_t>(g)];
    bool same = v->pairs.size() == want.size() && v->bytes == t.bytes;
    for (std::size_t i = 0; same && i < want.size(); ++i)
      same = v->pairs[i].trainer == want[i].first && v->pairs[i].digest == want[i].second;
    out.same = same;
    out.routes = v->routes();
    out.heap = v->heap_bytes();
  });
  for (int g = 0; g < in.engine_ranks(); ++g) {
    const EngineResult& v = checked[static_cast<std::size_t>(g)];
    exit_if_error(v.status, kExitSetup);
    const EngineTotals& t = engines[static_cast<std::size_t>(g)];
    if (!v.same)
      throw CliExit(kExitSetup,
                    fmt::format("internal: {}'s view of its pairs differs from its trainer ranks' "
                                "views (a bug in the plan; please report it)",
                                engine_name(c, g)));
    if (v.routes > heaviest_engine_routes) heaviest_engine_routes = v.routes, heaviest_engine = g;
    print(fmt::format(
        "  engine rank {} receives {} ({:.3f} of the model) from {} trainer rank(s): "
        "{} routes in {} round(s), plan view {}\n",
        g, mb(t.bytes),
        model_bytes > 0 ? static_cast<double>(t.bytes) / static_cast<double>(model_bytes) : 0.0,
        t.sources, t.routes, t.rounds, mb(static_cast<std::int64_t>(v.heap))));
  }
  print(fmt::format(
      "plan: {} routes over {} pairs, at most {} round(s); the most routes: trainer "
      "rank {} ({}), engine rank {} ({}); every pair's routes agree on both sides\n",
      routes, pairs, rounds, heaviest, heaviest_routes, heaviest_engine, heaviest_engine_routes));
}

// One rank's view, as that rank derives it at setup: its pairs, its routes, its rounds.
void print_rank_view(const Config& c, const ModelSpec& spec, const std::string& which) {
  const auto colon = which.find(':');
  const std::string role = which.substr(0, colon);
  int rank = -1;
  if (colon != std::string::npos) {
    try {
      std::size_t used = 0;
      rank = std::stoi(which.substr(colon + 1), &used);
      if (used != which.size() - colon - 1) rank = -1;
    } catch (const std::exception&) {
      rank = -1;
    }
  }
  if ((role != "trainer" && role != "engine") || rank < 0)
    throw CliExit(kExitSetup, fmt::format("--rank {}: expected trainer:R or engine:G", which));
  if (!uses_transfer_plan(c))
    throw CliExit(kExitSetup, fmt::format("--rank {}: refit.executor gather has no transfer plan "
                                          "(every engine rank receives the whole model)",
                                          which));
  const bool trainer = role == "trainer";
  const int limit = trainer ? c.policy.world_size : c.engine_ranks();
  if (rank >= limit)
    throw CliExit(
        kExitSetup,
        fmt::format("--rank {}: there is no {} rank {} ({} is {})", which, role, rank,
                    trainer ? "policy.world_size" : "generation.num_engines x tp_size", limit));
  // CPU seconds too: what the derivation costs, however busy the machine is.
  const std::clock_t cpu = std::clock();
  auto setup =
      trainer ? make_trainer_route_setup(c, spec, rank) : make_engine_route_setup(c, spec, rank);
  const double cpu_seconds = static_cast<double>(std::clock() - cpu) / CLOCKS_PER_SEC;
  exit_if_error(setup.status(), kExitSetup);
  const PlanView& v = setup->view;
  const std::string self = trainer ? fmt::format("trainer rank {}", rank) : engine_name(c, rank);
  print(
      fmt::format("{}: transfer plan {}, at most {} bytes per pair and round; derived in {:.3f} "
                  "s ({:.3f} s of CPU), the view holds {} bytes\n",
                  self, v.identity_hex(), v.pair_budget, setup->seconds, cpu_seconds,
                  v.heap_bytes()));
  print(fmt::format(
      "  {} {} per refit {} {} {} rank(s): {} routes in {} round(s), the largest "
      "round staging {} bytes\n",
      trainer ? "sends" : "receives", mb(v.bytes), trainer ? "to" : "from", v.pairs.size(),
      trainer ? "engine" : "trainer", v.routes(), v.rounds, v.max_stage_bytes));
  if (trainer && setup->wire().fp8) print("  " + fp8_plan_summary(*setup) + "\n");
  for (const PairPlan& p : v.pairs)
    print(fmt::format(
        "  {} {}: {}, {} routes in {} round(s), routes digest {}\n", trainer ? "->" : "<-",
        trainer ? engine_name(c, p.engine) : fmt::format("trainer rank {}", p.trainer), mb(p.bytes),
        p.routes.size(), p.rounds(), p.digest_hex()));
  const auto& tensors = setup->wire().spec.tensors();
  print("  routes (member 0; a count above 1 repeats it with the step):\n");
  for (const PairPlan& p : v.pairs) {
    const EngineShardLayout& lay = setup->engine_layout(p.engine);
    for (const Route& r : p.routes) {
      std::string line = fmt::format(
          "    trainer rank {} -> engine rank {}: round {} offset {}: {} [{}, {}] {} x {}, from "
          "{} [{}, {}] to {} [{}, {}]",
          p.trainer, p.engine, r.round, r.segment_offset, tensors[r.hf_tensor].name, r.hf_row,
          r.hf_col, r.rows, r.cols,
          trainer ? setup->trainer.tensors[r.trainer_tensor].name
                  : fmt::format("local tensor {}", r.trainer_tensor),
          r.trainer_row, r.trainer_col, lay.params[r.engine_param].name, r.engine_row,
          r.engine_col);
      if (r.count > 1)
        line += fmt::format(
            ", x {} (step: tensor +{}, local tensor +{} at +[{}, {}], parameter "
            "+{} at +[{}, {}])",
            r.count, r.step.hf_tensor, r.step.trainer_tensor, r.step.trainer_row,
            r.step.trainer_col, r.step.engine_param, r.step.engine_row, r.step.engine_col);
      print(line + "\n");
    }
  }
}

void run_check(const std::string& path, bool print_config, const std::string& rank) {
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
  auto wire_bytes = bytes_per_refit(c, *spec);
  if (!wire_bytes.ok()) exit_if_error(wire_bytes.status().with_context(path), kExitSetup);
  print(fmt::format("refit: {} on {}, {} bytes per refit, {} buffers of {} bytes, timeout {} s\n",
                    dtype_name(c.refit.target_precision), device_name(c.device), *wire_bytes,
                    c.refit.num_buffers, c.refit.buffer_size_bytes, c.refit.timeout_s));
  if (c.refit.staged)
    print("refit.staged: every engine rank also holds a staging copy of its parameters (as many "
          "bytes again as it receives in a full refit, below); generation pauses only to copy "
          "it in\n");
  if (rank.empty())
    print_transfer_plan(c, *spec);
  else
    print_rank_view(c, *spec, rank);
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
  auto rank = std::make_shared<std::string>();
  check->add_option("--rank", *rank,
                    "print one rank's view of the transfer plan, as it derives it at setup: "
                    "trainer:R or engine:G");
  check->callback([path, print_config, rank] { run_check(*path, *print_config, *rank); });

  auto as_json = std::make_shared<bool>(false);
  auto* matrix = app.add_subcommand("matrix", "Print the support matrix as this build knows it");
  matrix->add_flag("--json", *as_json, "print JSON: cells and target_precisions");
  matrix->callback([as_json] { run_matrix(*as_json); });
}

}  // namespace refit::cli
