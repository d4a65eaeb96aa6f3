// CLI-mode ranks: own the storage, fill it with the deterministic weights every step, and verify.
#include "harness/rank.h"
#include "common/stats.h"
#include "harness/fp8_reference.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <thread>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "comm/communicator.h"
#include "common/convert.h"
#include "common/host_buffer.h"
#include "common/log.h"
#include "control/auth.h"
#include "control/store.h"
#include "engine/engine_layout.h"
#include "executor/routes.h"
#include "harness/forward.h"
#include "io/safetensors.h"
#include "plane/data_plane.h"
#include "runtime/create.h"
#include "runtime/protocol.h"
#include "runtime/slots.h"
#include "trainer/trainer_layout.h"
#include "weights/materialize.h"
#include "weights/setup.h"

namespace refit {
namespace {

// One allocation of plane memory holding every slot, 256-byte aligned each.
struct SlotArena {
  std::unique_ptr<PlaneBuffer> memory;
  std::vector<std::byte*> ptrs;

  static Result<SlotArena> create(DataPlane& plane, const std::vector<TensorSlot>& slots) {
    SlotArena a;
    std::size_t total = 0;
    const std::vector<std::size_t> offsets = slot_offsets(slots, &total);
    REFIT_ASSIGN_OR_RETURN(a.memory, plane.allocate(std::max<std::size_t>(total, 1)));
    for (std::size_t o : offsets) a.ptrs.push_back(a.memory->data() + o);
    return a;
  }
};

// Logit check: models above this size would make the single-process CPU reference too slow.
constexpr std::int64_t kLogitCheckMaxParams = 2'000'000'000;
constexpr int kLogitCheckTokens = 8;
constexpr double kLogitTolerance = 1e-4;

}  // namespace

namespace {

// The full HF tensors of `step` as every trainer rank's shards hold them (the same deterministic
// source fills them), in the policy dtype and after the cast.
Status dump_trainer_tensors(const RankOptions& o, const RankModel& model, int step) {
  const Config& cfg = o.config;
  REFIT_ASSIGN_OR_RETURN(const WireModel wire, wire_model(cfg, model.spec));
  std::optional<Fp8Reference> ref;
  if (wire.fp8) ref.emplace(model, wire, cfg.policy.dtype, step);
  std::vector<HostBuffer> held, cast;
  std::vector<TensorView> trainer_views, expected_views;
  for (std::uint32_t t = 0; t < wire.spec.tensors().size(); ++t) {
    const TensorSpec& ts = wire.spec.tensors()[t];
    const MatrixShape m = matrix_shape(ts.shape);
    const std::vector<Piece> whole = {Piece{.hf_tensor = t, .rows = m.rows, .cols = m.cols}};
    const auto n = static_cast<std::size_t>(m.numel());
    const DType out = wire.dtype[t];
    cast.emplace_back(n * dtype_size(out) + 1);
    if (ref) {  // FP8: the reference quantizer's codes and scales (docs/fp8.md)
      REFIT_ASSIGN_OR_RETURN(const std::vector<std::byte>* bytes, ref->tensor(t));
      std::memcpy(cast.back().data(), bytes->data(), bytes->size());
    } else {
      materialize_pieces(model.spec, whole, ts.shape, *model.weights, step, cfg.policy.dtype, out,
                         cast.back().data());
    }
    expected_views.push_back({ts.name, out, ts.shape, cast.back().data()});
    if (t >= model.spec.tensors().size()) continue;  // scales: the trainer holds none
    held.emplace_back(n * dtype_size(cfg.policy.dtype) + 1);
    materialize_pieces(model.spec, whole, ts.shape, *model.weights, step, cfg.policy.dtype,
                       cfg.policy.dtype, held.back().data());
    trainer_views.push_back({ts.name, cfg.policy.dtype, ts.shape, held.back().data()});
  }
  const std::map<std::string, std::string> meta = {{"refit_model", cfg.model},
                                                   {"refit_step", std::to_string(step)}};
  REFIT_RETURN_IF_ERROR(write_safetensors(o.dump_dir + "/trainer.safetensors", trainer_views, meta));
  return write_safetensors(o.dump_dir + "/expected.safetensors", expected_views, meta);
}

// Engine rank `g`'s parameters as they are now, under the engine's names and shapes.
Status dump_engine_params(const RankOptions& o, DataPlane& plane, const EngineShardLayout& layout,
                          const std::vector<PieceTarget>& params, int g) {
  std::vector<HostBuffer> host;
  std::vector<TensorView> views;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto bytes = static_cast<std::size_t>(layout.params[i].bytes());
    host.emplace_back(bytes + 1);
    REFIT_RETURN_IF_ERROR(plane.read(host.back().data(), params[i].data, bytes));
    views.push_back({layout.params[i].name, layout.params[i].dtype, layout.params[i].shape,
                     host.back().data()});
  }
  return write_safetensors(
      fmt::format("{}/engine-{}.safetensors", o.dump_dir, g), views,
      {{"refit_model", o.config.model},
       {"refit_engine", std::to_string(g / o.config.generation.tp_size)},
       {"refit_tp_rank", std::to_string(g % o.config.generation.tp_size)},
       {"refit_tp_size", std::to_string(o.config.generation.tp_size)}});
}

}  // namespace

