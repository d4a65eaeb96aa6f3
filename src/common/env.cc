#include "common/env.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <cctype>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <type_traits>

namespace refit::env {
namespace {

Status bad_value(std::string_view name, std::string_view text, std::string_view accepted) {
  return Status::InvalidArgument(fmt::format(
      "environment variable {}='{}' is not valid: expected {} (or leave it unset for the default)",
      name, text, accepted));
}

std::string int_range(int lo, int hi) {
  if (hi == INT_MAX && lo == 0) return "a non-negative integer";
  if (hi == INT_MAX && lo == 1) return "a positive integer";
  return fmt::format("an integer from {} to {}", lo, hi);
}

template <typename T>
std::string show(const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? "1" : "0";
  } else if constexpr (std::is_same_v<T, CopyEngineUse>) {
    return v == CopyEngineUse::kKernel ? "0" : v == CopyEngineUse::kCopyEngines ? "1" : "auto";
  } else {
    return fmt::format("{}", v);
  }
}

// Reads `name` once and parses it; logs the chosen value at debug level (the caller caches).
// `when_unset` describes the default when the value itself does not (optional results).
template <typename T>
Result<T> load(const char* name, Result<T> (*parse)(Text), const char* when_unset = nullptr) {
  const std::optional<std::string> raw = read(name);
  Result<T> r = parse(raw ? Text(*raw) : Text());
  if (r.ok()) {
    if (raw) {
      log::debug("environment: {}={}", name, *raw);
    } else if (when_unset != nullptr) {
      log::debug("environment: {} not set: {} (default)", name, when_unset);
    } else if constexpr (!std::is_same_v<T, std::optional<int>> &&
                         !std::is_same_v<T, std::optional<std::string>>) {
      log::debug("environment: {} not set: {} (default)", name, show(*r));
    }
  }
  return r;
}

std::optional<std::string> load_string(const char* name, const char* when_unset) {
  std::optional<std::string> v = read(name);
  if (v)
    log::debug("environment: {}={}", name, *v);
  else
    log::debug("environment: {} not set: {} (default)", name, when_unset);
  return v;
}

}  // namespace

std::optional<std::string> read(const char* name) {
  const char* v = std::getenv(name);  // the one getenv of src/
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

Result<std::optional<int>> parse_int(std::string_view name, Text text, int lo, int hi) {
  if (!text || text->empty()) return std::optional<int>();
  int v = 0;
  const char* first = text->data();
  const char* last = first + text->size();
  const auto [end, ec] = std::from_chars(first, last, v, 10);
  if (ec != std::errc() || end != last || v < lo || v > hi)
    return bad_value(name, *text, int_range(lo, hi));
  return std::optional<int>(v);
}

Result<std::optional<int>> parse_word(std::string_view name, Text text,
                                      std::initializer_list<std::string_view> words) {
  if (!text || text->empty()) return std::optional<int>();
  int i = 0;
  for (std::string_view w : words) {
    if (*text == w) return std::optional<int>(i);
    ++i;
  }
  std::string accepted = "one of";
  i = 0;
  for (std::string_view w : words) accepted += fmt::format("{}{}", i++ == 0 ? " " : ", ", w);
  return bad_value(name, *text, accepted);
}

std::optional<std::string> parse_string(Text text) {
  if (!text || text->empty()) return std::nullopt;
  return std::string(*text);
}

// ---- refit's own variables -----------------------------------------------------------------

Result<log::Level> parse_log_level(Text text) {
  REFIT_ASSIGN_OR_RETURN(std::optional<int> w,
                         parse_word("REFIT_LOG", text, {"debug", "info", "warn", "error"}));
  if (!w) return log::Level::kInfo;
  constexpr log::Level kLevels[] = {log::Level::kDebug, log::Level::kInfo, log::Level::kWarn,
                                    log::Level::kError};
  return kLevels[*w];
}

Result<log::Level> log_level() {
  // No logging here: the logger asks for its level through this accessor (common/log.cc).
  static const Result<log::Level> v = [] {
    const std::optional<std::string> raw = read("REFIT_LOG");
    return parse_log_level(raw ? Text(*raw) : Text());
  }();
  return v;
}

Result<int> parse_cpu_threads(Text text) {
  REFIT_ASSIGN_OR_RETURN(std::optional<int> n, parse_int("REFIT_CPU_THREADS", text, 1, 64));
  if (n) return *n;
  return static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 8u));
}

Result<int> cpu_threads() {
  static const Result<int> v = load("REFIT_CPU_THREADS", &parse_cpu_threads);
  return v;
}

Result<int> parse_control_spin_us(Text text) {
  REFIT_ASSIGN_OR_RETURN(std::optional<int> us,
                         parse_int("REFIT_CONTROL_SPIN_US", text, 0, 1000000));
  if (us) return *us;
  return std::thread::hardware_concurrency() >= 8 ? 50000 : 0;
}

Result<int> control_spin_us() {
  static const Result<int> v = load("REFIT_CONTROL_SPIN_US", &parse_control_spin_us);
  return v;
}

Result<std::optional<int>> parse_device(Text text) {
  return parse_int("REFIT_DEVICE", text, 0, INT_MAX);
}

Result<std::optional<int>> device() {
  static const Result<std::optional<int>> v =
      load("REFIT_DEVICE", &parse_device, "the rank's GPU placement");
  return v;
}

Result<CopyEngineUse> parse_copy_engine(Text text) {
  REFIT_ASSIGN_OR_RETURN(std::optional<int> w,
                         parse_word("REFIT_COPY_ENGINE", text, {"0", "1", "auto"}));
  static constexpr CopyEngineUse kByWord[] = {CopyEngineUse::kKernel, CopyEngineUse::kCopyEngines,
                                              CopyEngineUse::kAuto};
  return w.has_value() ? kByWord[*w] : CopyEngineUse::kAuto;
}

