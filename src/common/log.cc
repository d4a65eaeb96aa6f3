#include "common/log.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>

#include "common/env.h"
#include "common/log_throttle.h"

namespace refit::log {
namespace {

std::mutex& mu() {
  static std::mutex m;
  return m;
}
// At debug level every line carries the wall-clock time (µs), so that the lines of the trainer
// and engine processes of one host can be put on one timeline.
std::atomic<bool>& stamped() {
  static std::atomic<bool> s{false};
  return s;
}
std::string& prefix() {
  static std::string p = "refit";
  return p;
}
// REFIT_LOG through its accessor (common/env.h), which does not log; the chosen level is logged
// here once it is known. A bad value is refused at setup (env::check); the logger itself cannot
// fail, so until then it warns once and logs at info.
Level threshold() {
  static const Level level = [] {
    const Result<Level> l = env::log_level();
    if (!l.ok()) {
      write(Level::kWarn, l.status().message() + "; logging at info");
      return Level::kInfo;
    }
    if (*l == Level::kDebug) {
      stamped() = true;
      write(Level::kDebug, "environment: REFIT_LOG=debug");
    }
    return *l;
  }();
  return level;
}

}  // namespace

std::string escape(std::string_view text, std::size_t max_bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  const std::size_t n = std::min(text.size(), max_bytes);
  out.reserve(n + 8);
  for (std::size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '\\') {
      out += "\\\\";
    } else if (c >= 0x20 && c < 0x7f) {
      out.push_back(static_cast<char>(c));
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  if (text.size() > max_bytes) out += "...";
  return out;
}

bool Throttle::allow() {
  std::lock_guard lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  if (now - window_ >= period_) {
    window_ = now;
    used_ = 0;
  }
  if (used_ < burst_) {
    ++used_;
    return true;
  }
  ++suppressed_;
  return false;
}

std::int64_t Throttle::suppressed() {
  std::lock_guard lock(mu_);
  const std::int64_t n = suppressed_;
  suppressed_ = 0;
  return n;
}

void set_prefix(std::string p) {
  std::lock_guard lock(mu());
  prefix() = "refit " + std::move(p);
}

bool enabled(Level level) { return level >= threshold(); }

void write(Level level, const std::string& message) {
  const char* tag = level == Level::kError ? "error: " : level == Level::kWarn ? "warning: " : "";
  std::lock_guard lock(mu());
  if (stamped()) {
    const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count();
    std::fprintf(stderr, "[%s %lld.%06lld] %s%s\n", prefix().c_str(),
                 static_cast<long long>(us / 1000000), static_cast<long long>(us % 1000000), tag,
                 message.c_str());
  } else {
    std::fprintf(stderr, "[%s] %s%s\n", prefix().c_str(), tag, message.c_str());
  }
  std::fflush(stderr);
}

}  // namespace refit::log