Status check_fault_fits(const Fault& f, const Config& config) {
  // Faults aimed at one rank that the session must survive: they need the transfer plan.
  const bool pause = f.kind == Fault::Kind::kFailPause || f.kind == Fault::Kind::kSlowPause;
  if (pause || f.kind == Fault::Kind::kStallTrainer || f.kind == Fault::Kind::kStallEngine) {
    const bool trainer = f.kind == Fault::Kind::kStallTrainer;
    const char* name = f.kind == Fault::Kind::kFailPause   ? "fail-pause"
                       : f.kind == Fault::Kind::kSlowPause ? "slow-pause"
                       : trainer                           ? "stall-trainer"
                                                           : "stall-engine";
    const int ranks = trainer ? config.policy.world_size : config.engine_ranks();
    if (f.rank >= ranks)
      return Status::InvalidArgument(
          fmt::format("--fault {}:{}: there is no {} rank {} ({} is {})", name, f.rank,
                      trainer ? "trainer" : "engine", f.rank,
                      trainer ? "policy.world_size" : "generation.num_engines x tp_size", ranks));
    if (!uses_transfer_plan(config))
      return Status::InvalidArgument(fmt::format(
          "--fault {}: {} needs the transfer plan (refit.executor is gather, where {} ends the "
          "session)",
          name,
          pause ? "a refused refit" : "a refit that fails in flight and leaves the session usable",
          pause ? "a failed pause hook" : "a timeout"));
    return Status::Ok();
  }
  if (f.kind != Fault::Kind::kCorrupt && f.kind != Fault::Kind::kKillTrainer &&
      f.kind != Fault::Kind::kKillEngine)
    return Status::Ok();
  const std::string what = f.kind == Fault::Kind::kCorrupt
                               ? fmt::format("corrupt:{}", f.bucket)
                               : fmt::format("{}-{}:{}:{}", f.stop ? "stop" : "kill",
                                             f.kind == Fault::Kind::kKillTrainer ? "trainer"
                                                                                 : "engine",
                                             f.rank,
                                             f.bucket == Fault::kAtSetup    ? std::string("setup")
                                             : f.bucket == Fault::kAtCommit ? std::string("commit")
                                                                            : std::to_string(f.bucket));
  if (f.kind == Fault::Kind::kKillTrainer && f.rank >= config.policy.world_size)
    return Status::InvalidArgument(
        fmt::format("--fault {}: there is no trainer rank {} (policy.world_size is {})", what,
                    f.rank, config.policy.world_size));
  if (f.kind == Fault::Kind::kKillEngine && f.rank >= config.engine_ranks())
    return Status::InvalidArgument(fmt::format(
        "--fault {}: there is no engine rank {} (generation.num_engines x tp_size is {})", what,
        f.rank, config.engine_ranks()));
  REFIT_ASSIGN_OR_RETURN(auto model, load_rank_model(config));
  int rounds = static_cast<int>(model->plan.buckets.size());
  const char* unit = "bucket";
  if (uses_transfer_plan(config)) {
    REFIT_ASSIGN_OR_RETURN(auto inputs, PlanInputs::create(config, model->spec));
    REFIT_ASSIGN_OR_RETURN(rounds, plan_rounds(*inputs));
    unit = "round";
  }
  if (f.bucket >= rounds)
    return Status::InvalidArgument(fmt::format(
        "--fault {}: {} {} is past the plan, which moves {} {}(s) per refit (0..{}) with "
        "refit.buffer_size_bytes {}",
        what, unit, f.bucket, rounds, unit, rounds - 1, config.refit.buffer_size_bytes));
  return Status::Ok();
}

Status run_trainer_rank(const RankOptions& o, int rank, RefitReport* report) {
  log::set_prefix(fmt::format("trainer {}", rank));
  REFIT_ASSIGN_OR_RETURN(auto model, load_rank_model(o.config));
  model->weights->set_update(o.update);
  REFIT_ASSIGN_OR_RETURN(auto layout, trainer_layout(model->spec, o.config.policy, rank));
  REFIT_ASSIGN_OR_RETURN(auto trainer,
                         create_trainer_with_fault(o.config, rank, o.endpoint, o.fault));
  if (rank == 0) REFIT_RETURN_IF_ERROR(publish_weight_update(o));
  // The shards live on the rank's device: host memory, or GPU memory for device: cuda.
  REFIT_ASSIGN_OR_RETURN(const PlaneSettings plane_settings, PlaneSettings::from_environment());
  const int device = default_device(o.config, true, rank, plane_settings);
  REFIT_ASSIGN_OR_RETURN(auto plane, make_data_plane(o.config, device, plane_settings));
  REFIT_ASSIGN_OR_RETURN(SlotArena arena, SlotArena::create(*plane, trainer->tensors()));
  std::vector<PieceTarget> shards;
  for (std::size_t i = 0; i < trainer->tensors().size(); ++i) {
    const TensorSlot& s = trainer->tensors()[i];
    REFIT_RETURN_IF_ERROR(trainer->register_tensor(s.name, arena.ptrs[i], s.dtype, s.shape));
    shards.push_back({&layout.tensors[i].pieces, layout.tensors[i].shape, arena.ptrs[i]});
  }
  RefitReport rep;
  std::vector<double> unshard, cast, transfer, apply;
  // A refit that fails at its end with every rank alive (checksum mismatch, failed verification)
  // leaves the session usable, as in an RL loop: the next steps run, and the run fails at the end
  // naming the first failed step.
  Status first_failed;
  std::vector<int> failed_steps;
  for (int step = 1; step <= o.steps; ++step) {
    // The "training step": new weights in the registered shards.
    REFIT_RETURN_IF_ERROR(
        plane->diagnostics()->fill_weights(*model, shards, step, o.config.policy.dtype, o.config.policy.dtype));
    Status refitted = trainer->refit(step, weight_version(o.config.generation.backend, step),
                                     o.verify || o.check_logits);
    if (!refitted.ok() && !trainer->session_ok()) return refitted;
    if (!refitted.ok()) {
      if (first_failed.ok()) first_failed = refitted;
      failed_steps.push_back(step);
      if (rank == 0)
        log::warn("step {}/{}: refit failed, the session goes on: {}", step, o.steps,
                  refitted.message());
      continue;
    }
    const RefitStats& st = trainer->last_stats();
    rep.refit_seconds.push_back(st.seconds);
    rep.pause_seconds.push_back(st.pause_s);
    if (rank == 0 && o.config.refit.delta != DeltaMode::kOff) {
      REFIT_ASSIGN_OR_RETURN(const std::vector<RankTraffic> t, trainer->traffic());
      rep.delta_steps.push_back(delta_step_of(t, step));
      const DeltaStep& d = rep.delta_steps.back();
      log::info(
          "step {}/{}: refit.delta: {} pair(s) as a delta, {:.1f} % changed; wire {:.2f} "
          "MB of {:.2f} MB",
          step, o.steps, d.pairs, d.changed_fraction * 100, d.wire_bytes / 1e6, d.full_bytes / 1e6);
    }
    unshard.push_back(st.unshard_s);
    cast.push_back(st.cast_pack_s);
    transfer.push_back(st.transfer_s);
    apply.push_back(st.apply_s);
    if (rank == 0)
      log::info("step {}/{}: refit {:.3f} s, {:.2f} GB/s{}{}{}", step, o.steps, st.seconds,
                st.bytes / st.seconds / 1e9,
                o.config.refit.staged ? fmt::format(", generation paused {:.3f} s", st.pause_s)
                                      : std::string(),
                o.verify ? ", verified" : "", o.check_logits ? ", logits checked" : "");
  }
  for (int pass = 0; pass < o.raw_passes; ++pass) {
    REFIT_ASSIGN_OR_RETURN(double secs, raw_transport_pass(*trainer));
    rep.raw_seconds.push_back(secs);
  }
  if (rank == 0) {
    REFIT_ASSIGN_OR_RETURN(rep.ranks, trainer->traffic());
  }
  REFIT_RETURN_IF_ERROR(trainer->shutdown());
  if (rank == 0) {
    REFIT_ASSIGN_OR_RETURN(rep.control, control_traffic(*trainer));
  }
  // The floor's bandwidths are measured after the shutdown: the other ranks must not wait on this
  // rank (bounded by refit.timeout_s) while it copies gigabytes.
  if (o.raw_passes > 0 && rank == 0) {
    REFIT_ASSIGN_OR_RETURN(rep.copy_bandwidth, plane->diagnostics()->measure_copy_bandwidth());
    if (uses_transfer_plan(o.config)) {
      REFIT_ASSIGN_OR_RETURN(auto inputs, PlanInputs::create(o.config, model->spec));
      // The link: from this rank's device to the first engine rank on another device.
      int peer = plane->ordinal();
      for (int g = 0; g < o.config.engine_ranks() && peer == plane->ordinal(); ++g) {
        peer = device_ordinal(o.config, false, g, plane_settings);
      }
      REFIT_ASSIGN_OR_RETURN(rep.peer_bandwidth, plane->diagnostics()->measure_peer_bandwidth(peer));
      REFIT_ASSIGN_OR_RETURN(const PlanFloor f,
                             transfer_plan_floor(o.config, *inputs, rep.copy_bandwidth,
                                                 rep.peer_bandwidth, plane_settings));
      rep.floor_seconds = f.seconds;
      rep.floor_overlap_seconds = f.overlap_seconds;
      rep.floor_basis = f.basis;
    } else {
      const double params = static_cast<double>(model->spec.total_parameters());
      rep.floor_seconds = params *
                          static_cast<double>(dtype_size(o.config.policy.dtype) +
                                              dtype_size(o.config.refit.target_precision)) /
                          rep.copy_bandwidth;
      rep.floor_basis = "every parameter read once in the policy dtype and written once in the "
                        "target dtype at the copy bandwidth";
    }
  }
  if (rank == 0 && !o.dump_dir.empty())
    REFIT_RETURN_IF_ERROR(dump_trainer_tensors(o, *model, o.steps));
  rep.steps = o.steps;
  rep.verified = o.verify;
  rep.logits_checked = o.check_logits;
  rep.bytes_per_refit = trainer->bytes_per_refit();
  rep.buckets_per_refit = trainer->buckets_per_refit();
  rep.unshard_s = median(unshard);
  rep.cast_pack_s = median(cast);
  rep.transfer_s = median(transfer);
  rep.apply_s = median(apply);
  rep.plan_hash = trainer->plan_hash();
  rep.executor = std::string(executor_name(o.config.refit.executor));
  if (report != nullptr) *report = rep;
  if (!first_failed.ok())
    return first_failed.with_context(
        fmt::format("{} of {} refit(s) failed (steps {}); the session went on and the other steps "
                    "succeeded; the first failure",
                    failed_steps.size(), o.steps, fmt::join(failed_steps, ", ")));
  return Status::Ok();
}

