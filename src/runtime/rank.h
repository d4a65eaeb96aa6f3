// The two process roles of a refit: trainer rank and engine rank (DESIGN §3).
//
// `refit run` starts one process per role instance on this machine; `refit trainer` /
// `refit engine` start one each, so ranks can be spread over hosts (torchrun-style environment).
// A role returns when the trainer has finished every step (ok) or when anything failed; a
// failure on one process reaches every other one within refit.timeout_s, through the control
// plane (abort messages, the store's first-error key) or through the collectives themselves.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "refit/config.h"
#include "refit/status.h"

namespace refit {

// Fault injection for tests (`--fault`), applied in step 1.
struct Fault {
  enum class Kind { kNone, kCorrupt, kKillTrainer, kKillEngine, kErrorEngine, kPlanMismatch };
  Kind kind = Kind::kNone;
  int rank = -1;    // trainer rank / engine rank the fault hits
  int bucket = -1;  // bucket index at which it fires
};
// "corrupt:K" | "kill-trainer:R:K" | "kill-engine:R:K" | "error-engine:R:K" | "plan-mismatch".
Result<Fault> parse_fault(std::string_view text);

struct RankOptions {
  Config config;
  int steps = 1;               // refits to run (trainer rank 0 decides; engines follow)
  bool verify = false;         // engines check every element after each refit
  int raw_passes = 0;          // bench: raw transport passes after the refits
  std::string json_path;       // trainer rank 0 writes the report here
  Fault fault;
  std::string master_addr = "127.0.0.1";  // where trainer rank 0 hosts the store
  int master_port = 29500;
  std::string host = "127.0.0.1";  // address this process listens on for data and control
};

// Per-refit numbers collected by trainer rank 0.
struct RefitReport {
  int steps = 0;
  bool verified = false;
  long long bytes_per_refit = 0;
  int buckets_per_refit = 0;
  std::vector<double> refit_seconds;
  double unshard_s = 0, cast_pack_s = 0, transfer_s = 0, apply_s = 0;  // medians per refit
  std::vector<double> raw_seconds;   // bench: raw transport passes
  std::string plan_hash;
};

// Runs trainer rank `rank` of config.policy.world_size. Trainer rank 0 hosts the store.
Status run_trainer_rank(const RankOptions& options, int rank, RefitReport* report);

// Runs engine rank `engine_rank` (= engine index * tp_size + tp rank).
Status run_engine_rank(const RankOptions& options, int engine_rank);

// Writes the JSON report of DESIGN §5.3 (plus bench fields when raw passes ran).
Status write_report_json(const std::string& path, const RankOptions& options,
                         const RefitReport& report);
// The one-screen summary.
std::string format_summary(const RankOptions& options, const RefitReport& report);

}  // namespace refit
