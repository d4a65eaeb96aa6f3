// How a failure on one process reaches every other one.
//
// The failing process records its cause once per run under the store key "error/first" (the
// first writer wins) and sends an abort message to the peers it talks to; processes that fail
// because a peer vanished look that key up, so every process reports the same root cause.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "refit/status.h"

namespace refit {

class Store;
class Mailbox;

void announce_failure(Store* store, Mailbox* mailbox, const std::vector<std::string>& peers,
                      const std::string& who, const Status& status);

// `status`, prefixed with the run's first recorded failure when that came from elsewhere.
Status with_root_cause(Store* store, const std::string& who, const Status& status);

}  // namespace refit