DeltaStep delta_step_of(const std::vector<RankTraffic>& ranks, int step) {
  DeltaStep d{.step = step};
  std::int64_t elements = 0, changed = 0;
  for (const RankTraffic& t : ranks) {
    if (t.role == "trainer") {
      d.wire_bytes += t.bytes_sent;
      d.full_bytes += t.full_bytes;
      d.pairs += t.delta_pairs;
      elements += t.delta_elements;
      changed += t.delta_changed;
      d.encode_seconds = std::max(d.encode_seconds, t.encode_s);
    } else {
      d.apply_seconds = std::max(d.apply_seconds, t.delta_apply_s);
    }
  }
  d.changed_fraction =
      elements > 0 ? static_cast<double>(changed) / static_cast<double>(elements) : 0.0;
  return d;
}

Result<PlanFloor> transfer_plan_floor(const Config& config, PlanInputs& inputs,
                                      double copy_bandwidth, double peer_bandwidth,
                                      const PlaneSettings& settings) {
  std::map<int, double> local, out, in;  // per device: bytes read+written there, sent, received
  std::set<int> devices;
  const WireModel& wire = inputs.wire();
  REFIT_RETURN_IF_ERROR(for_each_trainer_view(inputs, [&](const PlanView& view) -> Status {
    for (const PairPlan& pair : view.pairs) {
      const int dt = device_ordinal(config, true, pair.trainer, settings);
      const int de = device_ordinal(config, false, pair.engine, settings);
      devices.insert(dt);
      devices.insert(de);
      for (const Route& r : pair.routes) {
        const auto n = static_cast<double>(r.numel());
        const bool scale = wire.fp8 && wire.fp8->is_scale(r.hf_tensor);
        // FP8 scales are read as float32 (the trainer computed them); everything else in the
        // policy dtype. Written in the route's wire dtype.
        const auto ssize =
            static_cast<double>(dtype_size(scale ? DType::kFloat32 : config.policy.dtype));
        const auto tsize = static_cast<double>(dtype_size(view.dtype_of(r)));
        local[dt] += n * ssize;  // the source is read where it lives
        if (dt == de) {
          local[dt] += n * tsize;
        } else {
          out[dt] += n * tsize;
          in[de] += n * tsize;
        }
      }
    }
    return Status::Ok();
  }));
  PlanFloor f;
  for (int d : devices) {
    const double link = std::max(out[d], in[d]);
    const double local_s = local[d] / copy_bandwidth;
    const double link_s = peer_bandwidth > 0 ? link / peer_bandwidth : 0.0;
    f.overlap_seconds = std::max(f.overlap_seconds, std::max(local_s, link_s));
    if (local_s + link_s <= f.seconds) continue;
    f.seconds = local_s + link_s;
    f.basis = fmt::format(
        "device {}: {:.3f} GB read+written locally at {:.0f} GB/s, {:.3f} GB over the link at "
        "{:.0f} GB/s",
        d, local[d] / 1e9, copy_bandwidth / 1e9, link / 1e9, peer_bandwidth / 1e9);
  }
  return f;
}