Result<CopyEngineUse> copy_engine() {
  static const Result<CopyEngineUse> v = load("REFIT_COPY_ENGINE", &parse_copy_engine);
  return v;
}

std::optional<std::string> host_id() {
  static const std::optional<std::string> v =
      load_string("REFIT_HOST_ID", "the boot id and the IPC namespace");
  return v;
}

std::string host_identity() {
  if (std::optional<std::string> id = host_id()) return *id;
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  struct stat st {};
  const unsigned long long ipc_ns =
      ::stat("/proc/self/ns/ipc", &st) == 0 ? static_cast<unsigned long long>(st.st_ino) : 0;
  return fmt::format("{}/ipc:{}", boot.empty() ? "unknown-boot" : boot, ipc_ns);
}

Result<bool> parse_control_lanes(Text text) {
  REFIT_ASSIGN_OR_RETURN(std::optional<int> w, parse_word("REFIT_CONTROL_LANES", text, {"0", "1"}));
  return !w.has_value() || *w == 1;
}

Result<bool> control_lanes() {
  static const Result<bool> v = load("REFIT_CONTROL_LANES", &parse_control_lanes);
  return v;
}

std::optional<std::string> host() {
  static const std::optional<std::string> v = load_string("REFIT_HOST", "MASTER_ADDR");
  return v;
}

Result<std::optional<std::string>> parse_run_id(Text text) {
  if (!text) return std::optional<std::string>();
  const bool ok = !text->empty() && text->size() <= 64 &&
                  std::all_of(text->begin(), text->end(), [](char c) {
                    return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '-' || c == '_';
                  });
  if (!ok)
    return Status::InvalidArgument(fmt::format(
        "environment variable REFIT_RUN_ID='{}' is not valid: expected 1 to 64 of A-Z a-z 0-9 - _",
        *text));
  return std::optional<std::string>(std::string(*text));
}

Result<std::optional<std::string>> run_id() {
  static const Result<std::optional<std::string>> v =
      load("REFIT_RUN_ID", &parse_run_id, "trainer rank 0's pid and the time");
  return v;
}

Status check() {
  // REFIT_LOG first: the others log when read, and the logger needs its level.
  REFIT_RETURN_IF_ERROR(log_level().status());
  REFIT_RETURN_IF_ERROR(cpu_threads().status());
  REFIT_RETURN_IF_ERROR(device().status());
  REFIT_RETURN_IF_ERROR(copy_engine().status());
  REFIT_RETURN_IF_ERROR(control_spin_us().status());
  REFIT_RETURN_IF_ERROR(control_lanes().status());
  REFIT_RETURN_IF_ERROR(run_id().status());
  REFIT_RETURN_IF_ERROR(refit_port().status());
  return Status::Ok();
}

// ---- torchrun-style variables --------------------------------------------------------------

std::string master_addr() {
  static const std::string v = load_string("MASTER_ADDR", "127.0.0.1").value_or("127.0.0.1");
  return v;
}

Result<int> parse_master_port(Text text) {
  REFIT_ASSIGN_OR_RETURN(std::optional<int> p, parse_int("MASTER_PORT", text, 1, 65535));
  return p.value_or(29500);
}

Result<int> master_port() {
  static const Result<int> v = load("MASTER_PORT", &parse_master_port);
  return v;
}

Result<std::optional<int>> parse_refit_port(Text text) {
  return parse_int("REFIT_PORT", text, 0, 65535);
}

Result<std::optional<int>> refit_port() {
  static const Result<std::optional<int>> v =
      load("REFIT_PORT", &parse_refit_port, "MASTER_PORT + 1, else 29501");
  return v;
}

Result<int> parse_store_port(Text refit_port, Text master_port) {
  REFIT_ASSIGN_OR_RETURN(const std::optional<int> given, parse_refit_port(refit_port));
  if (given) return *given;
  if (!master_port) return kDefaultStorePort;
  REFIT_ASSIGN_OR_RETURN(const int torch_port, parse_master_port(master_port));
  if (torch_port == 65535)
    return Status::InvalidArgument(
        "MASTER_PORT=65535 leaves no port above it for refit's store (MASTER_PORT + 1 by "
        "default): set REFIT_PORT");
  return torch_port + 1;
}

Result<int> store_port() {
  static const Result<int> v = []() -> Result<int> {
    const std::optional<std::string> master = read("MASTER_PORT");
    REFIT_ASSIGN_OR_RETURN(const std::optional<int> given, refit_port());
    if (given) return Result<int>(*given);
    Result<int> p = parse_store_port(Text(), master ? Text(*master) : Text());
    if (p.ok())
      log::debug("refit's store port: {} ({})", *p, master ? "MASTER_PORT + 1" : "default");
    return p;
  }();
  return v;
}

Result<std::optional<int>> parse_rank(Text text) { return parse_int("RANK", text, 0, INT_MAX); }

Result<std::optional<int>> rank() {
  static const Result<std::optional<int>> v = load("RANK", &parse_rank, "none");
  return v;
}

Result<std::optional<int>> parse_world_size(Text text) {
  return parse_int("WORLD_SIZE", text, 1, INT_MAX);
}

Result<std::optional<int>> world_size() {
  static const Result<std::optional<int>> v =
      load("WORLD_SIZE", &parse_world_size, "policy.world_size");
  return v;
}

Result<std::optional<int>> parse_engine_rank(Text text) {
  return parse_int("ENGINE_RANK", text, 0, INT_MAX);
}

Result<std::optional<int>> engine_rank() {
  static const Result<std::optional<int>> v = load("ENGINE_RANK", &parse_engine_rank, "RANK");
  return v;
}

}  // namespace refit::env
