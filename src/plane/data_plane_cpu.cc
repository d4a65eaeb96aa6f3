// The CPU data plane: host memory; copies split over a persistent worker pool by elements.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "common/checksum.h"
#include "common/convert.h"
#include "common/env.h"
#include "common/host_buffer.h"
#include "common/quantize.h"
#include "delta/delta_cpu.h"
#include "device/device.h"
#include "plane/data_plane.h"
#include "plane/shared_memory.h"
#include "weights/materialize.h"
#include "weights/setup.h"

namespace refit {
namespace {

class HostPlaneBuffer final : public PlaneBuffer {
 public:
  explicit HostPlaneBuffer(std::size_t bytes) : buf_(bytes) {}
  std::byte* data() override { return buf_.data(); }
  std::size_t size() const override { return buf_.size(); }

 private:
  HostBuffer buf_;
};

class SharedPlaneBuffer final : public PlaneBuffer {
 public:
  explicit SharedPlaneBuffer(std::unique_ptr<SharedMemory> shm) : shm_(std::move(shm)) {}
  std::byte* data() override { return shm_->data(); }
  std::size_t size() const override { return shm_->size(); }
  void release_name() override { shm_->unlink(); }

 private:
  std::unique_ptr<SharedMemory> shm_;
};

// Runs `task(worker)` on `n` workers (the caller is worker 0) and waits for all.
class WorkerPool {
 public:
  explicit WorkerPool(int n) {
    for (int i = 1; i < n; ++i) threads_.emplace_back([this, i] { loop(i); });
  }
  ~WorkerPool() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int size() const { return static_cast<int>(threads_.size()) + 1; }

  template <typename F>
  void run(F&& task) {
    {
      std::lock_guard lock(mu_);
      task_ = task;
      pending_ = static_cast<int>(threads_.size());
      ++generation_;
    }
    cv_.notify_all();
    task(0);
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [&] { return pending_ == 0; });
  }

