#include "executor/applier.h"

namespace refit {

Applier::Applier() : thread_([this] { loop(); }) {}

Applier::~Applier() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Applier::post(Work w) {
  std::lock_guard lock(mu_);
  queue_.push_back(std::move(w));
  cv_.notify_all();
}

Status Applier::drain(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return (queue_.empty() && !running_) || !error_.ok(); }))
    return Status::Timeout("apply did not finish within the timeout");
  return error_;
}

std::int64_t Applier::completed() {
  std::lock_guard lock(mu_);
  return completed_;
}

Status Applier::wait_completed(std::int64_t n, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return completed_ >= n || !error_.ok(); }))
    return Status::Timeout("apply did not finish within the timeout");
  return error_;
}

Status Applier::reset(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return queue_.empty() && !running_; }))
    return Status::Timeout("a work item of the failed refit is still running");
  error_ = Status::Ok();
  return Status::Ok();
}

Status Applier::error() {
  std::lock_guard lock(mu_);
  return error_;
}

void Applier::loop() {
  while (true) {
    Work w;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      w = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
    }
    Status st = error().ok() ? w() : Status::Ok();
    std::lock_guard lock(mu_);
    running_ = false;
    ++completed_;
    if (!st.ok() && error_.ok()) error_ = st;
    cv_.notify_all();
  }
}

}  // namespace refit