namespace {

// FP8 (docs/fp8.md): every parameter against the reference quantizer over whole HF tensors, on
// the engine rank's GPU with device: cuda, else on the host.
Status verify_fp8_params(DataPlane& plane, const RankModel& model, const WireModel& wire,
                         const EngineShardLayout& layout, const std::vector<PieceTarget>& params,
                         const Config& cfg, int step, const std::string& who) {
  Fp8Reference ref(model, wire, cfg.policy.dtype, step);
  std::optional<Fp8Mismatch> found;
  const bool on_gpu = plane.device() == Device::kCuda;
  if (on_gpu) {
    REFIT_ASSIGN_OR_RETURN(
        found, find_fp8_mismatch_on_device(plane, model, wire, layout, params, cfg.policy.dtype,
                                           cfg.seed, step, cfg.refit.timeout()));
  } else {
    std::vector<std::byte> got;
    for (std::size_t i = 0; i < params.size() && !found; ++i) {
      const EngineParam& p = layout.params[i];
      REFIT_ASSIGN_OR_RETURN(const std::vector<std::byte> want, ref.param(p));
      got.resize(want.size());
      REFIT_RETURN_IF_ERROR(plane.read(got.data(), params[i].data, got.size()));
      if (got == want) continue;
      const std::size_t esize = dtype_size(p.dtype);
      std::size_t b = 0;
      while (got[b] == want[b]) ++b;
      Fp8Mismatch mm{.param = i, .element = static_cast<std::int64_t>(b / esize)};
      const auto at = static_cast<std::size_t>(mm.element) * esize;
      std::memcpy(&mm.got, got.data() + at, esize);
      std::memcpy(&mm.want, want.data() + at, esize);
      found = mm;
    }
  }
  if (found) {
    const EngineParam& p = layout.params[found->param];
    const std::size_t esize = dtype_size(p.dtype);
    const std::int64_t k = found->element;
    const std::int64_t cols = matrix_shape(p.shape).cols;
    return Status::Corruption(fmt::format(
        "verify: {}: tensor {} ({}) element {} (row {}, col {}; from {}) is 0x{:0{}x}, expected "
        "0x{:0{}x} (step {}, the reference quantizer of docs/fp8.md{})",
        who, p.name, dtype_name(p.dtype), k, k / cols, k % cols, ref.source(p, k / cols, k % cols),
        found->got, esize * 2, found->want, esize * 2, step, on_gpu ? ", on the GPU" : ""));
  }
  log::info("{}: {} parameters verified bit-exact against the FP8 reference quantizer{} (step {})",
            who, params.size(), on_gpu ? " on the GPU" : "", step);
  return Status::Ok();
}

// Recomputes what every parameter must hold after `step` and compares bit for bit, on the
// engine's device; the first mismatch names the parameter, the element and its HF source.
Status verify_params(DataPlane& plane, const RankModel& model, const WireModel& wire,
                     const EngineShardLayout& layout, const std::vector<PieceTarget>& params,
                     const Config& cfg, int step, const std::string& who) {
  if (wire.fp8) return verify_fp8_params(plane, model, wire, layout, params, cfg, step, who);
  // One pass per engine dtype: the parameters in the plain dtype, then any kept apart (the router
  // correction bias in float32, spec/fp8.h engine_dtype).
  std::optional<std::pair<std::size_t, std::int64_t>> found;
  std::vector<DType> dtypes;
  for (const EngineParam& p : layout.params)
    if (std::find(dtypes.begin(), dtypes.end(), p.dtype) == dtypes.end()) dtypes.push_back(p.dtype);
  for (const DType group : dtypes) {
    std::vector<PieceTarget> targets;
    std::vector<std::size_t> index_of;
    for (std::size_t i = 0; i < params.size(); ++i)
      if (layout.params[i].dtype == group) {
        targets.push_back(params[i]);
        index_of.push_back(i);
      }
    REFIT_ASSIGN_OR_RETURN(auto hit,
                           plane.diagnostics()->find_mismatch(model, targets, step, cfg.policy.dtype, group));
    if (hit) {
      found = std::make_pair(index_of[hit->first], hit->second);
      break;
    }
  }
  if (!found) return Status::Ok();
  const auto [index, k] = *found;
  const EngineParam& p = layout.params[index];
  const DType dt = p.dtype;
  const std::size_t esize = dtype_size(dt);
  const std::int64_t cols = matrix_shape(p.shape).cols;
  const std::int64_t row = k / cols, col = k % cols;
  std::uint32_t got = 0, want = 0;
  REFIT_RETURN_IF_ERROR(
      plane.read(&got, params[index].data + k * static_cast<std::int64_t>(esize), esize));
  std::string source = "vocabulary padding (must be zero)";
  for (const Piece& pc : p.pieces) {
    if (row < pc.dst_row || row >= pc.dst_row + pc.rows || col < pc.dst_col ||
        col >= pc.dst_col + pc.cols)
      continue;
    const std::int64_t hf_row = pc.src_row + row - pc.dst_row;
    const std::int64_t hf_col = pc.src_col + col - pc.dst_col;
    source = fmt::format("{}[{}, {}]", model.spec.tensors()[pc.hf_tensor].name, hf_row, hf_col);
    const Piece one{pc.hf_tensor, hf_row, hf_col, 1, 1, 0, 0};
    materialize_pieces(model.spec, {one}, {1}, *model.weights, step, cfg.policy.dtype, dt,
                       reinterpret_cast<std::byte*>(&want));
    break;
  }
  return Status::Corruption(
      fmt::format("verify: {}: tensor {} element {} (row {}, col {}; from {}) is 0x{:0{}x}, "
                  "expected 0x{:0{}x} (step {})",
                  who, p.name, k, row, col, source, got, esize * 2, want, esize * 2, step));
}

}  // namespace

Status check_logit_check_fits(const Config& cfg, const ModelSpec& spec) {
  if (!has_reference_forward(spec.config().arch))
    return Status::Unsupported(fmt::format(
        "--check-logits: refit has no reference forward for {} ({}); --verify still checks "
        "every byte the engines hold",
        spec.config().architecture, cfg.model));
  if (spec.total_parameters() > kLogitCheckMaxParams)
    return Status::InvalidArgument(fmt::format(
        "--check-logits: {} has {} parameters; the CPU reference forward is limited to {}",
        cfg.model, spec.total_parameters(), kLogitCheckMaxParams));
  // The forward's facts from config.json (activation, soft-capping, windows, RoPE).
  REFIT_ASSIGN_OR_RETURN(const std::string json, model_config_json(cfg.model));
  const Result<ForwardConfig> fc = forward_config(spec, json);
  if (!fc.ok()) return fc.status().with_context("--check-logits");
  return Status::Ok();
}

