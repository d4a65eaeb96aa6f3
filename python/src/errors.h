// Status -> Python exception at the module boundary (the library itself never throws).
//
// Every non-ok Status becomes an instance of the refit.Error class its FailureKind names
// (refit.SetupError, PeerLostError, TimeoutError, VerificationError, ProtocolError, or Error
// itself). The text is Status::to_string(), the message the CLI prints after "refit: error: ";
// `.code` names the code ("invalid_argument", "timeout", ...), `.message` is the bare message,
// `.rank` / `.role` / `.process` the rank the failure started on (its origin, else the rank of the
// ErrorScope the call runs in), and `.recoverable` whether that scope's session goes on.
#pragma once

#include <pybind11/pybind11.h>

#include <functional>
#include <string>

#include "refit/status.h"

namespace refit::python {

// While alive, the exceptions this thread raises are attributed to `self` (unless their Status
// names another origin) and carry `session_ok()` as `.recoverable`. Scopes nest; the innermost
// one counts. Outside every scope, `.rank` is None and `.recoverable` False.
class ErrorScope {
 public:
  ErrorScope(RankId self, std::function<bool()> session_ok);
  ~ErrorScope();
  ErrorScope(const ErrorScope&) = delete;
  ErrorScope& operator=(const ErrorScope&) = delete;

  const RankId& self() const { return self_; }
  bool session_ok() const { return session_ok_ && session_ok_(); }
  static const ErrorScope* current();

 private:
  RankId self_;
  std::function<bool()> session_ok_;
  const ErrorScope* outer_;
};

// "invalid_argument", "not_found", ... ("ok" for kOk).
const char* status_code_id(StatusCode code);
bool is_setup_error(StatusCode code);

// A Python exception object as a Status: a refit.Error keeps its code, message and kind; any
// other exception is "<who>: <Type>: <text>" (code internal, kind other).
Status status_from_exception(const pybind11::handle& exc, const std::string& who);

// The refit.Error / refit.SetupError instance for `status` (not raised).
pybind11::object make_exception(const Status& status);
// Raises it: sets the Python error and throws pybind11::error_already_set.
[[noreturn]] void raise_status(const Status& status);
// Same, with `cause` (a Python exception object) as its __cause__.
[[noreturn]] void raise_status(const Status& status, const pybind11::object& cause);
inline void raise_if_error(const Status& status) {
  if (!status.ok()) raise_status(status);
}
// The value, or the Status raised as its refit exception.
template <typename T>
T value_or_raise(Result<T> result) {
  if (!result.ok()) raise_status(result.status());
  return std::move(result).value();
}

}  // namespace refit::python
