#include "runtime/failure.h"

#include <fmt/format.h>

#include <cstdio>

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

std::optional<Blame> blame_process(const std::string& name, int tp_size) {
  Blame b;
  int a = -1, t = -1, n = 0;
  if (std::sscanf(name.c_str(), "trainer rank %d%n", &a, &n) == 1 &&
      static_cast<std::size_t>(n) == name.size() && a >= 0) {
    b.role = "trainer";
    b.rank = a;
  } else if (std::sscanf(name.c_str(), "engine %d tp rank %d%n", &a, &t, &n) == 2 &&
             static_cast<std::size_t>(n) == name.size() && a >= 0 && t >= 0) {
    b.role = "engine";
    b.rank = a * tp_size + t;
  } else {
    return std::nullopt;
  }
  b.process = name;
  return b;
}

Blame blame_failure(const std::string& self, const Status& status, int tp_size) {
  // with_root_cause and liveness_check write "aborted because <process>: <error>", followed by
  // " (seen here as: <this process's error>)" from with_root_cause; contexts may precede it.
  static const std::string kBecause = "aborted because ";
  static const std::string kSeen = " (seen here as: ";
  const std::string& m = status.message();
  const std::size_t at = m.find(kBecause);
  if (at != std::string::npos) {
    const std::size_t start = at + kBecause.size();
    const std::size_t colon = m.find(": ", start);
    if (colon != std::string::npos) {
      if (auto b = blame_process(m.substr(start, colon - start), tp_size)) {
        const std::size_t seen = m.find(kSeen, colon);
        b->message = m.substr(start, seen == std::string::npos ? std::string::npos : seen - start);
        return *b;
      }
    }
  }
  Blame b;
  if (auto parsed = blame_process(self, tp_size)) b = *parsed;
  b.process = self;
  b.message = fmt::format("{}: {}", self, status.to_string());
  return b;
}

Status FailureLatch::guard(const std::function<Status()>& step, const std::unique_ptr<Store>& store,
                           const std::string& who, const std::function<void()>& close_collectives) {
  if (!failed_.ok()) return failed_;
  Status st = step();
  if (st.ok()) return st;
  st = with_root_cause(store.get(), who, st);
  announce_failure(store.get(), who, st);
  close_collectives();
  failed_ = st;
  return st;
}

}  // namespace refit
