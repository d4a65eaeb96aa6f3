// zero_copy_bench: refit's colocated GPU paths against the floor, on one GPU, trainer and engine
// as two processes (the engine is forked before either touches CUDA).
//
//   zero_copy_bench --model qwen3-8b --trainer-dtype float32 [--steps 5] [--json FILE]
//   zero_copy_bench --model qwen3-8b --dump-layout FILE      (no GPU: shapes for the baseline)
//
// Shapes: FSDP2 at world size 1 (the trainer's local tensors are the HF tensors, one arena) and
// the engine layout of TP 1 (engine/engine_layout.h: fused qkv_proj / gate_up_proj, MoE
// w13_weight / w2_weight), bf16 engine. Methods, each timed from the trainer's first launch to
// the engine's acknowledgement, median over --steps refits, weights changed before each:
//  - floor: one cudaMemcpy of the engine's bytes (device-to-device bandwidth) and one flat cast
//    pass over every element; the floor of a refit is (source bytes + destination bytes) at the
//    measured copy bandwidth — read the source once, write the destination once;
//  - zero-copy: the engine exports its parameter arena once (CUDA IPC); the trainer runs one
//    block-copy launch that casts its shards straight into the engine's parameters, records an
//    IPC event, and the engine orders itself after that event on the GPU;
//  - bucketed ipc: num_buffers slots of buffer_size_bytes exported once by the trainer; per
//    bucket the trainer packs (cast) into a slot, the engine applies it into its layout; slot
//    hand-over is an IPC event each way plus one control message, no host wait on the GPU.
// Every method is verified bit-exact on the engine after its last refit (the engine arena is
// poisoned with NaNs first). Prints one JSON object per method on stdout.
#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "device/copy_kernels.h"
#include "device/cuda_ipc.h"
#include "device/device.h"
#include "engine/engine_layout.h"
#include "plan/bucket_plan.h"
#include "refit/model_spec.h"

