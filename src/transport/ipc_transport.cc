// IPC transport (colocated, CPU): shared-memory slots created once by the trainer rank and mapped
// once by the engine rank on the same device; one control message per bucket each way.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "common/timer.h"
#include "control/store.h"
#include "plane/data_plane.h"
#include "plane/shared_memory.h"
#include "control/inbox.h"
#include "transport/transport.h"

namespace refit {
namespace {

// The receiver finds it through the store (the key is the prefix), so the name may carry a
// random suffix.
std::string segment_name(const std::string& prefix, int slot) {
  return fmt::format("{}-{}-{}", prefix, slot, unguessable_suffix());
}

class IpcSender final : public BucketSender {
 public:
  IpcSender(Mailbox& mailbox, std::string peer, std::vector<std::unique_ptr<PlaneBuffer>> slots,
            std::chrono::milliseconds timeout)
      : mailbox_(mailbox),
        peer_(std::move(peer)),
        slots_(std::move(slots)),
        in_flight_(slots_.size(), false),
        timeout_(timeout) {}

  int num_slots() const override { return static_cast<int>(slots_.size()); }
  std::byte* slot_data(int slot) override { return slots_[slot]->data(); }

  Status wait_slot(int slot) override {
    Timer t;
    while (in_flight_[slot]) REFIT_RETURN_IF_ERROR(take_ack());
    busy_seconds_ += t.seconds();
    return Status::Ok();
  }

  Status send(int slot, BucketHeader header) override {
    in_flight_[slot] = true;
    return mailbox_.send(peer_, MessageType::kBucket, encode(bucket_message(slot, header)));
  }

  Status drain() override {
    Timer t;
    for (std::size_t s = 0; s < slots_.size(); ++s)
      while (in_flight_[s]) REFIT_RETURN_IF_ERROR(take_ack());
    busy_seconds_ += t.seconds();
    return Status::Ok();
  }

  double take_busy_seconds() override { return std::exchange(busy_seconds_, 0.0); }

  void on_receivers_attached() override {
    for (auto& s : slots_) s->release_name();
  }

 private:
  Status take_ack() {
    REFIT_ASSIGN_OR_RETURN(Message msg, expect_message(mailbox_, MessageType::kBucketDone, timeout_,
                                                       "the acknowledgement of " + peer_));
    REFIT_ASSIGN_OR_RETURN(const BucketDoneMessage done, decode_bucket_done(msg.payload, msg.from));
    const int slot = done.slot;
    if (slot < 0 || slot >= num_slots() || !in_flight_[slot])
      return Status::Internal(
          fmt::format("ipc: {} acknowledged slot {} that was not in flight", peer_, slot));
    in_flight_[slot] = false;
    return Status::Ok();
  }

  Mailbox& mailbox_;
  std::string peer_;
  std::vector<std::unique_ptr<PlaneBuffer>> slots_;
  std::vector<bool> in_flight_;
  std::chrono::milliseconds timeout_;
  double busy_seconds_ = 0;
};

class IpcReceiver final : public BucketReceiver {
 public:
  IpcReceiver(Mailbox& mailbox, std::string peer, std::vector<std::unique_ptr<PlaneBuffer>> slots,
              std::chrono::milliseconds timeout)
      : mailbox_(mailbox), peer_(std::move(peer)), slots_(std::move(slots)), timeout_(timeout) {}

  Result<IncomingBucket> receive(const std::optional<BucketHeader>& expected) override {
    REFIT_ASSIGN_OR_RETURN(Message msg, expect_message(mailbox_, MessageType::kBucket, timeout_,
                                                       "a bucket from " + peer_));
    REFIT_ASSIGN_OR_RETURN(const BucketMessage m, decode_bucket(msg.payload, msg.from));
    IncomingBucket in = incoming_bucket(m);
    if (in.slot < 0 || in.slot >= static_cast<int>(slots_.size()) ||
        in.header.bytes > slots_[in.slot]->size())
      return Status::Corruption(fmt::format(
          "ipc: bucket {} from {} names slot {} with {} bytes; this engine mapped {} slots of {} "
          "bytes",
          in.header.bucket, peer_, in.slot, in.header.bytes, slots_.size(),
          slots_.empty() ? 0 : slots_[0]->size()));
    if (expected) in.header.meta = expected->meta;
    in.data = slots_[in.slot]->data();
    return in;
  }

  Status release(const IncomingBucket& bucket) override {
    return mailbox_.send(peer_, MessageType::kBucketDone,
                         encode(BucketDoneMessage{.slot = bucket.slot,
                                                  .step = bucket.header.step,
                                                  .bucket = bucket.header.bucket}));
  }

 private:
  Mailbox& mailbox_;
  std::string peer_;
  std::vector<std::unique_ptr<PlaneBuffer>> slots_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

Result<std::unique_ptr<BucketSender>> make_ipc_sender(Mailbox& mailbox, Store& store,
                                                      DataPlane& plane, std::string peer_id,
                                                      const std::string& segment_prefix,
                                                      const TransportOptions& options) {
  std::vector<std::unique_ptr<PlaneBuffer>> slots;
  for (int s = 0; s < options.num_slots; ++s) {
    std::string handle;
    REFIT_ASSIGN_OR_RETURN(
        auto buf,
        plane.allocate_exported(options.slot_bytes, segment_name(segment_prefix, s), &handle));
    REFIT_RETURN_IF_ERROR(store.set(fmt::format("{}/slot/{}", segment_prefix, s), handle));
    slots.push_back(std::move(buf));
  }
  return std::unique_ptr<BucketSender>(
      new IpcSender(mailbox, std::move(peer_id), std::move(slots), options.timeout));
}

Result<std::unique_ptr<BucketReceiver>> make_ipc_receiver(Mailbox& mailbox, Store& store,
                                                          DataPlane& plane, std::string peer_id,
                                                          const std::string& segment_prefix,
                                                          const TransportOptions& options) {
  std::vector<std::unique_ptr<PlaneBuffer>> slots;
  for (int s = 0; s < options.num_slots; ++s) {
    REFIT_ASSIGN_OR_RETURN(
        std::string handle,
        store.get(fmt::format("{}/slot/{}", segment_prefix, s), options.timeout));
    REFIT_ASSIGN_OR_RETURN(auto buf, plane.open_exported(handle, options.slot_bytes));
    slots.push_back(std::move(buf));
  }
  return std::unique_ptr<BucketReceiver>(
      new IpcReceiver(mailbox, std::move(peer_id), std::move(slots), options.timeout));
}

}  // namespace refit
