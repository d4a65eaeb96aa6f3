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

const char* failure_kind_name(FailureKind kind) {
  switch (kind) {
    case FailureKind::kOther:
      return "other";
    case FailureKind::kSetup:
      return "setup";
    case FailureKind::kPeerLost:
      return "peer_lost";
    case FailureKind::kTimeout:
      return "timeout";
    case FailureKind::kVerification:
      return "verification";
    case FailureKind::kProtocol:
      return "protocol";
  }
  return "other";
}

FailureKind default_failure_kind(StatusCode code) {
  switch (code) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kUnsupported:
      return FailureKind::kSetup;
    case StatusCode::kTimeout:
      return FailureKind::kTimeout;
    case StatusCode::kOk:
    case StatusCode::kCorruption:
    case StatusCode::kIOError:
    case StatusCode::kAborted:
    case StatusCode::kInternal:
      return FailureKind::kOther;
  }
  return FailureKind::kOther;
}

FailureKind Status::kind() const {
  if (origin_) return origin_->kind;
  if (kind_) return *kind_;
  return default_failure_kind(code_);
}

Status Status::with_kind(FailureKind kind) const {
  if (ok()) return *this;
  Status out = *this;
  out.kind_ = kind;
  return out;
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  return std::string(status_code_name(code_)) + ": " + message_;
}

Status Status::with_context(const std::string& context) const {
  if (ok()) return *this;
  Status out(code_, context + ": " + message_);
  out.origin_ = origin_;
  out.kind_ = kind_;
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
