// The refit processes of the CLI (`refit run`, `refit trainer`, `refit engine`): a Trainer or
// Engine of the library API (refit/session.h) whose storage the process owns and fills with the
// deterministic weights of weights/weights.h, so that engines can verify every element.
#pragma once

#include <string>
#include <vector>

#include "harness/fault_probe.h"
#include "plane/data_plane.h"
#include "refit/config.h"
#include "refit/session.h"
#include "refit/status.h"
#include "runtime/failure.h"
#include "runtime/traffic.h"
#include "weights/weights.h"

namespace refit {

class PlanInputs;

struct RankOptions {
  Config config;
  Endpoint endpoint;
  int steps = 1;              // refits to run (trainer rank 0 decides; engines follow)
  bool verify = false;        // engines check every element after each refit
  bool check_logits = false;  // engines also compare a TP forward pass with a reference
  int raw_passes = 0;         // bench: raw transport passes after the refits
  // How the generated weights move each step (--update); every rank of a run must use the same:
  // trainer rank 0 publishes its own and engines refuse to serve another.
  WeightUpdate update;
  Fault fault;
  // After the last refit: trainer rank 0 writes DIR/trainer.safetensors (the full HF tensors in
  // the policy dtype) and DIR/expected.safetensors (after the cast); engine rank g writes
  // DIR/engine-<g>.safetensors (its parameters, engine names and layout). Empty: no dump.
  std::string dump_dir;
};

// Version of the --json report's layout (docs/report.schema.json; what each version added:
// docs/runtime.md, "Report").
inline constexpr int kReportSchemaVersion = 7;

// refit.delta: what one refit moved, over every rank (the report's `delta`).
struct DeltaStep {
  int step = 0;
  std::int64_t wire_bytes = 0;  // the trainer ranks' bytes_sent
  std::int64_t full_bytes = 0;  // what a full refit of every pair moves
  double changed_fraction = 0;  // changed / elements over the pairs sent as a delta
  int pairs = 0;                // pairs sent as a delta
  double encode_seconds = 0;    // the slowest trainer rank's encoding and keeping
  double apply_seconds = 0;     // the slowest engine rank's delta applies
};
DeltaStep delta_step_of(const std::vector<RankTraffic>& ranks, int step);

// Per-run numbers collected by trainer rank 0.
struct RefitReport {
  int steps = 0;
  bool verified = false;
  bool logits_checked = false;
  long long bytes_per_refit = 0;
  int buckets_per_refit = 0;
  std::vector<double> refit_seconds;
  std::vector<double> pause_seconds;  // per refit: the longest pause of generation (RefitStats)
  double unshard_s = 0, cast_pack_s = 0, transfer_s = 0, apply_s = 0;  // medians per refit
  std::vector<double> raw_seconds;  // bench: raw transport passes
  // bench: the floor of docs/design.md §7 — the refit's reads (policy dtype) and writes (target
  // dtype) at the copy bandwidth measured on the trainer's device in the same run.
  double floor_seconds = 0;
  double copy_bandwidth = 0;  // read+write bytes/s
  double peer_bandwidth = 0;  // bench, transfer plan across devices: payload bytes/s device to device
  std::string plan_hash;
  std::string executor;                // refit.executor as resolved
  std::vector<RankTraffic> ranks;      // per rank, of the last refit
  ControlTraffic control;              // the control plane over the whole run, every rank
  std::vector<DeltaStep> delta_steps;  // refit.delta: per successful refit

  // Transfer plan bench: the floor with local traffic and the link overlapping, and what bounds
  // the floor (the busiest device).
  double floor_overlap_seconds = 0;
  std::string floor_basis;
};

// The floor of a refit along the transfer plan: per device, the bytes its routes read and write
// there at `copy_bandwidth` (read+write bytes/s) plus the bytes it sends to or receives from other
// devices at `peer_bandwidth` (bytes/s); the busiest device sets the floor. `overlap_seconds` is
// the same with local traffic and the link overlapping perfectly (the larger of the two per
// device): a strict lower bound, where `seconds` assumes they take turns. `settings` place the
// ranks on devices (device_ordinal).
struct PlanFloor {
  double seconds = 0;
  double overlap_seconds = 0;
  std::string basis;  // the busiest device and its bytes
};
Result<PlanFloor> transfer_plan_floor(const Config& config, PlanInputs& inputs,
                                      double copy_bandwidth, double peer_bandwidth,
                                      const PlaneSettings& settings);

// Runs trainer rank `rank` for options.steps refits; trainer rank 0 fills `report`.
// `--fault` against the run it would act on: the rank exists and the bucket or round is one the
// plan moves (0 .. rounds-1). An error names the fault, the limit and the key behind it.
Status check_fault_fits(const Fault& fault, const Config& config);
// `--check-logits` against the run: an architecture with a reference forward, a model small
// enough for it, bf16 engine parameters. An error names the flag and the reason.
Status check_logit_check_fits(const Config& config, const ModelSpec& spec);

// --update agreement: trainer rank 0 publishes options.update in the run's store; an engine
// rank checks its own against it (InvalidArgument naming both when they differ).
Status publish_weight_update(const RankOptions& options);
Status check_weight_update(const RankOptions& options, const std::string& who);

Status run_trainer_rank(const RankOptions& options, int rank, RefitReport* report);
// Runs engine rank `engine_rank` until the trainer shuts it down.
Status run_engine_rank(const RankOptions& options, int engine_rank);

// The JSON report of docs/design.md §5.3 (plus bench fields when raw passes ran), `ok: true`.
// Every report is written to a temporary file next to `path` and renamed over it.
Status write_report_json(const std::string& path, const RankOptions& options,
                         const RefitReport& report);
// The report of a run that failed: `ok: false` and `error` naming the process blamed.
Status write_failure_report_json(const std::string& path, const RankOptions& options,
                                 const Blame& error);
// A command that stopped with a setup error before any rank started, after its --json path was
// checked: `command` ("refit run", "refit bench", "refit trainer") and the flags it was given, the
// config when it was read (nullptr when the error was in reading it), and the error's text.
struct SetupFailure {
  std::string command;
  int steps = 0;
  bool verify = false;
  bool check_logits = false;
  const Config* config = nullptr;
  std::string message;
};
// Its report: `ok: false`, `error` {message "<command>: <message>", process <command>, role
// "setup"} and no rank; `executor` and `config` only when the config was read.
Status write_setup_failure_report_json(const std::string& path, const SetupFailure& failure);
// `refit run` after a run that failed, `first` being the first process that exited abnormally
// (`killed`: by a signal). The failure report trainer rank 0 wrote (its root cause comes from the
// run's "error/first") stays, unless `first` was killed outright: that is always the root cause.
// Without one (trainer rank 0 died, or it wrote a success report and a process failed after it)
// the launcher writes a failure report blaming `first`. A device or pipe (`--json /dev/stdout`) is
// left to trainer rank 0.
Status settle_failed_run_report(const std::string& path, const RankOptions& options,
                                const Blame& first, bool killed);
// --json FILE before any rank starts: InvalidArgument naming the path when the report could not be
// written there (missing directory, a directory, no write permission); otherwise removes a report
// an earlier run left there, so that the file is this run's report or absent.
Status prepare_report_path(const std::string& path);
// The one-screen summary.
std::string format_summary(const RankOptions& options, const RefitReport& report);

}  // namespace refit
