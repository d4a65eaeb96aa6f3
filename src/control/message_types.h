// The control messages of refit: one table of every message type, who sends it and in which phase
// (docs/protocol.md draws the phases as each side's state machine). Each type but relayed is sent
// in one direction only; its payload is the struct of the same name in control/messages.h.
#pragma once

#include <cstdint>

#include "refit/rank.h"

namespace refit {

enum class MessageType : std::uint8_t {
  // Setup.
  kHello = 1,  // engine -> each feeder: joined, with its versions, settings and plan hash
  kRoutes,     // trainer -> engine (SGLang protocol, transfer plan): the routes it will send
  // One refit.
  kBegin,         // trainer -> engine: a refit starts
  kPaused,        // engine -> trainer 0 (transfer plan): paused (or refused), its export's digest
  kProceed,       // trainer 0 -> engine (transfer plan): write, or abort
  kAbortHeard,    // engine -> feeder: the abort was heard; nothing was written
  kBucket,        // trainer -> engine (gather): a bucket's header (the gather data path)
  kBucketDone,    // engine -> trainer (gather, ipc): a bucket was applied; its slot is free again
  kCommit,        // trainer -> engine: every byte of this rank for the refit moved
  kCommitted,     // engine -> feeder: every byte of the refit landed (apply time, checksum)
  kVerified,      // engine -> feeder: the verification hook's verdict
  kOutcome,       // trainer -> engine: publish, or not (transfer plan: trainer 0 decides)
  kOutcomeHeard,  // engine -> feeder: the outcome was applied (valid, weight version)
  // The end.
  kShutdown,  // trainer -> engine: no refit follows
  kLeaving,   // engine -> feeder: the shutdown was heard; the engine leaves
  // Between trainer ranks (transfer plan: trainer rank 0 coordinates every engine rank).
  kEnginesPaused,  // trainer 0 -> trainer: every engine rank's answer; proceed or abort
  kSent,           // trainer -> trainer 0: every byte of this rank moved (its checksums)
  kRefitDone,      // trainer 0 -> trainer: the refit is over on every engine (its failure)
  // A relay -> trainer rank 0 (docs/protocol.md, "Relays"): one phase's answers of its group's
  // ranks, each of its own type. The one type both roles send: an engine's TP rank 0 relays its
  // engine's answers, the first trainer rank of a group its group's sent.
  kRelayed,
};

// When in a session a message travels.
enum class Phase : std::uint8_t { kSetup, kRefit, kShutdown };

struct MessageInfo {
  MessageType type;
  const char* name;  // "begin", "paused", ...
  Role sender;       // the only role that sends it
  Phase phase;
};

// The table's row of `type`.
const MessageInfo& message_info(MessageType type);
const char* message_type_name(MessageType type);
// Whether a type byte off the wire names a message type at all.
bool is_message_type(std::uint8_t type);

}  // namespace refit
