// Process-wide log prefix and leveled logging to stderr. REFIT_LOG=debug|info|warn|error
// (default info), read once through refit::env::log_level() (common/env.h).
#pragma once

#include <fmt/format.h>

#include <string>

namespace refit::log {

enum class Level { kDebug, kInfo, kWarn, kError };

void set_prefix(std::string prefix);  // e.g. "trainer 0"
bool enabled(Level level);
void write(Level level, const std::string& message);

template <typename... Args>
void debug(fmt::format_string<Args...> f, Args&&... args) {
  if (enabled(Level::kDebug)) write(Level::kDebug, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void info(fmt::format_string<Args...> f, Args&&... args) {
  if (enabled(Level::kInfo)) write(Level::kInfo, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void warn(fmt::format_string<Args...> f, Args&&... args) {
  if (enabled(Level::kWarn)) write(Level::kWarn, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void error(fmt::format_string<Args...> f, Args&&... args) {
  write(Level::kError, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace refit::log
