// The JSON report (docs/design.md §5.3) and the one-screen summary.
#include <fmt/format.h>

#include <unistd.h>
#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/stats.h"
#include "executor/routes.h"
#include "harness/rank.h"

namespace refit {
namespace {

// What `refit bench`'s raw pass measured.
std::string raw_limit_text(const Config& c) {
  if (uses_transfer_plan(c))
    return "the transfer plan's own moves without the cast or the scatter (peer: the same copy "
           "calls reading target-dtype bytes; p2p: the same sends and receives)";
  return c.generation.weight_transfer_mode == TransferMode::kBroadcast
             ? "gloo broadcast of the same bytes in the same bucket sizes"
             : "memcpy through the same shared-memory buffers";
}

std::string mb(std::int64_t bytes) { return fmt::format("{:.1f} MB", static_cast<double>(bytes) / 1e6); }

std::filesystem::path report_dir(const std::string& path) {
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  return dir.empty() ? std::filesystem::path(".") : dir;
}

// Writes the report: a regular file (or none yet) through a temporary file in the same directory
// renamed over it, so that a reader never sees half a report; a link, device or pipe in place.
Status write_report_file(const std::string& path, const nlohmann::ordered_json& j) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(path, ec);
  const bool in_place = fs::exists(st) && !fs::is_regular_file(st);
  const std::string tmp =
      in_place ? path
               : (report_dir(path) / fmt::format(".{}.tmp-{}",
                                                 fs::path(path).filename().string(), getpid()))
                     .string();
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return Status::IOError(fmt::format("cannot write the report to {}", tmp));
    out << j.dump(2) << "\n";
    out.flush();
    if (!out) {
      if (!in_place) fs::remove(tmp, ec);
      return Status::IOError(fmt::format("writing the report to {} failed", tmp));
    }
  }
  if (!in_place) {
    fs::rename(tmp, path, ec);
    if (ec) {
      fs::remove(tmp, ec);
      return Status::IOError(fmt::format("cannot rename the report to {}: {}", path, ec.message()));
    }
  }
  return Status::Ok();
}

// The keys every report starts with (docs/report.schema.json).
nlohmann::ordered_json report_head(bool ok, int steps, bool verified, bool logits_checked) {
  nlohmann::ordered_json j;
  j["schema_version"] = kReportSchemaVersion;
  j["ok"] = ok;
  j["steps"] = steps;
  j["verified"] = verified;
  j["logits_checked"] = logits_checked;
  return j;
}

// The keys every report has, then `error`: what was asked, and who failed.
nlohmann::ordered_json failure_report(const RankOptions& options, const Blame& error) {
  nlohmann::ordered_json j =
      report_head(false, options.steps, options.verify, options.check_logits);
  j["executor"] = std::string(executor_name(options.config.refit.executor));
  j["error"] = {{"message", error.message},
                {"process", error.process},
                {"role", error.role},
                {"rank", error.rank}};
  j["config"] = nlohmann::ordered_json::parse(config_to_json(options.config));
  return j;
}

}  // namespace


