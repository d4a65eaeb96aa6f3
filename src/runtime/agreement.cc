#include "runtime/agreement.h"

#include <fmt/format.h>

#include <cstdint>

namespace refit {
namespace {

// FNV-1a over every tensor's name and shape, as 16 hex digits.
std::string tensor_table_hash(const ModelSpec& spec) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](std::uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  for (const TensorSpec& t : spec.tensors()) {
    for (char c : t.name) mix(static_cast<unsigned char>(c));
    mix(0xFF);
    for (std::int64_t d : t.shape) mix(static_cast<std::uint64_t>(d));
    mix(0xFE);
  }
  return fmt::format("{:016x}", h);
}

}  // namespace

std::map<std::string, std::string> agreed_settings(const Config& c, const ModelSpec& spec) {
  const MegatronParallel& m = c.policy.megatron;
  return {
      {"model", fmt::format("{} tensors, table {}", spec.tensors().size(), tensor_table_hash(spec))},
      {"device", std::string(device_name(c.device))},
      {"seed", std::to_string(c.seed)},
      {"policy.backend", std::string(policy_backend_name(c.policy.backend))},
      {"policy.world_size", std::to_string(c.policy.world_size)},
      {"policy.dtype", std::string(dtype_name(c.policy.dtype))},
      {"policy.megatron", c.policy.backend == PolicyBackend::kMegatron
                              ? fmt::format("tp {} pp {} ep {}", m.tp, m.pp, m.ep)
                              : std::string("-")},
      {"generation.backend", std::string(engine_protocol_name(c.generation.backend))},
      {"generation.colocated", c.generation.colocated ? "true" : "false"},
      {"generation.weight_transfer_mode",
       std::string(transfer_mode_name(c.generation.weight_transfer_mode))},
      {"generation.num_engines", std::to_string(c.generation.num_engines)},
      {"generation.tp_size", std::to_string(c.generation.tp_size)},
      {"generation.layout", std::string(engine_layout_name(c.generation.layout))},
      {"refit.target_precision", std::string(dtype_name(c.refit.target_precision))},
      {"refit.fp8", c.refit.target_precision != DType::kFloat8E4M3 ? std::string("-")
                    : c.refit.fp8.scheme == Fp8Scheme::kTensor
                        ? std::string("tensor")
                        : fmt::format("block {}x{}", c.refit.fp8.block_rows, c.refit.fp8.block_cols)},
      {"refit.buffer_size_bytes", std::to_string(c.refit.buffer_size_bytes)},
      {"refit.num_buffers", std::to_string(c.refit.num_buffers)},
      {"refit.executor", std::string(executor_name(c.refit.executor))},
      {"refit.checksum", c.refit.checksum ? "true" : "false"},
      {"refit.delta", std::string(delta_mode_name(c.refit.delta))},
      {"refit.staged", c.refit.staged ? "true" : "false"},
  };
}

Status check_agreed_settings(const std::map<std::string, std::string>& ours,
                             const std::map<std::string, std::string>& theirs,
                             const std::string& from, const std::string& self) {
  auto value = [](const std::map<std::string, std::string>& m, const std::string& key) {
    const auto it = m.find(key);
    return it == m.end() ? std::string("(not announced)") : it->second;
  };
  std::map<std::string, bool> keys;
  for (const auto& [k, v] : ours) keys[k] = true;
  for (const auto& [k, v] : theirs) keys[k] = true;
  for (const auto& [key, unused] : keys) {
    const std::string a = value(theirs, key), b = value(ours, key);
    if (a != b)
      return Status::InvalidArgument(fmt::format(
          "setup: {} and {} disagree on {}: {} has {}, {} has {}; every rank of a refit must use "
          "the same value",
          from, self, key, from, a, self, b));
  }
  return Status::Ok();
}

}  // namespace refit
