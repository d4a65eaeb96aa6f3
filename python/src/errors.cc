#include "errors.h"

namespace py = pybind11;

namespace refit::python {

const char* status_code_id(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "ok";
    case StatusCode::kInvalidArgument:
      return "invalid_argument";
    case StatusCode::kNotFound:
      return "not_found";
    case StatusCode::kCorruption:
      return "corruption";
    case StatusCode::kIOError:
      return "io_error";
    case StatusCode::kTimeout:
      return "timeout";
    case StatusCode::kAborted:
      return "aborted";
    case StatusCode::kUnsupported:
      return "unsupported";
    case StatusCode::kInternal:
      return "internal";
  }
  return "internal";
}

bool is_setup_error(StatusCode code) {
  switch (code) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kUnsupported:
      return true;
    case StatusCode::kOk:
    case StatusCode::kCorruption:
    case StatusCode::kIOError:
    case StatusCode::kTimeout:
    case StatusCode::kAborted:
    case StatusCode::kInternal:
      return false;
  }
  return false;
}

namespace {
thread_local const ErrorScope* innermost = nullptr;
}  // namespace

ErrorScope::ErrorScope(RankId self, std::function<bool()> session_ok)
    : self_(self), session_ok_(std::move(session_ok)), outer_(innermost) {
  innermost = this;
}

ErrorScope::~ErrorScope() { innermost = outer_; }

const ErrorScope* ErrorScope::current() { return innermost; }

py::object make_exception(const Status& status) {
  py::module_ common = py::module_::import("refit._common");
  py::object cls = common.attr("ERROR_CLASSES")[py::str(failure_kind_name(status.kind()))];
  const ErrorScope* scope = ErrorScope::current();
  const RankId* origin = status.origin() != nullptr ? &status.origin()->rank
                         : scope != nullptr         ? &scope->self()
                                                    : nullptr;
  py::object rank = py::none(), role = py::none(), process = py::none();
  if (origin != nullptr) {
    rank = py::int_(origin->rank);
    role = py::str(role_name(origin->role));
    process = py::str(origin->name());
  }
  const bool recoverable = scope != nullptr && scope->session_ok();
  return cls(status.to_string(), status_code_id(status.code()), status.message(), rank, role,
             process, recoverable);
}

void raise_status(const Status& status) {
  py::object exc = make_exception(status);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

void raise_status(const Status& status, const py::object& cause) {
  py::object exc = make_exception(status);
  if (cause && !cause.is_none()) PyException_SetCause(exc.ptr(), cause.inc_ref().ptr());
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

}  // namespace refit::python
