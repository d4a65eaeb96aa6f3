#include "executor/executor.h"

namespace refit {

RefitProbe& RefitProbe::none() {
  static RefitProbe nothing;
  return nothing;
}

std::vector<std::string> mailbox_ids(const std::vector<RankId>& ranks) {
  std::vector<std::string> ids;
  ids.reserve(ranks.size());
  for (const RankId& r : ranks) ids.push_back(r.mailbox());
  return ids;
}

}  // namespace refit
