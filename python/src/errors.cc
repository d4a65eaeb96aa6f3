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

Status status_from_exception(const py::handle& exc, const std::string& who) {
  py::module_ common = py::module_::import("refit._common");
  const std::string text = py::str(exc);
  if (!py::isinstance(exc, common.attr("Error"))) {
    const std::string type = py::str(py::type::handle_of(exc).attr("__name__"));
    return Status::Internal(who + ": " + type + (text.empty() ? "" : ": " + text));
  }
  const auto code_id = py::str(exc.attr("code")).cast<std::string>();
  const auto kind_id = py::str(exc.attr("kind_name")).cast<std::string>();
  StatusCode code = StatusCode::kInternal;
  for (int c = static_cast<int>(StatusCode::kInvalidArgument);
       c <= static_cast<int>(StatusCode::kInternal); ++c)
    if (code_id == status_code_id(static_cast<StatusCode>(c))) code = static_cast<StatusCode>(c);
  FailureKind kind = FailureKind::kOther;
  for (int k = static_cast<int>(FailureKind::kOther); k <= static_cast<int>(FailureKind::kProtocol);
       ++k)
    if (kind_id == failure_kind_name(static_cast<FailureKind>(k)))
      kind = static_cast<FailureKind>(k);
  py::object message = exc.attr("message");
  return Status(code, message.is_none() ? text : py::str(message).cast<std::string>())
      .with_kind(kind);
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