namespace {

// An FP8 code times its scale, rounded to bf16: the weight the forward passes of --check-logits
// use for a quantized element, on both sides (docs/fp8.md).
std::uint16_t dequantized_bf16(std::uint8_t code, float scale) {
  return f32_to_bf16(fp8e4m3_to_f32(code) * scale);
}

// Parameter `i` of `layout` on the host: bf16 and float32 as they are (float32 elements as two
// halves each), an fp8 weight dequantized to bf16 with the scale parameter after it (each
// element's scale found through the layouts' pieces: the block of its HF element). Sets `*used`
// to the number of parameters read (2 for an fp8 weight and its scale).
Result<std::vector<std::uint16_t>> param_value(DataPlane& plane, const WireModel& wire,
                                               const EngineShardLayout& layout,
                                               const std::vector<PieceTarget>& params,
                                               std::size_t i, std::size_t* used) {
  const EngineParam& p = layout.params[i];
  const MatrixShape m = matrix_shape(p.shape);
  *used = 1;
  if (p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat32) {
    const std::size_t halves = p.dtype == DType::kFloat32 ? 2 : 1;
    std::vector<std::uint16_t> out(static_cast<std::size_t>(m.numel()) * halves);
    REFIT_RETURN_IF_ERROR(plane.read(out.data(), params[i].data, out.size() * 2));
    return out;
  }
  if (p.dtype != DType::kFloat8E4M3 || i + 1 >= params.size())
    return Status::Unsupported(
        fmt::format("--check-logits: parameter {} is {}", p.name, dtype_name(p.dtype)));
  *used = 2;
  const EngineParam& sp = layout.params[i + 1];
  const MatrixShape sm = matrix_shape(sp.shape);
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(m.numel()));
  std::vector<float> scales(static_cast<std::size_t>(sm.numel()));
  REFIT_RETURN_IF_ERROR(plane.read(codes.data(), params[i].data, codes.size()));
  REFIT_RETURN_IF_ERROR(plane.read(scales.data(), params[i + 1].data, scales.size() * 4));
  std::vector<std::uint16_t> v(codes.size(), 0);
  const Fp8Table& f = *wire.fp8;
  for (const Piece& pc : p.pieces) {
    const auto st = static_cast<std::uint32_t>(f.scale_of[pc.hf_tensor]);
    const MatrixShape b = f.block(wire.spec, pc.hf_tensor);
    // The scale piece derived from this weight piece: it covers every block of it.
    const std::int64_t hr0 = pc.src_row / b.rows, hc0 = pc.src_col / b.cols;
    const Piece* s = nullptr;
    for (const Piece& q : sp.pieces)
      if (q.hf_tensor == st && hr0 >= q.src_row && hr0 < q.src_row + q.rows && hc0 >= q.src_col &&
          hc0 < q.src_col + q.cols)
        s = &q;
    if (s == nullptr)
      return Status::Internal(
          fmt::format("--check-logits: no scale of {} covers block ({}, {})", p.name, hr0, hc0));
    for (std::int64_t r = 0; r < pc.rows; ++r)
      for (std::int64_t c = 0; c < pc.cols; ++c) {
        const std::int64_t hr = (pc.src_row + r) / b.rows, hc = (pc.src_col + c) / b.cols;
        const std::int64_t k = (pc.dst_row + r) * m.cols + pc.dst_col + c;
        const float scale = scales[static_cast<std::size_t>(
            (s->dst_row + hr - s->src_row) * sm.cols + s->dst_col + hc - s->src_col)];
        v[static_cast<std::size_t>(k)] =
            dequantized_bf16(codes[static_cast<std::size_t>(k)], scale);
      }
  }
  return v;
}

// Every parameter of `layout` but the FP8 scales, on the host (param_value).
Result<std::vector<std::vector<std::uint16_t>>> engine_values(
    DataPlane& plane, const WireModel& wire, const EngineShardLayout& layout,
    const std::vector<PieceTarget>& params) {
  std::vector<std::vector<std::uint16_t>> out;
  for (std::size_t i = 0; i < params.size();) {
    std::size_t used = 1;
    REFIT_ASSIGN_OR_RETURN(std::vector<std::uint16_t> v,
                           param_value(plane, wire, layout, params, i, &used));
    out.push_back(std::move(v));
    i += used;
  }
  return out;
}

// What an MLA engine derives from kv_b_proj after loading (vLLM's W_UK_T / W_UV in
// process_weights_after_loading, SGLang's w_kc / w_vc in post_load_weights): derived again by
// this engine's weights_changed hook for every layer whose kv_b_proj a refit rewrote, and read
// by the logit check's absorbed forward (stale matrices would fail it).
class MlaDerivedState {
 public:
  // `derive`: whether the matrices are derived (refit run --verify / --check-logits); without,
  // the hook's names are checked only.
  MlaDerivedState(const Config& cfg, const ModelSpec& spec, bool derive, std::string who)
      : cfg_(cfg),
        spec_(spec),
        derive_(derive),
        who_(std::move(who)),
        absorbed_(static_cast<std::size_t>(spec.config().num_layers)) {}

  // The weights_changed hook: `changed` must name every parameter of the rank, in layout order.
  Status derive(DataPlane& plane, const WireModel& wire, const EngineShardLayout& layout,
                const std::vector<PieceTarget>& params, const std::vector<std::string>& changed) {
    if (changed.size() != layout.params.size())
      return Status::Internal(
          fmt::format("{}: the weights_changed hook named {} parameters; the rank holds {}", who_,
                      changed.size(), layout.params.size()));
    for (std::size_t i = 0; i < changed.size(); ++i)
      if (changed[i] != layout.params[i].name)
        return Status::Internal(fmt::format(
            "{}: the weights_changed hook named {} where the layout's parameter {} ({}) was due",
            who_, changed[i], i, layout.params[i].name));
    ++epoch_;
    if (!derive_ || !spec_.config().mla || cfg_.generation.layout != EngineLayout::kFused)
      return Status::Ok();
    // Every parameter changed: each layer's kv_b_proj (dequantized with FP8) gives its matrices.
    int layers = 0;
    for (std::size_t i = 0; i < changed.size(); ++i) {
      const std::string& name = changed[i];
      if (!name.ends_with(".self_attn.kv_b_proj.weight")) continue;
      const std::int64_t layer = layer_of_name(name);
      if (layer < 0 || layer >= spec_.config().num_layers)
        return Status::Internal(fmt::format("{}: {} is outside the decoder layers", who_, name));
      std::size_t used = 1;
      REFIT_ASSIGN_OR_RETURN(const std::vector<std::uint16_t> kv_b,
                             param_value(plane, wire, layout, params, i, &used));
      absorbed_[static_cast<std::size_t>(layer)] =
          derive_mla(spec_.config(), cfg_.generation.tp_size, kv_b.data());
      ++layers;
    }
    log::info(
        "{}: weights_changed hook: {} parameters; {} derived again from kv_b_proj for {} "
        "layers",
        who_, changed.size(),
        cfg_.generation.backend == EngineProtocol::kSglang ? "w_kc / w_vc" : "W_UK_T / W_UV",
        layers);
    return Status::Ok();
  }

  const std::vector<MlaAbsorbed>& absorbed() const { return absorbed_; }
  // Calls of derive() so far.
  int epoch() const { return epoch_; }

 private:
  const Config& cfg_;
  const ModelSpec& spec_;
  const bool derive_;
  const std::string who_;
  std::vector<MlaAbsorbed> absorbed_;
  int epoch_ = 0;
};

