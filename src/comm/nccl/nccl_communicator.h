// The NCCL backend of the Communicator interface (comm/communicator.h) for `device: cuda`.
//
// Rendezvous: rank 0 creates the ncclUniqueId and publishes it in the store under
// "nccl/<name>/id"; the other ranks read it (bounded by the timeout). A group name is used once
// per store.
//
// Never hangs: the communicator is created non-blocking (ncclConfig_t.blocking = 0), and every
// wait — initialisation, a collective's completion on the stream — polls ncclCommGetAsyncError
// and the stream with the timeout. On a timeout or an NCCL error the communicator is aborted
// (ncclCommAbort) and the call returns kTimeout / kIOError naming the operation, the group, the
// rank and the cause; every later call returns that first cause at once. abort() may be called
// from any thread: a call pending on another thread notices within microseconds, aborts the NCCL
// communicator itself and returns kAborted. Aborting this rank does not by itself fail the peers'
// pending calls: they learn through the control plane (the runtime's failure announcement) and
// abort, or run out their timeout.
//
// Buffers: every pointer passed to all_gather_v / broadcast is device memory on this
// communicator's device. The Communicator calls are synchronous: they enqueue on stream() and
// return once the operation completed on it (a bounded wait). The enqueue_* calls only enqueue
// (ordered on stream()); synchronize() is their bounded wait. Use them to overlap a collective
// with kernels on other streams (make those wait on an event recorded on stream()).
//
// Environment (set once, before the first NCCL call of the process, each only when unset, so a
// user's value wins; every process of one NCCL group must agree, which holds when all are refit
// processes):
//   NCCL_CUMEM_ENABLE=0  NCCL's cuMem-based buffers off, as vLLM and SGLang workers set it:
//                        peers that disagree fail to connect, and the trainer and engines share
//                        the update group.
//   NCCL_NVLS_ENABLE=0   no NVLink multicast (NVLS) — never used by refit's collectives, and on
//                        shared hosts a crashed NVLS user can take GPUs out of service.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "refit/status.h"

namespace refit {

class Store;

struct NcclOptions {
  std::string name;  // group name; namespaces its store keys ("trainer", "update")
  int rank = 0;
  int size = 1;
  int device = 0;  // CUDA device of this rank
  // Bounds initialisation and every collective; on expiry the communicator is aborted.
  std::chrono::milliseconds timeout{60000};
  // cudaStream_t the collectives run on; null = the communicator creates (and owns) a
  // non-blocking stream.
  void* stream = nullptr;
  // Optional: asked every `liveness_interval` while a collective is waited for; a non-ok Status
  // aborts the communicator and ends the wait with it (NCCL itself does not notice a peer
  // process that died on the same host). The runtime checks the store's first failure.
  std::function<Status()> liveness;
  std::chrono::milliseconds liveness_interval{500};
};

class NcclCommunicator : public Communicator {
 public:
  // cudaStream_t the collectives are ordered on.
  virtual void* stream() const = 0;
  virtual int device() const = 0;
  // Enqueue only; buffers must stay valid until synchronize() (or a later ordered wait) returns.
  virtual Status enqueue_all_gather_v(const void* send, void* recv,
                                      const std::vector<std::size_t>& counts) = 0;
  virtual Status enqueue_broadcast(void* buf, std::size_t bytes, int root) = 0;
  // Bounded wait for everything enqueued on stream().
  virtual Status synchronize() = 0;
};

// Sets NCCL_CUMEM_ENABLE / NCCL_NVLS_ENABLE as documented above (no-op after the first call).
// make_nccl_communicator calls it; call it yourself earlier if the process uses NCCL otherwise.
void set_nccl_environment();

// Forms the group. Errors name the group, rank, size and device. Without CUDA: kUnsupported.
Result<std::unique_ptr<NcclCommunicator>> make_nccl_communicator(Store& store,
                                                                 const NcclOptions& options);

}  // namespace refit
