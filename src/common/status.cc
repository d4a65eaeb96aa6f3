#include "refit/status.h"

namespace refit {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "ok";
    case StatusCode::kInvalidArgument:
      return "invalid argument";
    case StatusCode::kNotFound:
      return "not found";
    case StatusCode::kCorruption:
      return "corruption";
    case StatusCode::kIOError:
      return "I/O error";
    case StatusCode::kTimeout:
      return "timeout";
    case StatusCode::kAborted:
      return "aborted";
    case StatusCode::kUnsupported:
      return "unsupported";
    case StatusCode::kInternal:
      return "internal error";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  return std::string(status_code_name(code_)) + ": " + message_;
}

Status Status::with_context(const std::string& context) const {
  if (ok()) return *this;
  Status out(code_, context + ": " + message_);
  out.origin_ = origin_;
  return out;
}

Status Status::with_origin(FailureOrigin origin) const {
  if (ok()) return *this;
  Status out = *this;
  out.origin_ = std::make_shared<const FailureOrigin>(std::move(origin));
  return out;
}

std::string FailureOrigin::describe() const {
  return rank.name() + ": " + error;
}

}  // namespace refit
