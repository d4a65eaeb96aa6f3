// Broadcast transport: trainer rank 0 → every engine rank over the update group.
#include <fmt/format.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "comm/communicator.h"
#include "common/timer.h"
#include "plane/data_plane.h"
#include "control/inbox.h"
#include "transport/transport.h"

namespace refit {
namespace {

class BroadcastSender final : public BucketSender {
 public:
  BroadcastSender(Communicator& update, Mailbox& mailbox,
                  std::vector<std::unique_ptr<PlaneBuffer>> slots,
                  std::vector<std::string> engine_ids, bool send_meta, const TransportOptions& opt)
      : update_(update),
        mailbox_(mailbox),
        engine_ids_(std::move(engine_ids)),
        send_meta_(send_meta),
        timeout_(opt.timeout),
        slots_(std::move(slots)),
        busy_(slots_.size(), false) {
    thread_ = std::thread([this] { loop(); });
  }

  ~BroadcastSender() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  int num_slots() const override { return static_cast<int>(slots_.size()); }
  std::byte* slot_data(int slot) override { return slots_[slot]->data(); }

  Status wait_slot(int slot) override {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout_, [&] { return !busy_[slot] || !error_.ok(); }))
      return Status::Timeout(
          fmt::format("broadcast: slot {} still in flight after {} ms", slot, timeout_.count()));
    return error_;
  }

  Status send(int slot, BucketHeader header) override {
    std::lock_guard lock(mu_);
    REFIT_RETURN_IF_ERROR(error_);
    busy_[slot] = true;
    queue_.push_back({slot, std::move(header)});
    cv_.notify_all();
    return Status::Ok();
  }

  Status drain() override {
    std::unique_lock lock(mu_);
    // Each queued bucket may take up to the timeout on the wire.
    auto limit = timeout_ * static_cast<int>(1 + queue_.size() + slots_.size());
    if (!cv_.wait_for(lock, limit, [&] { return (queue_.empty() && !sending_) || !error_.ok(); }))
      return Status::Timeout("broadcast: buckets still in flight after the timeout");
    return error_;
  }

  double take_busy_seconds() override {
    std::lock_guard lock(mu_);
    return std::exchange(busy_seconds_, 0.0);
  }

 private:
  struct Job {
    int slot;
    BucketHeader header;
  };

  void loop() {
    while (true) {
      Job job;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        job = std::move(queue_.front());
        queue_.pop_front();
        sending_ = true;
      }
      Timer t;
      Status st = deliver(job);
      std::lock_guard lock(mu_);
      busy_seconds_ += t.seconds();
      sending_ = false;
      busy_[job.slot] = false;
      if (!st.ok() && error_.ok()) error_ = st;
      cv_.notify_all();
    }
  }

  Status deliver(const Job& job) {
    if (send_meta_) {
      const std::string payload = encode(bucket_message(job.slot, job.header));
      for (const auto& id : engine_ids_)
        REFIT_RETURN_IF_ERROR(mailbox_.send(id, MessageType::kBucket, payload));
    }
    Status st = update_.broadcast(slots_[job.slot]->data(), job.header.bytes, 0);
    if (!st.ok())
      return st.with_context(fmt::format("broadcast of bucket {} (step {}, {} bytes)",
                                         job.header.bucket, job.header.step, job.header.bytes));
    return st;
  }

  Communicator& update_;
  Mailbox& mailbox_;
  std::vector<std::string> engine_ids_;
  bool send_meta_;
  std::chrono::milliseconds timeout_;
  std::vector<std::unique_ptr<PlaneBuffer>> slots_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  std::vector<bool> busy_;
  bool sending_ = false;
  bool stop_ = false;
  Status error_;
  double busy_seconds_ = 0;
  std::thread thread_;
};

class BroadcastReceiver final : public BucketReceiver {
 public:
  BroadcastReceiver(Communicator& update, Mailbox& mailbox,
                    std::vector<std::unique_ptr<PlaneBuffer>> slots, const TransportOptions& opt)
      : update_(update),
        mailbox_(mailbox),
        timeout_(opt.timeout),
        slots_(std::move(slots)),
        busy_(slots_.size(), false) {}

  Result<IncomingBucket> receive(const std::optional<BucketHeader>& expected) override {
    IncomingBucket in;
    if (expected) {
      in.header = *expected;
    } else {
      REFIT_ASSIGN_OR_RETURN(
          Message msg, expect_message(mailbox_, MessageType::kBucket, timeout_, "bucket metadata"));
      REFIT_ASSIGN_OR_RETURN(const BucketMessage m, decode_bucket(msg.payload, msg.from));
      in.header = incoming_bucket(m).header;
    }
    if (in.header.bytes > slots_[0]->size())
      return Status::Corruption(fmt::format("broadcast: bucket {} has {} bytes, the buffer {}",
                                            in.header.bucket, in.header.bytes, slots_[0]->size()));
    in.slot = next_slot_;
    next_slot_ = (next_slot_ + 1) % static_cast<int>(slots_.size());
    {
      std::unique_lock lock(mu_);
      if (!cv_.wait_for(lock, timeout_, [&] { return !busy_[in.slot]; }))
        return Status::Timeout(
            fmt::format("broadcast: bucket {} could not get a free buffer "
                        "within {} ms (apply is stuck)",
                        in.header.bucket, timeout_.count()));
      busy_[in.slot] = true;
    }
    Status st = update_.broadcast(slots_[in.slot]->data(), in.header.bytes, 0);
    if (!st.ok())
      return st.with_context(
          fmt::format("receiving bucket {} of step {}", in.header.bucket, in.header.step));
    in.data = slots_[in.slot]->data();
    return in;
  }

  Status release(const IncomingBucket& bucket) override {
    std::lock_guard lock(mu_);
    busy_[bucket.slot] = false;
    cv_.notify_all();
    return Status::Ok();
  }

 private:
  Communicator& update_;
  Mailbox& mailbox_;
  std::chrono::milliseconds timeout_;
  std::vector<std::unique_ptr<PlaneBuffer>> slots_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<bool> busy_;
  int next_slot_ = 0;
};

}  // namespace

Result<std::vector<std::unique_ptr<PlaneBuffer>>> allocate_slots(DataPlane& plane,
                                                                 const TransportOptions& o) {
  std::vector<std::unique_ptr<PlaneBuffer>> slots;
  for (int s = 0; s < o.num_slots; ++s) {
    REFIT_ASSIGN_OR_RETURN(auto buf, plane.allocate(o.slot_bytes));
    slots.push_back(std::move(buf));
  }
  return slots;
}

Result<std::unique_ptr<BucketSender>> make_broadcast_sender(Communicator& update, Mailbox& mailbox,
                                                            DataPlane& plane,
                                                            std::vector<std::string> engine_ids,
                                                            bool send_meta,
                                                            const TransportOptions& options) {
  REFIT_ASSIGN_OR_RETURN(auto slots, allocate_slots(plane, options));
  return std::unique_ptr<BucketSender>(new BroadcastSender(
      update, mailbox, std::move(slots), std::move(engine_ids), send_meta, options));
}

Result<std::unique_ptr<BucketReceiver>> make_broadcast_receiver(Communicator& update,
                                                                Mailbox& mailbox, DataPlane& plane,
                                                                const TransportOptions& options) {
  REFIT_ASSIGN_OR_RETURN(auto slots, allocate_slots(plane, options));
  return std::unique_ptr<BucketReceiver>(
      new BroadcastReceiver(update, mailbox, std::move(slots), options));
}

}  // namespace refit
