#include "comm/gloo/gloo_store.h"

#include <gloo/common/error.h>

#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstddef>
#include <cstring>

namespace refit::gloo_backend {

void GlooStoreAdapter::fail(const Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (first_error_.ok()) first_error_ = status;
  }
  throw ::gloo::IoException(status.to_string());
}

Status GlooStoreAdapter::last_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return first_error_;
}

void GlooStoreAdapter::set(const std::string& key, const std::vector<char>& data) {
  Status s = store_.set(key, std::string(data.begin(), data.end()));
  if (!s.ok()) fail(s);
}

void scrub_tcp_addresses(std::string& value) {
  // Gloo's TCP address (gloo/transport/tcp/address.h): a sockaddr_storage filled by getsockname,
  // which writes only the address's own length, then a 64-bit sequence number.
  constexpr std::size_t kAddress = sizeof(sockaddr_storage) + sizeof(std::int64_t);
  if (value.empty() || value.size() % kAddress != 0) return;
  std::vector<std::size_t> used;
  for (std::size_t at = 0; at < value.size(); at += kAddress) {
    sa_family_t family;
    std::memcpy(&family, value.data() + at, sizeof(family));
    if (family == AF_INET)
      used.push_back(sizeof(sockaddr_in));
    else if (family == AF_INET6)
      used.push_back(sizeof(sockaddr_in6));
    else
      return;  // not a list of Gloo TCP addresses: leave it as it is
  }
  for (std::size_t i = 0; i < used.size(); ++i) {
    char* ss = value.data() + i * kAddress;
    std::memset(ss + used[i], 0, sizeof(sockaddr_storage) - used[i]);
    if (used[i] == sizeof(sockaddr_in))
      std::memset(ss + offsetof(sockaddr_in, sin_zero), 0, sizeof(sockaddr_in::sin_zero));
  }
}

std::vector<char> GlooStoreAdapter::get(const std::string& key) {
  auto value = get_while_alive(store_, key, timeout_, alive_);
  if (!value.ok()) fail(value.status());
  return std::vector<char>(value->begin(), value->end());
}

void GlooStoreAdapter::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void GlooStoreAdapter::wait(const std::vector<std::string>& keys,
                            const std::chrono::milliseconds& timeout) {
  // Gloo passes its own default (30 s) or the context timeout; never wait longer than ours.
  const auto bounded = timeout.count() > 0 ? std::min(timeout, timeout_) : timeout_;
  if (!alive_) {
    Status s = store_.wait(keys, bounded);
    if (!s.ok()) fail(s);
    return;
  }
  // One deadline for every key; a present key returns at once.
  const auto deadline = std::chrono::steady_clock::now() + bounded;
  for (const std::string& key : keys) {
    const auto left = std::max(std::chrono::milliseconds(1),
                               std::chrono::duration_cast<std::chrono::milliseconds>(
                                   deadline - std::chrono::steady_clock::now()));
    const auto v = get_while_alive(store_, key, left, alive_);
    if (!v.ok()) fail(v.status());
  }
}

}  // namespace refit::gloo_backend