namespace refit {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kTimeout = std::chrono::seconds(120);
constexpr std::uint64_t kSeed = 7;

struct Options {
  std::string model = "qwen3-8b";
  DType trainer_dtype = DType::kFloat32;
  int steps = 5;
  std::int64_t buffer_bytes = std::int64_t{512} << 20;
  int num_buffers = 2;
  std::string json;
  std::string dump_layout;
};

// ---- the static plan, computed before fork from metadata alone ----
struct Plan {
  ModelSpec spec;
  EngineShardLayout layout;
  BucketPlan buckets;
  std::vector<std::int64_t> hf_base;     // trainer arena offset of each HF tensor (elements)
  std::vector<std::int64_t> param_base;  // engine arena offset of each parameter (elements)
  std::int64_t trainer_elems = 0, engine_elems = 0, hf_elems = 0;
  std::vector<Block2D> zero_copy;  // trainer arena -> engine arena
  std::vector<std::uint32_t> zero_copy_tags;
  std::vector<Block2D> generate;  // HF index -> trainer arena
  std::vector<std::uint32_t> generate_tags;
  std::vector<Block2D> expect;  // HF index -> engine arena (verification)
  std::vector<std::uint32_t> expect_tags;
  std::vector<std::vector<Block2D>> pack;   // per bucket: trainer arena -> slot
  std::vector<std::vector<Block2D>> apply;  // per bucket: slot -> engine arena
};

std::int64_t align_up(std::int64_t v, std::int64_t a) { return (v + a - 1) / a * a; }

Result<Plan> make_plan(const Options& o) {
  Plan p;
  REFIT_ASSIGN_OR_RETURN(p.spec, load_model_spec(o.model));
  REFIT_ASSIGN_OR_RETURN(p.layout,
                         engine_layout(p.spec, 1, 0, EngineLayout::kFused, EngineProtocol::kVllm));
  REFIT_ASSIGN_OR_RETURN(p.buckets,
                         make_bucket_plan(p.spec, DType::kBFloat16, o.buffer_bytes, 256));
  const std::int64_t talign = 256 / static_cast<std::int64_t>(dtype_size(o.trainer_dtype));
  for (std::size_t t = 0; t < p.spec.tensors().size(); ++t) {
    const std::int64_t n = p.spec.tensors()[t].numel();
    p.hf_base.push_back(p.trainer_elems);
    p.generate.push_back(Block2D{0, n, p.trainer_elems, n, 1, n});
    p.generate_tags.push_back(static_cast<std::uint32_t>(t));
    p.trainer_elems = align_up(p.trainer_elems + n, talign);
    p.hf_elems += n;
  }
  for (const EngineParam& prm : p.layout.params) {
    p.param_base.push_back(p.engine_elems);
    append_piece_runs(p.spec, prm.pieces, prm.shape, p.engine_elems, &p.hf_base, p.zero_copy,
                      p.zero_copy_tags);
    append_piece_runs(p.spec, prm.pieces, prm.shape, p.engine_elems, nullptr, p.expect,
                      p.expect_tags);
    p.engine_elems = align_up(p.engine_elems + matrix_shape(prm.shape).numel(), 128);
  }
  std::vector<Block2D> blocks;
  for (const Bucket& b : p.buckets.buckets) {
    auto& pack = p.pack.emplace_back();
    auto& apply = p.apply.emplace_back();
    for (const BucketEntry& e : b.entries) {
      const std::int64_t slot_elem = e.offset / 2;
      pack.push_back(Block2D{p.hf_base[e.tensor] + e.elem_begin, e.elem_count, slot_elem,
                             e.elem_count, 1, e.elem_count});
      const std::int64_t hf_cols = matrix_shape(p.spec.tensors()[e.tensor].shape).cols;
      for (const auto& [param, piece] : p.layout.pieces_by_hf[e.tensor]) {
        const EngineParam& prm = p.layout.params[param];
        blocks.clear();
        intersect_piece(prm.pieces[piece], hf_cols, matrix_shape(prm.shape).cols, e.elem_begin,
                        e.elem_begin + e.elem_count, blocks);
        for (Block2D blk : blocks) {
          blk.src_offset += slot_elem;
          blk.dst_offset += p.param_base[param];
          apply.push_back(blk);
        }
      }
    }
  }
  return p;
}

Status dump_layout(const Plan& p, const std::string& path) {
  nlohmann::json j;
  j["model"] = p.spec.source();
  j["total_parameters"] = p.spec.total_parameters();
  for (const TensorSpec& t : p.spec.tensors())
    j["tensors"].push_back({{"name", t.name}, {"shape", t.shape}});
  for (const EngineParam& prm : p.layout.params) {
    nlohmann::json pieces = nlohmann::json::array();
    for (const Piece& pc : prm.pieces)
      pieces.push_back(
          {pc.hf_tensor, pc.src_row, pc.src_col, pc.rows, pc.cols, pc.dst_row, pc.dst_col});
    j["params"].push_back({{"name", prm.name}, {"shape", prm.shape}, {"pieces", pieces}});
  }
  std::ofstream f(path);
  f << j.dump();
  return f ? Status::Ok() : Status::IOError("cannot write " + path);
}

// ---- control messages between the two processes (a socketpair) ----
enum Msg : std::uint32_t {
  kHandles = 1,
  kZeroCopyGo,
  kZeroCopyDone,
  kFilled,
  kFreed,
  kAllApplied,
  kPoison,
  kPoisoned,
  kVerify,
  kVerified,
  kQuit,
  kFailed,
  kPullGo,
  kPullDone,
};

struct Channel {
  int fd = -1;
  Status send(Msg type, const std::string& payload = {}) {
    std::string frame(8, '\0');
    const std::uint32_t len = static_cast<std::uint32_t>(payload.size());
    std::memcpy(frame.data(), &type, 4);
    std::memcpy(frame.data() + 4, &len, 4);
    frame += payload;
    std::size_t done = 0;
    while (done < frame.size()) {
      const ssize_t n = ::write(fd, frame.data() + done, frame.size() - done);
      if (n <= 0) return Status::IOError("channel write failed: peer gone");
      done += static_cast<std::size_t>(n);
    }
    return Status::Ok();
  }
  Status read_exact(char* out, std::size_t n) {
    const auto deadline = Clock::now() + kTimeout;
    std::size_t done = 0;
    while (done < n) {
      pollfd p{fd, POLLIN, 0};
      const int left = static_cast<int>(
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
      if (left <= 0 || ::poll(&p, 1, left) <= 0)
        return Status::Timeout("channel: no message from the peer process in time");
      const ssize_t r = ::read(fd, out + done, n - done);
      if (r <= 0) return Status::IOError("channel: peer process closed the connection");
      done += static_cast<std::size_t>(r);
    }
    return Status::Ok();
  }
  Result<std::pair<Msg, std::string>> recv() {
    char head[8];
    REFIT_RETURN_IF_ERROR(read_exact(head, 8));
    std::uint32_t type = 0, len = 0;
    std::memcpy(&type, head, 4);
    std::memcpy(&len, head + 4, 4);
    std::string payload(len, '\0');
    if (len > 0) REFIT_RETURN_IF_ERROR(read_exact(payload.data(), len));
    if (type == kFailed) return Status::Aborted("peer process failed: " + payload);
    return std::make_pair(static_cast<Msg>(type), std::move(payload));
  }
  Result<std::string> expect(Msg type) {
    REFIT_ASSIGN_OR_RETURN(auto m, recv());
    if (m.first != type)
      return Status::Internal(fmt::format("channel: expected message {}, got {}",
                                          static_cast<int>(type), static_cast<int>(m.first)));
    return std::move(m.second);
  }
};

std::string pack_strings(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) {
    const std::uint32_t n = static_cast<std::uint32_t>(s.size());
    out.append(reinterpret_cast<const char*>(&n), 4);
    out += s;
  }
  return out;
}
std::vector<std::string> unpack_strings(const std::string& in) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at + 4 <= in.size()) {
    std::uint32_t n = 0;
    std::memcpy(&n, in.data() + at, 4);
    out.push_back(in.substr(at + 4, n));
    at += 4 + n;
  }
  return out;
}
// A bucket and the slot it fills, as one message payload.
struct BucketSlot {
  int bucket = 0;
  int slot = 0;
};
template <typename T>
std::string pod(const T& v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof(T));
}
template <typename T>
T unpod(const std::string& s) {
  T v{};
  std::memcpy(&v, s.data(), std::min(sizeof(T), s.size()));
  return v;
}

