#include "common/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace refit::log {
namespace {

std::mutex& mu() {
  static std::mutex m;
  return m;
}
std::string& prefix() {
  static std::string p = "refit";
  return p;
}
Level threshold() {
  static const Level level = [] {
    const char* env = std::getenv("REFIT_LOG");
    if (env == nullptr) return Level::kInfo;
    if (std::strcmp(env, "debug") == 0) return Level::kDebug;
    if (std::strcmp(env, "warn") == 0) return Level::kWarn;
    if (std::strcmp(env, "error") == 0) return Level::kError;
    return Level::kInfo;
  }();
  return level;
}

}  // namespace

void set_prefix(std::string p) {
  std::lock_guard lock(mu());
  prefix() = "refit " + std::move(p);
}

bool enabled(Level level) { return level >= threshold(); }

void write(Level level, const std::string& message) {
  const char* tag = level == Level::kError ? "error: " : level == Level::kWarn ? "warning: " : "";
  std::lock_guard lock(mu());
  std::fprintf(stderr, "[%s] %s%s\n", prefix().c_str(), tag, message.c_str());
  std::fflush(stderr);
}

}  // namespace refit::log
