// Per-rank traffic of a refit (refit/session.h RankTraffic), shared through the store: every rank
// publishes its own after each refit under "traffic/<role>/<rank>"; trainer ranks read them all.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "refit/config.h"
#include "refit/session.h"
#include "refit/status.h"

namespace refit {

// The control plane's work over a whole session, summed over every rank: requests on the ranks'
// main store connections (setup, group rendezvous, mailbox addresses, exports, traffic records;
// not the heartbeat's and liveness checks' own connections, whose requests follow the clock: two
// per rank every 0.5 s) and mailbox messages sent. refit_*: of those, the ones made while a refit
// was in flight on that rank. busiest_refit_mailbox_messages: the most refit_mailbox_messages of
// any one rank (trainer rank 0 coordinates, so this is its share: docs/protocol.md "Relays").
struct ControlTraffic {
  std::int64_t store_requests = 0;
  std::int64_t mailbox_messages = 0;
  std::int64_t refit_store_requests = 0;
  std::int64_t refit_mailbox_messages = 0;
  std::int64_t busiest_refit_mailbox_messages = 0;
  bool operator==(const ControlTraffic&) const = default;
};

class Store;

Status publish_traffic(Store& store, const RankTraffic& traffic);

// A rank's publisher: a refit's traffic is almost always the previous refit's, and the store's
// round trip lies on the refit's critical path, so it writes only what changed.
class TrafficPublisher {
 public:
  Status publish(Store& store, const RankTraffic& traffic);

 private:
  std::optional<RankTraffic> last_;
};
// Trainer ranks 0.., then engine ranks 0.. of `config`.
Result<std::vector<RankTraffic>> read_traffic(Store& store, const Config& config,
                                              std::chrono::milliseconds timeout);

}  // namespace refit
