#include "refit/rank.h"

#include <fmt/format.h>

#include <charconv>

namespace refit {
namespace {

// A non-negative decimal number that fills `text` exactly.
std::optional<int> whole_number(std::string_view text) {
  int v = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty() || v < 0)
    return std::nullopt;
  return v;
}

// `text` with `prefix` cut off, or nullopt.
std::optional<std::string_view> after(std::string_view text, std::string_view prefix) {
  if (text.substr(0, prefix.size()) != prefix) return std::nullopt;
  return text.substr(prefix.size());
}

}  // namespace

const char* role_name(Role role) {
  switch (role) {
    case Role::kTrainer:
      return "trainer";
    case Role::kEngine:
      return "engine";
  }
  return "?";
}

std::string RankId::name() const {
  switch (role) {
    case Role::kTrainer:
      return fmt::format("trainer rank {}", rank);
    case Role::kEngine:
      return fmt::format("engine {} tp rank {}", engine_index(), tp_rank());
  }
  return "?";
}

std::string RankId::mailbox() const { return fmt::format("{}/{}", role_name(role), rank); }

std::optional<RankId> RankId::from_name(std::string_view name, int tp_size) {
  if (auto rest = after(name, "trainer rank ")) {
    if (auto r = whole_number(*rest)) return trainer(*r);
    return std::nullopt;
  }
  auto rest = after(name, "engine ");
  if (!rest || tp_size < 1) return std::nullopt;
  const std::size_t space = rest->find(' ');
  if (space == std::string_view::npos) return std::nullopt;
  const auto e = whole_number(rest->substr(0, space));
  const auto tail = after(rest->substr(space), " tp rank ");
  if (!e || !tail) return std::nullopt;
  const auto t = whole_number(*tail);
  if (!t || *t >= tp_size) return std::nullopt;
  return engine(*e * tp_size + *t, tp_size);
}

std::optional<RankId> RankId::from_mailbox(std::string_view id, int tp_size) {
  if (auto rest = after(id, "trainer/")) {
    if (auto r = whole_number(*rest)) return trainer(*r);
    return std::nullopt;
  }
  auto rest = after(id, "engine/");
  if (!rest || tp_size < 1) return std::nullopt;
  if (auto g = whole_number(*rest)) return engine(*g, tp_size);
  return std::nullopt;
}

}  // namespace refit
