// Who relays the refit's control messages (docs/protocol.md, "Relays").
//
// With the transfer plan, trainer rank 0 coordinates every refit. Talking to every engine rank
// itself, it would send and receive 8 messages per engine rank and refit one after another, the
// refit's critical path growing with the run. With TP > 1, each engine's TP rank 0 relays instead:
// trainer rank 0 sends each phase's message (begin, proceed, commit, outcome, shutdown) to the
// relays alone; a relay forwards it to its TP peers and answers for its whole group in one
// relayed message (control/messages.h RelayedMessage), each answer keeping its own sender. The
// messages per refit stay 8 per engine rank in all; trainer rank 0's share falls by the TP size.
//
// The trainer ranks do the same among themselves. They form groups of ceil(sqrt(T)) consecutive
// ranks; trainer rank 0 leads the first group itself, and each other group's first rank relays
// for its group: it hands on trainer rank 0's engines-paused and refit-done, and sends the
// group's sent in one relayed message. Trainer rank 0 then sends and receives about 2 sqrt(T)
// messages per phase instead of T - 1. Every rank derives the same relays from
// generation.tp_size and policy.world_size alone.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "refit/rank.h"

namespace refit::relay {

// Whether engine ranks of TP `tp_size` answer trainer rank 0 through relays (transfer plan).
inline bool engines_relayed(int tp_size) { return tp_size > 1; }

// The relay of engine rank `engine`: its engine's TP rank 0 (itself for a TP rank 0).
RankId engine_relay(const RankId& engine);
// The TP peers relay `engine` forwards to and answers for; empty for a TP rank other than 0.
std::vector<RankId> relayed_peers(const RankId& engine);
// Of `engines`, with relays: the relays' mailbox ids, in order (without: `engines`' own).
std::vector<std::string> engine_relays(const std::vector<RankId>& engines);
// Of `engines`, with relays: each relay's mailbox id -> the ids it answers for, its own first
// (Inbox::accept_relayed); without, empty.
std::map<std::string, std::vector<std::string>> engine_relay_groups(
    const std::vector<RankId>& engines);

// The size of the trainer ranks' groups: ceil(sqrt(world)).
int trainer_group_size(int world);
// The trainer rank `rank` talks to in a refit: its group's first rank, or trainer rank 0 for the
// first group's ranks and for every group's first rank.
int trainer_leader(int rank, int world);
// The trainer ranks relay `rank` hands on to and answers for: the rest of its group when it is
// the first of a group other than the first; else none.
std::vector<int> trainer_relayed(int rank, int world);
// Trainer rank 0's recipients of each phase's message: the first group's other ranks and every
// other group's first rank, as mailbox ids.
std::vector<std::string> trainer_relays(int world);
// For trainer rank 0's inbox: each trainer relay's mailbox id -> the ids it answers for, its own
// first (relays without a group to answer for are left out).
std::map<std::string, std::vector<std::string>> trainer_relay_groups(int world);

}  // namespace refit::relay
