#include "runtime/failure.h"

#include <fmt/format.h>

#include "control/store.h"

namespace refit {

void announce_failure(Store* store, const std::string& who, const Status& status) {
  if (store == nullptr) return;
  const std::string cause = fmt::format("{}: {}", who, status.to_string());
  auto n = store->add("error/count", 1);
  if (n.ok() && *n == 1) (void)store->set("error/first", cause);
}

std::function<Status()> liveness_check(Store& store, const std::string& who) {
  return [&store, who]() -> Status {
    auto first = store.try_get("error/first");
    if (!first.ok())
      return Status::Aborted(fmt::format("lost the control plane (the store of trainer rank 0): {}",
                                         first.status().to_string()));
    if (first->has_value() && (*first)->rfind(who + ":", 0) != 0)
      return Status::Aborted("aborted because " + **first);
    return Status::Ok();
  };
}

Status with_root_cause(Store* store, const std::string& who, const Status& status) {
  if (store == nullptr || status.ok()) return status;
  auto first = store->try_get("error/first");
  if (!first.ok() || !first->has_value()) return status;
  const std::string& cause = **first;
  if (cause.rfind(who + ":", 0) == 0) return status;  // the root cause is this process itself
  if (status.message().find(cause) != std::string::npos) return status;
  return Status(StatusCode::kAborted,
                fmt::format("aborted because {} (seen here as: {})", cause, status.to_string()));
}

Status FailureLatch::guard(const std::function<Status()>& step, Store* store,
                           const std::string& who, const std::function<void()>& close_collectives) {
  if (!failed_.ok()) return failed_;
  Status st = step();
  if (st.ok()) return st;
  st = with_root_cause(store, who, st);
  announce_failure(store, who, st);
  close_collectives();
  failed_ = st;
  return st;
}

}  // namespace refit
