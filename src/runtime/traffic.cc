#include "runtime/traffic.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "control/store.h"

namespace refit {

Status publish_traffic(Store& store, const RankTraffic& t) {
  nlohmann::json j = {{"sent", t.bytes_sent},
                      {"received", t.bytes_received},
                      {"peer", t.peer_pairs},
                      {"p2p", t.p2p_pairs}};
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
  std::vector<RankTraffic> out;
  auto read = [&](const char* role, int rank) -> Status {
    const std::string key = fmt::format("traffic/{}/{}", role, rank);
    REFIT_ASSIGN_OR_RETURN(std::string v, store.get(key, timeout));
    auto j = nlohmann::json::parse(v, nullptr, false);
    if (j.is_discarded() || !j.is_object())
      return Status::Corruption(fmt::format("store key {} holds no traffic record", key));
    RankTraffic t{.role = role, .rank = rank};
    t.bytes_sent = j.value("sent", std::int64_t{0});
    t.bytes_received = j.value("received", std::int64_t{0});
    t.peer_pairs = j.value("peer", 0);
    t.p2p_pairs = j.value("p2p", 0);
    out.push_back(std::move(t));
    return Status::Ok();
  };
  for (int r = 0; r < config.policy.world_size; ++r) REFIT_RETURN_IF_ERROR(read("trainer", r));
  for (int g = 0; g < config.engine_ranks(); ++g) REFIT_RETURN_IF_ERROR(read("engine", g));
  return out;
}

}  // namespace refit
