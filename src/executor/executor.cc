#include "executor/executor.h"

#include "executor/routes.h"

namespace refit {

RefitProbe& RefitProbe::none() {
  static RefitProbe nothing;
  return nothing;
}

ExecutorKind executor_kind(const Config& config) {
  return ExecutorKind{.transfer_plan = uses_transfer_plan(config),
                      .p2p_group = needs_p2p_group(config)};
}

std::vector<std::string> mailbox_ids(const std::vector<RankId>& ranks) {
  std::vector<std::string> ids;
  ids.reserve(ranks.size());
  for (const RankId& r : ranks) ids.push_back(r.mailbox());
  return ids;
}

}  // namespace refit
