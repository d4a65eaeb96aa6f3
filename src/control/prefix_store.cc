#include "control/store.h"

#include <fmt/format.h>

#include <algorithm>

namespace refit {

Status PrefixStore::set(const std::string& key, const std::string& value) {
  return base_.set(prefix_ + key, value);
}

Status PrefixStore::erase(const std::string& key) { return base_.erase(prefix_ + key); }

Result<std::string> PrefixStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  return base_.get(prefix_ + key, timeout);
}

Result<std::optional<std::string>> PrefixStore::try_get(const std::string& key) {
  return base_.try_get(prefix_ + key);
}

Result<std::vector<std::optional<std::string>>> PrefixStore::try_get_many(
    const std::vector<std::string>& keys) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const auto& k : keys) full.push_back(prefix_ + k);
  return base_.try_get_many(full);
}

Status PrefixStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const auto& k : keys) full.push_back(prefix_ + k);
  return base_.wait(full, timeout);
}

Result<std::int64_t> PrefixStore::add(const std::string& key, std::int64_t delta) {
  return base_.add(prefix_ + key, delta);
}

namespace {

// A watch through PrefixStore `prefix`: `read` gets the keys and the watched prefix with it, and
// the stale keys come back without it.
Result<Store::Watched> prefixed_watch(
    const std::string& prefix, const std::vector<std::string>& keys, const std::string& under,
    const std::function<Result<Store::Watched>(const std::vector<std::string>&,
                                               const std::string&)>& read) {
  std::vector<std::string> full;
  for (const std::string& k : keys) full.push_back(prefix + k);
  REFIT_ASSIGN_OR_RETURN(Store::Watched w, read(full, prefix + under));
  for (Store::Stale& s : w.stale) s.key = s.key.substr(prefix.size());
  return w;
}

}  // namespace

Result<Store::Watched> PrefixStore::watch(const std::vector<std::string>& keys,
                                          const std::string& prefix,
                                          std::chrono::milliseconds silence) {
  return prefixed_watch(prefix_, keys, prefix, [&](const auto& full, const std::string& under) {
    return base_.watch(full, under, silence);
  });
}

Result<Store::Watched> PrefixStore::beat_and_watch(const std::string& beat,
                                                   const std::vector<std::string>& keys,
                                                   const std::string& prefix,
                                                   std::chrono::milliseconds silence,
                                                   std::chrono::milliseconds timeout) {
  return prefixed_watch(prefix_, keys, prefix, [&](const auto& full, const std::string& under) {
    return base_.beat_and_watch(prefix_ + beat, full, under, silence, timeout);
  });
}

Result<std::string> get_while_alive(Store& store, const std::string& key,
                                    std::chrono::milliseconds timeout,
                                    const std::function<Status()>& alive) {
  constexpr std::chrono::milliseconds kSlice(500);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    Result<std::string> v = store.get(key, std::max(std::chrono::milliseconds(1), std::min(left, kSlice)));
    if (v.ok() || v.status().code() != StatusCode::kTimeout) return v;
    if (left <= kSlice)
      return Status::Timeout(
          fmt::format("store key '{}' was not set within {} ms", key, timeout.count()));
    if (alive) REFIT_RETURN_IF_ERROR(alive().with_context("waiting for store key '" + key + "'"));
  }
}

}  // namespace refit