Status write_report_json(const std::string& path, const RankOptions& options,
                         const RefitReport& r) {
  const double med = median(r.refit_seconds);
  nlohmann::ordered_json j = report_head(true, r.steps, r.verified, r.logits_checked);
  j["bytes_per_refit"] = r.bytes_per_refit;
  j["buckets_per_refit"] = r.buckets_per_refit;
  j["refit_seconds"] = r.refit_seconds;
  j["pause_seconds"] = r.pause_seconds;
  j["gbps"] = med > 0 ? r.bytes_per_refit / med / 1e9 : 0.0;
  j["phases"] = {{"unshard", r.unshard_s},
                 {"cast_pack", r.cast_pack_s},
                 {"transfer", r.transfer_s},
                 {"apply", r.apply_s}};
  if (!r.raw_seconds.empty()) {
    const double raw = median(r.raw_seconds);
    const double gbps = med > 0 ? r.bytes_per_refit / med / 1e9 : 0.0;
    const double limit = raw > 0 ? r.bytes_per_refit / raw / 1e9 : 0.0;
    j["raw_seconds"] = r.raw_seconds;
    j["limit_gbps"] = limit;
    j["ratio"] = limit > 0 ? gbps / limit : 0.0;
    j["limit"] = raw_limit_text(options.config);
  }
  if (r.floor_seconds > 0) {
    j["floor_seconds"] = r.floor_seconds;
    j["copy_bandwidth_gbps"] = r.copy_bandwidth / 1e9;
    if (r.peer_bandwidth > 0) j["peer_bandwidth_gbps"] = r.peer_bandwidth / 1e9;
    j["ratio_to_floor"] = med > 0 ? r.floor_seconds / med : 0.0;
    j["floor_basis"] = r.floor_basis;
    if (r.floor_overlap_seconds > 0) {
      j["floor_overlap_seconds"] = r.floor_overlap_seconds;
      j["ratio_to_overlap_floor"] = med > 0 ? r.floor_overlap_seconds / med : 0.0;
    }
  }
  j["executor"] = r.executor;
  nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
  for (const RankTraffic& t : r.ranks) {
    nlohmann::ordered_json e = {{"role", t.role},
                                {"rank", t.rank},
                                {"bytes_sent", t.bytes_sent},
                                {"bytes_received", t.bytes_received}};
    if (uses_transfer_plan(options.config)) {
      e["peer_pairs"] = t.peer_pairs;
      e["p2p_pairs"] = t.p2p_pairs;
    }
    e["setup_seconds"] = t.setup_seconds;
    e["plan_bytes"] = t.plan_bytes;
    ranks.push_back(std::move(e));
  }
  j["ranks"] = std::move(ranks);
  j["control"] = {{"store_requests", r.control.store_requests},
                  {"mailbox_messages", r.control.mailbox_messages},
                  {"refit_store_requests", r.control.refit_store_requests},
                  {"refit_mailbox_messages", r.control.refit_mailbox_messages},
                  {"busiest_refit_mailbox_messages", r.control.busiest_refit_mailbox_messages}};
  if (!r.delta_steps.empty()) {
    auto one = [](const DeltaStep& d) {
      return nlohmann::ordered_json{{"changed_fraction", d.changed_fraction},
                                    {"wire_bytes", d.wire_bytes},
                                    {"full_bytes", d.full_bytes},
                                    {"encode_seconds", d.encode_seconds},
                                    {"apply_seconds", d.apply_seconds},
                                    {"pairs", d.pairs}};
    };
    nlohmann::ordered_json delta = one(r.delta_steps.back());
    nlohmann::ordered_json steps = nlohmann::ordered_json::array();
    for (const DeltaStep& d : r.delta_steps) {
      nlohmann::ordered_json e = {{"step", d.step}};
      e.update(one(d));
      steps.push_back(std::move(e));
    }
    delta["steps"] = std::move(steps);
    j["delta"] = std::move(delta);
  }
  j["plan_hash"] = r.plan_hash;
  j["config"] = nlohmann::ordered_json::parse(config_to_json(options.config));
  return write_report_file(path, j);
}

Status write_failure_report_json(const std::string& path, const RankOptions& options,
                                 const Blame& error) {
  return write_report_file(path, failure_report(options, error));
}

Status write_setup_failure_report_json(const std::string& path, const SetupFailure& f) {
  nlohmann::ordered_json j = report_head(false, f.steps, f.verify, f.check_logits);
  if (f.config != nullptr) j["executor"] = std::string(executor_name(f.config->refit.executor));
  j["error"] = {
      {"message", f.command + ": " + f.message}, {"process", f.command}, {"role", "setup"}};
  if (f.config != nullptr) j["config"] = nlohmann::ordered_json::parse(config_to_json(*f.config));
  return write_report_file(path, j);
}

Status settle_failed_run_report(const std::string& path, const RankOptions& options,
                                const Blame& first, bool killed) {
  // A device or pipe cannot be read back (reading /dev/stdout would block): what trainer rank 0
  // wrote there stands.
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (std::filesystem::exists(st) && !std::filesystem::is_regular_file(st)) return Status::Ok();
  if (!killed) {
    std::ifstream in(path);
    if (in) {
      const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.value("ok", true) == false && j.contains("error")) return Status::Ok();
    }
  }
  return write_report_file(path, failure_report(options, first));
}

Status prepare_report_path(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);  // follows links
  if (fs::is_directory(st))
    return Status::InvalidArgument(fmt::format("--json {}: is a directory", path));
  if (fs::exists(st) && !fs::is_regular_file(st)) {  // a device or a pipe: written in place
    if (access(path.c_str(), W_OK) != 0)
      return Status::InvalidArgument(fmt::format("--json {}: not writable", path));
    return Status::Ok();
  }
  const fs::path dir = report_dir(path);
  if (!fs::is_directory(dir, ec))
    return Status::InvalidArgument(fmt::format(
        "--json {}: {} is not an existing directory", path, dir.string()));
  if (access(dir.c_str(), W_OK | X_OK) != 0)
    return Status::InvalidArgument(
        fmt::format("--json {}: the directory {} is not writable", path, dir.string()));
  if (fs::is_symlink(fs::symlink_status(path, ec))) {
    if (fs::exists(st) && (access(path.c_str(), W_OK) != 0 || truncate(path.c_str(), 0) != 0))
      return Status::InvalidArgument(fmt::format("--json {}: not writable", path));
  } else if (fs::exists(st) && !fs::remove(path, ec)) {
    return Status::InvalidArgument(fmt::format(
        "--json {}: cannot remove the report of an earlier run ({})", path, ec.message()));
  }
  return Status::Ok();
}

