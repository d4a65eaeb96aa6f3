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

py::object make_exception(const Status& status) {
  py::module_ common = py::module_::import("refit._common");
  py::object cls = common.attr(is_setup_error(status.code()) ? "SetupError" : "Error");
  return cls(status.to_string(), status_code_id(status.code()), status.message());
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
