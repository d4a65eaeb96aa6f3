// validate_config: cross-key and model checks at setup, before any rank starts (docs/design.md §1,
// §5.4).
#include <fmt/format.h>

#include <string>
#include <vector>

#include "config/support.h"
#include "engine/engine_layout.h"
#include "refit/config.h"

namespace refit {
namespace {

constexpr int kMaxListed = 64;

std::string join_ints(const std::vector<std::int64_t>& values) {
  std::string out;
  for (auto v : values) out += (out.empty() ? "" : ", ") + std::to_string(v);
  return out.empty() ? "none" : out;
}

// Every candidate in [1, kMaxListed] that passes `ok`.
template <typename Pred>
std::vector<std::int64_t> candidates(Pred ok) {
  std::vector<std::int64_t> out;
  for (std::int64_t v = 1; v <= kMaxListed; ++v)
    if (ok(v)) out.push_back(v);
  return out;
}

Status invalid(std::string_view key, std::string_view problem, std::string_view got,
               std::string_view allowed) {
  return Status::InvalidArgument(
      fmt::format("{}: {}; got {}; allowed: {}", key, problem, got, allowed));
}

// Single-key checks again, for configs built in code rather than parsed.
Status check_values(const Config& c) {
  if (c.model.empty())
    return invalid("model", "must not be empty", "\"\"",
                   "a built-in preset name or an HF model directory");
  REFIT_RETURN_IF_ERROR(check_int_rule("policy.world_size", c.policy.world_size, kRankCountRule));
  if (c.policy.dtype != DType::kFloat32 && c.policy.dtype != DType::kBFloat16)
    return invalid("policy.dtype", "unsupported trainer master dtype", dtype_name(c.policy.dtype),
                   "float32 | bfloat16");
  const auto& m = c.policy.megatron;
  REFIT_RETURN_IF_ERROR(check_int_rule("policy.megatron.tp", m.tp, kRankCountRule));
  REFIT_RETURN_IF_ERROR(check_int_rule("policy.megatron.pp", m.pp, kRankCountRule));
  REFIT_RETURN_IF_ERROR(check_int_rule("policy.megatron.ep", m.ep, kRankCountRule));
  if (c.policy.backend != PolicyBackend::kMegatron && (m.tp != 1 || m.pp != 1 || m.ep != 1))
    return invalid("policy.megatron",
                   fmt::format("only used with policy.backend: megatron (policy.backend is {})",
                               policy_backend_name(c.policy.backend)),
                   fmt::format("{{tp: {}, pp: {}, ep: {}}}", m.tp, m.pp, m.ep),
                   "{tp: 1, pp: 1, ep: 1}, or set policy.backend: megatron");
  REFIT_RETURN_IF_ERROR(
      check_int_rule("generation.num_engines", c.generation.num_engines, kRankCountRule));
  REFIT_RETURN_IF_ERROR(
      check_int_rule("generation.tp_size", c.generation.tp_size, kRankCountRule));
  if (std::int64_t{c.generation.num_engines} * c.generation.tp_size > kMaxRanks)
    return invalid("generation.num_engines",
                   fmt::format("times generation.tp_size ({}) is more than {} engine ranks",
                               c.generation.tp_size, kMaxRanks),
                   std::to_string(c.generation.num_engines),
                   fmt::format("at most {} engines of TP {}", kMaxRanks / c.generation.tp_size,
                               c.generation.tp_size));
  bool parseable = false;
  for (DType d : parseable_target_precisions()) parseable |= d == c.refit.target_precision;
  if (!parseable)
    return invalid("refit.target_precision", "unknown target precision",
                   dtype_name(c.refit.target_precision), "bf16 | bfloat16 | fp8 | float8_e4m3");
  REFIT_RETURN_IF_ERROR(
      check_int_rule("refit.buffer_size_bytes", c.refit.buffer_size_bytes, kBufferSizeRule));
  REFIT_RETURN_IF_ERROR(check_int_rule("refit.num_buffers", c.refit.num_buffers, kNumBuffersRule));
  REFIT_RETURN_IF_ERROR(check_timeout("refit.timeout_s", c.refit.timeout_s));
  return Status::Ok();
}

Status check_transfer_mode(const GenerationConfig& g) {
  if (g.weight_transfer_mode == TransferMode::kIpc && !g.colocated)
    return invalid("generation.weight_transfer_mode",
                   "ipc requires generation.colocated: true (ipc maps buffers of a trainer rank "
                   "and an engine rank on the same device)",
                   "ipc with generation.colocated: false",
                   "broadcast (or omit weight_transfer_mode) when colocated is false, or set "
                   "generation.colocated: true");
  if (g.weight_transfer_mode == TransferMode::kBroadcast && g.colocated)
    return invalid("generation.weight_transfer_mode",
                   "broadcast is the non-colocated mode; colocated engines share devices with "
                   "trainer ranks and receive weights through ipc",
                   "broadcast with generation.colocated: true",
                   "ipc (or omit weight_transfer_mode) when colocated is true, or set "
                   "generation.colocated: false");
  return Status::Ok();
}

// NCCL cannot join two processes on one GPU, so point-to-point between a colocated trainer rank and
// its engine rank on CUDA does not exist; peer access serves them.
Status check_executor(const Config& c) {
  if (c.refit.executor == Executor::kP2p && c.device == Device::kCuda && c.generation.colocated)
    return invalid("refit.executor",
                   "p2p uses NCCL send/recv, and NCCL cannot join a colocated trainer rank and "
                   "engine rank that share one GPU",
                   "p2p with device: cuda and generation.colocated: true",
                   "auto or peer (CUDA IPC peer access), or gather");
  if (c.refit.checksum && c.refit.executor == Executor::kGather)
    return invalid("refit.checksum",
                   "checksums are per route of the transfer plan, and executor gather moves "
                   "buckets instead",
                   "true with refit.executor: gather",
                   "refit.executor auto, peer or p2p, or refit.checksum: false");
  return Status::Ok();
}

// refit.delta and refit.staged move the transfer plan's routes: executor gather moves buckets.
Status check_delta(const Config& c) {
  const bool delta = c.refit.delta != DeltaMode::kOff;
  if (delta && c.refit.executor == Executor::kGather)
    return invalid("refit.delta",
                   "delta refits send the transfer plan's routes, and executor gather moves "
                   "buckets instead",
                   fmt::format("{} with refit.executor: gather", delta_mode_name(c.refit.delta)),
                   "refit.executor auto, peer or p2p, or refit.delta: off");
  if (c.refit.staged && c.refit.executor == Executor::kGather)
    return invalid("refit.staged",
                   "a staged apply lands the transfer plan's routes in a staging area, and "
                   "executor gather moves buckets instead",
                   "true with refit.executor: gather",
                   "refit.executor auto, peer or p2p, or refit.staged: false");
  return Status::Ok();
}

Status check_matrix_cell(const Config& c) {
  const MatrixCell* cell =
      find_matrix_cell(c.policy.backend, c.generation.backend, c.generation.weight_transfer_mode);
  const std::string got = fmt::format("{} -> {}, {}", policy_backend_name(c.policy.backend),
                                      engine_protocol_name(c.generation.backend),
                                      transfer_mode_label(c.generation.weight_transfer_mode));
  if (cell == nullptr)
    return Status::Unsupported(fmt::format(
        "policy.backend / generation.backend / generation.weight_transfer_mode: combination is "
        "not in the support matrix; got {}; allowed: the cells `refit matrix` lists",
        got));
  if (!cell->supported)
    return Status::Unsupported(fmt::format(
        "policy.backend / generation.backend / generation.weight_transfer_mode: {}; got {}; "
        "allowed: the supported cells `refit matrix` lists",
        cell->note, got));
  return Status::Ok();
}

Status check_colocation(const Config& c) {
  if (!c.generation.colocated) return Status::Ok();
  const std::int64_t engines = c.generation.num_engines;
  const std::int64_t tp = c.generation.tp_size;
  const std::int64_t ws = c.policy.world_size;
  if (engines * tp == ws) return Status::Ok();
  std::string allowed = fmt::format("policy.world_size: {}", engines * tp);
  if (ws % tp == 0) allowed += fmt::format(", or generation.num_engines: {}", ws / tp);
  return invalid("generation.colocated",
                 "true requires generation.num_engines * generation.tp_size == policy.world_size "
                 "(one engine rank per trainer device)",
                 fmt::format("generation.num_engines {} * generation.tp_size {} = {}, "
                             "policy.world_size {}",
                             engines, tp, engines * tp, ws),
                 allowed);
}

Status check_device(const Config& c) {
  switch (c.device) {
    case Device::kCpu:
      return Status::Ok();
    case Device::kCuda:
#ifdef REFIT_HAVE_CUDA
      // The build has CUDA; whether this machine has enough GPUs is decided when ranks start.
      return Status::Ok();
#else
      return invalid("device",
                     "this build of refit has no CUDA (CUDA was not found when it was compiled)",
                     "cuda", "cpu, or rebuild refit with CUDA (/usr/local/cuda) present");
#endif
  }
  return Status::Ok();
}

Status check_precision(const Config& c) {
  const DType want = c.refit.target_precision;
  std::vector<std::string> ok_names;
  const PrecisionSupport* row = nullptr;
  for (const auto& p : precision_support()) {
    if (p.engine != c.generation.backend) continue;
    if (p.supported) ok_names.emplace_back(dtype_name(p.precision));
    if (p.precision == want) row = &p;
  }
  std::string allowed;
  for (const auto& n : ok_names) allowed += (allowed.empty() ? "" : " | ") + n;
  if (row == nullptr)
    return Status::Unsupported(fmt::format(
        "refit.target_precision: generation.backend {} has no entry for this precision; got {}; "
        "allowed: {}",
        engine_protocol_name(c.generation.backend), dtype_name(want), allowed));
  if (row->supported) return Status::Ok();
  return Status::Unsupported(fmt::format(
      "refit.target_precision: {}; got {} with generation.backend "
      "{}; allowed: {}",
      row->note, dtype_name(want), engine_protocol_name(c.generation.backend), allowed));
}

bool any_dense_layer(const ModelConfig& m) {
  for (std::int64_t i = 0; i < m.num_layers; ++i)
    if (!m.is_moe_layer(i)) return true;
  return false;
}

bool any_moe_layer(const ModelConfig& m) {
  for (std::int64_t i = 0; i < m.num_layers; ++i)
    if (m.is_moe_layer(i)) return true;
  return false;
}

// Megatron-Core constraints (docs/design.md §6.3): world_size = tp*pp*dp; query groups, heads and
// MLP rows split evenly over TP; layers evenly over PP; experts evenly over EP, and EP within DP.
// The vocabulary is padded to 128*tp, so it never constrains tp.
Status check_megatron(const Config& c, const ModelSpec& spec) {
  const ModelConfig& m = spec.config();
  const auto& par = c.policy.megatron;
  const std::int64_t ws = c.policy.world_size;
  const std::int64_t tp = par.tp, pp = par.pp, ep = par.ep;
  const std::string& model = c.model;

  if (ws % (tp * pp) != 0)
    return invalid("policy.world_size",
                   fmt::format("must be a multiple of policy.megatron.tp * policy.megatron.pp = "
                               "{} * {} = {} (world_size = tp * pp * dp)",
                               tp, pp, tp * pp),
                   std::to_string(ws), fmt::format("a multiple of {}", tp * pp));

  const bool dense = any_dense_layer(m), moe = any_moe_layer(m);
  const std::int64_t nkv = m.num_kv_heads > 0 ? m.num_kv_heads : m.num_heads;
  // Why TP size t cannot shard the model in Megatron, or "".
  auto tp_problem = [&](std::int64_t t) -> std::string {
    if (nkv % t != 0)
      return fmt::format(
          "num_key_value_heads ({}) is not divisible by {} (Megatron splits query groups evenly "
          "over TP)",
          nkv, t);
    if (m.num_heads % t != 0)
      return fmt::format("num_attention_heads ({}) is not divisible by {}", m.num_heads, t);
    if (dense && m.intermediate_size % t != 0)
      return fmt::format("intermediate_size ({}) is not divisible by {}", m.intermediate_size, t);
    if (moe && m.moe_intermediate_size % t != 0)
      return fmt::format("moe_intermediate_size ({}) is not divisible by {} (expert TP equals tp)",
                         m.moe_intermediate_size, t);
    return {};
  };
  if (auto problem = tp_problem(tp); !problem.empty()) {
    auto ok =
        candidates([&](std::int64_t t) { return tp_problem(t).empty() && ws % (t * pp) == 0; });
    return invalid("policy.megatron.tp", problem, std::to_string(tp),
                   fmt::format("{} (for {} with policy.world_size {} and pp {})", join_ints(ok),
                               model, ws, pp));
  }

  if (m.num_layers % pp != 0) {
    auto ok =
        candidates([&](std::int64_t p) { return m.num_layers % p == 0 && ws % (tp * p) == 0; });
    return invalid("policy.megatron.pp",
                   fmt::format("num_hidden_layers ({}) is not divisible by {} (Megatron splits "
                               "layers evenly over pipeline stages)",
                               m.num_layers, pp),
                   std::to_string(pp),
                   fmt::format("{} (for {} with policy.world_size {} and tp {})", join_ints(ok),
                               model, ws, tp));
  }

  if (ep > 1 && !moe)
    return invalid("policy.megatron.ep",
                   fmt::format("expert parallelism needs a MoE model ({} is dense)", model),
                   std::to_string(ep), "1");
  if (moe) {
    const std::int64_t dp = ws / (tp * pp);
    auto ok = candidates([&](std::int64_t e) { return m.num_experts % e == 0 && dp % e == 0; });
    const std::string allowed =
        fmt::format("{} (for {} with data-parallel size {})", join_ints(ok), model, dp);
    if (m.num_experts % ep != 0)
      return invalid("policy.megatron.ep",
                     fmt::format("num_experts ({}) is not divisible by {} (experts are split "
                                 "evenly over expert-parallel ranks)",
                                 m.num_experts, ep),
                     std::to_string(ep), allowed);
    if (dp % ep != 0)
      return invalid("policy.megatron.ep",
                     fmt::format("must divide the data-parallel size policy.world_size / (tp * "
                                 "pp) = {} / ({} * {}) = {}",
                                 ws, tp, pp, dp),
                     std::to_string(ep), allowed);
  }
  return Status::Ok();
}

// refit.target_precision fp8 (docs/fp8.md): the transfer plan carries the scales; the block must
// fit the engines' layout on every TP rank.
Status check_fp8(const Config& c, const ModelSpec& spec) {
  const bool fp8 = c.refit.target_precision == DType::kFloat8E4M3;
  if (c.refit.fp8.given && !fp8)
    return invalid("refit.fp8", "is used only with refit.target_precision: fp8",
                   fmt::format("refit.fp8 with refit.target_precision {}",
                               dtype_name(c.refit.target_precision)),
                   "remove refit.fp8, or set refit.target_precision: fp8");
  REFIT_RETURN_IF_ERROR(check_int_rule("refit.fp8.block", c.refit.fp8.block_rows, kFp8BlockRule));
  REFIT_RETURN_IF_ERROR(check_int_rule("refit.fp8.block", c.refit.fp8.block_cols, kFp8BlockRule));
  REFIT_ASSIGN_OR_RETURN(const WireModel wire, wire_model(c, spec));
  // Parameters the engines keep in a dtype of their own (engine_dtype, spec/fp8.h) travel on the
  // transfer plan, whose routes carry their dtype; gather buckets hold one dtype.
  if (const auto apart = wire.first_kept_apart(); apart && c.refit.executor == Executor::kGather)
    return invalid(
        "refit.executor",
        fmt::format("gather moves full buckets in one dtype, and {}'s engines keep {} in "
                    "{} (docs/models.md, \"Engine dtypes\")",
                    c.model, wire.spec.tensors()[*apart].name, dtype_name(wire.dtype[*apart])),
        "gather", "auto, peer or p2p");
  if (!fp8) return Status::Ok();
  if (c.refit.executor == Executor::kGather)
    return invalid("refit.executor",
                   "gather moves full buckets in one dtype; FP8 weights travel with their scales "
                   "on the transfer plan",
                   "gather with refit.target_precision: fp8", "auto, peer or p2p");
  if (c.refit.checksum)
    return invalid("refit.checksum",
                   "per-route checksums compare cast elements, and FP8 elements depend on their "
                   "block's scale; --verify checks every FP8 element against the reference "
                   "quantizer instead",
                   "true with refit.target_precision: fp8", "false");
  for (int t = 0; t < c.generation.tp_size; ++t) {
    auto layout = engine_wire_layout(c, spec, wire, t);
    if (!layout.ok()) return layout.status();
  }
  return Status::Ok();
}

// The fused engine layout and the Megatron bridge need the architecture's facts; a table read
// from safetensors headers has none (docs/models.md).
Status check_architecture(const Config& c, const ModelSpec& spec) {
  const std::string& arch = spec.config().architecture;
  if (c.policy.backend == PolicyBackend::kMegatron && !llama_family(spec.config().arch)) {
    // Megatron-Core's multi-latent attention (linear_q_down_proj, linear_kv_down_proj, ...) and
    // its shared experts are not in refit's bridge (docs/megatron.md, docs/models.md).
    const bool mla = spec.config().mla;
    const bool shared = spec.config().shared_expert_intermediate_size > 0;
    return Status::Unsupported(fmt::format(
        "policy.backend: megatron needs an architecture refit's Megatron bridge knows "
        "(LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, "
        "Qwen3MoeForCausalLM: Megatron's parameter names and shard layouts); {} is {}{}; got "
        "megatron; allowed: fsdp2{}",
        c.model, arch,
        mla      ? " (Megatron-Core's multi-latent attention and shared-expert shards are not "
                   "modelled)"
        : shared ? " (Megatron-Core's shared-expert shards are not modelled)"
                 : "",
        spec.known_architecture() ? "" : ", with generation.layout: hf"));
  }
  if (spec.known_architecture()) return Status::Ok();
  if (c.generation.layout == EngineLayout::kFused)
    return Status::Unsupported(fmt::format(
        "generation.layout: fused needs an architecture refit knows (the engine's fused "
        "parameter names and TP slices); {} is {}; got fused; allowed: hf (every engine rank "
        "receives the whole tensors under their Hugging Face names, and the engine's "
        "load_weights fuses and slices them)",
        c.model, arch));
  return Status::Ok();
}

}  // namespace

Status validate_config(const Config& config, const ModelSpec& spec) {
  REFIT_RETURN_IF_ERROR(check_values(config));
  REFIT_RETURN_IF_ERROR(check_transfer_mode(config.generation));
  REFIT_RETURN_IF_ERROR(check_executor(config));
  REFIT_RETURN_IF_ERROR(check_delta(config));
  REFIT_RETURN_IF_ERROR(check_matrix_cell(config));
  REFIT_RETURN_IF_ERROR(check_colocation(config));
  REFIT_RETURN_IF_ERROR(check_device(config));
  REFIT_RETURN_IF_ERROR(check_precision(config));
  REFIT_RETURN_IF_ERROR(check_architecture(config, spec));
  // The hf layout gives every TP rank whole tensors: any TP size fits.
  if (config.generation.layout == EngineLayout::kFused)
    REFIT_RETURN_IF_ERROR(check_engine_tp(spec, config.generation.tp_size));
  REFIT_RETURN_IF_ERROR(check_fp8(config, spec));
  switch (config.policy.backend) {
    case PolicyBackend::kFsdp2:
      // Shard(0) with torch.chunk semantics fits any world size (trailing ranks may hold none).
      break;
    case PolicyBackend::kMegatron:
      REFIT_RETURN_IF_ERROR(check_megatron(config, spec));
      break;
  }
  return Status::Ok();
}

}  // namespace refit
