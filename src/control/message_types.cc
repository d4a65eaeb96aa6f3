#include "control/message_types.h"

#include <array>

namespace refit {
namespace {

using enum MessageType;

constexpr std::array<MessageInfo, 19> kMessages{{
    {kHello, "hello", Role::kEngine, Phase::kSetup},
    {kRoutes, "routes", Role::kTrainer, Phase::kSetup},
    {kBegin, "begin", Role::kTrainer, Phase::kRefit},
    {kPaused, "paused", Role::kEngine, Phase::kRefit},
    {kProceed, "proceed", Role::kTrainer, Phase::kRefit},
    {kAbortHeard, "abort-heard", Role::kEngine, Phase::kRefit},
    {kBucket, "bucket", Role::kTrainer, Phase::kRefit},
    {kBucketDone, "bucket-done", Role::kEngine, Phase::kRefit},
    {kCommit, "commit", Role::kTrainer, Phase::kRefit},
    {kCommitted, "committed", Role::kEngine, Phase::kRefit},
    {kVerified, "verified", Role::kEngine, Phase::kRefit},
    {kOutcome, "outcome", Role::kTrainer, Phase::kRefit},
    {kOutcomeHeard, "outcome-heard", Role::kEngine, Phase::kRefit},
    {kShutdown, "shutdown", Role::kTrainer, Phase::kShutdown},
    {kLeaving, "leaving", Role::kEngine, Phase::kShutdown},
    {kEnginesPaused, "engines-paused", Role::kTrainer, Phase::kRefit},
    {kSent, "sent", Role::kTrainer, Phase::kRefit},
    {kRefitDone, "refit-done", Role::kTrainer, Phase::kRefit},
    {kRelayed, "relayed", Role::kEngine, Phase::kRefit},
}};

constexpr bool table_in_order() {
  for (std::size_t i = 0; i < kMessages.size(); ++i)
    if (static_cast<std::size_t>(kMessages[i].type) != i + 1) return false;
  return true;
}
static_assert(table_in_order(), "kMessages lists every MessageType in enum order, from 1");

}  // namespace

bool is_message_type(std::uint8_t type) { return type >= 1 && type <= kMessages.size(); }

const MessageInfo& message_info(MessageType type) {
  return kMessages[static_cast<std::size_t>(type) - 1];
}

const char* message_type_name(MessageType type) {
  return is_message_type(static_cast<std::uint8_t>(type)) ? message_info(type).name : "unknown";
}

}  // namespace refit
