#include "runtime/traffic.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "control/store.h"

namespace refit {

Status publish_traffic(Store& store, const RankTraffic& t) {
  nlohmann::json j = {{"sent", t.bytes_sent},
                      {"received", t.bytes_received},
                      {"peer", t.peer_pairs},
                      {"p2p", t.p2p_pairs},
                      {"setup_s", t.setup_seconds},
                      {"plan_bytes", t.plan_bytes},
                      {"delta_pairs", t.delta_pairs},
                      {"delta_elements", t.delta_elements},
                      {"delta_changed", t.delta_changed},
                      {"full", t.full_bytes},
                      {"encode_s", t.encode_s},
                      {"delta_apply_s", t.delta_apply_s}};
  return store.set(fmt::format("traffic/{}/{}", t.role, t.rank), j.dump());
}

Status TrafficPublisher::publish(Store& store, const RankTraffic& traffic) {
  if (last_ && *last_ == traffic) return Status::Ok();
  REFIT_RETURN_IF_ERROR(publish_traffic(store, traffic));
  last_ = traffic;
  return Status::Ok();
}

Result<std::vector<RankTraffic>> read_traffic(Store& store, const Config& config,
                                              std::chrono::milliseconds timeout) {
  std::vector<std::pair<const char*, int>> ranks;
  for (int r = 0; r < config.policy.world_size; ++r) ranks.emplace_back("trainer", r);
  for (int g = 0; g < config.engine_ranks(); ++g) ranks.emplace_back("engine", g);
  std::vector<std::string> keys;
  for (const auto& [role, rank] : ranks) keys.push_back(fmt::format("traffic/{}/{}", role, rank));
  // Two requests, whatever the number of ranks: wait for every record, then read them all.
  REFIT_RETURN_IF_ERROR(store.wait(keys, timeout));
  REFIT_ASSIGN_OR_RETURN(const std::vector<std::optional<std::string>> values,
                         store.try_get_many(keys));
  std::vector<RankTraffic> out;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    auto j = values[i] ? nlohmann::json::parse(*values[i], nullptr, false) : nlohmann::json();
    if (j.is_discarded() || !j.is_object())
      return Status::Corruption(fmt::format("store key {} holds no traffic record", keys[i]));
    RankTraffic t{.role = ranks[i].first, .rank = ranks[i].second};
    t.bytes_sent = j.value("sent", std::int64_t{0});
    t.bytes_received = j.value("received", std::int64_t{0});
    t.peer_pairs = j.value("peer", 0);
    t.p2p_pairs = j.value("p2p", 0);
    t.setup_seconds = j.value("setup_s", 0.0);
    t.plan_bytes = j.value("plan_bytes", std::int64_t{0});
    t.delta_pairs = j.value("delta_pairs", 0);
    t.delta_elements = j.value("delta_elements", std::int64_t{0});
    t.delta_changed = j.value("delta_changed", std::int64_t{0});
    t.full_bytes = j.value("full", std::int64_t{0});
    t.encode_s = j.value("encode_s", 0.0);
    t.delta_apply_s = j.value("delta_apply_s", 0.0);
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace refit
