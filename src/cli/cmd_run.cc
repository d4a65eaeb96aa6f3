// `refit run`, `refit bench` (launch every rank on this machine), `refit trainer` / `refit engine`
// (one rank, torchrun-style environment) and `refit shard` (what a trainer rank holds).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include "cli/commands.h"
#include "common/env.h"
#include "common/host_buffer.h"
#include "control/auth.h"
#include "control/fd_limit.h"
#include "control/ports.h"
#include "control/store.h"
#include "harness/launcher.h"
#include "harness/rank.h"
#include "io/safetensors.h"
#include "runtime/failure.h"
#include "trainer/trainer_layout.h"
#include "weights/materialize.h"
#include "weights/setup.h"

namespace refit::cli {
namespace {

struct RunFlags {
  std::string config_path;  // empty: the embedded default
  int steps = 1;
  bool verify = false;
  bool check_logits = false;
  std::string json_path;
  std::string fault;
  std::string host;
  int engine_rank = -1;
  int raw_passes = 0;
  std::string dump_dir;
  std::string update;     // --update: how the generated weights move (weights/weights.h)
  double deadline_s = 0;  // run / bench: the whole run's bound (0: the default, run_deadline)
  std::string command;    // "refit run", "refit bench", "refit trainer": names a setup error
};

// `refit run`'s overall bound when --deadline is not given: three timeouts per refit (its own,
// the raw passes', setup and shutdown), which no healthy run comes near.
double run_deadline(const RunFlags& f, const Config& cfg) {
  if (f.deadline_s > 0) return f.deadline_s;
  return 3.0 * cfg.refit.timeout_s * (f.steps + f.raw_passes + 4);
}

// Loads CONFIG (or the embedded default) and checks it against its model: setup errors exit 2
// before any rank starts.
Config load_checked_config(const std::string& path) {
  auto cfg = path.empty() ? parse_config(default_config_yaml()) : load_config_file(path);
  exit_if_error(cfg.status(), kExitSetup);
  // The spec, the config against it, and a model directory's checkpoint (every safetensors header
  // against the table): all before any rank starts.
  exit_if_error(load_rank_model(*cfg).status(), kExitSetup);
  return *cfg;
}

// The value of an environment accessor (common/env.h); a bad value exits 2 naming the variable.
template <typename T>
T setup_env(Result<T> value) {
  exit_if_error(value.status(), kExitSetup);
  return std::move(value).value();
}

RankOptions rank_options(const RunFlags& f, const Config& cfg) {
  RankOptions o;
  o.config = cfg;
  o.steps = f.steps;
  o.verify = f.verify;
  o.check_logits = f.check_logits;
  o.raw_passes = f.raw_passes;
  o.dump_dir = f.dump_dir;
  if (!f.update.empty()) {
    auto update = parse_weight_update(f.update);
    exit_if_error(update.status(), kExitSetup);
    o.update = *update;
  }
  if (!o.dump_dir.empty()) {  // a directory we cannot write is a setup error, before any rank
    std::error_code ec;
    std::filesystem::create_directories(o.dump_dir, ec);
    if (ec || access(o.dump_dir.c_str(), W_OK) != 0)
      throw CliExit(kExitSetup, fmt::format("--dump {}: not a writable directory{}", o.dump_dir,
                                            ec ? " (" + ec.message() + ")" : ""));
  }
  auto fault = parse_fault(f.fault);
  exit_if_error(fault.status(), kExitSetup);
  exit_if_error(check_fault_fits(*fault, cfg), kExitSetup);
  if (o.check_logits) {
    auto spec = load_model_spec(cfg.model);
    exit_if_error(spec.status(), kExitSetup);
    exit_if_error(check_logit_check_fits(cfg, *spec), kExitSetup);
  }
  o.fault = *fault;
  o.endpoint.master_addr = env::master_addr();
  o.endpoint.master_port = setup_env(env::store_port());
  o.endpoint.host = !f.host.empty() ? f.host : env::host().value_or(o.endpoint.master_addr);
  return o;
}

int exit_code_for(const Status& st) {
  switch (st.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kUnsupported:
    case StatusCode::kNotFound:
      return kExitSetup;
    case StatusCode::kOk:
      return 0;
    case StatusCode::kCorruption:
    case StatusCode::kIOError:
    case StatusCode::kTimeout:
    case StatusCode::kAborted:
    case StatusCode::kInternal:
      return kExitRuntime;
  }
  return kExitRuntime;
}

// --json FILE (`refit run`, `refit bench`, trainer rank 0), like --dump: a path the report cannot
// be written to is a setup error before any rank starts, and a report an earlier run left there is
// removed, so that after the command the file is this run's report or absent.
void prepare_report(const std::string& json_path) {
  if (!json_path.empty()) exit_if_error(prepare_report_path(json_path), kExitSetup);
}

// A setup error after the --json path was prepared (before any rank started): the report says so
// (`ok: false`, error.role "setup", `config` when it was read), and the error goes on to exit 2.
[[noreturn]] void report_setup_error(const RunFlags& f, const Config* cfg, const CliExit& e) {
  if (!f.json_path.empty()) {
    Status written =
        write_setup_failure_report_json(f.json_path, SetupFailure{.command = f.command,
                                                                  .steps = f.steps,
                                                                  .verify = f.verify,
                                                                  .check_logits = f.check_logits,
                                                                  .config = cfg,
                                                                  .message = e.what()});
    if (!written.ok()) std::fprintf(stderr, "refit: %s\n", written.to_string().c_str());
  }
  throw e;
}

// Trainer rank 0 of a run that failed writes the failure report, blaming the run's root cause
// (the process with_root_cause names in `st`, or itself).
void report_trainer_failure(const std::string& json_path, const RankOptions& o, int rank,
                            const Status& st) {
  if (json_path.empty() || rank != 0) return;
  const Blame blame = blame_failure(RankId::trainer(rank), st);
  Status written = write_failure_report_json(json_path, o, blame);
  if (!written.ok()) std::fprintf(stderr, "refit: %s\n", written.to_string().c_str());
}

// A rank of `cfg`'s run may hold a lane or a ZeroMQ connection to each peer and, in Gloo's full
// meshes, a pair to each member of its groups: its soft RLIMIT_NOFILE is raised to cover them, or
// the rank refuses at setup naming the limit (the store's host checks its own share,
// control/store.h).
void ensure_rank_descriptors(const Config& cfg, const std::string& who) {
  const int ranks = cfg.policy.world_size + cfg.engine_ranks();
  exit_if_error(ensure_fd_limit(256 + std::int64_t{8} * ranks, who,
                                fmt::format("a rank of a run of {} ranks", ranks)),
                kExitSetup);
}

void run_trainer(const RunFlags& f) {
  exit_if_error(env::check(), kExitSetup);
  const Config cfg = load_checked_config(f.config_path);
  const int rank = setup_env(env::rank()).value_or(0);
  const int world = setup_env(env::world_size()).value_or(cfg.policy.world_size);
  if (world != cfg.policy.world_size)
    throw CliExit(kExitSetup, fmt::format("WORLD_SIZE={} but policy.world_size is {}", world,
                                          cfg.policy.world_size));
  if (rank >= world)
    throw CliExit(kExitSetup,
                  fmt::format("RANK={} is outside the trainer group of {}", rank, world));
  if (rank == 0) prepare_report(f.json_path);
  RankOptions o;
  try {
    ensure_rank_descriptors(cfg, RankId::trainer(rank).name());
    o = rank_options(f, cfg);
  } catch (const CliExit& e) {
    if (rank == 0) report_setup_error(f, &cfg, e);
    throw;
  }
  RefitReport report;
  Status st = run_trainer_rank(o, rank, &report);
  if (!st.ok()) {
    report_trainer_failure(f.json_path, o, rank, st);
    throw CliExit(exit_code_for(st), fmt::format("trainer rank {}: {}", rank, st.to_string()));
  }
  if (rank == 0) {
    std::fputs(format_summary(o, report).c_str(), stdout);
    std::fflush(stdout);
    if (!f.json_path.empty()) exit_if_error(write_report_json(f.json_path, o, report), 1);
  }
}

void run_engine(const RunFlags& f) {
  exit_if_error(env::check(), kExitSetup);
  const Config cfg = load_checked_config(f.config_path);
  int rank = f.engine_rank;
  if (rank < 0) {
    const std::optional<int> engine_rank = setup_env(env::engine_rank());
    rank = engine_rank ? *engine_rank : setup_env(env::rank()).value_or(-1);
  }
  if (rank < 0 || rank >= cfg.engine_ranks())
    throw CliExit(kExitSetup, fmt::format("engine rank {} is outside 0..{} (set --engine-rank or "
                                          "ENGINE_RANK = engine index * tp_size + tp rank)",
                                          rank, cfg.engine_ranks() - 1));
  ensure_rank_descriptors(cfg, RankId::engine(rank, cfg.generation.tp_size).name());
  Status st = run_engine_rank(rank_options(f, cfg), rank);
  if (!st.ok())
    throw CliExit(exit_code_for(st), fmt::format("engine rank {}: {}", rank, st.to_string()));
}

// The private directory of a `refit run`, removed with its contents when it goes out of scope
// (an error thrown as CliExit included) or at remove().
class RunDirectory {
 public:
  explicit RunDirectory(std::string path) : path_(std::move(path)) {}
  ~RunDirectory() { remove(); }
  RunDirectory(const RunDirectory&) = delete;
  RunDirectory& operator=(const RunDirectory&) = delete;
  void remove() {
    if (path_.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
    path_.clear();
  }

 private:
  std::string path_;
};

// `refit run` / `refit bench`: every rank as a process of this machine.
void run_local(const RunFlags& f) {
  prepare_report(f.json_path);  // first: every setup error below is reported in it
  std::optional<Config> loaded;
  RankOptions checked;
  std::shared_ptr<const ControlAuth> auth;
  try {
    exit_if_error(env::check(), kExitSetup);  // every rank inherits this environment
    loaded = load_checked_config(f.config_path);
    checked = rank_options(f, *loaded);  // flags are checked before anything starts
    if (checked.fault.step > f.steps)
      throw CliExit(kExitSetup, fmt::format("--fault {}: step {} is past the run's --steps {}",
                                            f.fault, checked.fault.step, f.steps));
    exit_if_error(ensure_process_limit(loaded->policy.world_size + loaded->engine_ranks()),
                  kExitSetup);
    // The user's run secret, checked before anything is made (a bad one is a setup error).
    auth = setup_env(process_control_auth());
  } catch (const CliExit& e) {
    report_setup_error(f, loaded ? &*loaded : nullptr, e);
  }
  const Config& cfg = *loaded;
  const RankOptions& options = checked;
  // Children read the resolved config from a private file.
  // Under $TMPDIR (default /tmp), removed when the run ends, however it ends: on every return and
  // every error from here on (RunDirectory's destructor), and before dying of a signal. SIGINT,
  // SIGTERM and SIGHUP are caught before it is made: one that comes during the setup below ends
  // the run when launch_and_wait starts, before any rank.
  catch_interrupts();
  const char* tmp = std::getenv("TMPDIR");
  std::string dir_template =
      std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/refit-run-XXXXXX";
  if (mkdtemp(dir_template.data()) == nullptr)
    throw CliExit(kExitRuntime, fmt::format("cannot create a directory {}: {}", dir_template,
                                            std::strerror(errno)));
  RunDirectory run_dir(dir_template);
  const std::string dir = dir_template;
  const std::string cfg_path = dir + "/config.yaml";
  std::ofstream(cfg_path) << config_to_yaml(cfg);
  // REFIT_PORT when the user chose one, else a free port.
  const std::optional<int> chosen = setup_env(env::refit_port());
  auto port = chosen && *chosen != 0 ? Result<int>(*chosen) : pick_free_port();
  exit_if_error(port.status(), kExitRuntime);

  std::vector<std::string> common = {cfg_path};
  if (!f.fault.empty()) common.insert(common.end(), {"--fault", f.fault});
  if (f.verify) common.push_back("--verify");
  if (f.check_logits) common.push_back("--check-logits");
  if (!f.dump_dir.empty()) common.insert(common.end(), {"--dump", f.dump_dir});
  if (!f.update.empty()) common.insert(common.end(), {"--update", f.update});
  std::vector<ChildSpec> children;
  // The run's id names its shared-memory segments, so that whatever its ranks leave behind (a
  // rank killed before it unlinked them, an interrupted run) is removed below.
  const std::string run_id = setup_env(env::run_id())
                                 .value_or(fmt::format("{}-{}", getpid(), time(nullptr)));
  std::vector<std::pair<std::string, std::string>> master = {{"MASTER_ADDR", "127.0.0.1"},
                                                             {"REFIT_PORT", std::to_string(*port)},
                                                             {"REFIT_RUN_ID", run_id}};
  // The control plane is authenticated with the user's secret, or else with a new one, which the
  // ranks read from a file of the run's private directory (docs/security.md).
  if (!auth) {
    const std::string secret = ControlAuth::generate_secret();
    const std::string secret_path = dir + "/secret";
    const int fd = ::open(secret_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 || ::write(fd, secret.data(), secret.size()) != static_cast<ssize_t>(secret.size()))
      throw CliExit(kExitRuntime, fmt::format("cannot write the run secret to {}", secret_path));
    ::close(fd);
    master.emplace_back("REFIT_SECRET_FILE", secret_path);
    auth = std::make_shared<const ControlAuth>(setup_env(ControlAuth::from_secret(secret)));
  }
  // Unless REFIT_HOST says where, each rank listens on a loopback address of its own (Linux routes
  // all of 127.0.0.0/8 to the loopback interface): Gloo binds a port per pair of a group on the
  // rank's address, and a few hundred ranks sharing 127.0.0.1 run out of its ephemeral ports
  // (about 28,000) while their groups form. Trainer rank 0, which hosts the store, keeps
  // MASTER_ADDR, 127.0.0.1.
  const bool own_addresses = !env::read("REFIT_HOST").has_value();
  auto listen_on = [&](ChildSpec& c, int k) {
    if (own_addresses)
      c.env.emplace_back("REFIT_HOST",
                         k == 0 ? std::string("127.0.0.1")
                                : fmt::format("127.1.{}.{}", k / 200, k % 200 + 1));
  };
  for (int r = 0; r < cfg.policy.world_size; ++r) {
    ChildSpec c{RankId::trainer(r).name(), {"trainer"}, master, /*hosts_store=*/r == 0};
    listen_on(c, r);
    c.args.insert(c.args.end(), common.begin(), common.end());
    c.args.insert(c.args.end(), {"--steps", std::to_string(f.steps)});
    if (f.raw_passes > 0)
      c.args.insert(c.args.end(), {"--raw-passes", std::to_string(f.raw_passes)});
    if (r == 0 && !f.json_path.empty()) c.args.insert(c.args.end(), {"--json", f.json_path});
    c.env.emplace_back("RANK", std::to_string(r));
    c.env.emplace_back("WORLD_SIZE", std::to_string(cfg.policy.world_size));
    children.push_back(std::move(c));
  }
  for (int g = 0; g < cfg.engine_ranks(); ++g) {
    ChildSpec c{RankId::engine(g, cfg.generation.tp_size).name(), {"engine"}, master};
    listen_on(c, cfg.policy.world_size + g);
    c.args.insert(c.args.end(), common.begin(), common.end());
    c.env.emplace_back("ENGINE_RANK", std::to_string(g));
    children.push_back(std::move(c));
  }
  // Each rank's mailbox spins after a message (REFIT_CONTROL_SPIN_US, on with 8 cores or more) to
  // be awake for the next one. With more processes than half the cores the spinners starve the
  // ranks that have work: 32 processes on 16 cores took 0.015 s per refit spinning and 0.004 s
  // without (notes/control-scale.md). Unless the caller set it, the spin is off for such runs.
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  if (!env::read("REFIT_CONTROL_SPIN_US").has_value() && 2 * children.size() > cores)
    for (ChildSpec& c : children) c.env.emplace_back("REFIT_CONTROL_SPIN_US", "0");
  // A child that dies without a word (a signal) is recorded in the store as the run's first
  // failure, so every other rank stops within a second, naming it.
  const int store_port = *port;
  const int tp_size = cfg.generation.tp_size;
  auto on_failure = [store_port, auth, tp_size](const std::string& child, const std::string& how) {
    auto store = connect_store("127.0.0.1", store_port, std::chrono::milliseconds(1000), auth);
    const std::optional<RankId> who = RankId::from_name(child, tp_size);
    if (store.ok() && who)
      announce_failure(store->get(), FailureOrigin{.rank = *who,
                                                   .code = StatusCode::kAborted,
                                                   .error = fmt::format("aborted: the process {}",
                                                                        how)});
  };
  auto result = launch_and_wait(self_executable(), children, cfg.refit.timeout_s, on_failure,
                                run_deadline(f, cfg));
  run_dir.remove();
  if (const int swept = remove_run_segments(run_id); swept > 0)
    std::fprintf(stderr, "refit: removed %d shared-memory segment(s) /dev/shm/refit-%s-* the run left\n",
                 swept, run_id.c_str());
  exit_if_error(result.status(), kExitRuntime);
  if (result->interrupted != 0) {  // cleaned up: now die of the signal, as the caller expects
    std::fprintf(stderr, "refit: %s\n", result->summary.c_str());
    signal(result->interrupted, SIG_DFL);
    raise(result->interrupted);
  }
  if (!result->ok) {
    // Trainer rank 0 wrote the failure report, unless it died or the first process to fail was
    // killed outright (then that process is the root cause, whatever the ranks saw).
    if (!f.json_path.empty() && result->first_failed >= 0) {
      const std::string& name = children[result->first_failed].name;
      Blame first{.process = name, .message = name + ": aborted: the process " + result->first_how};
      if (const std::optional<RankId> who = RankId::from_name(name, cfg.generation.tp_size))
        first = blame_of(FailureOrigin{.rank = *who,
                                       .code = StatusCode::kAborted,
                                       .error = "aborted: the process " + result->first_how});
      Status written = settle_failed_run_report(f.json_path, options, first, result->first_killed);
      if (!written.ok()) std::fprintf(stderr, "refit: %s\n", written.to_string().c_str());
    }
    throw CliExit(kExitRuntime, "run failed: " + result->summary);
  }
  std::fprintf(stdout, "refit: %d refit(s) completed%s%s\n", f.steps,
               f.verify ? ", verified bit-exact on every engine rank" : "",
               f.check_logits ? ", engine logits match the reference forward" : "");
}

// `refit shard CONFIG --rank R --out FILE`.
void run_shard(const std::string& config_path, int rank, const std::string& out) {
  const Config cfg = load_checked_config(config_path);
  if (rank < 0 || rank >= cfg.policy.world_size)
    throw CliExit(kExitSetup, fmt::format("--rank {} is outside the trainer group of {}", rank,
                                          cfg.policy.world_size));
  auto model = load_rank_model(cfg);
  exit_if_error(model.status(), kExitSetup);
  auto layout = trainer_layout((*model)->spec, cfg.policy, rank);
  exit_if_error(layout.status(), kExitSetup);
  const std::size_t esize = dtype_size(cfg.policy.dtype);
  std::vector<HostBuffer> storage;
  std::vector<TensorView> views;
  for (const LocalTensor& t : layout->tensors) {
    storage.emplace_back(static_cast<std::size_t>(matrix_shape(t.shape).numel()) * esize + 1);
    materialize_pieces((*model)->spec, t.pieces, t.shape, *(*model)->weights, 0, cfg.policy.dtype,
                       cfg.policy.dtype, storage.back().data());
    views.push_back(TensorView{t.name, cfg.policy.dtype, t.shape, storage.back().data()});
  }
  exit_if_error(
      write_safetensors(out, views,
                        {{"refit_rank", std::to_string(rank)},
                         {"refit_backend", std::string(policy_backend_name(cfg.policy.backend))},
                         {"refit_model", cfg.model}}),
      kExitRuntime);
  std::printf("wrote %zu tensors of trainer rank %d to %s\n", views.size(), rank, out.c_str());
}

}  // namespace

void add_run_commands(CLI::App& app) {
  auto f = std::make_shared<RunFlags>();
  auto add_update = [&](CLI::App* cmd) {
    cmd->add_option("--update", f->update,
                    "how the generated weights move each step: drift (default: by up to 1/128) "
                    "or adam:LR (each element by about LR, as an optimizer step moves it; "
                    "docs/delta.md); every rank of a run needs the same");
  };
  auto add_common = [&](CLI::App* cmd) {
    add_update(cmd);
    cmd->add_option("--fault", f->fault,
                    "inject a fault (tests): corrupt:BUCKET[:STEP], kill-trainer:RANK:AT, "
                    "kill-engine:RANK:AT, stop-trainer:RANK:AT, stop-engine:RANK:AT (AT: a "
                    "bucket or round, setup or commit), fail-pause:RANK[:STEP], "
                    "slow-pause:RANK[:STEP], stall-trainer:RANK[:STEP], "
                    "stall-engine:RANK[:STEP], forget-base:ENGINE:TRAINER:STEP, "
                    "forget-kept:TRAINER:ENGINE:STEP, plan-mismatch, version-mismatch");
    cmd->add_option("--dump", f->dump_dir,
                    "after the last refit write DIR/trainer.safetensors, DIR/expected.safetensors "
                    "and DIR/engine-<g>.safetensors (created if missing)");
  };

  auto* run = app.add_subcommand("run", "Run refits with every rank as a process on this machine");
  run->add_option("CONFIG", f->config_path, "config YAML (default: the embedded CPU default)");
  run->add_option("--steps", f->steps, "refits to run")->check(CLI::PositiveNumber);
  run->add_flag("--verify", f->verify, "check every element on every engine rank bit-exact");
  run->add_flag("--check-logits", f->check_logits,
                "engines run a TP forward pass and compare logits with a reference forward");
  run->add_option("--json", f->json_path, "write the JSON report here");
  add_common(run);
  auto add_deadline = [&](CLI::App* cmd) {
    cmd->add_option("--deadline", f->deadline_s,
                    "seconds the whole run may take before every rank is killed (default: 3 x "
                    "refit.timeout_s x (steps + 4))")
        ->check(CLI::PositiveNumber);
  };
  add_deadline(run);
  run->callback([f] {
    f->command = "refit run";
    run_local(*f);
  });

  auto* bench = app.add_subcommand("bench", "Measure refit throughput against the raw transport");
  bench->add_option("CONFIG", f->config_path, "config YAML")->required();
  bench->add_option("--steps", f->steps, "refits to time")->check(CLI::PositiveNumber);
  bench->add_option("--json", f->json_path, "write the JSON report here (gbps, limit_gbps, ratio)");
  add_deadline(bench);
  add_update(bench);
  bench->callback([f] {
    if (f->steps < 3) f->steps = 3;
    f->raw_passes = 3;
    f->command = "refit bench";
    run_local(*f);
  });

  auto* trainer = app.add_subcommand(
      "trainer", "Run one trainer rank (env RANK, WORLD_SIZE, MASTER_ADDR, REFIT_PORT)");
  trainer->add_option("CONFIG", f->config_path, "config YAML")->required();
  trainer->add_option("--steps", f->steps, "refits to run")->check(CLI::PositiveNumber);
  trainer->add_flag("--verify", f->verify, "engines check every element after each refit");
  trainer->add_flag("--check-logits", f->check_logits, "engines also check their logits");
  trainer->add_option("--json", f->json_path, "rank 0: write the JSON report here");
  trainer->add_option("--raw-passes", f->raw_passes, "bench: raw transport passes");
  trainer->add_option("--host", f->host,
                      "address to listen on (default REFIT_HOST or MASTER_ADDR)");
  add_common(trainer);
  trainer->callback([f] {
    f->command = "refit trainer";
    run_trainer(*f);
  });

  auto* engine = app.add_subcommand(
      "engine", "Run one engine rank (env ENGINE_RANK, MASTER_ADDR, REFIT_PORT of trainer rank 0)");
  engine->add_option("CONFIG", f->config_path, "config YAML")->required();
  engine->add_option("--engine-rank", f->engine_rank, "engine index * tp_size + tp rank");
  engine->add_flag("--verify", f->verify, "verify every element when the trainer asks");
  engine->add_flag("--check-logits", f->check_logits,
                   "compare a TP forward pass with a reference when the trainer asks");
  engine->add_option("--host", f->host, "address to listen on (default REFIT_HOST or MASTER_ADDR)");
  add_common(engine);
  engine->callback([f] { run_engine(*f); });

  auto shard_cfg = std::make_shared<std::string>();
  auto shard_rank = std::make_shared<int>(0);
  auto shard_out = std::make_shared<std::string>();
  auto* shard = app.add_subcommand("shard", "Write what a trainer rank holds as safetensors");
  shard->add_option("CONFIG", *shard_cfg, "config YAML")->required();
  shard->add_option("--rank", *shard_rank, "trainer rank")->required();
  shard->add_option("--out", *shard_out, "output .safetensors file")->required();
  shard->callback([=] { run_shard(*shard_cfg, *shard_rank, *shard_out); });
}

}  // namespace refit::cli