// The engine's TP forward pass against a single-process forward on the trainer's weights.
class LogitCheck {
 public:
  static Result<std::unique_ptr<LogitCheck>> create(const RankOptions& o, const RankModel& model,
                                                    int engine_rank) {
    auto lc = std::unique_ptr<LogitCheck>(new LogitCheck());
    REFIT_RETURN_IF_ERROR(check_logit_check_fits(o.config, model.spec));
    const int tp = o.config.generation.tp_size;
    // With the hf layout every rank holds the whole model: no TP group.
    if (tp > 1 && o.config.generation.layout == EngineLayout::kFused) {
      const auto timeout =
          std::chrono::milliseconds(static_cast<long long>(o.config.refit.timeout_s * 1000));
      REFIT_ASSIGN_OR_RETURN(const std::shared_ptr<const ControlAuth> auth, process_control_auth());
      REFIT_ASSIGN_OR_RETURN(lc->store_, connect_store(o.endpoint.master_addr,
                                                       o.endpoint.master_port, timeout, auth));
      GlooOptions g{fmt::format("engine{}-tp", engine_rank / tp), engine_rank % tp, tp,
                    o.endpoint.host, timeout};
      REFIT_ASSIGN_OR_RETURN(lc->tp_group_, make_gloo_communicator(*lc->store_, g));
    }
    lc->tokens_ = logit_check_tokens(model.spec, kLogitCheckTokens);
    REFIT_ASSIGN_OR_RETURN(const std::string json, model_config_json(o.config.model));
    REFIT_ASSIGN_OR_RETURN(lc->fc_, forward_config(model.spec, json));
    return lc;
  }

  Status check(DataPlane& plane, const RankModel& model, const WireModel& wire,
               const EngineShardLayout& layout, const std::vector<PieceTarget>& params,
               const Config& cfg, int step, const std::string& who, const MlaDerivedState* mla) {
    // Reference: full HF tensors as the trainer holds them after the cast (bf16 → fp32); with
    // fp8 the quantized weights dequantized (docs/fp8.md, "--check-logits").
    const auto& tensors = model.spec.tensors();
    std::optional<Fp8Reference> ref;
    if (wire.fp8) ref.emplace(model, wire, cfg.policy.dtype, step);
    std::vector<std::vector<float>> hf(tensors.size());
    std::vector<const float*> hf_ptrs;
    std::vector<std::uint16_t> bf16;
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const MatrixShape m = matrix_shape(tensors[t].shape);
      bf16.assign(static_cast<std::size_t>(m.numel()), 0);
      if (wire.dtype[t] == DType::kFloat32) {  // kept in float32 by the engines (engine_dtype)
        const Piece whole{static_cast<std::uint32_t>(t), 0, 0, m.rows, m.cols, 0, 0};
        hf[t].resize(bf16.size());
        materialize_pieces(model.spec, {whole}, tensors[t].shape, *model.weights, step,
                           cfg.policy.dtype, DType::kFloat32,
                           reinterpret_cast<std::byte*>(hf[t].data()));
        hf_ptrs.push_back(hf[t].data());
        continue;
      }
      if (ref && wire.fp8->quantized(static_cast<std::uint32_t>(t))) {
        const auto s = static_cast<std::uint32_t>(wire.fp8->scale_of[t]);
        REFIT_ASSIGN_OR_RETURN(const std::vector<std::byte>* codes, ref->tensor(static_cast<std::uint32_t>(t)));
        const std::vector<std::byte> c = *codes;
        REFIT_ASSIGN_OR_RETURN(const std::vector<std::byte>* scales, ref->tensor(s));
        const MatrixShape b = wire.fp8->block(wire.spec, static_cast<std::uint32_t>(t));
        const std::int64_t nbc = (m.cols + b.cols - 1) / b.cols;
        const auto* sc = reinterpret_cast<const float*>(scales->data());
        for (std::int64_t r = 0; r < m.rows; ++r)
          for (std::int64_t k = 0; k < m.cols; ++k)
            bf16[static_cast<std::size_t>(r * m.cols + k)] = dequantized_bf16(
                static_cast<std::uint8_t>(c[static_cast<std::size_t>(r * m.cols + k)]),
                sc[(r / b.rows) * nbc + k / b.cols]);
      } else {
        const Piece whole{static_cast<std::uint32_t>(t), 0, 0, m.rows, m.cols, 0, 0};
        materialize_pieces(model.spec, {whole}, tensors[t].shape, *model.weights, step,
                           cfg.policy.dtype, DType::kBFloat16,
                           reinterpret_cast<std::byte*>(bf16.data()));
      }
      hf[t].resize(bf16.size());
      convert(bf16.data(), DType::kBFloat16, hf[t].data(), DType::kFloat32, bf16.size());
      hf_ptrs.push_back(hf[t].data());
    }
    REFIT_ASSIGN_OR_RETURN(auto want, reference_forward(model.spec, fc_, hf_ptrs, tokens_));
    // The engine's shards as bf16 (fp8 weights dequantized with the scales the engine holds),
    // in the model's engine layout (no scale parameters).
    REFIT_ASSIGN_OR_RETURN(EngineShardLayout base,
                           engine_layout(model.spec, cfg.generation.tp_size, layout.tp_rank,
                                         cfg.generation.layout, cfg.generation.backend));
    REFIT_ASSIGN_OR_RETURN(std::vector<std::vector<std::uint16_t>> host,
                           engine_values(plane, wire, layout, params));
    if (host.size() != base.params.size())
      return Status::Internal("check-logits: the engine layout without scales differs");
    // The parameters the engines keep in float32 stay float32 (engine_values read them so); fp8
    // weights arrive dequantized to bf16, their scales left out.
    for (std::size_t i = 0, k = 0; i < layout.params.size() && k < base.params.size(); ++k) {
      if (layout.params[i].dtype == DType::kFloat32) base.params[k].dtype = DType::kFloat32;
      i += layout.params[i].dtype == DType::kFloat8E4M3 ? 2 : 1;
    }
    std::vector<const void*> values;
    for (const auto& h : host) values.push_back(h.data());
    std::vector<float> got;
    if (cfg.generation.layout == EngineLayout::kHf) {
      // Whole HF tensors, one per parameter in the spec's order: the same forward on them.
      std::vector<std::vector<float>> held(values.size());
      std::vector<const float*> held_ptrs;
      for (std::size_t i = 0; i < values.size(); ++i) {
        const DType dt = base.params[i].dtype;
        held[i].resize(static_cast<std::size_t>(matrix_shape(base.params[i].shape).numel()));
        convert(values[i], dt, held[i].data(), DType::kFloat32, held[i].size());
        held_ptrs.push_back(held[i].data());
      }
      REFIT_ASSIGN_OR_RETURN(got, reference_forward(model.spec, fc_, held_ptrs, tokens_));
    } else {
      // MLA: the absorbed matrices as the engine's weights_changed hook derived them after this
      // refit (stale ones would fail here).
      if (model.spec.config().mla) {
        if (mla == nullptr || mla->epoch() == checked_epoch_)
          return Status::Internal(fmt::format(
              "check-logits: {} (step {}): the weights_changed hook did not run after this "
              "refit, so the MLA matrices were not derived again",
              who, step));
        checked_epoch_ = mla->epoch();
      }
      REFIT_ASSIGN_OR_RETURN(got,
                             engine_forward(model.spec, fc_, base, values, tokens_, tp_group_.get(),
                                            mla ? &mla->absorbed() : nullptr));
    }
    Status st = compare_logits(got, want, model.spec.config().vocab_size, kLogitTolerance);
    if (!st.ok()) return st.with_context(fmt::format("check-logits: {} (step {})", who, step));
    log::info(
        "{}: logits of {} tokens from the engine's {} match the reference forward of {} "
        "(error {:.2g} relative to the largest logit; tolerance {:.0e}; step {})",
        who, tokens_.size(),
        cfg.generation.layout == EngineLayout::kHf ? "whole tensors" : "TP shards",
        architecture_name(model.spec.config().arch), logit_error(got, want), kLogitTolerance, step);
    return Status::Ok();
  }

 private:
  LogitCheck() = default;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Communicator> tp_group_;
  std::vector<std::int32_t> tokens_;
  ForwardConfig fc_;
  int checked_epoch_ = 0;  // the MLA derivation the last check used
};

