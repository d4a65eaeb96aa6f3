#include "runtime/protocol.h"

#include <fmt/format.h>

namespace refit {

std::string weight_version(EngineProtocol protocol, int step) {
  switch (protocol) {
    case EngineProtocol::kSglang:
      return fmt::format("step-{}", step);
    case EngineProtocol::kVllm:
      return std::to_string(step);
  }
  return std::to_string(step);
}

}  // namespace refit
