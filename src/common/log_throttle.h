// Rate limiting for log lines that peers can cause (common/log.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

#include "common/log.h"

namespace refit::log {

// Rate limiting for lines that peers can cause (refused connections, dropped messages): at most
// `burst` lines per `period`; allow() is false for the others, which are counted and announced
// by the next line allowed (suppressed() returns and resets the count). Thread-safe.
class Throttle {
 public:
  explicit Throttle(int burst = 10, std::chrono::milliseconds period = std::chrono::seconds(10))
      : burst_(burst), period_(period) {}
  bool allow();
  // Lines not allowed since the last call (the caller appends "(and N more …)").
  std::int64_t suppressed();

 private:
  std::mutex mu_;
  const int burst_;
  const std::chrono::milliseconds period_;
  std::chrono::steady_clock::time_point window_{};
  int used_ = 0;
  std::int64_t suppressed_ = 0;
};

// warn() through a Throttle: the line is written when the throttle allows it, with the number of
// lines it held back since the last one.
template <typename... Args>
void warn_throttled(Throttle& t, fmt::format_string<Args...> f, Args&&... args) {
  if (!enabled(Level::kWarn) || !t.allow()) return;
  std::string line = fmt::format(f, std::forward<Args>(args)...);
  if (const std::int64_t held = t.suppressed(); held > 0)
    line += fmt::format(" ({} more such line(s) were held back by the log's rate limit)", held);
  write(Level::kWarn, line);
}

}  // namespace refit::log
