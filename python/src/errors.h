// Status -> Python exception at the module boundary (the library itself never throws).
//
// Every non-ok Status becomes refit.Error (a RuntimeError) or, for the codes the CLI treats as
// setup errors (exit 2: invalid argument, not found, unsupported), refit.SetupError. The text is
// Status::to_string(), the message the CLI prints after "refit: error: "; `.code` names the code
// ("invalid_argument", "timeout", ...) and `.message` is the bare message.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "refit/status.h"

namespace refit::python {

// "invalid_argument", "not_found", ... ("ok" for kOk).
const char* status_code_id(StatusCode code);
bool is_setup_error(StatusCode code);

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
