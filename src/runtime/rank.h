// The refit processes of the CLI (`refit run`, `refit trainer`, `refit engine`): a Trainer or
// Engine of the library API (refit/session.h) whose storage the process owns and fills with the
// deterministic weights of runtime/weights.h, so that engines can verify every element.
#pragma once

#include <string>
#include <vector>

#include "refit/config.h"
#include "refit/session.h"
#include "refit/status.h"
#include "runtime/fault.h"

namespace refit {

struct RankOptions {
  Config config;
  Endpoint endpoint;
  int steps = 1;              // refits to run (trainer rank 0 decides; engines follow)
  bool verify = false;        // engines check every element after each refit
  bool check_logits = false;  // engines also compare a TP forward pass with a reference
  int raw_passes = 0;         // bench: raw transport passes after the refits
  Fault fault;
};

// Per-run numbers collected by trainer rank 0.
struct RefitReport {
  int steps = 0;
  bool verified = false;
  bool logits_checked = false;
  long long bytes_per_refit = 0;
  int buckets_per_refit = 0;
  std::vector<double> refit_seconds;
  double unshard_s = 0, cast_pack_s = 0, transfer_s = 0, apply_s = 0;  // medians per refit
  std::vector<double> raw_seconds;  // bench: raw transport passes
  // bench: the floor of DESIGN §7 — the refit's reads (policy dtype) and writes (target dtype)
  // at the copy bandwidth measured on the trainer's device in the same run.
  double floor_seconds = 0;
  double copy_bandwidth = 0;  // read+write bytes/s
  std::string plan_hash;
};

// Runs trainer rank `rank` for options.steps refits; trainer rank 0 fills `report`.
Status run_trainer_rank(const RankOptions& options, int rank, RefitReport* report);
// Runs engine rank `engine_rank` until the trainer shuts it down.
Status run_engine_rank(const RankOptions& options, int engine_rank);

// The JSON report of DESIGN §5.3 (plus bench fields when raw passes ran).
Status write_report_json(const std::string& path, const RankOptions& options,
                         const RefitReport& report);
// The one-screen summary.
std::string format_summary(const RankOptions& options, const RefitReport& report);

}  // namespace refit
