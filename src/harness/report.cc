// The JSON report (docs/design.md §5.3) and the one-screen summary.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/stats.h"
#include "harness/rank.h"
#include "executor/routes.h"

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

}  // namespace


Status write_report_json(const std::string& path, const RankOptions& options,
                         const RefitReport& r) {
  const double med = median(r.refit_seconds);
  nlohmann::ordered_json j;
  j["schema_version"] = kReportSchemaVersion;
  j["steps"] = r.steps;
  j["verified"] = r.verified;
  j["logits_checked"] = r.logits_checked;
  j["bytes_per_refit"] = r.bytes_per_refit;
  j["buckets_per_refit"] = r.buckets_per_refit;
  j["refit_seconds"] = r.refit_seconds;
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
    ranks.push_back(std::move(e));
  }
  j["ranks"] = std::move(ranks);
  j["plan_hash"] = r.plan_hash;
  j["config"] = nlohmann::ordered_json::parse(config_to_json(options.config));
  std::ofstream out(path);
  if (!out) return Status::IOError(fmt::format("cannot write the report to {}", path));
  out << j.dump(2) << "\n";
  if (!out) return Status::IOError(fmt::format("writing the report to {} failed", path));
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
  s += fmt::format("  refits: {}  median {:.3f} s  ->  {:.2f} GB/s{}{}\n", r.steps, med,
                   med > 0 ? r.bytes_per_refit / med / 1e9 : 0.0,
                   r.verified ? "  (every element verified bit-exact)" : "",
                   r.logits_checked ? "  (engine logits match the reference)" : "");
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