 private:
  void loop(int id) {
    std::uint64_t seen = 0;
    while (true) {
      std::function<void(int)> task;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        task = task_;
      }
      task(id);
      std::lock_guard lock(mu_);
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::function<void(int)> task_;
  std::uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

// The plane and its diagnostics (PlaneDiagnostics: the harness's weight generation and checks,
// bandwidth measurements, fault injection), which need the same workers and memory.
class CpuDataPlane final : public DataPlane, public PlaneDiagnostics {
 public:
  PlaneDiagnostics* diagnostics() override { return this; }
  Status corrupt_byte(std::byte* at) override {
    std::byte b{};
    REFIT_RETURN_IF_ERROR(read(&b, at, 1));
    b ^= std::byte{0x5a};
    return write(at, &b, 1);
  }
  explicit CpuDataPlane(int threads) : pool_(threads) {}
  Device device() const override { return Device::kCpu; }
  int ordinal() const override { return 0; }

  Result<std::unique_ptr<PlaneBuffer>> allocate(std::size_t bytes) override {
    try {
      return std::unique_ptr<PlaneBuffer>(new HostPlaneBuffer(bytes));
    } catch (const std::bad_alloc&) {
      return Status::IOError(fmt::format("cannot allocate {} bytes of host memory", bytes));
    }
  }

  Result<std::unique_ptr<PlaneBuffer>> allocate_exported(std::size_t bytes, const std::string& name,
                                                         std::string* handle) override {
    REFIT_ASSIGN_OR_RETURN(auto shm, SharedMemory::create(name, bytes));
    *handle = name;
    return std::unique_ptr<PlaneBuffer>(new SharedPlaneBuffer(std::move(shm)));
  }

  bool can_export_existing() const override { return false; }
  Result<std::string> export_existing(std::byte*, std::size_t) override {
    return Status::Unsupported(
        "host memory the caller allocated cannot be mapped by another process; allocate it with "
        "allocate_params()");
  }

  Result<std::unique_ptr<PlaneBuffer>> open_exported(const std::string& handle,
                                                     std::size_t bytes) override {
    REFIT_ASSIGN_OR_RETURN(auto shm, SharedMemory::open(handle, bytes));
    return std::unique_ptr<PlaneBuffer>(new SharedPlaneBuffer(std::move(shm)));
  }

  Result<double> measure_copy_bandwidth() override {
    constexpr std::size_t kBytes = 256u << 20;
    HostBuffer a(kBytes), b(kBytes);
    std::vector<double> secs;
    for (int i = 0; i < 3; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      std::memcpy(b.data(), a.data(), kBytes);
      secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(secs.begin(), secs.end());
    return 2.0 * kBytes / secs[1];
  }

  Result<double> measure_peer_bandwidth(int) override {
    REFIT_ASSIGN_OR_RETURN(double rw, measure_copy_bandwidth());
    return rw / 2;
  }

  Status read(void* host_dst, const std::byte* src, std::size_t bytes) override {
    std::memcpy(host_dst, src, bytes);
    return Status::Ok();
  }
  Status write(std::byte* dst, const void* host_src, std::size_t bytes) override {
    std::memcpy(dst, host_src, bytes);
    return Status::Ok();
  }

  Status fill_weights(const RankModel& model, const std::vector<PieceTarget>& targets, int step,
                      DType via, DType out) override {
    for (const PieceTarget& t : targets)
      materialize_pieces(model.spec, *t.pieces, t.shape, *model.weights, step, via, out, t.data);
    return Status::Ok();
  }

  Result<std::optional<std::pair<std::size_t, std::int64_t>>> find_mismatch(
      const RankModel& model, const std::vector<PieceTarget>& targets, int step, DType via,
      DType dtype) override {
    std::vector<std::byte> expected;
    for (std::size_t i = 0; i < targets.size(); ++i)
      if (auto k =
              first_host_mismatch(model, targets[i], step, via, dtype, targets[i].data, expected))
        return std::optional<std::pair<std::size_t, std::int64_t>>(std::make_pair(i, *k));
    return std::optional<std::pair<std::size_t, std::int64_t>>();
  }

  Status copy(const std::vector<CopyRun>& runs, DType sdt, DType ddt,
              const std::byte* src_base) override {
    kernel_bytes_ += total_elements(runs) * static_cast<std::int64_t>(dtype_size(ddt));
    for_rows(runs, [&](const CopyRun& r, std::int64_t first, std::int64_t last, int) {
      run_rows(r, src_base, first, last, sdt, ddt);
    });
    return Status::Ok();
  }

  // One thread: blocks of different runs may be the same block, and amax grids are small.
  Status block_amax(const std::vector<QuantRun>& runs, DType sdt) override {
    std::vector<float> row;
    for (const QuantRun& q : runs) {
      const Block2D& b = q.run.block;
      auto* grid = reinterpret_cast<std::uint32_t*>(q.grid);
      row.resize(static_cast<std::size_t>(b.cols));
      for (std::int64_t r = 0; r < b.rows; ++r) {
        convert_block(q.run.src, sdt, b.src_offset + r * b.src_stride, 0, row.data(),
                      DType::kFloat32, 0, 0, 1, b.cols);
        for (std::int64_t c = 0; c < b.cols; ++c) {
          std::uint32_t& a = grid[q.block_index(r, c)];
          a = std::max(a, abs_bits(row[static_cast<std::size_t>(c)]));
        }
      }
    }
    return Status::Ok();
  }

  Status quantize(const std::vector<QuantRun>& runs, DType sdt) override {
    for (const QuantRun& q : runs)
      if (q.from_grid != nullptr) scales_in_pass(q, sdt);
    std::vector<CopyRun> plain;
    plain.reserve(runs.size());
    for (const QuantRun& q : runs) plain.push_back(q.run);
    kernel_bytes_ += total_elements(plain);
    for_rows(plain, [&](const CopyRun& r, std::int64_t first, std::int64_t last, int) {
      const QuantRun& q = runs[static_cast<std::size_t>(&r - plain.data())];
      const Block2D& b = r.block;
      const auto* scales = reinterpret_cast<const float*>(q.grid);
      std::vector<float> row(static_cast<std::size_t>(b.cols));
      auto* dst = reinterpret_cast<std::uint8_t*>(r.dst);
      for (std::int64_t i = first; i < last; ++i) {
        convert_block(r.src, sdt, b.src_offset + i * b.src_stride, 0, row.data(), DType::kFloat32,
                      0, 0, 1, b.cols);
        std::uint8_t* out = dst + b.dst_offset + i * b.dst_stride;
        for (std::int64_t c = 0; c < b.cols; ++c)
          out[c] = quantize_fp8(row[static_cast<std::size_t>(c)], scales[q.block_index(i, c)]);
      }
    });
    return Status::Ok();
  }

  // The scales quantize() computes itself: blocks whole in `q` that from_grid leaves to it.
  static void scales_in_pass(const QuantRun& q, DType sdt) {
    const Block2D& b = q.run.block;
    if (b.rows <= 0 || b.cols <= 0) return;
    auto* grid = reinterpret_cast<float*>(q.grid);
    std::vector<float> row;
    for (std::int64_t kr = q.hf_row / q.block_rows; kr <= (q.hf_row + b.rows - 1) / q.block_rows;
         ++kr)
      for (std::int64_t kc = q.hf_col / q.block_cols; kc <= (q.hf_col + b.cols - 1) / q.block_cols;
           ++kc) {
        const std::int64_t k = kr * q.scale_cols + kc;
        if (q.from_grid[k] != 0) continue;
        // The block's rows and columns inside the run (all of them: from_grid says it is whole).
        const std::int64_t r0 = std::max(kr * q.block_rows - q.hf_row, std::int64_t{0});
        const std::int64_t r1 = std::min((kr + 1) * q.block_rows - q.hf_row, b.rows);
        const std::int64_t c0 = std::max(kc * q.block_cols - q.hf_col, std::int64_t{0});
        const std::int64_t c1 = std::min((kc + 1) * q.block_cols - q.hf_col, b.cols);
        std::uint32_t amax = 0;
        row.resize(static_cast<std::size_t>(c1 - c0));
        for (std::int64_t r = r0; r < r1; ++r) {
          convert_block(q.run.src, sdt, b.src_offset + r * b.src_stride + c0, 0, row.data(),
                        DType::kFloat32, 0, 0, 1, c1 - c0);
          for (float x : row) amax = std::max(amax, abs_bits(x));
        }
        grid[k] = fp8_scale_from_amax(from_bits(amax));
        if (!std::isnan(grid[k]) || q.bad == nullptr) continue;
        auto* bad = reinterpret_cast<std::uint64_t*>(q.bad);
        bad[0] += 1;
        bad[1] = std::min(bad[1], (std::uint64_t{q.tag} << 32) | static_cast<std::uint64_t>(k));
      }
  }

  Result<DeltaResult> delta_encode(const std::vector<DeltaRoute>& routes, std::byte* kept,
                                   std::byte* out, std::size_t capacity, std::uint64_t base_digest,
                                   const DeltaOptions& options) override {
    return delta_encode_host(routes, kept, out, capacity, base_digest, options, workers());
  }
  Result<DeltaResult> delta_capture(const std::vector<DeltaRoute>& routes, std::byte* kept,
                                    const DeltaOptions& options) override {
    return delta_capture_host(routes, kept, options, workers());
  }
  Result<DeltaResult> delta_apply(const std::vector<DeltaRoute>& routes, const std::byte* stream,
                                  std::size_t bytes, std::uint64_t base_digest,
                                  const DeltaOptions& options) override {
    return delta_apply_host(routes, stream, bytes, base_digest, options, workers());
  }
  Status delta_replay(const std::vector<DeltaRoute>& routes, const DeltaLog& log,
                      const DeltaOptions& options) override {
    return delta_replay_host(routes, log, options, workers());
  }
  Result<DeltaResult> delta_patch(const std::vector<DeltaRoute>& routes, std::byte* kept,
                                  const DeltaOptions& options) override {
    return delta_patch_host(routes, kept, options, workers());
  }

  Result<std::uint64_t> checksum(const std::vector<CopyRun>& runs, DType sdt, DType as) override {
    // One sum per worker when the pool splits the runs; most calls are a few small runs that
    // this thread sums alone, with no buffer.
    std::uint64_t sum = 0;
    std::vector<std::uint64_t> per_worker;
    if (parallel(runs)) per_worker.assign(static_cast<std::size_t>(pool_.size()), 0);
    for_rows(runs, [&](const CopyRun& r, std::int64_t first, std::int64_t last, int w) {
      (per_worker.empty() ? sum : per_worker[static_cast<std::size_t>(w)]) +=
          checksum_rows(r, first, last, sdt, as);
    });
    for (std::uint64_t s : per_worker) sum += s;
    return sum;
  }

 private:
  static std::int64_t total_elements(const std::vector<CopyRun>& runs) {
    std::int64_t total = 0;
    for (const CopyRun& r : runs) total += r.block.numel();
    return total;
  }

  // The pool as the delta loops take it: equal ranges of items, one per worker.
  HostWorkers workers() {
    HostWorkers w;
    w.count = pool_.size();
    w.run = [this](std::int64_t items,
                   const std::function<void(std::int64_t, std::int64_t, int)>& body) {
      const int n = pool_.size();
      const std::int64_t share = (items + n - 1) / n;
      pool_.run([&](int k) {
        const std::int64_t lo = k * share, hi = std::min(items, lo + share);
        if (lo < hi) body(lo, hi, k);
      });
    };
    return w;
  }

  // Calls fn(run, first row, end row, worker) over every row of every run, split over the pool:
  // worker w takes elements [w*share, (w+1)*share) of the concatenated runs, cut at row
  // boundaries, so every worker handles about the same number of elements. Small lists are not
  // worth waking the workers.
  bool parallel(const std::vector<CopyRun>& runs) const {
    constexpr std::int64_t kParallelMin = 1 << 20;
    return pool_.size() > 1 && total_elements(runs) >= kParallelMin;
  }

  template <class F>
  void for_rows(const std::vector<CopyRun>& runs, F&& fn) {
    if (!parallel(runs)) {
      for (const CopyRun& r : runs) fn(r, 0, r.block.rows, 0);
      return;
    }
    const std::int64_t total = total_elements(runs);
    const int workers = pool_.size();
    const std::int64_t share = (total + workers - 1) / workers;
    pool_.run([&](int w) {
      const std::int64_t lo = w * share, hi = std::min(total, lo + share);
      std::int64_t at = 0;
      for (const CopyRun& r : runs) {
        const std::int64_t n = r.block.numel();
        if (at + n > lo && at < hi && r.block.cols > 0) {
          // Rows of this run whose first element falls in [lo, hi).
          const std::int64_t first =
              std::max<std::int64_t>(0, (lo - at + r.block.cols - 1) / r.block.cols);
          const std::int64_t last =
              std::min(r.block.rows, (hi - at + r.block.cols - 1) / r.block.cols);
          if (first < last) fn(r, first, last, w);
        }
        at += n;
        if (at >= hi) break;
      }
    });
  }

  // Rows [row_begin, row_end) of a checksum run: converted in chunks on the stack, then summed.
  static std::uint64_t checksum_rows(const CopyRun& r, std::int64_t row_begin, std::int64_t row_end,
                                     DType sdt, DType as) {
    switch (dtype_size(as)) {  // once per call, not per element
      case 4:
        return checksum_rows_of<std::uint32_t>(r, row_begin, row_end, sdt, as);
      case 2:
        return checksum_rows_of<std::uint16_t>(r, row_begin, row_end, sdt, as);
      default:
        return checksum_rows_of<std::uint8_t>(r, row_begin, row_end, sdt, as);
    }
  }

  // checksum_rows with the elements' bits read as `Bits` (an unsigned integer of `as`'s width).
  template <typename Bits>
  static std::uint64_t checksum_rows_of(const CopyRun& r, std::int64_t row_begin,
                                        std::int64_t row_end, DType sdt, DType as) {
    constexpr std::int64_t kChunk = 1024;
    alignas(16) std::byte buf[kChunk * 4];
    const Block2D& b = r.block;
    std::uint64_t sum = 0;
    for (std::int64_t row = row_begin; row < row_end; ++row) {
      for (std::int64_t c0 = 0; c0 < b.cols; c0 += kChunk) {
        const std::int64_t n = std::min(kChunk, b.cols - c0);
        convert_block(r.src, sdt, b.src_offset + row * b.src_stride + c0, 0, buf, as, 0, 0, 1, n);
        const auto key0 = static_cast<std::uint64_t>(b.dst_offset + row * b.dst_stride + c0);
        for (std::int64_t i = 0; i < n; ++i) {
          Bits v;
          std::memcpy(&v, buf + i * static_cast<std::int64_t>(sizeof(Bits)), sizeof(Bits));
          sum += checksum_term(key0 + static_cast<std::uint64_t>(i), static_cast<std::uint32_t>(v));
        }
      }
    }
    return sum;
  }

  static void run_rows(const CopyRun& r, const std::byte* src_base, std::int64_t row_begin,
                       std::int64_t row_end, DType sdt, DType ddt) {
    const Block2D& b = r.block;
    convert_block(src_base != nullptr ? src_base : r.src, sdt,
                  b.src_offset + row_begin * b.src_stride, b.src_stride, r.dst, ddt,
                  b.dst_offset + row_begin * b.dst_stride, b.dst_stride, row_end - row_begin,
                  b.cols);
  }

  WorkerPool pool_;
};

}  // namespace

std::optional<std::int64_t> first_host_mismatch(const RankModel& model, const PieceTarget& t,
                                                int step, DType via, DType dtype,
                                                const std::byte* actual,
                                                std::vector<std::byte>& expected) {
  const std::size_t esize = dtype_size(dtype);
  const std::size_t n = static_cast<std::size_t>(matrix_shape(t.shape).numel());
  expected.assign(n * esize, std::byte{0});  // uncovered elements (padding) must be zero
  materialize_pieces(model.spec, *t.pieces, t.shape, *model.weights, step, via, dtype,
                     expected.data());
  if (std::memcmp(expected.data(), actual, n * esize) == 0) return std::nullopt;
  std::size_t k = 0;
  while (std::memcmp(expected.data() + k * esize, actual + k * esize, esize) == 0) ++k;
  return static_cast<std::int64_t>(k);
}

Result<std::uint64_t> DataPlane::delta_digest(const std::vector<DeltaRoute>& routes) {
  std::map<DType, std::vector<CopyRun>> by_dtype;
  for (const DeltaRoute& r : routes) {
    if (r.elements() == 0) continue;
    by_dtype[r.wire_dtype].push_back(
        CopyRun{.src = r.dst,
                .dst = nullptr,
                .block = {.src_offset = r.block.dst_offset,
                          .src_stride = r.block.dst_stride,
                          .dst_offset = static_cast<std::int64_t>(r.key),
                          .dst_stride = r.key_stride,
                          .rows = r.block.rows,
                          .cols = r.block.cols}});
  }
  std::uint64_t sum = 0;
  for (const auto& [dtype, runs] : by_dtype) {
    REFIT_ASSIGN_OR_RETURN(const std::uint64_t s, checksum(runs, dtype, dtype));
    sum += s;
  }
  return sum;
}

Status DataPlane::copy_bytes(std::byte* dst, const std::byte* src, std::size_t bytes) {
  if (bytes == 0) return Status::Ok();
  // One-byte elements of the same dtype: a plain copy on every plane.
  const std::vector<CopyRun> runs = {
      {src,
       dst,
       {0, static_cast<std::int64_t>(bytes), 0, static_cast<std::int64_t>(bytes), 1,
        static_cast<std::int64_t>(bytes)}}};
  return copy(runs, DType::kFloat8E4M3, DType::kFloat8E4M3);
}

Result<std::unique_ptr<DataPlane>> make_cuda_data_plane(const Config& config, int device,
                                                        const PlaneSettings& settings);

Result<PlaneSettings> PlaneSettings::from_environment() {
  PlaneSettings s;
  REFIT_ASSIGN_OR_RETURN(s.cpu_threads, env::cpu_threads());
  REFIT_ASSIGN_OR_RETURN(const env::CopyEngineUse copy_engine, env::copy_engine());
  s.copy_engine = static_cast<int>(copy_engine);
  REFIT_ASSIGN_OR_RETURN(s.device, env::device());
  return s;
}

Result<std::unique_ptr<DataPlane>> make_data_plane(const Config& config, int device,
                                                   const PlaneSettings& settings) {
  switch (config.device) {
    case Device::kCpu: {
      int threads = settings.cpu_threads;
      if (threads <= 0) {
        REFIT_ASSIGN_OR_RETURN(threads, env::parse_cpu_threads(std::nullopt));  // the default
      }
      return std::unique_ptr<DataPlane>(new CpuDataPlane(threads));
    }
    case Device::kCuda:
      return make_cuda_data_plane(config, device, settings);
  }
  return Status::Internal("unknown device");
}

int default_device(const Config& config, bool trainer, int rank, const PlaneSettings& settings) {
  if (settings.device) return *settings.device;
  if (trainer || config.generation.colocated) return rank;
  return config.policy.world_size + rank;
}

int device_ordinal(const Config& config, bool trainer, int rank, const PlaneSettings& settings) {
  if (config.device == Device::kCpu) return 0;
  const int device = default_device(config, trainer, rank, settings);
  const int count = device_count();
  return count > 0 ? device % count : 0;
}

}  // namespace refit
