// The CUDA data plane (device: cuda): device memory, one stream, the copy kernels of
// device/copy_kernels.h, CUDA IPC for exported memory. Compiled in every build; without CUDA the
// device layer answers kUnsupported and so does make_cuda_data_plane.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/env.h"
#include "common/log.h"
#include "delta/delta_cpu.h"
#include "device/copy_kernels.h"
#include "device/cuda_ipc.h"
#include "device/delta_kernels.h"
#include "device/device.h"
#include "device/quant_kernels.h"
#include "plane/data_plane.h"
#include "weights/materialize.h"
#include "weights/setup.h"

namespace refit {
namespace {

std::string to_hex(const std::string& bytes) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(d[c >> 4]);
    out.push_back(d[c & 15]);
  }
  return out;
}

Result<std::string> from_hex(const std::string& hex) {
  if (hex.size() % 2 != 0) return Status::Corruption("ipc handle: odd hex length");
  std::string out;
  for (std::size_t i = 0; i < hex.size(); i += 2) {
    auto v = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
    out.push_back(static_cast<char>(v(hex[i]) * 16 + v(hex[i + 1])));
  }
  return out;
}

class CudaPlaneBuffer final : public PlaneBuffer {
 public:
  explicit CudaPlaneBuffer(DeviceBuffer buf) : buf_(std::move(buf)) {}
  std::byte* data() override { return buf_.bytes(); }
  std::size_t size() const override { return buf_.size(); }

 private:
  DeviceBuffer buf_;
};

// The address ranges of another GPU's memory this process mapped through CUDA IPC (a pointer's
// attributes name the GPU that mapped it, not the one that holds it).
class RemoteRanges {
 public:
  void add(const std::byte* p, std::size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    ranges_.emplace_back(p, p + n);
  }
  void remove(const std::byte* p) {
    std::lock_guard<std::mutex> lock(mu_);
    std::erase_if(ranges_, [p](const auto& r) { return r.first == p; });
  }
  bool contains(const std::byte* p) const {
    std::lock_guard<std::mutex> lock(mu_);
    return std::any_of(ranges_.begin(), ranges_.end(),
                       [p](const auto& r) { return p >= r.first && p < r.second; });
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::pair<const std::byte*, const std::byte*>> ranges_;
};

class OpenedPlaneBuffer final : public PlaneBuffer {
 public:
  OpenedPlaneBuffer(IpcMemory mem, std::weak_ptr<RemoteRanges> remote)
      : mem_(std::move(mem)), remote_(std::move(remote)) {}
  ~OpenedPlaneBuffer() override {
    if (auto r = remote_.lock()) r->remove(mem_.data());
  }
  std::byte* data() override { return mem_.data(); }
  std::size_t size() const override { return mem_.size(); }

 private:
  IpcMemory mem_;
  std::weak_ptr<RemoteRanges> remote_;  // set when the memory is another GPU's
};

// The plane and its diagnostics (PlaneDiagnostics: the harness's weight generation and checks,
// bandwidth measurements, fault injection), which need the same workers and memory.
class CudaDataPlane final : public DataPlane, public PlaneDiagnostics {
 public:
  PlaneDiagnostics* diagnostics() override { return this; }
  Status corrupt_byte(std::byte* at) override {
    std::byte b{};
    REFIT_RETURN_IF_ERROR(read(&b, at, 1));
    b ^= std::byte{0x5a};
    return write(at, &b, 1);
  }
  CudaDataPlane(int device, DeviceStream stream, std::chrono::milliseconds timeout)
      : device_(device), stream_(std::move(stream)), timeout_(timeout) {}
  Device device() const override { return Device::kCuda; }
  int ordinal() const override { return device_; }

  Result<std::unique_ptr<PlaneBuffer>> allocate(std::size_t bytes) override {
    REFIT_RETURN_IF_ERROR(on_device());
    REFIT_ASSIGN_OR_RETURN(DeviceBuffer buf, DeviceBuffer::allocate(bytes, device_));
    REFIT_RETURN_IF_ERROR(fill_bytes_async(buf.data(), 0, bytes, stream_.handle()));
    REFIT_RETURN_IF_ERROR(sync("zero-filling a new buffer"));
    return std::unique_ptr<PlaneBuffer>(new CudaPlaneBuffer(std::move(buf)));
  }

  Result<std::unique_ptr<PlaneBuffer>> allocate_exported(std::size_t bytes, const std::string&,
                                                         std::string* handle) override {
    REFIT_ASSIGN_OR_RETURN(auto buf, allocate(bytes));
    REFIT_ASSIGN_OR_RETURN(std::string raw, export_device_memory(buf->data(), bytes));
    *handle = to_hex(raw);
    return buf;
  }

