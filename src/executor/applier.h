// Applies received bytes on a thread of its own, so that receiving the next bucket or round
// overlaps applying this one. Work items run in order; the first failure is kept and later items
// are skipped. post() and the waits are called from the receiving thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "refit/status.h"

namespace refit {

class Applier {
 public:
  using Work = std::function<Status()>;
  Applier();
  ~Applier();
  Applier(const Applier&) = delete;
  Applier& operator=(const Applier&) = delete;

  void post(Work w);
  // Waits until the queue is empty; returns the first failure.
  Status drain(std::chrono::milliseconds timeout);
  // Work items finished since construction (failed or skipped ones included).
  std::int64_t completed();
  // Waits until at least `n` items finished; returns the first failure.
  Status wait_completed(std::int64_t n, std::chrono::milliseconds timeout);
  Status error();
  // After a failure: waits until every posted item finished or was skipped, then forgets the
  // failure, so the next refit can post again. kTimeout if an item is still running.
  Status reset(std::chrono::milliseconds timeout);

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Work> queue_;
  bool running_ = false;
  bool stop_ = false;
  std::int64_t completed_ = 0;
  Status error_;
  std::thread thread_;
};

}  // namespace refit
