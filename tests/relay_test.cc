// Who relays whom (runtime/relay.h): every rank's messages reach trainer rank 0 by exactly one
// path, and trainer rank 0's share is about E / tp + 2 sqrt(T) whatever the run's size.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "runtime/relay.h"

namespace refit {
namespace {

TEST(Relays, EveryTrainerRankIsReachedOnceThroughAtMostOneRelay) {
  for (int world = 1; world <= 300; ++world) {
    std::multiset<int> reached;
    int down = 0;
    for (const std::string& id : relay::trainer_relays(world)) {
      const int r = RankId::from_mailbox(id, 1)->rank;
      ++down;
      reached.insert(r);
      EXPECT_EQ(relay::trainer_leader(r, world), 0) << world;
      for (int m : relay::trainer_relayed(r, world)) {
        reached.insert(m);
        EXPECT_EQ(relay::trainer_leader(m, world), r) << world << " " << m;
        EXPECT_TRUE(relay::trainer_relayed(m, world).empty()) << world << " " << m;
      }
    }
    ASSERT_EQ(reached.size(), static_cast<std::size_t>(world - 1)) << world;
    for (int r = 1; r < world; ++r) EXPECT_EQ(reached.count(r), 1u) << world << " " << r;
    // About 2 sqrt(T) recipients, not T - 1.
    const int k = relay::trainer_group_size(world);
    EXPECT_GE(k * k, world);
    EXPECT_LT((k - 1) * (k - 1), world);
    EXPECT_LE(down, 2 * k) << world;
    // Trainer rank 0's inbox accepts from each relay exactly its group.
    for (const auto& [relay_id, members] : relay::trainer_relay_groups(world)) {
      const int r = RankId::from_mailbox(relay_id, 1)->rank;
      ASSERT_FALSE(members.empty());
      EXPECT_EQ(members.front(), relay_id);
      EXPECT_EQ(members.size(), relay::trainer_relayed(r, world).size() + 1);
    }
  }
}

TEST(Relays, EachEnginesTpRankZeroRelaysForItsTpPeersAlone) {
  for (int tp : {1, 2, 4, 8}) {
    std::vector<RankId> engines;
    for (int g = 0; g < 3 * tp; ++g) engines.push_back(RankId::engine(g, tp));
    const std::vector<std::string> relays = relay::engine_relays(engines);
    const auto groups = relay::engine_relay_groups(engines);
    if (tp == 1) {
      EXPECT_EQ(relays.size(), engines.size());
      EXPECT_TRUE(groups.empty());
      continue;
    }
    ASSERT_EQ(relays.size(), 3u) << tp;
    ASSERT_EQ(groups.size(), 3u) << tp;
    for (const RankId& e : engines) {
      const RankId r = relay::engine_relay(e);
      EXPECT_EQ(r.engine_index(), e.engine_index());
      EXPECT_EQ(r.tp_rank(), 0);
      const std::vector<RankId> peers = relay::relayed_peers(e);
      EXPECT_EQ(peers.size(), e.tp_rank() == 0 ? static_cast<std::size_t>(tp - 1) : 0u);
      const std::vector<std::string>& g = groups.at(r.mailbox());
      EXPECT_EQ(g.front(), r.mailbox());
      EXPECT_EQ(std::count(g.begin(), g.end(), e.mailbox()), 1);
    }
  }
}

}  // namespace
}  // namespace refit