  bool can_export_existing() const override { return true; }
  Result<std::string> export_existing(std::byte* ptr, std::size_t bytes) override {
    REFIT_RETURN_IF_ERROR(on_device());
    REFIT_ASSIGN_OR_RETURN(std::string raw, export_device_memory(ptr, bytes));
    return to_hex(raw);
  }

  Result<std::unique_ptr<PlaneBuffer>> open_exported(const std::string& handle,
                                                     std::size_t) override {
    REFIT_RETURN_IF_ERROR(on_device());
    REFIT_ASSIGN_OR_RETURN(std::string raw, from_hex(handle));
    REFIT_ASSIGN_OR_RETURN(IpcMemory mem, IpcMemory::open(raw, device_));
    std::weak_ptr<RemoteRanges> remote;
    if (!mem.on_this_device()) {
      remote_->add(mem.data(), mem.size());
      remote = remote_;
    }
    return std::unique_ptr<PlaneBuffer>(new OpenedPlaneBuffer(std::move(mem), std::move(remote)));
  }

  Result<double> measure_copy_bandwidth() override {
    REFIT_RETURN_IF_ERROR(on_device());
    constexpr std::size_t kBytes = 1u << 30;
    REFIT_ASSIGN_OR_RETURN(DeviceBuffer a, DeviceBuffer::allocate(kBytes, device_));
    REFIT_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::allocate(kBytes, device_));
    std::vector<double> secs;
    for (int i = 0; i < 5; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      REFIT_RETURN_IF_ERROR(copy_device_async(b.data(), a.data(), kBytes, stream_.handle()));
      REFIT_RETURN_IF_ERROR(sync("measuring the copy bandwidth"));
      secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(secs.begin(), secs.end());
    return 2.0 * kBytes / secs[2];
  }

  Result<double> measure_peer_bandwidth(int peer) override {
    if (peer == device_) {
      REFIT_ASSIGN_OR_RETURN(double rw, measure_copy_bandwidth());
      return rw / 2;
    }
    REFIT_RETURN_IF_ERROR(on_device());
    REFIT_RETURN_IF_ERROR(enable_peer_access(peer));
    constexpr std::size_t kBytes = 1u << 30;
    REFIT_ASSIGN_OR_RETURN(DeviceBuffer a, DeviceBuffer::allocate(kBytes, device_));
    REFIT_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::allocate(kBytes, peer));
    REFIT_RETURN_IF_ERROR(on_device());
    std::vector<double> secs;
    for (int i = 0; i < 5; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      REFIT_RETURN_IF_ERROR(
          copy_peer_async(b.data(), peer, a.data(), device_, kBytes, stream_.handle()));
      REFIT_RETURN_IF_ERROR(sync("measuring the peer bandwidth"));
      secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(secs.begin(), secs.end());
    return static_cast<double>(kBytes) / secs[2];
  }

  Status read(void* host_dst, const std::byte* src, std::size_t bytes) override {
    REFIT_RETURN_IF_ERROR(on_device());
    REFIT_RETURN_IF_ERROR(sync("before a read"));
    return copy_to_host(host_dst, src, bytes);
  }
  Status write(std::byte* dst, const void* host_src, std::size_t bytes) override {
    REFIT_RETURN_IF_ERROR(on_device());
    REFIT_RETURN_IF_ERROR(sync("before a write"));
    return copy_to_device(dst, host_src, bytes);
  }

  Status fill_weights(const RankModel& model, const std::vector<PieceTarget>& targets, int step,
                      DType via, DType out) override {
    REFIT_RETURN_IF_ERROR(on_device());
    if (model.checkpoint != nullptr) {  // base values live on the host: build there, upload
      for (const PieceTarget& t : targets) {
        const std::size_t bytes =
            static_cast<std::size_t>(matrix_shape(t.shape).numel()) * dtype_size(out);
        std::vector<std::byte> host(bytes);
        REFIT_RETURN_IF_ERROR(copy_to_host(host.data(), t.data, bytes));
        materialize_pieces(model.spec, *t.pieces, t.shape, *model.weights, step, via, out,
                           host.data());
        REFIT_RETURN_IF_ERROR(copy_to_device(t.data, host.data(), bytes));
      }
      return Status::Ok();
    }
    REFIT_ASSIGN_OR_RETURN(Table * table, weights_table(model, targets, dtype_size(out)));
    REFIT_RETURN_IF_ERROR(launch_generate(table->table, weights_params(model, step, via),
                                          table->base, out, stream_.handle()));
    return sync("generating weights");
  }