// bench/gpu/kernels_gpu.sh sets REFIT_BENCH_BULK=0 when the bulk-engine variant failed its tests.
bool bulk_allowed() {
  const char* v = std::getenv("REFIT_BENCH_BULK");
  return v == nullptr || std::string(v) != "0";
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct VerifyRequest {
  int step;
  DType via;
};

// ---- engine process ----

Status engine_main(const Options& o, const Plan& p, Channel& ch) {
  REFIT_RETURN_IF_ERROR(set_device(0));
  REFIT_ASSIGN_OR_RETURN(DeviceStream stream, DeviceStream::create(0));
  REFIT_ASSIGN_OR_RETURN(DeviceBuffer params,
                         DeviceBuffer::allocate(static_cast<std::size_t>(p.engine_elems) * 2, 0));
  const std::vector<std::vector<std::uint32_t>> expect_tags{p.expect_tags};
  REFIT_ASSIGN_OR_RETURN(DeviceBlockTable expect,
                         DeviceBlockTable::upload({p.expect}, 0, &expect_tags));
  REFIT_ASSIGN_OR_RETURN(DeviceBlockTable apply, DeviceBlockTable::upload(p.apply, 0));
  std::vector<IpcEvent> freed;
  std::vector<std::string> mine;
  REFIT_ASSIGN_OR_RETURN(std::string arena, export_device_memory(params.data(), params.size()));
  mine.push_back(arena);
  for (int s = 0; s < o.num_buffers; ++s) {
    REFIT_ASSIGN_OR_RETURN(IpcEvent e, IpcEvent::create(0));
    REFIT_ASSIGN_OR_RETURN(std::string h, e.handle());
    mine.push_back(h);
    freed.push_back(std::move(e));
  }
  mine.push_back(pod(static_cast<std::uint64_t>(apply.device_bytes())));
  REFIT_RETURN_IF_ERROR(ch.send(kHandles, pack_strings(mine)));
  // The trainer's handles, opened once.
  REFIT_ASSIGN_OR_RETURN(std::string theirs_raw, ch.expect(kHandles));
  const auto theirs = unpack_strings(theirs_raw);
  if (theirs.size() != static_cast<std::size_t>(2 * o.num_buffers + 2))
    return Status::Corruption("engine: malformed trainer handles");
  std::vector<IpcMemory> slots;
  std::vector<IpcEvent> filled;
  for (int s = 0; s < o.num_buffers; ++s) {
    REFIT_ASSIGN_OR_RETURN(IpcMemory m, IpcMemory::open(theirs[s], 0));
    slots.push_back(std::move(m));
    REFIT_ASSIGN_OR_RETURN(IpcEvent e, IpcEvent::open(theirs[o.num_buffers + s], 0));
    filled.push_back(std::move(e));
  }
  REFIT_ASSIGN_OR_RETURN(IpcEvent zero_copy_done, IpcEvent::open(theirs[2 * o.num_buffers], 0));
  // Pull variant: the trainer's shards opened here, the engine runs the copy.
  REFIT_ASSIGN_OR_RETURN(IpcMemory trainer_weights, IpcMemory::open(theirs.back(), 0));
  REFIT_ASSIGN_OR_RETURN(DeviceBlockTable pull, DeviceBlockTable::upload({p.zero_copy}, 0));
  REFIT_ASSIGN_OR_RETURN(DeviceEvent e0, DeviceEvent::create(0, true));
  REFIT_ASSIGN_OR_RETURN(DeviceEvent e1, DeviceEvent::create(0, true));

  for (;;) {
    REFIT_ASSIGN_OR_RETURN(auto msg, ch.recv());
    switch (msg.first) {
      case kZeroCopyGo:
        REFIT_RETURN_IF_ERROR(zero_copy_done.wait_on(stream.handle()));
        REFIT_RETURN_IF_ERROR(synchronize_stream(stream.handle(), kTimeout, "engine: zero-copy"));
        REFIT_RETURN_IF_ERROR(ch.send(kZeroCopyDone));
        break;
      case kFilled: {
        const auto [bucket, slot] = unpod<BucketSlot>(msg.second);
        REFIT_RETURN_IF_ERROR(filled[slot].wait_on(stream.handle()));
        REFIT_RETURN_IF_ERROR(launch_block_copy(apply, static_cast<std::size_t>(bucket),
                                                slots[slot].data(), DType::kBFloat16, params.data(),
                                                DType::kBFloat16, stream.handle()));
        REFIT_RETURN_IF_ERROR(freed[slot].record(stream.handle()));
        REFIT_RETURN_IF_ERROR(ch.send(kFreed, pod(slot)));
        if (bucket + 1 == static_cast<int>(p.apply.size())) {
          REFIT_RETURN_IF_ERROR(synchronize_stream(stream.handle(), kTimeout, "engine: apply"));
          REFIT_RETURN_IF_ERROR(ch.send(kAllApplied));
        }
        break;
      }
      case kPullGo: {
        REFIT_RETURN_IF_ERROR(zero_copy_done.wait_on(stream.handle()));
        REFIT_RETURN_IF_ERROR(e0.record(stream.handle()));
        REFIT_RETURN_IF_ERROR(launch_block_copy(pull, trainer_weights.data(), o.trainer_dtype,
                                                params.data(), DType::kBFloat16, stream.handle()));
        REFIT_RETURN_IF_ERROR(e1.record(stream.handle()));
        REFIT_RETURN_IF_ERROR(synchronize_stream(stream.handle(), kTimeout, "engine: pull"));
        REFIT_ASSIGN_OR_RETURN(float ms, DeviceEvent::elapsed_ms(e0, e1));
        REFIT_RETURN_IF_ERROR(ch.send(kPullDone, pod(ms)));
        break;
      }
      case kPoison:
        REFIT_RETURN_IF_ERROR(
            fill_bytes_async(params.data(), 0xFF, params.size(), stream.handle()));
        REFIT_RETURN_IF_ERROR(synchronize_stream(stream.handle(), kTimeout, "engine: poison"));
        REFIT_RETURN_IF_ERROR(ch.send(kPoisoned));
        break;
      case kVerify: {
        const auto req = unpod<VerifyRequest>(msg.second);
        REFIT_ASSIGN_OR_RETURN(
            VerifyResult v,
            verify_generated(expect, WeightsParams{kSeed, req.step, req.via}, params.data(),
                             DType::kBFloat16, stream.handle(), kTimeout));
        REFIT_RETURN_IF_ERROR(ch.send(kVerified, pod(v)));
        break;
      }
      case kQuit:
        return Status::Ok();
      default:
        return Status::Internal(
            fmt::format("engine: unexpected message {}", static_cast<int>(msg.first)));
    }
  }
}

// ---- trainer process ----

struct Timing {
  std::vector<double> wall_ms;    // first launch -> engine acknowledgement
  std::vector<double> device_ms;  // GPU time of the trainer's launches
};

Status trainer_main(const Options& o, const Plan& p, Channel& ch, nlohmann::json& out) {
  REFIT_RETURN_IF_ERROR(set_device(0));
  const DType tdt = o.trainer_dtype;
  const std::size_t tsize = dtype_size(tdt);
  REFIT_ASSIGN_OR_RETURN(DeviceStream stream, DeviceStream::create(0));
  void* st = stream.handle();
  REFIT_ASSIGN_OR_RETURN(
      DeviceBuffer weights,
      DeviceBuffer::allocate(static_cast<std::size_t>(p.trainer_elems) * tsize, 0));
  const std::vector<std::vector<std::uint32_t>> gen_tags{p.generate_tags};
  REFIT_ASSIGN_OR_RETURN(DeviceBlockTable gen,
                         DeviceBlockTable::upload({p.generate}, 0, &gen_tags));
  // Refit's own allocations (the "extra memory"): zero-copy table; slots and pack table.
  REFIT_ASSIGN_OR_RETURN(DeviceBlockTable zero_copy, DeviceBlockTable::upload({p.zero_copy}, 0));
  REFIT_ASSIGN_OR_RETURN(DeviceBlockTable pack, DeviceBlockTable::upload(p.pack, 0));
  const std::size_t slot_bytes = static_cast<std::size_t>(o.buffer_bytes);
  REFIT_ASSIGN_OR_RETURN(DeviceBuffer slots, DeviceBuffer::allocate(slot_bytes * o.num_buffers, 0));
  std::vector<IpcEvent> filled;
  std::vector<std::string> mine;
  for (int s = 0; s < o.num_buffers; ++s) {
    REFIT_ASSIGN_OR_RETURN(std::string h,
                           export_device_memory(slots.bytes() + s * slot_bytes, slot_bytes));
    mine.push_back(h);
  }
  for (int s = 0; s < o.num_buffers; ++s) {
    REFIT_ASSIGN_OR_RETURN(IpcEvent e, IpcEvent::create(0));
    REFIT_ASSIGN_OR_RETURN(std::string h, e.handle());
    mine.push_back(h);
    filled.push_back(std::move(e));
  }
  REFIT_ASSIGN_OR_RETURN(IpcEvent zero_copy_done, IpcEvent::create(0));
  REFIT_ASSIGN_OR_RETURN(std::string zh, zero_copy_done.handle());
  mine.push_back(zh);
  REFIT_ASSIGN_OR_RETURN(std::string wh, export_device_memory(weights.data(), weights.size()));
  mine.push_back(wh);
  REFIT_RETURN_IF_ERROR(ch.send(kHandles, pack_strings(mine)));
  REFIT_ASSIGN_OR_RETURN(std::string theirs_raw, ch.expect(kHandles));
  const auto theirs = unpack_strings(theirs_raw);
  if (theirs.size() != static_cast<std::size_t>(o.num_buffers + 2))
    return Status::Corruption("trainer: malformed engine handles");
  REFIT_ASSIGN_OR_RETURN(IpcMemory engine, IpcMemory::open(theirs[0], 0));
  std::vector<IpcEvent> freed;
  for (int s = 0; s < o.num_buffers; ++s) {
    REFIT_ASSIGN_OR_RETURN(IpcEvent e, IpcEvent::open(theirs[1 + s], 0));
    freed.push_back(std::move(e));
  }
  const auto engine_table_bytes = unpod<std::uint64_t>(theirs.back());
  REFIT_ASSIGN_OR_RETURN(DeviceEvent t0, DeviceEvent::create(0, true));
  REFIT_ASSIGN_OR_RETURN(DeviceEvent t1, DeviceEvent::create(0, true));

  const double payload = static_cast<double>(p.hf_elems) * 2;  // bytes the engine receives
  const double src_bytes = static_cast<double>(p.hf_elems) * static_cast<double>(tsize);
  auto row = [&](const std::string& method, double ms, double device_ms, double extra,
                 const std::string& note) {
    nlohmann::json j = {{"model", o.model},
                        {"trainer_dtype", std::string(dtype_name(tdt))},
                        {"method", method},
                        {"ms", ms},
                        {"device_ms", device_ms},
                        {"gbps", payload / (ms * 1e-3) / 1e9},
                        {"extra_bytes", extra},
                        {"tensors", p.spec.tensors().size()},
                        {"parameters", p.hf_elems},
                        {"buckets", p.buckets.buckets.size()},
                        {"note", note}};
    out.push_back(j);
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  };
  auto timed = [&](auto&& launch, int reps) -> Result<double> {
    std::vector<double> ms;
    for (int r = 0; r < reps + 1; ++r) {
      REFIT_RETURN_IF_ERROR(t0.record(st));
      REFIT_RETURN_IF_ERROR(launch());
      REFIT_RETURN_IF_ERROR(t1.record(st));
      REFIT_RETURN_IF_ERROR(synchronize_stream(st, kTimeout, "floor"));
      REFIT_ASSIGN_OR_RETURN(float m, DeviceEvent::elapsed_ms(t0, t1));
      if (r > 0) ms.push_back(m);  // the first is a warm-up
    }
    return median(ms);
  };
  auto generate = [&](int step) -> Status {
    REFIT_RETURN_IF_ERROR(
        launch_generate(gen, WeightsParams{kSeed, step, tdt}, weights.data(), tdt, st));
    return synchronize_stream(st, kTimeout, "generate");
  };
  auto verify = [&](int step, const char* method) -> Status {
    REFIT_RETURN_IF_ERROR(ch.send(kVerify, pod(VerifyRequest{step, tdt})));
    REFIT_ASSIGN_OR_RETURN(std::string r, ch.expect(kVerified));
    const auto v = unpod<VerifyResult>(r);
    std::fprintf(stderr, "[%s %s] verify step %d: %llu mismatches\n", o.model.c_str(), method, step,
                 static_cast<unsigned long long>(v.mismatches));
    if (v.mismatches != 0)
      return Status::Corruption(
          fmt::format("{}: {} engine elements differ after step {} "
                      "(first at element {})",
                      method, v.mismatches, step, v.first_dst_offset));
    return Status::Ok();
  };
  auto poison = [&]() -> Status {
    REFIT_RETURN_IF_ERROR(ch.send(kPoison));
    return ch.expect(kPoisoned).status();
  };

  // Floors: device-to-device copy bandwidth on this GPU, now, between two buffers of this process
  // (4 GiB each: far above the L2). Diagnostics: the same copy through the IPC mapping.
  REFIT_RETURN_IF_ERROR(generate(0));
  const std::size_t dst_bytes = static_cast<std::size_t>(p.hf_elems) * 2;
  double rw_bandwidth = 0;
  {
    const std::size_t probe = std::min<std::size_t>(std::size_t{4} << 30, dst_bytes);
    REFIT_ASSIGN_OR_RETURN(DeviceBuffer a, DeviceBuffer::allocate(probe, 0));
    REFIT_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::allocate(probe, 0));
    REFIT_RETURN_IF_ERROR(copy_device_async(a.data(), weights.data(), probe, st));
    REFIT_ASSIGN_OR_RETURN(
        double local_ms,
        timed([&] { return copy_device_async(b.data(), a.data(), probe, st); }, 5));
    rw_bandwidth = 2.0 * static_cast<double>(probe) / (local_ms * 1e-3);
    const std::size_t n = probe / 2;
    auto diag = [&](const char* what, const void* from, void* to) -> Status {
      REFIT_ASSIGN_OR_RETURN(double ms, timed(
                                            [&] {
                                              return launch_flat_convert(from, DType::kBFloat16, to,
                                                                         DType::kBFloat16, n, st);
                                            },
                                            5));
      std::fprintf(stderr, "[%s diag] %s: %.3f ms for %.2f GB = %.0f GB/s read+write\n",
                   o.model.c_str(), what, ms, probe / 1e9, 2.0 * probe / (ms * 1e-3) / 1e9);
      return Status::Ok();
    };
    std::fprintf(stderr,
                 "[%s diag] cudaMemcpy local->local: %.3f ms for %.2f GB = %.0f GB/s "
                 "read+write\n",
                 o.model.c_str(), local_ms, probe / 1e9, rw_bandwidth / 1e9);
    REFIT_ASSIGN_OR_RETURN(
        double ipc_ms,
        timed([&] { return copy_device_async(engine.data(), a.data(), probe, st); }, 5));
    std::fprintf(stderr, "[%s diag] cudaMemcpy local->ipc: %.3f ms = %.0f GB/s read+write\n",
                 o.model.c_str(), ipc_ms, 2.0 * probe / (ipc_ms * 1e-3) / 1e9);
    const std::pair<const char*, CopyKernelTuning> variants[] = {{"thread kernel", {false}},
                                                                 {"bulk engine", {true}}};
    for (const auto& [name, tuning] : variants) {
      if (tuning.bulk_same_dtype && !bulk_allowed()) continue;
      set_copy_kernel_tuning(tuning);
      std::fprintf(stderr, "[%s diag] -- kernel variant: %s\n", o.model.c_str(), name);
      REFIT_RETURN_IF_ERROR(diag("bf16 copy kernel local->local", a.data(), b.data()));
      REFIT_RETURN_IF_ERROR(diag("bf16 copy kernel local->ipc", a.data(), engine.data()));
      REFIT_ASSIGN_OR_RETURN(double cast, timed(
                                              [&] {
                                                return launch_flat_convert(
                                                    a.data(), DType::kFloat32, b.data(),
                                                    DType::kBFloat16, probe / 4, st);
                                              },
                                              5));
      std::fprintf(stderr,
                   "[%s diag] fp32->bf16 cast kernel local->local: %.3f ms = %.0f GB/s "
                   "read+write\n",
                   o.model.c_str(), cast, 1.5 * probe / (cast * 1e-3) / 1e9);
    }
    set_copy_kernel_tuning({});
  }
  const double floor_ms = (src_bytes + payload) / rw_bandwidth * 1e3;
  REFIT_ASSIGN_OR_RETURN(double cast_ms, timed(
                                             [&] {
                                               return launch_flat_convert(
                                                   weights.data(), tdt, engine.data(),
                                                   DType::kBFloat16,
                                                   static_cast<std::size_t>(p.hf_elems), st);
                                             },
                                             5));
  row("floor: copy-derived", floor_ms, floor_ms, 0,
      fmt::format("in-process D2D memcpy at {:.0f} GB/s read+write; source read once, engine "
                  "written once",
                  rw_bandwidth / 1e9));
  row("floor: one flat cast pass", cast_ms, cast_ms, 0,
      "launch_flat_convert over every element, into the engine's IPC-mapped arena");

  // Zero-copy colocated refit, with each kernel variant (CopyKernelTuning; the bulk engine only
  // applies to equal dtypes). Each verified on the engine.
  int last = 0;
  int wbase = 0;
  auto zero_copy_refits = [&](const char* label, const CopyKernelTuning& tuning) -> Status {
    set_copy_kernel_tuning(tuning);
    REFIT_RETURN_IF_ERROR(poison());
    Timing zc;
    wbase += 20;
    for (int step = 1; step <= o.steps + 1; ++step) {
      REFIT_RETURN_IF_ERROR(generate(wbase + step));
      const auto start = Clock::now();
      REFIT_RETURN_IF_ERROR(t0.record(st));
      REFIT_RETURN_IF_ERROR(
          launch_block_copy(zero_copy, weights.data(), tdt, engine.data(), DType::kBFloat16, st));
      REFIT_RETURN_IF_ERROR(t1.record(st));
      REFIT_RETURN_IF_ERROR(zero_copy_done.record(st));
      REFIT_RETURN_IF_ERROR(ch.send(kZeroCopyGo));
      REFIT_RETURN_IF_ERROR(ch.expect(kZeroCopyDone).status());
      const double wall = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
      REFIT_ASSIGN_OR_RETURN(float dev, DeviceEvent::elapsed_ms(t0, t1));
      if (step > 1) {  // the first refit is a warm-up
        zc.wall_ms.push_back(wall);
        zc.device_ms.push_back(dev);
      }
      last = wbase + step;
    }
    REFIT_RETURN_IF_ERROR(verify(last, label));
    row(label, median(zc.wall_ms), median(zc.device_ms),
        static_cast<double>(zero_copy.device_bytes()),
        fmt::format("1 launch, {} tiles; verified bit-exact", zero_copy.num_tiles()));
    return Status::Ok();
  };
  REFIT_RETURN_IF_ERROR(zero_copy_refits("refit zero-copy", {}));
  if (tdt == DType::kBFloat16 && bulk_allowed())
    REFIT_RETURN_IF_ERROR(zero_copy_refits("refit zero-copy [bulk engine]", {true}));
  set_copy_kernel_tuning({});

  // Zero-copy, pull variant: the engine runs the same copy reading the trainer's exported shards.
  REFIT_RETURN_IF_ERROR(poison());
  Timing pull;
  for (int step = 1; step <= o.steps + 1; ++step) {
    const int wstep = 200 + step;
    REFIT_RETURN_IF_ERROR(generate(wstep));
    const auto start = Clock::now();
    REFIT_RETURN_IF_ERROR(zero_copy_done.record(st));
    REFIT_RETURN_IF_ERROR(ch.send(kPullGo));
    REFIT_ASSIGN_OR_RETURN(std::string r, ch.expect(kPullDone));
    const double wall = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    if (step > 1) {
      pull.wall_ms.push_back(wall);
      pull.device_ms.push_back(unpod<float>(r));
    }
    last = wstep;
  }
  REFIT_RETURN_IF_ERROR(verify(last, "zero-copy pull"));
  row("refit zero-copy (engine pulls)", median(pull.wall_ms), median(pull.device_ms),
      static_cast<double>(zero_copy.device_bytes()),
      "the engine opens the trainer's shards once and runs the copy; verified bit-exact");

  // Bucketed, double-buffered CUDA IPC.
  REFIT_RETURN_IF_ERROR(poison());
  Timing bk;
  const int nb = o.num_buffers;
  const int nbuckets = static_cast<int>(p.pack.size());
  for (int step = 1; step <= o.steps + 1; ++step) {
    const int wstep = 100 + step;
    REFIT_RETURN_IF_ERROR(generate(wstep));
    const auto start = Clock::now();
    REFIT_RETURN_IF_ERROR(t0.record(st));
    int freed_seen = 0;
    for (int b = 0; b < nbuckets; ++b) {
      const int s = b % nb;
      if (b >= nb) {  // slot s is free once the engine enqueued bucket b - nb's apply
        while (freed_seen <= b - nb) {
          REFIT_RETURN_IF_ERROR(ch.expect(kFreed).status());
          ++freed_seen;
        }
        REFIT_RETURN_IF_ERROR(freed[s].wait_on(st));
      }
      REFIT_RETURN_IF_ERROR(launch_block_copy(pack, static_cast<std::size_t>(b), weights.data(),
                                              tdt, slots.bytes() + s * slot_bytes, DType::kBFloat16,
                                              st));
      REFIT_RETURN_IF_ERROR(filled[s].record(st));
      REFIT_RETURN_IF_ERROR(ch.send(kFilled, pod(BucketSlot{b, s})));
    }
    REFIT_RETURN_IF_ERROR(t1.record(st));
    while (freed_seen < nbuckets) {
      REFIT_RETURN_IF_ERROR(ch.expect(kFreed).status());
      ++freed_seen;
    }
    REFIT_RETURN_IF_ERROR(ch.expect(kAllApplied).status());
    const double wall = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    REFIT_RETURN_IF_ERROR(synchronize_stream(st, kTimeout, "pack"));
    REFIT_ASSIGN_OR_RETURN(float dev, DeviceEvent::elapsed_ms(t0, t1));
    if (step > 1) {
      bk.wall_ms.push_back(wall);
      bk.device_ms.push_back(dev);
    }
    last = wstep;
  }
  REFIT_RETURN_IF_ERROR(verify(last, "bucketed ipc"));
  row("refit bucketed ipc", median(bk.wall_ms), median(bk.device_ms),
      static_cast<double>(slots.size() + pack.device_bytes() + engine_table_bytes),
      fmt::format("{} buckets of <= {} MiB, {} slots; verified bit-exact", nbuckets,
                  o.buffer_bytes >> 20, nb));
  for (auto& j : out) {
    j["floor_ms"] = floor_ms;
    j["ratio_to_floor"] = floor_ms / j["ms"].get<double>();
  }
  return ch.send(kQuit);
}

