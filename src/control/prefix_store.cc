#include "control/store.h"

namespace refit {

Status PrefixStore::set(const std::string& key, const std::string& value) {
  return base_.set(prefix_ + key, value);
}

Result<std::string> PrefixStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  return base_.get(prefix_ + key, timeout);
}

Result<std::optional<std::string>> PrefixStore::try_get(const std::string& key) {
  return base_.try_get(prefix_ + key);
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

}  // namespace refit
