// The compact payload of the messages every trainer rank reads or writes in every refit
// (engines-paused, sent, refit-done; docs/protocol.md, "Encoding"): fields in a fixed order, one
// space between two, the first the wire version. A number is written in decimal (a real number
// as the shortest text that reads back to the same double), a text as `<bytes>:<bytes of it>`
// (so it may hold spaces), an absent text as `-`, and a list as its length and then its entries.
//
// With thousands of trainer ranks each of them reads two such messages per refit; a JSON parse
// builds a document of allocations for a few dozen numbers and short texts, while these are read
// in place. The payload stays UTF-8 text (as long as the texts written are), so a relay can carry
// it inside its own JSON message.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "refit/status.h"

namespace refit {

class FieldWriter {
 public:
  explicit FieldWriter(int version);
  FieldWriter& integer(std::int64_t v);
  FieldWriter& natural(std::uint64_t v);
  FieldWriter& real(double v);
  FieldWriter& text(std::string_view s);
  FieldWriter& maybe_text(const std::optional<std::string>& s);  // `-` when absent
  std::string take() { return std::move(out_); }

 private:
  void separate();
  template <typename T>
  FieldWriter& number(T v);
  std::string out_;
};

// Reads the fields of one message in order. The first problem is kept and named (the message,
// its sender, the field); every read after it fails too, so a decoder checks status() once.
class FieldReader {
 public:
  // Reads the wire version first: a payload of another build (or a JSON one) is refused here.
  FieldReader(std::string_view payload, const char* message, const std::string& from,
              int version);

  bool integer(const char* field, std::int64_t& out, std::int64_t min, std::int64_t max);
  bool integer(const char* field, int& out, int min = 0);
  bool natural(const char* field, std::uint64_t& out);
  bool real(const char* field, double& out);
  bool text(const char* field, std::string& out);
  bool maybe_text(const char* field, std::optional<std::string>& out);
  // A list's length: at most one entry per two bytes left, so a forged length reserves nothing.
  bool count(const char* field, std::size_t& out);
  // Every field read and nothing left over: the message's status.
  Status finish();
  Status status() const { return error_; }
  bool fail(const char* field, std::string_view what);

 private:
  // The space before every field but the first.
  bool separator(const char* field);
  // A number up to the next space (or the end); `what` names its kind in the error.
  template <typename T>
  bool number(const char* field, T& out, const char* what);

  std::string_view rest_;
  bool first_ = true;
  const char* message_;
  const std::string from_;  // a copy: a short mailbox id, and callers may pass a temporary
  Status error_;
};

}  // namespace refit