int run(const Options& o) {
  auto plan = make_plan(o);
  if (!plan.ok()) {
    std::fprintf(stderr, "zero_copy_bench: %s\n", plan.status().to_string().c_str());
    return 2;
  }
  if (!o.dump_layout.empty()) {
    const Status st = dump_layout(*plan, o.dump_layout);
    if (!st.ok()) std::fprintf(stderr, "zero_copy_bench: %s\n", st.to_string().c_str());
    return st.ok() ? 0 : 1;
  }
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) return 1;
  const pid_t pid = fork();  // before any CUDA call in either process
  if (pid == 0) {
    ::close(fds[0]);
    Channel ch{fds[1]};
    const Status st = engine_main(o, *plan, ch);
    if (!st.ok()) {
      std::fprintf(stderr, "zero_copy_bench engine: %s\n", st.to_string().c_str());
      (void)ch.send(kFailed, st.to_string());
    }
    std::fflush(stderr);
    _exit(st.ok() ? 0 : 1);
  }
  ::close(fds[1]);
  Channel ch{fds[0]};
  nlohmann::json out = nlohmann::json::array();
  const Status st = trainer_main(o, *plan, ch, out);
  if (!st.ok()) {
    std::fprintf(stderr, "zero_copy_bench trainer: %s\n", st.to_string().c_str());
    (void)ch.send(kFailed, st.to_string());
  }
  ::close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!o.json.empty()) std::ofstream(o.json) << out.dump(2);
  return st.ok() && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  refit::Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "zero_copy_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--model") {
      o.model = next();
    } else if (a == "--trainer-dtype") {
      auto d = refit::parse_dtype(next());
      if (!d) {
        std::fprintf(stderr, "zero_copy_bench: --trainer-dtype takes float32 or bfloat16\n");
        return 2;
      }
      o.trainer_dtype = *d;
    } else if (a == "--steps") {
      o.steps = std::max(1, std::stoi(next()));
    } else if (a == "--buffer-bytes") {
      o.buffer_bytes = std::stoll(next());
    } else if (a == "--num-buffers") {
      o.num_buffers = std::max(1, std::stoi(next()));
    } else if (a == "--json") {
      o.json = next();
    } else if (a == "--dump-layout") {
      o.dump_layout = next();
    } else {
      std::fprintf(stderr,
                   "usage: zero_copy_bench --model M [--trainer-dtype float32|bfloat16] "
                   "[--steps N] [--buffer-bytes B] [--num-buffers K] [--json FILE] "
                   "[--dump-layout FILE]\n");
      return 2;
    }
  }
  return refit::run(o);
}
