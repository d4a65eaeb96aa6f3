// --verify of an FP8 refit on the GPU (harness/fp8_reference.h, find_fp8_mismatch_on_device):
// each quantized HF tensor is generated whole on the engine rank's GPU, quantized there by the
// reference kernels (harness/fp8_reference_device.h), placed into the expected bytes of every
// engine parameter that holds pieces of it, and compared byte for byte.
#include <fmt/format.h>

#include <map>

#include "device/copy_kernels.h"
#include "device/device.h"
#include "harness/fp8_reference.h"
#include "harness/fp8_reference_device.h"
#include "weights/materialize.h"

namespace refit {
namespace {

constexpr std::chrono::milliseconds kWait{120'000};

// Device memory that only grows: scratch reused tensor after tensor on one stream.
class Scratch {
 public:
  Result<void*> at_least(std::size_t bytes, int device, void* stream) {
    if (buf_.size() < bytes) {
      // Work queued on `stream` may still use the old buffer.
      REFIT_RETURN_IF_ERROR(synchronize_stream(stream, kWait, "fp8 reference: growing scratch"));
      buf_ = DeviceBuffer();
      REFIT_ASSIGN_OR_RETURN(buf_, DeviceBuffer::allocate(bytes, device));
    }
    return buf_.data();
  }

 private:
  DeviceBuffer buf_;
};

// The reference codes and scales of quantized weights, on the device, kept for the parameters
// that follow (a weight's scale parameter comes right after it in the layout; replicated kv heads
// and several engines' layouts read one tensor more than once).
class DeviceReference {
 public:
  DeviceReference(const RankModel& model, const WireModel& wire, DType policy, std::uint64_t seed,
                  int step, int device, void* stream, std::uint64_t* status)
      : model_(model),
        wire_(wire),
        policy_(policy),
        seed_(seed),
        step_(step),
        device_(device),
        stream_(stream),
        status_(status) {}

  // The device bytes of wire tensor `t` whole: the codes of a quantized weight or the scales of
  // its scale tensor, computed on first use.
  Result<const std::byte*> tensor(std::uint32_t t) {
    const Fp8Table& f = *wire_.fp8;
    const auto weight = f.is_scale(t) ? static_cast<std::uint32_t>(f.weight_of[t]) : t;
    auto it = cache_.find(weight);
    if (it == cache_.end()) {
      REFIT_ASSIGN_OR_RETURN(Entry e, quantize(weight));
      cached_bytes_ += e.codes.size() + e.scales.size();
      it = cache_.emplace(weight, std::move(e)).first;
    }
    return f.is_scale(t) ? it->second.scales.bytes() : it->second.codes.bytes();
  }

  // Between parameters: drops the cache when it holds more than the budget.
  void trim() {
    if (cached_bytes_ <= kCacheBudget) return;
    cache_.clear();
    cached_bytes_ = 0;
  }

 private:
  static constexpr std::size_t kCacheBudget = std::size_t{2} << 30;
  struct Entry {
    DeviceBuffer codes, scales;
    DeviceBlockTable generate;  // kept until the entry goes: the launch reads it
  };

  Result<Entry> quantize(std::uint32_t weight) {
    const Fp8Table& f = *wire_.fp8;
    const TensorSpec& ts = model_.spec.tensors()[weight];
    const MatrixShape m = matrix_shape(ts.shape);
    const MatrixShape block = f.block(wire_.spec, weight);
    const std::int64_t nbr = (m.rows + block.rows - 1) / block.rows;
    const std::int64_t nbc = (m.cols + block.cols - 1) / block.cols;
    const auto n = static_cast<std::size_t>(m.numel());
    REFIT_ASSIGN_OR_RETURN(void* x, x_.at_least(n * 4, device_, stream_));
    REFIT_ASSIGN_OR_RETURN(
        void* amax, amax_.at_least(static_cast<std::size_t>(nbr * nbc) * 4, device_, stream_));
    Entry e;
    const std::vector<Piece> whole = {Piece{.hf_tensor = weight, .rows = m.rows, .cols = m.cols}};
    if (model_.checkpoint != nullptr) {
      // The checkpoint's values live on the host: built there, as the CPU reference does.
      std::vector<float> host(n);
      materialize_pieces(model_.spec, whole, ts.shape, *model_.weights, step_, policy_,
                         DType::kFloat32, reinterpret_cast<std::byte*>(host.data()));
      REFIT_RETURN_IF_ERROR(synchronize_stream(stream_, kWait, "fp8 reference: before an upload"));
      REFIT_RETURN_IF_ERROR(copy_to_device(x, host.data(), n * 4));
    } else {
      std::vector<std::vector<Block2D>> runs(1);
      std::vector<std::vector<std::uint32_t>> tags(1);
      append_piece_runs(model_.spec, whole, ts.shape, 0, nullptr, runs[0], tags[0]);
      REFIT_ASSIGN_OR_RETURN(e.generate, DeviceBlockTable::upload(runs, device_, &tags));
      // The update of the run (--update): the weights the trainer ranks generated.
      const WeightsParams params{.seed = seed_,
                                 .step = step_,
                                 .via = policy_,
                                 .adam_lr = model_.weights->update().adam_lr()};
      REFIT_RETURN_IF_ERROR(launch_generate(e.generate, params, x, DType::kFloat32, stream_));
    }
    REFIT_ASSIGN_OR_RETURN(e.codes, DeviceBuffer::allocate(n, device_));
    REFIT_ASSIGN_OR_RETURN(
        e.scales, DeviceBuffer::allocate(static_cast<std::size_t>(nbr * nbc) * 4, device_));
    REFIT_RETURN_IF_ERROR(
        fp8_ref_quantize(static_cast<const float*>(x), m.rows, m.cols, block.rows, block.cols,
                         static_cast<std::uint32_t*>(amax), static_cast<float*>(e.scales.data()),
                         static_cast<std::uint8_t*>(e.codes.data()), weight, status_, stream_));
    return e;
  }

  const RankModel& model_;
  const WireModel& wire_;
  const DType policy_;
  const std::uint64_t seed_;
  const int step_, device_;
  void* const stream_;
  std::uint64_t* const status_;
  Scratch x_, amax_;
  std::map<std::uint32_t, Entry> cache_;
  std::size_t cached_bytes_ = 0;
};

}  // namespace

Result<std::optional<Fp8Mismatch>> find_fp8_mismatch_on_device(
    DataPlane& plane, const RankModel& model, const WireModel& wire,
    const EngineShardLayout& layout, const std::vector<PieceTarget>& params, DType policy,
    std::uint64_t seed, int step, std::chrono::milliseconds timeout) {
  using Found = std::optional<Fp8Mismatch>;
  const Fp8Table& f = *wire.fp8;
  const int device = plane.ordinal();
  REFIT_RETURN_IF_ERROR(set_device(device));

  // Parameters of plain dtypes (bf16 embeddings and norms, any float32 one): the plane compares
  // them with the weights it generates, as without fp8, one call per dtype.
  std::map<DType, std::vector<std::size_t>> plain;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const EngineParam& p = layout.params[i];
    const bool scales = !p.pieces.empty() && f.is_scale(p.pieces.front().hf_tensor);
    if (p.dtype != DType::kFloat8E4M3 && !scales) plain[p.dtype].push_back(i);
  }
  PlaneDiagnostics* diagnostics = plane.diagnostics();
  if (diagnostics == nullptr && !plain.empty())
    return Status::Internal("fp8 verify: the data plane has no diagnostics to compare with");
  for (const auto& [dtype, which] : plain) {
    std::vector<PieceTarget> targets;
    for (std::size_t i : which) targets.push_back(params[i]);
    REFIT_ASSIGN_OR_RETURN(auto found,
                           diagnostics->find_mismatch(model, targets, step, policy, dtype));
    if (!found) continue;
    Fp8Mismatch mm{.param = which[found->first], .element = found->second};
    const std::size_t esize = dtype_size(dtype);
    REFIT_RETURN_IF_ERROR(plane.read(
        &mm.got, params[mm.param].data + mm.element * static_cast<std::int64_t>(esize), esize));
    // What the element must hold: its HF element after the cast (zero where no piece covers it).
    const EngineParam& p = layout.params[mm.param];
    const std::int64_t cols = matrix_shape(p.shape).cols;
    const std::int64_t row = mm.element / cols, col = mm.element % cols;
    for (const Piece& pc : p.pieces) {
      if (row < pc.dst_row || row >= pc.dst_row + pc.rows || col < pc.dst_col ||
          col >= pc.dst_col + pc.cols)
        continue;
      const Piece one{
          pc.hf_tensor, pc.src_row + row - pc.dst_row, pc.src_col + col - pc.dst_col, 1, 1, 0, 0};
      materialize_pieces(model.spec, {one}, {1}, *model.weights, step, policy, dtype,
                         reinterpret_cast<std::byte*>(&mm.want));
      break;
    }
    return Found(mm);
  }