  Result<std::optional<std::pair<std::size_t, std::int64_t>>> find_mismatch(
      const RankModel& model, const std::vector<PieceTarget>& targets, int step, DType via,
      DType dtype) override {
    REFIT_RETURN_IF_ERROR(on_device());
    using Found = std::optional<std::pair<std::size_t, std::int64_t>>;
    if (model.checkpoint != nullptr) {
      // The checkpoint's base values live on the host: compare there, target by target.
      std::vector<std::byte> expected, actual;
      for (std::size_t i = 0; i < targets.size(); ++i) {
        const std::size_t bytes =
            static_cast<std::size_t>(matrix_shape(targets[i].shape).numel()) * dtype_size(dtype);
        actual.resize(bytes);
        REFIT_RETURN_IF_ERROR(copy_to_host(actual.data(), targets[i].data, bytes));
        if (auto k =
                first_host_mismatch(model, targets[i], step, via, dtype, actual.data(), expected))
          return Found(std::make_pair(i, *k));
      }
      return Found();
    }
    REFIT_ASSIGN_OR_RETURN(Table * table, weights_table(model, targets, dtype_size(dtype)));
    REFIT_ASSIGN_OR_RETURN(VerifyResult r,
                           verify_generated(table->table, weights_params(model, step, via),
                                            table->base, dtype, stream_.handle(), timeout_));
    if (r.mismatches == 0) return Found();
    // Map the element back to its target (element offsets from the table's base).
    const std::size_t esize = dtype_size(dtype);
    const std::byte* at = table->base + r.first_dst_offset * static_cast<std::int64_t>(esize);
    for (std::size_t i = 0; i < targets.size(); ++i) {
      const std::byte* b = targets[i].data;
      const std::byte* e =
          b + matrix_shape(targets[i].shape).numel() * static_cast<std::int64_t>(esize);
      if (at >= b && at < e)
        return Found(std::make_pair(i, (at - b) / static_cast<std::int64_t>(esize)));
    }
    return Status::Internal("verify: mismatch outside every target");
  }

  Status copy(const std::vector<CopyRun>& runs, DType sdt, DType ddt,
              const std::byte* src_base) override {
    REFIT_RETURN_IF_ERROR(on_device());
    if (runs.empty()) return Status::Ok();
    REFIT_ASSIGN_OR_RETURN(CopyTable * t, copy_table(runs, sdt, ddt, src_base));
    REFIT_ASSIGN_OR_RETURN(void* ce_stream, launch_copy(*t, sdt, ddt, src_base, stream_.handle()));
    REFIT_RETURN_IF_ERROR(sync(t->kernel_bytes > 0 ? "a block copy" : "copy-engine copies"));
    if (ce_stream != stream_.handle())
      REFIT_RETURN_IF_ERROR(synchronize_stream(ce_stream, timeout_, "copy-engine copies"));
    return Status::Ok();
  }

  // The cast kernel on the side stream, the quantize kernel on the main one, then both waited
  // for. Copy-engine stretches (REFIT_COPY_ENGINE) keep the plain path.
  Status copy_and_quantize(const std::vector<CopyRun>& cast, DType cast_from, DType cast_to,
                           const std::vector<QuantRun>& quant, DType quant_from) override {
    REFIT_RETURN_IF_ERROR(on_device());
    auto one_then_other = [&] {
      return DataPlane::copy_and_quantize(cast, cast_from, cast_to, quant, quant_from);
    };
    if (cast.empty() || quant.empty()) return one_then_other();
    REFIT_ASSIGN_OR_RETURN(CopyTable * t, copy_table(cast, cast_from, cast_to, nullptr));
    if (!t->engine_copies.empty()) return one_then_other();
    REFIT_ASSIGN_OR_RETURN(const DeviceQuantTable* q, quant_table(quant, quant_from));
    if (side_stream_.handle() == nullptr) {
      REFIT_ASSIGN_OR_RETURN(side_stream_, DeviceStream::create(device_));
    }
    REFIT_RETURN_IF_ERROR(
        launch_copy(*t, cast_from, cast_to, nullptr, side_stream_.handle()).status());
    Status launched = launch_fp8_quantize(*q, quant_from, stream_.handle());
    // Both streams are waited for, whatever failed: nothing may still write after this returns.
    Status quantized = sync("an fp8 quantize");
    Status cast_done =
        synchronize_stream(side_stream_.handle(), timeout_, "a block copy beside an fp8 quantize");
    REFIT_RETURN_IF_ERROR(launched);
    REFIT_RETURN_IF_ERROR(quantized);
    REFIT_RETURN_IF_ERROR(cast_done);
    for (const QuantRun& r : quant) kernel_bytes_ += r.run.block.numel();
    return Status::Ok();
  }

  Status block_amax(const std::vector<QuantRun>& runs, DType sdt) override {
    REFIT_RETURN_IF_ERROR(on_device());
    if (runs.empty()) return Status::Ok();
    REFIT_ASSIGN_OR_RETURN(const DeviceQuantTable* t, quant_table(runs, sdt));
    REFIT_RETURN_IF_ERROR(launch_fp8_amax(*t, sdt, stream_.handle()));
    return sync("an fp8 amax");
  }