// After a rollback to `version`: the parameters hold it again, bit for bit — the weights of
// `step`, the last step that passed verification, or with step 0 the zero-filled storage of
// before the first refit.
Status verify_rolled_back(DataPlane& plane, const RankModel& model, const WireModel& wire,
                          const EngineShardLayout& layout, const std::vector<PieceTarget>& params,
                          const Config& cfg, int step, const std::string& version,
                          const std::string& who) {
  if (step == 0) {
    std::vector<std::byte> host;
    for (std::size_t i = 0; i < params.size(); ++i) {
      host.resize(static_cast<std::size_t>(layout.params[i].bytes()));
      REFIT_RETURN_IF_ERROR(plane.read(host.data(), params[i].data, host.size()));
      if (std::any_of(host.begin(), host.end(), [](std::byte b) { return b != std::byte{0}; }))
        return Status::Corruption(fmt::format(
            "{}: rolled back to version 0, but parameter {} is not the zero-filled storage it "
            "held before the first refit",
            who, layout.params[i].name));
    }
  } else {
    REFIT_RETURN_IF_ERROR(verify_params(plane, model, wire, layout, params, cfg, step, who)
                              .with_context("after the rollback to version " + version));
  }
  log::info("{}: the weights kept after the failed refit (version '{}') verified bit-exact", who,
            version);
  return Status::Ok();
}

// The weights of an engine that takes them by name (generation.layout hf): every load_weights
// batch is copied here, and the hook's contract (refit/session.h on_load_weights) is checked —
// every parameter once per refit, in layout order, whole, from the rank's own storage, a decoder
// layer never split, a batch within refit.buffer_size_bytes unless one layer is larger.
class LoadedWeights {
 public:
  LoadedWeights(const EngineShardLayout& layout, const std::vector<void*>& storage,
                std::int64_t limit, std::string who)
      : layout_(layout), storage_(storage), limit_(limit), who_(std::move(who)),
        bytes_(layout.params.size()) {}

  Status take(DataPlane& plane, const std::vector<ParamView>& batch) {
    if (next_ == layout_.params.size()) next_ = 0, calls_ = 0;  // a new refit (or a rollback)
    if (batch.empty())
      return Status::Internal(fmt::format("{}: load_weights batch {} is empty", who_, calls_));
    const std::int64_t first_layer = layer_of_name(batch.front().name);
    if (calls_ > 0 && first_layer >= 0 && first_layer == prev_layer_)
      return Status::Internal(
          fmt::format("{}: load_weights split layer {} across two calls", who_, prev_layer_));
    std::int64_t bytes = 0;
    std::set<std::int64_t> layers;
    for (const ParamView& v : batch) {
      if (next_ >= layout_.params.size() || v.name != layout_.params[next_].name ||
          v.data != storage_[next_] || v.shape != layout_.params[next_].shape)
        return Status::Internal(fmt::format(
            "{}: load_weights batch {} handed {} where the layout's parameter {} ({}) was due",
            who_, calls_, v.name, next_,
            next_ < layout_.params.size() ? layout_.params[next_].name : "none"));
      auto& host = bytes_[next_];
      host.resize(static_cast<std::size_t>(v.numel()) * dtype_size(v.dtype));
      REFIT_RETURN_IF_ERROR(plane.read(host.data(), static_cast<const std::byte*>(v.data), host.size()));
      bytes += static_cast<std::int64_t>(host.size());
      layers.insert(layer_of_name(v.name));
      ++next_;
    }
    prev_layer_ = layer_of_name(batch.back().name);
    // Over the limit only as one unit: one decoder layer, or one tensor outside the layers.
    const bool one_unit = batch.size() == 1 || (layers.size() == 1 && *layers.begin() >= 0);
    if (bytes > limit_ && !one_unit)
      return Status::Internal(fmt::format(
          "{}: load_weights batch {} holds {} bytes in {} tensors; the limit is {}", who_, calls_,
          bytes, batch.size(), limit_));
    ++calls_;
    return Status::Ok();
  }

  // At verification: the hook took every parameter, and what it took is what the storage holds.
  Status check_complete(DataPlane& plane, int step) {
    if (next_ != layout_.params.size())
      return Status::Corruption(fmt::format(
          "{}: the load_weights hook took {} of {} parameters before verification (step {})",
          who_, next_, layout_.params.size(), step));
    std::vector<std::byte> held;
    for (std::size_t i = 0; i < bytes_.size(); ++i) {
      held.resize(bytes_[i].size());
      REFIT_RETURN_IF_ERROR(plane.read(held.data(), static_cast<const std::byte*>(storage_[i]), held.size()));
      if (held != bytes_[i])
        return Status::Corruption(fmt::format(
            "{}: the weights load_weights took for {} differ from the parameter's bytes (step {})",
            who_, layout_.params[i].name, step));
    }
    if (!logged_) {
      log::info("{}: load_weights took all {} tensors by name in {} call(s), whole, no layer "
                "split",
                who_, layout_.params.size(), calls_);
      logged_ = true;
    }
    return Status::Ok();
  }

 private:
  const EngineShardLayout& layout_;
  const std::vector<void*>& storage_;
  const std::int64_t limit_;
  const std::string who_;
  std::vector<std::vector<std::byte>> bytes_;
  std::size_t next_ = 0;
  int calls_ = 0;
  std::int64_t prev_layer_ = -1;
  bool logged_ = false;
};

}  // namespace

namespace {

// --update: trainer rank 0 publishes the update its weights follow; every engine checks it against
// its own before it serves, so that ranks started separately with different flags fail at setup
// naming the flag instead of failing verification.
constexpr const char* kUpdateKey = "harness/weight_update";

Result<std::unique_ptr<Store>> harness_store(const RankOptions& o) {
  REFIT_ASSIGN_OR_RETURN(const std::shared_ptr<const ControlAuth> auth, process_control_auth());
  return connect_store(o.endpoint.master_addr, o.endpoint.master_port, o.config.refit.timeout(),
                       auth);
}

}  // namespace