std::string format_summary(const RankOptions& options, const RefitReport& r) {
  const Config& c = options.config;
  const double med = median(r.refit_seconds);
  std::string s;
  const bool routes = uses_transfer_plan(c);
  s += fmt::format(
      "refit {} -> {} {} ({}), model {}, {} trainer rank(s), {} engine(s) x TP {}\n",
      policy_backend_name(c.policy.backend), engine_protocol_name(c.generation.backend),
      c.generation.colocated ? "colocated" : "non-colocated",
      routes ? fmt::format("executor {}", executor_name(c.refit.executor))
             : fmt::format("executor gather, {}", transfer_mode_name(c.generation.weight_transfer_mode)),
      c.model, c.policy.world_size, c.generation.num_engines, c.generation.tp_size);
  s += fmt::format("  per refit: {:.1f} MB in {} {}(s) of <= {} bytes{}, plan {}\n",
                   r.bytes_per_refit / 1e6, r.buckets_per_refit, routes ? "round" : "bucket",
                   c.refit.buffer_size_bytes, routes ? " per rank" : "", r.plan_hash);
  if (!r.ranks.empty()) {
    std::string sent, received;
    int peer = 0, p2p = 0;
    for (const RankTraffic& t : r.ranks) {
      if (t.role == "trainer") {
        sent += fmt::format("{}{} {}", sent.empty() ? "" : ", ", t.rank, mb(t.bytes_sent));
        peer += t.peer_pairs;
        p2p += t.p2p_pairs;
      } else {
        received += fmt::format("{}{} {}", received.empty() ? "" : ", ", t.rank, mb(t.bytes_received));
      }
    }
    s += fmt::format("  sent by trainer rank: {}; received by engine rank: {}\n", sent, received);
    if (routes) s += fmt::format("  pairs by executor: peer {}, p2p {}\n", peer, p2p);
  }
  const int ranks = c.policy.world_size + c.engine_ranks();
  if (r.steps > 0 && r.control.mailbox_messages > 0)
    s += fmt::format(
        "  control plane: {} store request(s), {} mailbox message(s); per rank per refit: {:.2f} "
        "store request(s), {:.2f} message(s)\n",
        r.control.store_requests, r.control.mailbox_messages,
        static_cast<double>(r.control.refit_store_requests) / ranks / r.steps,
        static_cast<double>(r.control.refit_mailbox_messages) / ranks / r.steps);
  if (!r.delta_steps.empty()) {
    int deltas = 0;
    std::int64_t wire = 0, full = 0;
    for (const DeltaStep& d : r.delta_steps) {
      deltas += d.pairs > 0 ? 1 : 0;
      wire += d.wire_bytes;
      full += d.full_bytes;
    }
    const DeltaStep& last = r.delta_steps.back();
    s += fmt::format(
        "  refit.delta {}: {} of {} refit(s) sent a delta; last refit {} pair(s), {:.2f} % "
        "changed, wire {:.2f} MB of {:.2f} MB; all refits {:.4f} of the full bytes\n",
        delta_mode_name(c.refit.delta), deltas, r.delta_steps.size(), last.pairs,
        last.changed_fraction * 100, last.wire_bytes / 1e6, last.full_bytes / 1e6,
        full > 0 ? static_cast<double>(wire) / static_cast<double>(full) : 0.0);
  }
  s += fmt::format("  refits: {}  median {:.3f} s  ->  {:.2f} GB/s{}{}\n", r.steps, med,
                   med > 0 ? r.bytes_per_refit / med / 1e9 : 0.0,
                   r.verified ? "  (every element verified bit-exact)" : "",
                   r.logits_checked ? "  (engine logits match the reference)" : "");
  if (c.refit.staged && !r.pause_seconds.empty())
    s += fmt::format(
        "  refit.staged: generation paused {:.3f} s per refit (median), {:.2f} of the refit\n",
        median(r.pause_seconds), med > 0 ? median(r.pause_seconds) / med : 0.0);
  s += fmt::format(
      "  busy time per stage (stages overlap): unshard {:.3f} s, cast/pack {:.3f} s, "
      "transfer {:.3f} s, apply {:.3f} s\n",
      r.unshard_s, r.cast_pack_s, r.transfer_s, r.apply_s);
  if (!r.raw_seconds.empty()) {
    const double raw = median(r.raw_seconds);
    const double limit = raw > 0 ? r.bytes_per_refit / raw / 1e9 : 0.0;
    const double gbps = med > 0 ? r.bytes_per_refit / med / 1e9 : 0.0;
    s += fmt::format("  raw transport: {:.3f} s -> {:.2f} GB/s; refit / raw = {:.2f}\n", raw, limit,
                     limit > 0 ? gbps / limit : 0.0);
  }
  if (r.floor_seconds > 0) {
    s += fmt::format("  floor ({}): {:.4f} s; floor / refit = {:.2f}\n", r.floor_basis,
                     r.floor_seconds, med > 0 ? r.floor_seconds / med : 0.0);
    if (r.floor_overlap_seconds > 0)
      s += fmt::format("  floor with local traffic and the link overlapping: {:.4f} s; / refit = {:.2f}\n",
                       r.floor_overlap_seconds, med > 0 ? r.floor_overlap_seconds / med : 0.0);
  }
  return s;
}

}  // namespace refit