  Status quantize(const std::vector<QuantRun>& runs, DType sdt) override {
    REFIT_RETURN_IF_ERROR(on_device());
    if (runs.empty()) return Status::Ok();
    REFIT_ASSIGN_OR_RETURN(const DeviceQuantTable* t, quant_table(runs, sdt));
    REFIT_RETURN_IF_ERROR(launch_fp8_quantize(*t, sdt, stream_.handle()));
    REFIT_RETURN_IF_ERROR(sync("an fp8 quantize"));
    for (const QuantRun& q : runs) kernel_bytes_ += q.run.block.numel();
    return Status::Ok();
  }

  Result<std::uint64_t> checksum(const std::vector<CopyRun>& runs, DType sdt, DType as) override {
    REFIT_RETURN_IF_ERROR(on_device());
    if (runs.empty()) return std::uint64_t{0};
    REFIT_ASSIGN_OR_RETURN(SumTable * t, sum_table(runs, sdt));
    return block_checksum(t->table, t->src, sdt, as, stream_.handle(), timeout_);
  }

  Result<DeltaResult> delta_encode(const std::vector<DeltaRoute>& routes, std::byte* kept,
                                   std::byte* out, std::size_t capacity, std::uint64_t base_digest,
                                   const DeltaOptions& options) override {
    REFIT_RETURN_IF_ERROR(check_delta_pointers(routes, options, true, false));
    REFIT_ASSIGN_OR_RETURN(DeviceDelta * d, device_delta(routes, options));
    REFIT_ASSIGN_OR_RETURN(DeltaResult r, d->encode(kept, out, capacity, base_digest,
                                                    options.dense_ratio, stream_.handle(),
                                                    timeout_, delta_scratch_));
    r.elements = delta_elements(routes);
    return r;
  }
  Result<DeltaResult> delta_capture(const std::vector<DeltaRoute>& routes, std::byte* kept,
                                    const DeltaOptions& options) override {
    REFIT_RETURN_IF_ERROR(check_delta_pointers(routes, options, true, false));
    REFIT_ASSIGN_OR_RETURN(DeviceDelta * d, device_delta(routes, options));
    REFIT_ASSIGN_OR_RETURN(DeltaResult r, d->capture(kept, stream_.handle(), timeout_));
    r.elements = delta_elements(routes);
    return r;
  }
  Result<DeltaResult> delta_patch(const std::vector<DeltaRoute>& routes, std::byte* kept,
                                  const DeltaOptions& options) override {
    REFIT_RETURN_IF_ERROR(check_delta_pointers(routes, options, true, true));
    REFIT_ASSIGN_OR_RETURN(DeviceDelta * d, device_delta(routes, options));
    REFIT_ASSIGN_OR_RETURN(DeltaResult r, d->patch(kept, stream_.handle(), timeout_));
    r.elements = delta_elements(routes);
    return r;
  }
  Status delta_replay(const std::vector<DeltaRoute>&, const DeltaLog&,
                      const DeltaOptions&) override {
    return Status::Unsupported(
        "delta: the CUDA plane does not log its applies, so it cannot replay one");
  }
  // The header and directory are read to the host and checked there (read_stream_directory);
  // everything else runs on the GPU.
  Result<DeltaResult> delta_apply(const std::vector<DeltaRoute>& routes, const std::byte* stream,
                                  std::size_t bytes, std::uint64_t base_digest,
                                  const DeltaOptions& options) override {
    if (options.log != nullptr) *options.log = DeltaLog{};  // the kernels do not log
    REFIT_RETURN_IF_ERROR(check_delta_pointers(routes, options, false, true));
    REFIT_ASSIGN_OR_RETURN(DeviceDelta * d, device_delta(routes, options));
    if (reinterpret_cast<std::uintptr_t>(stream) % 8 != 0)
      return Status::InvalidArgument("delta: a stream must start at an 8-byte boundary");
    const std::size_t head = std::min<std::size_t>(
        bytes, delta_format::kHeaderBytes + sizeof(delta_format::RouteEntry) * routes.size());
    std::vector<std::byte> host(head);
    REFIT_RETURN_IF_ERROR(sync("before reading a delta stream's directory"));
    REFIT_RETURN_IF_ERROR(copy_to_host(host.data(), stream, head));
    REFIT_ASSIGN_OR_RETURN(std::vector<delta_format::RouteEntry> entries,
                           read_stream_directory(routes, host.data(), bytes, base_digest, options));
    DeviceDelta::ApplyFailure failure;
    auto r = d->apply(entries, stream, bytes, stream_.handle(), timeout_, &failure);
    if (r.ok()) {
      r->elements = delta_elements(routes);
      return r;
    }
    if (failure.error == DeviceDelta::ApplyError::kNone) return r.status();
    const std::string route = describe_route(options, routes[failure.route].tag);
    switch (failure.error) {
      case DeviceDelta::ApplyError::kPayloadChecksum:
        return Status::Corruption(fmt::format(
            "delta stream: {}: its payload ({} bytes) fails its checksum: the stream was "
            "corrupted in flight; nothing was applied",
            route, entries[failure.route].bytes));
      case DeviceDelta::ApplyError::kChunkTable:
        return Status::Corruption(fmt::format(
            "delta stream: {}: its chunk table is malformed; nothing was applied", route));
      case DeviceDelta::ApplyError::kCodes:
        return Status::Corruption(fmt::format(
            "delta stream: {}: malformed position or exception codes (the route was applied in "
            "part)",
            route));
      case DeviceDelta::ApplyError::kResult:
        return Status::Corruption(fmt::format(
            "delta: {}: the applied changes differ from what the trainer computed ({} elements, "
            "digest +{:016x}): this engine rank's base differs from the trainer's kept copy at an "
            "element that changed",
            route, entries[failure.route].changed, entries[failure.route].digest_delta));
      case DeviceDelta::ApplyError::kNone:
        break;
    }
    return r.status();
  }

