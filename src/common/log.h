// Process-wide log prefix and leveled logging to stderr. REFIT_LOG=debug|info|warn|error
// (default info), read once through refit::env::log_level() (common/env.h).
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>

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

// `text` as it may appear in a log line when a peer supplied it (an id, a name, a message from a
// peer that has not authenticated): printable ASCII is kept, a backslash is doubled, every other
// byte is written as \xNN, and more than `max_bytes` input bytes are cut, ending in "...". So no
// peer can start a line of its own, or shape a terminal, through the log.
std::string escape(std::string_view text, std::size_t max_bytes = 256);

}  // namespace refit::log
