#include "runtime/relay.h"

#include <algorithm>

namespace refit::relay {

RankId engine_relay(const RankId& engine) {
  return RankId::engine(engine.engine_index() * engine.tp_size, engine.tp_size);
}

std::vector<RankId> relayed_peers(const RankId& engine) {
  std::vector<RankId> peers;
  if (!engines_relayed(engine.tp_size) || engine.tp_rank() != 0) return peers;
  for (int r = 1; r < engine.tp_size; ++r)
    peers.push_back(RankId::engine(engine.rank + r, engine.tp_size));
  return peers;
}

std::vector<std::string> engine_relays(const std::vector<RankId>& engines) {
  std::vector<std::string> out;
  for (const RankId& e : engines)
    if (!engines_relayed(e.tp_size) || e.tp_rank() == 0) out.push_back(e.mailbox());
  return out;
}

std::map<std::string, std::vector<std::string>> engine_relay_groups(
    const std::vector<RankId>& engines) {
  std::map<std::string, std::vector<std::string>> groups;
  for (const RankId& e : engines)
    if (engines_relayed(e.tp_size)) groups[engine_relay(e).mailbox()].push_back(e.mailbox());
  return groups;
}

int trainer_group_size(int world) {
  int k = 1;
  while (k * k < world) ++k;
  return k;
}

int trainer_leader(int rank, int world) {
  const int first = rank / trainer_group_size(world) * trainer_group_size(world);
  return first == rank ? 0 : first;
}

std::vector<int> trainer_relayed(int rank, int world) {
  std::vector<int> out;
  const int k = trainer_group_size(world);
  if (rank == 0 || rank % k != 0) return out;
  for (int r = rank + 1; r < std::min(rank + k, world); ++r) out.push_back(r);
  return out;
}

std::vector<std::string> trainer_relays(int world) {
  std::vector<std::string> out;
  for (int r = 1; r < world; ++r)
    if (trainer_leader(r, world) == 0) out.push_back(RankId::trainer(r).mailbox());
  return out;
}

std::map<std::string, std::vector<std::string>> trainer_relay_groups(int world) {
  std::map<std::string, std::vector<std::string>> groups;
  for (int r = 1; r < world; ++r) {
    const std::vector<int> members = trainer_relayed(r, world);
    if (members.empty()) continue;
    std::vector<std::string>& g = groups[RankId::trainer(r).mailbox()];
    g.push_back(RankId::trainer(r).mailbox());
    for (int m : members) g.push_back(RankId::trainer(m).mailbox());
  }
  return groups;
}

}  // namespace refit::relay
