// Transports move packed buckets from a trainer rank to engine ranks (docs/design.md §2 stage 6).
//
// Both transports own `num_buffers` slots of `buffer_size_bytes`, registered once at setup:
//  - broadcast (non-colocated): the sender's slots are host buffers; a background thread sends
//    each handed-over bucket with one broadcast on the update group (trainer rank 0 → every
//    engine rank), preceded, for SGLang, by the bucket's metadata on the control plane.
//  - ipc (colocated): the slots are memory the trainer rank exports once (POSIX shared memory on
//    CPU, CUDA IPC on GPU) and the engine rank on its device maps once; handing over a bucket is
//    one control message,
//    and the engine acknowledges when it has applied it, after which the slot may be refilled.
// Senders are driven by one thread (the packer); receivers by one thread (the engine's receive
// loop) plus release() from the apply thread. Every wait is bounded by the timeout.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "control/mailbox.h"
#include "control/messages.h"
#include "refit/status.h"

namespace refit {

class Communicator;
class DataPlane;
class Store;

struct BucketHeader {
  int step = 0;
  int bucket = 0;
  std::size_t bytes = 0;
  std::string meta;  // protocol metadata (SGLang: names, dtypes, shapes, offsets); may be empty
};

struct IncomingBucket {
  int slot = 0;
  const std::byte* data = nullptr;
  BucketHeader header;
};

class BucketSender {
 public:
  virtual ~BucketSender() = default;
  virtual int num_slots() const = 0;
  virtual std::byte* slot_data(int slot) = 0;
  // Blocks until `slot` may be packed again (its previous bucket was delivered).
  virtual Status wait_slot(int slot) = 0;
  // Hands the packed slot over for delivery; returns before delivery completes.
  virtual Status send(int slot, BucketHeader header) = 0;
  // Waits until every bucket handed over was delivered.
  virtual Status drain() = 0;
  // Seconds spent moving bytes (broadcast) or waiting for the engine (ipc) since the last call.
  virtual double take_busy_seconds() = 0;
  // Every receiver has attached (its hello arrived): setup-time names may be dropped.
  virtual void on_receivers_attached() {}
};

class BucketReceiver {
 public:
  virtual ~BucketReceiver() = default;
  // The next bucket. `expected` carries the header when the protocol fixed it at setup (vLLM
  // broadcast); otherwise it comes from the control plane.
  virtual Result<IncomingBucket> receive(const std::optional<BucketHeader>& expected) = 0;
  // The bucket was applied: its slot may be reused. Callable from another thread.
  virtual Status release(const IncomingBucket& bucket) = 0;
};

struct TransportOptions {
  int num_slots = 2;
  std::size_t slot_bytes = 0;
  std::chrono::milliseconds timeout{60000};
};

// Broadcast: `update` is the update group (this process rank 0 on the sender side); slots are
// allocated on `plane` (host or device memory, matching the communicator). When `send_meta` is
// set the header travels to every id in `engine_ids` before each broadcast.
Result<std::unique_ptr<BucketSender>> make_broadcast_sender(Communicator& update, Mailbox& mailbox,
                                                            DataPlane& plane,
                                                            std::vector<std::string> engine_ids,
                                                            bool send_meta,
                                                            const TransportOptions& options);
Result<std::unique_ptr<BucketReceiver>> make_broadcast_receiver(Communicator& update,
                                                                Mailbox& mailbox, DataPlane& plane,
                                                                const TransportOptions& options);

// IPC: the sender allocates the slots as exported memory of `plane` (POSIX shared memory on
// CPU, CUDA IPC on GPU) and publishes their handles in `store` under "<segment_prefix>/slot/<s>";
// the receiver maps them once. `peer_id` is the mailbox of the other side.
Result<std::unique_ptr<BucketSender>> make_ipc_sender(Mailbox& mailbox, Store& store,
                                                      DataPlane& plane, std::string peer_id,
                                                      const std::string& segment_prefix,
                                                      const TransportOptions& options);
Result<std::unique_ptr<BucketReceiver>> make_ipc_receiver(Mailbox& mailbox, Store& store,
                                                          DataPlane& plane, std::string peer_id,
                                                          const std::string& segment_prefix,
                                                          const TransportOptions& options);

// A bucket's header (plus slot) as the bucket message of control/messages.h, and back.
BucketMessage bucket_message(int slot, const BucketHeader& header);
IncomingBucket incoming_bucket(const BucketMessage& message);

}  // namespace refit
