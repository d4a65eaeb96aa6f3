// refit/status.h — the value type every fallible refit call returns.
//
// Status carries a code and a message that names what failed and where (rank, peer, bucket,
// tensor, key). Result<T> is a Status or a T. Both are cheap to move, [[nodiscard]], and
// thread-compatible (distinct objects may be used from distinct threads). Exceptions are used
// only at the CLI and Python boundaries, never inside the library.
#pragma once

#include <cassert>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>

#include "refit/rank.h"

namespace refit {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // bad config value or input data; setup errors (exit 2)
  kNotFound,         // a file, key, preset or tensor that does not exist
  kCorruption,       // a file or message whose bytes disagree with its own description
  kIOError,          // the operating system refused (open, mmap, socket)
  kTimeout,          // a bounded wait ran out
  kAborted,          // another rank failed; this one stopped on its behalf
  kUnsupported,      // a combination outside the support matrix
  kInternal,         // a bug in refit
};

const char* status_code_name(StatusCode code);

// What the caller does about a failure, whatever its code: the Python exception classes
// (refit.SetupError, PeerLostError, TimeoutError, VerificationError, ProtocolError) follow it.
// A failure that travelled from another rank has the kind of its root cause (its origin).
enum class FailureKind : std::uint8_t {
  kOther = 0,     // none below: a hook's own error, an I/O error, a bug in refit
  kSetup,         // refused: a config value, an input, a registration, a version label; fix it
  kPeerLost,      // a rank this one depends on exited, stopped or was cut off: rebuild the session
  kTimeout,       // a bounded wait ran out while its peers were alive
  kVerification,  // the bytes arrived but failed the verification hook or refit.checksum
  kProtocol,      // a peer sent what this rank cannot accept (a message out of order, malformed)
};

// "other" | "setup" | "peer_lost" | "timeout" | "verification" | "protocol".
const char* failure_kind_name(FailureKind kind);
// The kind a code implies when nothing more specific was said: setup for invalid_argument,
// not_found and unsupported, timeout for timeout, other for the rest.
FailureKind default_failure_kind(StatusCode code);

// Where a failure that travelled between ranks started: the process it is blamed on (its root
// cause) and that process's own error as it recorded it. The runtime attaches it to every failure
// it returns on behalf of another rank; a failure without one started on the rank returning it.
struct FailureOrigin {
  RankId rank;
  StatusCode code = StatusCode::kInternal;
  FailureKind kind = FailureKind::kOther;
  // That process's error as it reported it, without its name: a failure that ended its session as
  // "<code name>: <message>" (Status::to_string), a refit's own failure as its message.
  std::string error;
  // "<process>: <error>", as the run's first failure is reported.
  std::string describe() const;
};

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  static Status InvalidArgument(std::string m) {
    return {StatusCode::kInvalidArgument, std::move(m)};
  }
  static Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status Corruption(std::string m) { return {StatusCode::kCorruption, std::move(m)}; }
  static Status IOError(std::string m) { return {StatusCode::kIOError, std::move(m)}; }
  static Status Timeout(std::string m) { return {StatusCode::kTimeout, std::move(m)}; }
  static Status Aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
  static Status Unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "<code name>: <message>", or "ok".
  std::string to_string() const;

  // Returns a copy whose message is "<context>: <message>" (same code and origin).
  Status with_context(const std::string& context) const;

  // The rank this failure started on, when the runtime knows it is another one (or named it);
  // null otherwise.
  const FailureOrigin* origin() const { return origin_.get(); }
  Status with_origin(FailureOrigin origin) const;

  // What the caller does about it: the origin's kind when there is one, else the kind set with
  // with_kind(), else the code's default (default_failure_kind).
  FailureKind kind() const;
  Status with_kind(FailureKind kind) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::optional<FailureKind> kind_;
  std::string message_;
  std::shared_ptr<const FailureOrigin> origin_;
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    assert(!std::get<Status>(v_).ok() && "Result built from an ok Status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(v_); }

  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace refit

#define REFIT_CONCAT_INNER_(a, b) a##b
#define REFIT_CONCAT_(a, b) REFIT_CONCAT_INNER_(a, b)

// Returns the Status of `expr` from the enclosing function when it is not ok.
#define REFIT_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::refit::Status refit_status_ = (expr);        \
    if (!refit_status_.ok()) return refit_status_; \
  } while (0)

// `lhs = value of expr`, or returns its Status from the enclosing function. Expands to several
// statements: put it in braces when it is the body of an if.
#define REFIT_ASSIGN_OR_RETURN(lhs, expr) \
  REFIT_ASSIGN_OR_RETURN_IMPL_(REFIT_CONCAT_(refit_result_, __LINE__), lhs, expr)
#define REFIT_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
