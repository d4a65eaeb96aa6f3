// NCCL implementation of comm/nccl/nccl_communicator.h.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "comm/nccl/nccl_communicator.h"
#include "control/store.h"
#include "device/cuda_check.h"
#include "device/device.h"

namespace refit {
namespace {

std::string nccl_error_text(ncclResult_t r, ncclComm_t comm) {
  const char* last = comm != nullptr ? ncclGetLastError(comm) : ncclGetLastError(nullptr);
  std::string text = ncclGetErrorString(r);
  if (last != nullptr && last[0] != '\0') text += fmt::format(" ({})", last);
  return text;
}

class NcclComm final : public NcclCommunicator {
 public:
  NcclComm(const NcclOptions& opt, ncclComm_t comm, DeviceStream owned, DeviceBuffer scratch)
      : opt_(opt),
        comm_(comm),
        owned_stream_(std::move(owned)),
        stream_(opt.stream != nullptr ? opt.stream : owned_stream_.handle()),
        scratch_(std::move(scratch)) {}

  ~NcclComm() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (comm_ == nullptr) return;
    // A healthy group finalises (bounded); anything else is aborted.
    (void)cudaSetDevice(opt_.device);
    bool clean = failed_.ok();
    if (clean) {
      const ncclResult_t r = ncclCommFinalize(comm_);
      clean = r == ncclSuccess || r == ncclInProgress;
    }
    if (clean) clean = wait_ready_locked("finalize").ok();
    if (clean) {
      (void)ncclCommDestroy(comm_);
    } else if (comm_ != nullptr) {
      (void)ncclCommAbort(comm_);
    }
    comm_ = nullptr;
  }

  int rank() const override { return opt_.rank; }
  int size() const override { return opt_.size; }
  std::string_view backend() const override { return "nccl"; }
  void* stream() const override { return stream_; }
  int device() const override { return opt_.device; }

  Status all_gather_v(const void* send, void* recv,
                      const std::vector<std::size_t>& counts) override {
    REFIT_RETURN_IF_ERROR(enqueue_all_gather_v(send, recv, counts));
    return synchronize();
  }

  Status broadcast(void* buf, std::size_t bytes, int root) override {
    REFIT_RETURN_IF_ERROR(enqueue_broadcast(buf, bytes, root));
    return synchronize();
  }

  Status barrier() override {
    REFIT_RETURN_IF_ERROR(begin("barrier"));
    Status st = issue("barrier", [&] {
      return ncclAllReduce(scratch_.data(), scratch_.data(), 1, ncclInt32, ncclSum, comm_,
                           static_cast<cudaStream_t>(stream_));
    });
    end();
    if (!st.ok()) return st;
    return synchronize();
  }

  void abort() override {
    abort_requested_.store(true);
    std::lock_guard<std::mutex> lock(mu_);
    // A call in progress on another thread sees the flag and aborts from its own thread.
    if (!busy_) fail_locked(aborted_status());
  }