  REFIT_ASSIGN_OR_RETURN(DeviceStream stream, DeviceStream::create(device));
  REFIT_ASSIGN_OR_RETURN(
      DeviceBuffer status,
      DeviceBuffer::allocate(kFp8RefStatusWords * sizeof(std::uint64_t), device));
  auto* words = static_cast<std::uint64_t*>(status.data());
  DeviceReference ref(model, wire, policy, seed, step, device, stream.handle(), words);
  Scratch expected_buf;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const EngineParam& p = layout.params[i];
    const bool scales = !p.pieces.empty() && f.is_scale(p.pieces.front().hf_tensor);
    if (p.dtype != DType::kFloat8E4M3 && !scales) continue;
    const std::size_t esize = dtype_size(p.dtype);
    const MatrixShape pm = matrix_shape(p.shape);
    const auto bytes = static_cast<std::size_t>(pm.numel()) * esize;
    ref.trim();
    REFIT_ASSIGN_OR_RETURN(void* expected, expected_buf.at_least(bytes, device, stream.handle()));
    auto* want = static_cast<std::byte*>(expected);
    REFIT_RETURN_IF_ERROR(fp8_ref_reset_status(words, stream.handle()));
    REFIT_RETURN_IF_ERROR(fill_bytes_async(want, 0, bytes, stream.handle()));
    for (const Piece& pc : p.pieces) {
      if (f.is_scale(pc.hf_tensor) != scales)
        return Status::Internal(
            fmt::format("verify: engine parameter {} mixes fp8 scales with other tensors", p.name));
      REFIT_ASSIGN_OR_RETURN(const std::byte* src, ref.tensor(pc.hf_tensor));
      const auto src_cols =
          static_cast<std::size_t>(matrix_shape(wire.spec.tensors()[pc.hf_tensor].shape).cols);
      const auto dst_cols = static_cast<std::size_t>(pm.cols);
      REFIT_RETURN_IF_ERROR(
          fp8_ref_copy_rect(want + (static_cast<std::size_t>(pc.dst_row) * dst_cols +
                                    static_cast<std::size_t>(pc.dst_col)) *
                                       esize,
                            dst_cols * esize,
                            src + (static_cast<std::size_t>(pc.src_row) * src_cols +
                                   static_cast<std::size_t>(pc.src_col)) *
                                      esize,
                            src_cols * esize, static_cast<std::size_t>(pc.cols) * esize,
                            static_cast<std::size_t>(pc.rows), stream.handle()));
    }
    REFIT_RETURN_IF_ERROR(fp8_ref_compare(want, params[i].data, bytes, words, stream.handle()));
    REFIT_RETURN_IF_ERROR(synchronize_stream(stream.handle(), timeout, "fp8 verification"));
    std::uint64_t host[kFp8RefStatusWords];
    REFIT_RETURN_IF_ERROR(copy_to_host(host, words, sizeof host));
    if (host[0] > 0) {
      const auto weight = static_cast<std::size_t>(host[1] >> 32);
      return Status::InvalidArgument(fmt::format(
          "fp8 reference: {} holds NaN or inf in block {} ({} block(s) in all)",
          weight < wire.spec.tensors().size() ? wire.spec.tensors()[weight].name : "a tensor",
          host[1] & 0xFFFFFFFFu, host[0]));
    }
    if (host[2] == 0) continue;
    Fp8Mismatch mm{.param = i, .element = static_cast<std::int64_t>(host[3] / esize)};
    const auto at = static_cast<std::int64_t>(host[3] / esize * esize);
    REFIT_RETURN_IF_ERROR(copy_to_host(&mm.got, params[i].data + at, esize));
    REFIT_RETURN_IF_ERROR(copy_to_host(&mm.want, want + at, esize));
    return Found(mm);
  }
  return Found();
}

}  // namespace refit