  void set_seed(std::uint64_t seed) { model_seed_ = seed; }
  void set_copy_engine(env::CopyEngineUse use) { copy_engine_ = use; }

 private:
  // The CUDA device is per thread: the plane is driven by whichever thread runs a stage (the
  // engine's apply thread, a transport thread), so each entry point makes its device current.
  Status on_device() const { return set_device(device_); }

  Status sync(const char* what) { return synchronize_stream(stream_.handle(), timeout_, what); }

  WeightsParams weights_params(const RankModel& model, int step, DType via) const {
    return WeightsParams{
        .seed = model_seed_, .step = step, .via = via, .adam_lr = model.weights->update().adam_lr()};
  }

  // A run list's identity and content (lists are built once and reused by every refit).
  using RunsKey = std::tuple<const void*, std::size_t, std::uint64_t>;
  static RunsKey runs_key(const std::vector<CopyRun>& runs, const std::byte* src_base) {
    std::uint64_t h = 1469598103934665603ull;
    auto mix = [&](std::uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    for (const CopyRun& r : runs) {
      mix(reinterpret_cast<std::uintptr_t>(src_base != nullptr ? nullptr : r.src));
      mix(reinterpret_cast<std::uintptr_t>(r.dst));
      mix(static_cast<std::uint64_t>(r.block.src_offset));
      mix(static_cast<std::uint64_t>(r.block.src_stride));
      mix(static_cast<std::uint64_t>(r.block.dst_offset));
      mix(static_cast<std::uint64_t>(r.block.dst_stride));
      mix(static_cast<std::uint64_t>(r.block.rows));
      mix(static_cast<std::uint64_t>(r.block.cols));
    }
    return {static_cast<const void*>(runs.data()), runs.size(), h};
  }

  // An FP8 run list uploaded once, cached like copy tables (by the list's identity and content).
  Result<const DeviceQuantTable*> quant_table(const std::vector<QuantRun>& runs, DType sdt) {
    std::vector<CopyRun> plain;
    std::uint64_t grids = 1469598103934665603ull;
    for (const QuantRun& q : runs) {
      plain.push_back(q.run);
      for (std::int64_t v : {reinterpret_cast<std::int64_t>(q.grid), q.hf_row, q.hf_col,
                             reinterpret_cast<std::int64_t>(q.from_grid),
                             reinterpret_cast<std::int64_t>(q.bad), std::int64_t{q.tag}})
        grids = (grids ^ static_cast<std::uint64_t>(v)) * 1099511628211ull;
    }
    RunsKey key = runs_key(plain, nullptr);
    key = {static_cast<const void*>(runs.data()), runs.size(),
           std::get<2>(key) ^ grids ^ (static_cast<std::uint64_t>(sdt) << 56)};
    auto it = quant_.find(key);
    if (it != quant_.end()) return &it->second;
    if (quant_.size() >= kMaxCachedTables) quant_.clear();
    std::vector<DeviceQuantRun> device_runs;
    for (const QuantRun& q : runs)
      device_runs.push_back(DeviceQuantRun{.src = q.run.src,
                                           .dst = q.run.dst,
                                           .grid = q.grid,
                                           .src_offset = q.run.block.src_offset,
                                           .src_stride = q.run.block.src_stride,
                                           .dst_offset = q.run.block.dst_offset,
                                           .dst_stride = q.run.block.dst_stride,
                                           .rows = q.run.block.rows,
                                           .cols = q.run.block.cols,
                                           .hf_row = q.hf_row,
                                           .hf_col = q.hf_col,
                                           .block_rows = q.block_rows,
                                           .block_cols = q.block_cols,
                                           .scale_cols = q.scale_cols,
                                           .from_grid = q.from_grid,
                                           .bad = reinterpret_cast<unsigned long long*>(q.bad),
                                           .tag = q.tag});
    REFIT_ASSIGN_OR_RETURN(DeviceQuantTable t, DeviceQuantTable::upload(device_runs, sdt, device_));
    return &quant_.emplace(key, std::move(t)).first->second;
  }

  // A checksum list as one uploaded table of offsets from its lowest source address (the keys
  // stay as they are), cached like copy tables.
  struct SumTable {
    DeviceBlockTable table;
    const std::byte* src = nullptr;
  };
  Result<SumTable*> sum_table(const std::vector<CopyRun>& runs, DType sdt) {
    const RunsKey key = runs_key(runs, nullptr);
    auto it = sums_.find(key);
    if (it != sums_.end()) return &it->second;
    if (sums_.size() >= kMaxCachedTables) sums_.clear();
    const std::int64_t ss = static_cast<std::int64_t>(dtype_size(sdt));
    SumTable t;
    t.src = runs[0].src;
    for (const CopyRun& r : runs) t.src = std::min(t.src, r.src);
    std::vector<std::vector<Block2D>> groups(1);
    for (const CopyRun& r : runs) {
      Block2D b = r.block;
      b.src_offset += (r.src - t.src) / ss;
      groups[0].push_back(b);
    }
    REFIT_ASSIGN_OR_RETURN(t.table, DeviceBlockTable::upload(groups, device_));
    return &sums_.emplace(key, std::move(t)).first->second;
  }

  // Runs with absolute pointers become one uploaded table of offsets from the lowest source and
  // destination address; cached by the runs' identity and content (run lists are built once).
  struct CopyTable {
    DeviceBlockTable table;
    const std::byte* src = nullptr;
    std::byte* dst = nullptr;
    // Set when the copy engines serve the list, or its first runs (REFIT_COPY_ENGINE, no cast,
    // every run contiguous, long stretches): (dst, src, bytes) per stretch of adjacent runs.
    std::vector<std::tuple<std::byte*, const std::byte*, std::size_t>> engine_copies;
    std::int64_t engine_bytes = 0;  // what engine_copies move
    std::int64_t kernel_bytes = 0;  // what the kernel's table moves (0: no launch)
  };
  // Launches table `t`: its copy-engine stretches (one call each; on the side stream when the
  // kernel runs too) and its kernel on `stream`. Returns the copy engines' stream.
  Result<void*> launch_copy(const CopyTable& t, DType sdt, DType ddt, const std::byte* src_base,
                            void* stream) {
    void* ce_stream = t.kernel_bytes > 0 ? side_stream_.handle() : stream;
    for (const auto& [dst, src, bytes] : t.engine_copies)
      REFIT_RETURN_IF_ERROR(copy_device_async(dst, src, bytes, ce_stream));
    if (t.kernel_bytes > 0)
      REFIT_RETURN_IF_ERROR(launch_block_copy(t.table, 0, src_base != nullptr ? src_base : t.src,
                                              sdt, t.dst, ddt, stream));
    kernel_bytes_ += t.kernel_bytes;
    copy_engine_bytes_ += t.engine_bytes;
    return ce_stream;
  }

  Result<CopyTable*> copy_table(const std::vector<CopyRun>& runs, DType sdt, DType ddt,
                                const std::byte* src_base) {
    const RunsKey key = runs_key(runs, src_base);
    auto it = copies_.find(key);
    if (it != copies_.end()) return &it->second;
    // Run lists are built once per bucket; a cache this large means lists are being rebuilt
    // (re-registration): drop the stale tables rather than grow without bound.
    if (copies_.size() >= kMaxCachedTables) copies_.clear();
    const std::int64_t ss = static_cast<std::int64_t>(dtype_size(sdt));
    const std::int64_t ds = static_cast<std::int64_t>(dtype_size(ddt));
    CopyTable t;
    if (src_base == nullptr) {
      t.src = runs[0].src;
      for (const CopyRun& r : runs) t.src = std::min(t.src, r.src);
    }
    t.dst = runs[0].dst;
    for (const CopyRun& r : runs) t.dst = std::min(t.dst, r.dst);
    REFIT_ASSIGN_OR_RETURN(const std::size_t first_kernel_run,
                           split_for_copy_engines(runs, sdt, ddt, src_base, t));
    std::vector<std::vector<Block2D>> groups(1);
    for (std::size_t i = first_kernel_run; i < runs.size(); ++i) {
      const CopyRun& r = runs[i];
      Block2D b = r.block;
      if (src_base == nullptr) b.src_offset += (r.src - t.src) / ss;
      b.dst_offset += (r.dst - t.dst) / ds;
      groups[0].push_back(b);
      t.kernel_bytes += b.numel() * ds;
    }
    if (t.kernel_bytes > 0) {
      REFIT_ASSIGN_OR_RETURN(t.table, DeviceBlockTable::upload(groups, device_));
    }
    return &copies_.emplace(key, std::move(t)).first->second;
  }

  // Which runs the copy engines take (REFIT_COPY_ENGINE): fills t.engine_copies / engine_bytes
  // and returns the index of the first run the kernel takes (runs.size(): none).
  //  - 1: every run, when the list is eligible (engine_stretches);
  //  - auto: when every destination is another GPU's memory, the first runs up to
  //    kCopyEngineShare of the bytes. The copy engines and the kernel then write over the link at
  //    once: on 2 x H200 the copy engines alone reach 395 GB/s into freshly idle GPUs but drop to
  //    about 330 GB/s once the sending GPU has written a GiB or more since its last peer copy
  //    (which a training step always has), the kernel holds 360 GB/s, and the two together
  //    reach 370 GB/s (docs/transfer-plan.md);
  //  - otherwise none.
  Result<std::size_t> split_for_copy_engines(const std::vector<CopyRun>& runs, DType sdt, DType ddt,
                                             const std::byte* src_base, CopyTable& t) {
    if (copy_engine_ == env::CopyEngineUse::kKernel || sdt != ddt || src_base != nullptr)
      return std::size_t{0};
    const auto esize = static_cast<std::int64_t>(dtype_size(sdt));
    std::size_t take = runs.size();
    if (copy_engine_ == env::CopyEngineUse::kAuto) {
      std::int64_t total = 0;
      for (const CopyRun& r : runs) {
        REFIT_ASSIGN_OR_RETURN(const bool remote,
                               on_another_gpu(r.dst + r.block.dst_offset * esize));
        if (!remote) return std::size_t{0};
        total += r.block.numel();
      }
      std::int64_t acc = 0;
      take = 0;
      while (take < runs.size() && acc + runs[take].block.numel() <= kCopyEngineShare * total)
        acc += runs[take++].block.numel();
      if (take == 0) return std::size_t{0};
    }
    const std::vector<CopyRun> head(runs.begin(), runs.begin() + static_cast<std::ptrdiff_t>(take));
    t.engine_copies = engine_stretches(head, esize);
    if (t.engine_copies.empty()) return std::size_t{0};
    for (const auto& c : t.engine_copies)
      t.engine_bytes += static_cast<std::int64_t>(std::get<2>(c));
    if (take < runs.size() && side_stream_.handle() == nullptr) {
      REFIT_ASSIGN_OR_RETURN(side_stream_, DeviceStream::create(device_));
    }
    log::debug(
        "copy list of {} runs: {} stretches ({} bytes) on the copy engines, {} runs by the "
        "kernel",
        runs.size(), t.engine_copies.size(), t.engine_bytes, runs.size() - take);
    return take;
  }

  // Adjacent contiguous runs merged into stretches for the copy engines; empty when a run is
  // strided or the stretches average under 4 MiB (then the kernel is faster).
  static std::vector<std::tuple<std::byte*, const std::byte*, std::size_t>> engine_stretches(
      const std::vector<CopyRun>& runs, std::int64_t esize) {
    std::vector<std::tuple<std::byte*, const std::byte*, std::size_t>> out;
    std::size_t total = 0;
    for (const CopyRun& r : runs) {
      const Block2D& b = r.block;
      if (b.rows > 1 && (b.src_stride != b.cols || b.dst_stride != b.cols)) return {};
      const auto bytes = static_cast<std::size_t>(b.numel() * esize);
      const std::byte* src = r.src + b.src_offset * esize;
      std::byte* dst = r.dst + b.dst_offset * esize;
      total += bytes;
      if (!out.empty()) {
        auto& [pd, ps, pb] = out.back();
        if (pd + pb == dst && ps + pb == src) {
          pb += bytes;
          continue;
        }
      }
      out.emplace_back(dst, src, bytes);
    }
    if (out.empty() || total / out.size() < (std::size_t{4} << 20)) return {};
    return out;
  }

  // Whether `p` is another GPU's memory: mapped from another process through CUDA IPC, or
  // allocated by this one on another GPU.
  Result<bool> on_another_gpu(const std::byte* p) const {
    if (remote_->contains(p)) return true;
    REFIT_ASSIGN_OR_RETURN(const int dev, device_of(p));
    return dev >= 0 && dev != device_;
  }

  // The weights table of a set of targets (generate / verify), cached by their identity.
  struct Table {
    DeviceBlockTable table;
    std::byte* base = nullptr;
  };
  Result<Table*> weights_table(const RankModel& model, const std::vector<PieceTarget>& targets,
                               std::size_t esize) {
    std::uint64_t h = 1469598103934665603ull;
    for (const PieceTarget& t : targets)
      h = (h ^ reinterpret_cast<std::uintptr_t>(t.data)) * 1099511628211ull;
    const auto key = std::make_pair(targets.size(), h);
    auto it = tables_.find(key);
    if (it != tables_.end()) return &it->second;
    if (tables_.size() >= kMaxCachedTables) tables_.clear();
    Table tab;
    tab.base = targets.empty() ? nullptr : targets[0].data;
    for (const PieceTarget& t : targets) tab.base = std::min(tab.base, t.data);
    std::vector<std::vector<Block2D>> groups(1);
    std::vector<std::vector<std::uint32_t>> tags(1);
    for (const PieceTarget& t : targets)
      append_piece_runs(model.spec, *t.pieces, t.shape,
                        (t.data - tab.base) / static_cast<std::int64_t>(esize), nullptr, groups[0],
                        tags[0]);
    REFIT_ASSIGN_OR_RETURN(tab.table, DeviceBlockTable::upload(groups, device_, &tags));
    return &tables_.emplace(key, std::move(tab)).first->second;
  }

  static std::int64_t delta_elements(const std::vector<DeltaRoute>& routes) {
    std::int64_t n = 0;
    for (const DeltaRoute& r : routes) n += r.elements();
    return n;
  }

  // A delta list uploaded once, cached by the list's identity and content and the chunk size.
  Result<DeviceDelta*> device_delta(const std::vector<DeltaRoute>& routes,
                                    const DeltaOptions& options) {
    REFIT_RETURN_IF_ERROR(on_device());
    std::uint64_t h = 1469598103934665603ull;
    auto mix = [&](std::uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    for (const DeltaRoute& r : routes) {
      for (std::int64_t v : {r.block.src_offset, r.block.src_stride, r.block.dst_offset,
                             r.block.dst_stride, r.block.rows, r.block.cols, r.kept, r.key_stride})
        mix(static_cast<std::uint64_t>(v));
      mix(reinterpret_cast<std::uintptr_t>(r.src));
      mix(reinterpret_cast<std::uintptr_t>(r.dst));
      mix(r.key);
      mix(r.tag);
      mix(static_cast<std::uint64_t>(r.src_dtype) << 8 | static_cast<std::uint64_t>(r.wire_dtype));
    }
    mix(static_cast<std::uint64_t>(options.chunk_log2));
    const RunsKey key{static_cast<const void*>(routes.data()), routes.size(), h};
    auto it = deltas_.find(key);
    if (it != deltas_.end()) return it->second.get();
    REFIT_RETURN_IF_ERROR(check_delta_routes(routes, options));
    // A rank holds a list per pair and round it sends or receives, each a few bytes per chunk
    // (the encode's scratch is the plane's, shared); as for the other tables, a cache this large
    // means lists are being rebuilt (re-registration): drop the stale ones.
    if (deltas_.size() >= kMaxCachedTables) deltas_.clear();
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<DeviceDelta> d,
                           DeviceDelta::create(routes, options.chunk_log2, device_));
    return deltas_.emplace(key, std::move(d)).first->second.get();
  }

  static constexpr std::size_t kMaxCachedTables = 4096;
  // REFIT_COPY_ENGINE=auto: the copy engines' share of the bytes (0.45-0.6 measured equal).
  static constexpr double kCopyEngineShare = 0.5;
  int device_;
  DeviceStream stream_;
  DeviceStream side_stream_;  // the copy engines' stream when the kernel runs at once
  std::shared_ptr<RemoteRanges> remote_ = std::make_shared<RemoteRanges>();
  std::chrono::milliseconds timeout_;
  std::uint64_t model_seed_ = 0;
  env::CopyEngineUse copy_engine_ = env::CopyEngineUse::kAuto;
  std::map<RunsKey, CopyTable> copies_;
  std::map<RunsKey, SumTable> sums_;
  std::map<RunsKey, DeviceQuantTable> quant_;
  std::map<std::pair<std::size_t, std::uint64_t>, Table> tables_;
  std::map<RunsKey, std::unique_ptr<DeviceDelta>> deltas_;
  DeviceDeltaScratch delta_scratch_;  // every list's encode runs on stream_, one after another
};

}  // namespace

Result<std::unique_ptr<DataPlane>> make_cuda_data_plane(const Config& config, int device,
                                                        const PlaneSettings& settings) {
  if (!cuda_built())
    return Status::Unsupported(
        "device: cuda — this build of refit has no CUDA (configure with "
        "/usr/local/cuda present)");
  const int count = device_count();
  if (count == 0)
    return Status::Unsupported("device: cuda — no CUDA device is visible to this process");
  device %= count;
  REFIT_RETURN_IF_ERROR(set_device(device));
  REFIT_ASSIGN_OR_RETURN(DeviceStream stream, DeviceStream::create(device));
  auto plane = std::make_unique<CudaDataPlane>(
      device, std::move(stream),
      std::chrono::milliseconds(static_cast<long long>(config.refit.timeout_s * 1000)));
  plane->set_seed(config.seed);
  plane->set_copy_engine(static_cast<env::CopyEngineUse>(settings.copy_engine));
  return std::unique_ptr<DataPlane>(std::move(plane));
}

}  // namespace refit