  Status enqueue_all_gather_v(const void* send, void* recv,
                              const std::vector<std::size_t>& counts) override {
    if (counts.size() != static_cast<std::size_t>(opt_.size))
      return Status::InvalidArgument(fmt::format("{}: all_gather_v got {} counts for {} ranks",
                                                 where(), counts.size(), opt_.size));
    if (send == nullptr && counts[opt_.rank] != 0)
      return Status::InvalidArgument(fmt::format(
          "{}: all_gather_v without a send buffer for {} bytes", where(), counts[opt_.rank]));
    REFIT_RETURN_IF_ERROR(begin("all_gather_v"));
    // One broadcast per contributing rank into its segment of recv, fused into one NCCL group.
    Status st = issue("all_gather_v", [&] {
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) return r;
      std::size_t offset = 0;
      for (int root = 0; root < opt_.size; ++root) {
        const std::size_t n = counts[root];
        if (n == 0) continue;
        auto* segment = static_cast<std::byte*>(recv) + offset;
        const void* from = root == opt_.rank ? send : segment;
        r = ncclBroadcast(from, segment, n, ncclUint8, root, comm_,
                          static_cast<cudaStream_t>(stream_));
        if (r != ncclSuccess) break;
        offset += n;
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
    end();
    return st;
  }

  Status enqueue_broadcast(void* buf, std::size_t bytes, int root) override {
    if (root < 0 || root >= opt_.size)
      return Status::InvalidArgument(fmt::format(
          "{}: broadcast from root {} (the group has {} ranks)", where(), root, opt_.size));
    if (bytes == 0) return Status::Ok();
    REFIT_RETURN_IF_ERROR(begin("broadcast"));
    Status st = issue("broadcast", [&] {
      return ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_,
                           static_cast<cudaStream_t>(stream_));
    });
    end();
    return st;
  }

  Status exchange(const std::vector<P2POp>& ops) override {
    for (const P2POp& o : ops)
      if (o.peer < 0 || o.peer >= opt_.size || o.peer == opt_.rank)
        return Status::InvalidArgument(
            fmt::format("{}: exchange with peer {}, not another rank", where(), o.peer));
    REFIT_RETURN_IF_ERROR(begin("exchange"));
    // Every send and receive in one NCCL group: NCCL matches them per peer in order.
    Status st = issue("exchange", [&] {
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) return r;
      for (const P2POp& o : ops) {
        if (o.bytes == 0) continue;
        r = o.kind == P2POp::Kind::kSend
                ? ncclSend(o.buf, o.bytes, ncclUint8, o.peer, comm_,
                           static_cast<cudaStream_t>(stream_))
                : ncclRecv(o.buf, o.bytes, ncclUint8, o.peer, comm_,
                           static_cast<cudaStream_t>(stream_));
        if (r != ncclSuccess) break;
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
    end();
    if (!st.ok()) return st;
    return synchronize();
  }

  Status synchronize() override {
    REFIT_RETURN_IF_ERROR(begin("synchronize"));
    Status st = wait_stream();
    end();
    return st;
  }

 private:
  std::string where() const {
    return fmt::format("nccl group '{}' rank {}/{} (device {})", opt_.name, opt_.rank, opt_.size,
                       opt_.device);
  }
  Status aborted_status() const {
    return Status::Aborted(fmt::format("{}: communicator aborted", where()));
  }

  Status begin(const char* op) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.ok()) return failed_;
    if (abort_requested_.load()) {
      fail_locked(aborted_status());
      return failed_;
    }
    busy_ = true;
    (void)op;
    return Status::Ok();
  }
  void end() {
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;
    if (abort_requested_.load() && failed_.ok()) fail_locked(aborted_status());
  }

  // Records the first failure and aborts the NCCL communicator (once).
  void fail_locked(Status cause) {
    if (failed_.ok()) failed_ = std::move(cause);
    if (comm_ != nullptr) {
      (void)ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }
  Status fail(Status cause) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_locked(std::move(cause));
    return failed_;
  }

  // Calls `enqueue` (NCCL calls) and waits, bounded, until NCCL accepted them (non-blocking
  // communicators may return ncclInProgress).
  template <typename F>
  Status issue(const char* op, F&& enqueue) {
    if (cudaSetDevice(opt_.device) != cudaSuccess)
      return fail(cuda_status(cudaGetLastError(), "cudaSetDevice"));
    const ncclResult_t r = enqueue();
    if (r != ncclSuccess && r != ncclInProgress)
      return fail(Status::IOError(
          fmt::format("{}: {} failed: {}", where(), op, nccl_error_text(r, comm_))));
    return wait_ready(op);
  }

  // Until NCCL accepted the enqueued operations. Point-to-point connects lazily, on the first
  // send/recv between two ranks, so this can wait on a peer too: the liveness check runs here as
  // in wait_stream, and a dead peer ends the wait within the liveness interval.
  Status wait_ready(const char* op) {
    const auto deadline = std::chrono::steady_clock::now() + opt_.timeout;
    auto next_liveness = std::chrono::steady_clock::now() + opt_.liveness_interval;
    for (;;) {
      if (abort_requested_.load()) return fail(aborted_status());
      ncclResult_t async = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &async);
      if (r != ncclSuccess) async = r;
      if (async == ncclSuccess) return Status::Ok();
      if (async != ncclInProgress)
        return fail(Status::IOError(
            fmt::format("{}: {} failed: {}", where(), op, nccl_error_text(async, comm_))));
      if (std::chrono::steady_clock::now() >= deadline)
        return fail(Status::Timeout(fmt::format("{}: {} not accepted by NCCL within {} ms", where(),
                                                op, opt_.timeout.count())));
      if (opt_.liveness && std::chrono::steady_clock::now() >= next_liveness) {
        Status alive = opt_.liveness();
        if (!alive.ok()) return fail(alive);
        next_liveness = std::chrono::steady_clock::now() + opt_.liveness_interval;
      }
      std::this_thread::yield();
    }
  }

