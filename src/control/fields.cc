#include "control/fields.h"

#include <charconv>
#include <limits>
#include <system_error>

#include <fmt/format.h>

namespace refit {

FieldWriter::FieldWriter(int version) {
  out_.reserve(64);
  integer(version);
}

void FieldWriter::separate() {
  if (!out_.empty()) out_.push_back(' ');
}

template <typename T>
FieldWriter& FieldWriter::number(T v) {
  separate();
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);  // a double: the shortest round trip
  out_.append(buf, r.ptr);
  return *this;
}

FieldWriter& FieldWriter::integer(std::int64_t v) { return number(v); }
FieldWriter& FieldWriter::natural(std::uint64_t v) { return number(v); }
FieldWriter& FieldWriter::real(double v) { return number(v); }

FieldWriter& FieldWriter::text(std::string_view s) {
  number(s.size());
  out_.push_back(':');
  out_.append(s);
  return *this;
}

FieldWriter& FieldWriter::maybe_text(const std::optional<std::string>& s) {
  if (s) return text(std::string_view(*s));
  separate();
  out_.push_back('-');
  return *this;
}

FieldReader::FieldReader(std::string_view payload, const char* message, const std::string& from,
                         int version)
    : rest_(payload), message_(message), from_(from) {
  std::int64_t v = 0;
  if (!integer("v", v, std::numeric_limits<std::int64_t>::min(),
               std::numeric_limits<std::int64_t>::max())) {
    error_ = Status::Corruption(fmt::format("{} message from {} has no wire version (a {} of "
                                            "another build, or not a refit process)",
                                            message_, from_, message_))
                 .with_kind(FailureKind::kProtocol);
    return;
  }
  if (v != version)
    fail("v", fmt::format("has wire version {}, this build speaks {}", v, version));
}

bool FieldReader::fail(const char* field, std::string_view what) {
  if (error_.ok())
    error_ = Status::Corruption(
                 fmt::format("{} message from {}: field '{}' {}", message_, from_, field, what))
                 .with_kind(FailureKind::kProtocol);
  return false;
}

bool FieldReader::separator(const char* field) {
  if (!error_.ok()) return false;
  if (first_) {
    first_ = false;
    return true;
  }
  if (rest_.empty()) return fail(field, "is missing (the message ends before it)");
  if (rest_.front() != ' ') return fail(field, "does not follow the field before it");
  rest_.remove_prefix(1);
  return true;
}

template <typename T>
bool FieldReader::number(const char* field, T& out, const char* what) {
  if (!separator(field)) return false;
  const std::string_view t = rest_.substr(0, rest_.find(' '));
  rest_.remove_prefix(t.size());
  if (t.empty()) return fail(field, "is missing");
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), out);
  if (ec != std::errc() || end != t.data() + t.size())
    return fail(field, fmt::format("is not {} ('{}')", what, t.substr(0, 32)));
  return true;
}

bool FieldReader::integer(const char* field, std::int64_t& out, std::int64_t min,
                          std::int64_t max) {
  std::int64_t v = 0;
  if (!number(field, v, "an integer")) return false;
  if (v < min || v > max)
    return fail(field, fmt::format("is {}, outside [{}, {}]", v, min, max));
  out = v;
  return true;
}

bool FieldReader::integer(const char* field, int& out, int min) {
  std::int64_t v = 0;
  if (!integer(field, v, min, std::numeric_limits<int>::max())) return false;
  out = static_cast<int>(v);
  return true;
}

bool FieldReader::natural(const char* field, std::uint64_t& out) {
  return number(field, out, "an unsigned integer");
}

bool FieldReader::real(const char* field, double& out) { return number(field, out, "a number"); }

bool FieldReader::text(const char* field, std::string& out) {
  std::optional<std::string> t;
  if (!maybe_text(field, t)) return false;
  if (!t) return fail(field, "is absent");
  out = std::move(*t);
  return true;
}

bool FieldReader::maybe_text(const char* field, std::optional<std::string>& out) {
  if (!separator(field)) return false;
  if (!rest_.empty() && rest_.front() == '-' && (rest_.size() == 1 || rest_[1] == ' ')) {
    rest_.remove_prefix(1);
    out.reset();
    return true;
  }
  std::size_t n = 0;
  const auto [end, ec] = std::from_chars(rest_.data(), rest_.data() + rest_.size(), n);
  if (ec != std::errc() || end == rest_.data() + rest_.size() || *end != ':')
    return fail(field, "is neither a text (<length>:<bytes>) nor absent (-)");
  const auto at = static_cast<std::size_t>(end + 1 - rest_.data());
  if (n > rest_.size() - at)
    return fail(field, fmt::format("claims {} bytes, {} are left", n, rest_.size() - at));
  out.emplace(rest_.substr(at, n));
  rest_.remove_prefix(at + n);
  return true;
}

bool FieldReader::count(const char* field, std::size_t& out) {
  std::int64_t v = 0;
  if (!integer(field, v, 0, std::numeric_limits<std::int64_t>::max())) return false;
  if (static_cast<std::uint64_t>(v) > rest_.size() / 2)
    return fail(field, fmt::format("claims {} entries in {} bytes", v, rest_.size()));
  out = static_cast<std::size_t>(v);
  return true;
}

Status FieldReader::finish() {
  if (error_.ok() && !rest_.empty())
    error_ = Status::Corruption(fmt::format("{} message from {} has {} byte(s) after its last field",
                                            message_, from_, rest_.size()))
                 .with_kind(FailureKind::kProtocol);
  return error_;
}

}  // namespace refit