Status publish_weight_update(const RankOptions& o) {
  REFIT_ASSIGN_OR_RETURN(auto store, harness_store(o));
  return store->set(kUpdateKey, weight_update_name(o.update));
}

Status check_weight_update(const RankOptions& o, const std::string& who) {
  REFIT_ASSIGN_OR_RETURN(auto store, harness_store(o));
  auto theirs = store->get(kUpdateKey, o.config.refit.timeout());
  if (!theirs.ok()) return theirs.status().with_context("reading trainer rank 0's --update");
  const std::string ours = weight_update_name(o.update);
  if (*theirs != ours)
    return Status::InvalidArgument(fmt::format(
        "--update: {} runs --update {}, but trainer rank 0 runs --update {}; give every rank "
        "the same --update",
        who, ours, *theirs));
  return Status::Ok();
}

Status run_engine_rank(const RankOptions& o, int engine_rank) {
  log::set_prefix(fmt::format("engine rank {}", engine_rank));
  const Config& cfg = o.config;
  const std::string who = RankId::engine(engine_rank, cfg.generation.tp_size).name();
  REFIT_ASSIGN_OR_RETURN(auto model, load_rank_model(cfg));
  model->weights->set_update(o.update);
  REFIT_ASSIGN_OR_RETURN(const WireModel wire, wire_model(cfg, model->spec));
  REFIT_ASSIGN_OR_RETURN(auto layout, engine_wire_layout(cfg, model->spec, wire,
                                                         engine_rank % cfg.generation.tp_size));
  REFIT_ASSIGN_OR_RETURN(auto engine,
                         create_engine_with_fault(cfg, engine_rank, o.endpoint, o.fault));
  REFIT_RETURN_IF_ERROR(check_weight_update(o, who));
  // refit-owned parameter storage: a colocated trainer rank holding full tensors writes it in
  // place.
  REFIT_ASSIGN_OR_RETURN(std::vector<void*> storage, engine->allocate_params());
  REFIT_ASSIGN_OR_RETURN(const PlaneSettings plane_settings, PlaneSettings::from_environment());
  const int device = default_device(cfg, false, engine_rank, plane_settings);
  REFIT_ASSIGN_OR_RETURN(auto plane, make_data_plane(cfg, device, plane_settings));
  std::vector<PieceTarget> params;
  for (std::size_t i = 0; i < storage.size(); ++i)
    params.push_back(
        {&layout.params[i].pieces, layout.params[i].shape, static_cast<std::byte*>(storage[i])});
  std::unique_ptr<LogitCheck> logits;
  if (o.check_logits) {
    REFIT_ASSIGN_OR_RETURN(logits, LogitCheck::create(o, *model, engine_rank));
  }
  // The weights_changed hook: checks that it names every parameter, and derives MLA's absorbed
  // matrices again from the refit's kv_b_proj, as the engines must.
  MlaDerivedState mla(cfg, model->spec, o.verify || o.check_logits, who);
  engine->on_weights_changed([&](const std::vector<std::string>& names) {
    return mla.derive(*plane, wire, layout, params, names);
  });
  // The step of the refit in flight, and of the version the engine published last (0: the
  // zero-filled storage): a refit whose verification passed here is published only when every
  // engine rank's passed, so the two differ after a refit that failed elsewhere.
  int verifying_step = 0, published_step = 0;
  // --fault fail-pause / slow-pause: this rank's pause hook fails, or outlasts the timeout, in
  // refit step S (the hook's calls count the refits; bench passes do not pause).
  int pauses = 0;
  engine->on_pause([&]() -> Status {
    ++pauses;
    if (o.fault.rank != engine_rank || o.fault.step != pauses) return Status::Ok();
    if (o.fault.kind == Fault::Kind::kFailPause) {
      log::info("{}: fault: the pause hook fails in refit step {}", who, pauses);
      return Status::Internal("fault injection: the pause hook failed (--fault fail-pause)");
    }
    if (o.fault.kind == Fault::Kind::kSlowPause) {
      log::info("{}: fault: the pause hook takes 1.5 x refit.timeout_s in refit step {}", who,
                pauses);
      std::this_thread::sleep_for(cfg.refit.timeout() * 3 / 2);
    }
    return Status::Ok();
  });
  // generation.layout hf: the engine takes the weights by name, as vLLM's and SGLang's
  // load_weights do. This one copies every batch into weights of its own (host memory), checking
  // the hook's contract as it goes; verification then checks those too.
  std::unique_ptr<LoadedWeights> loaded;
  if (cfg.generation.layout == EngineLayout::kHf) {
    loaded = std::make_unique<LoadedWeights>(layout, storage, cfg.refit.buffer_size_bytes, who);
    engine->on_load_weights(
        [&](const std::vector<ParamView>& batch) { return loaded->take(*plane, batch); });
  }
  engine->on_verify([&](int step, const std::string&) -> Status {
    verifying_step = step;
    if (loaded) REFIT_RETURN_IF_ERROR(loaded->check_complete(*plane, step));
    // Element-wise verification unless the engine was started for the logit check alone.
    if (o.verify || !logits)
      REFIT_RETURN_IF_ERROR(verify_params(*plane, *model, wire, layout, params, cfg, step, who));
    if (logits)
      REFIT_RETURN_IF_ERROR(
          logits->check(*plane, *model, wire, layout, params, cfg, step, who, &mla));
    return Status::Ok();
  });
  // Serve until the shutdown, past refits that failed at their end (the session goes on). After
  // a rollback (refit.keep_previous) under --verify, the restored bytes are verified too.
  while (true) {
    Result<bool> more = engine->serve_one();
    if (more.ok() && !*more) break;
    if (more.ok()) {
      published_step = verifying_step;
      // The run's log says that refit.checksum held (the runtime says it at debug level).
      if (const int matched = engine->last_stats().checksums_matched; matched > 0)
        log::info("{}: refit.checksum: step {} arrived intact from {} feeder(s)", who,
                  published_step, matched);
      continue;
    }
    if (!engine->session_ok()) {
      // What generation would serve now: the previous version, or nothing (never a new label over
      // torn weights).
      log::info("{}: the session ended with weight version '{}'{}", who, engine->weight_version(),
                engine->is_valid() ? "" : " (invalid: generation stays paused)");
      return more.status();
    }
    if (!o.verify || !engine->is_valid()) continue;
    if (loaded) REFIT_RETURN_IF_ERROR(loaded->check_complete(*plane, published_step));
    REFIT_RETURN_IF_ERROR(verify_rolled_back(*plane, *model, wire, layout, params, cfg,
                                             published_step, engine->weight_version(), who));
  }
  if (o.dump_dir.empty()) return Status::Ok();
  return dump_engine_params(o, *plane, layout, params, engine_rank);
}

}  // namespace refit