  // Destructor path (mu_ held, no abort flag handling).
  Status wait_ready_locked(const char* op) {
    const auto deadline = std::chrono::steady_clock::now() + opt_.timeout;
    for (;;) {
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &async) != ncclSuccess) return Status::IOError(op);
      if (async == ncclSuccess) return Status::Ok();
      if (async != ncclInProgress || std::chrono::steady_clock::now() >= deadline)
        return Status::IOError(op);
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  // Polls the stream and NCCL's async error until the stream drained, with the timeout.
  Status wait_stream() {
    const auto deadline = std::chrono::steady_clock::now() + opt_.timeout;
    auto next_liveness = std::chrono::steady_clock::now() + opt_.liveness_interval;
    std::chrono::microseconds nap{0};
    for (int spins = 0;; ++spins) {
      if (abort_requested_.load()) return fail(aborted_status());
      const cudaError_t q = cudaStreamQuery(static_cast<cudaStream_t>(stream_));
      if (q == cudaSuccess) return Status::Ok();
      if (q != cudaErrorNotReady)
        return fail(cuda_status(q, fmt::format("cudaStreamQuery ({})", where()).c_str()));
      ncclResult_t async = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &async);
      if (r != ncclSuccess) async = r;
      if (async != ncclSuccess && async != ncclInProgress)
        return fail(Status::IOError(
            fmt::format("{}: collective failed: {}", where(), nccl_error_text(async, comm_))));
      if (std::chrono::steady_clock::now() >= deadline)
        return fail(Status::Timeout(fmt::format(
            "{}: collective did not complete within {} ms (a peer missing, stopped or slow); "
            "communicator aborted",
            where(), opt_.timeout.count())));
      if (opt_.liveness && std::chrono::steady_clock::now() >= next_liveness) {
        Status alive = opt_.liveness();
        if (!alive.ok()) return fail(alive);
        next_liveness = std::chrono::steady_clock::now() + opt_.liveness_interval;
      }
      if (spins > 2000) {
        nap = std::min(std::chrono::microseconds{200}, nap + std::chrono::microseconds{5});
        std::this_thread::sleep_for(nap);
      }
    }
  }

  NcclOptions opt_;
  ncclComm_t comm_ = nullptr;
  DeviceStream owned_stream_;
  void* stream_ = nullptr;
  DeviceBuffer scratch_;
  std::mutex mu_;
  bool busy_ = false;
  std::atomic<bool> abort_requested_{false};
  Status failed_;
};

}  // namespace

void set_nccl_environment() {
  static std::once_flag once;
  std::call_once(once, [] {
    setenv("NCCL_CUMEM_ENABLE", "0", /*overwrite=*/0);
    setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  });
}

Result<std::unique_ptr<NcclCommunicator>> make_nccl_communicator(Store& store,
                                                                 const NcclOptions& opt) {
  const std::string where = fmt::format("nccl group '{}' rank {}/{} (device {})", opt.name,
                                        opt.rank, opt.size, opt.device);
  if (opt.size < 1 || opt.rank < 0 || opt.rank >= opt.size)
    return Status::InvalidArgument(fmt::format("{}: rank must be in [0, size)", where));
  set_nccl_environment();
  Status st = set_device(opt.device);
  if (!st.ok()) return st.with_context(where);

  const std::string key = fmt::format("nccl/{}/id", opt.name);
  ncclUniqueId id;
  if (opt.rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess)
      return Status::IOError(
          fmt::format("{}: ncclGetUniqueId failed: {}", where, nccl_error_text(r, nullptr)));
    REFIT_RETURN_IF_ERROR(
        store.set(key, std::string(reinterpret_cast<const char*>(&id), sizeof(id))));
  } else {
    auto value = store.get(key, opt.timeout);
    if (!value.ok())
      return value.status().with_context(where + ": waiting for rank 0's NCCL unique id");
    if (value->size() != sizeof(id))
      return Status::Corruption(
          fmt::format("{}: store key {} holds {} bytes, an ncclUniqueId has {}", where, key,
                      value->size(), sizeof(id)));
    std::memcpy(&id, value->data(), sizeof(id));
  }

  DeviceStream owned;
  if (opt.stream == nullptr) {
    auto s = DeviceStream::create(opt.device);
    if (!s.ok()) return s.status().with_context(where);
    owned = std::move(s).value();
  }
  auto scratch = DeviceBuffer::allocate(sizeof(int), opt.device);
  if (!scratch.ok()) return scratch.status().with_context(where);

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, opt.size, id, opt.rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    const std::string text = nccl_error_text(r, comm);
    if (comm != nullptr) (void)ncclCommAbort(comm);
    return Status::IOError(fmt::format("{}: ncclCommInitRankConfig failed: {}", where, text));
  }
  const auto deadline = std::chrono::steady_clock::now() + opt.timeout;
  for (;;) {
    ncclResult_t async = ncclInProgress;
    r = ncclCommGetAsyncError(comm, &async);
    if (r != ncclSuccess) async = r;
    if (async == ncclSuccess) break;
    if (async != ncclInProgress) {
      const std::string text = nccl_error_text(async, comm);
      (void)ncclCommAbort(comm);
      return Status::IOError(fmt::format("{}: initialisation failed: {}", where, text));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      (void)ncclCommAbort(comm);
      return Status::Timeout(fmt::format(
          "{}: initialisation did not finish within {} ms; every one of the {} ranks must join "
          "group '{}' with its own GPU; communicator aborted",
          where, opt.timeout.count(), opt.size, opt.name));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return std::unique_ptr<NcclCommunicator>(
      new NcclComm(opt, comm, std::move(owned), std::move(scratch).value()));
}

}  // namespace refit
