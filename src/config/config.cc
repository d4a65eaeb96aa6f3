// Config names, the embedded default config, and the resolved config as YAML / JSON.
#include <fmt/format.h>
#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

#include "refit/config.h"

namespace refit {

bool build_has_cuda() {
#ifdef REFIT_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

std::string_view device_name(Device d) {
  switch (d) {
    case Device::kCpu:
      return "cpu";
    case Device::kCuda:
      return "cuda";
  }
  return "?";
}

std::string_view policy_backend_name(PolicyBackend b) {
  switch (b) {
    case PolicyBackend::kFsdp2:
      return "fsdp2";
    case PolicyBackend::kMegatron:
      return "megatron";
  }
  return "?";
}

std::string_view engine_protocol_name(EngineProtocol p) {
  switch (p) {
    case EngineProtocol::kSglang:
      return "sglang";
    case EngineProtocol::kVllm:
      return "vllm";
  }
  return "?";
}

std::string_view transfer_mode_name(TransferMode m) {
  switch (m) {
    case TransferMode::kBroadcast:
      return "broadcast";
    case TransferMode::kIpc:
      return "ipc";
  }
  return "?";
}

std::string_view delta_mode_name(DeltaMode m) {
  switch (m) {
    case DeltaMode::kOff:
      return "off";
    case DeltaMode::kOn:
      return "on";
    case DeltaMode::kAuto:
      return "auto";
  }
  return "?";
}

std::string_view executor_name(Executor e) {
  switch (e) {
    case Executor::kAuto:
      return "auto";
    case Executor::kPeer:
      return "peer";
    case Executor::kP2p:
      return "p2p";
    case Executor::kGather:
      return "gather";
  }
  return "?";
}

std::string_view fp8_scheme_name(Fp8Scheme s) {
  switch (s) {
    case Fp8Scheme::kBlock:
      return "block";
    case Fp8Scheme::kTensor:
      return "tensor";
  }
  return "?";
}

std::string_view engine_layout_name(EngineLayout l) {
  switch (l) {
    case EngineLayout::kFused:
      return "fused";
    case EngineLayout::kHf:
      return "hf";
  }
  return "?";
}

// The docs/design.md §5.1 example, value for value. `policy.megatron` is accepted with backend fsdp2
// only while it is the no-op {tp: 1, pp: 1, ep: 1}, so this text is valid as written.
std::string_view default_config_yaml() {
  return R"(# refit config (docs/config.md). Every key is optional: absent -> default, present but invalid -> error.
model: qwen2.5-0.5b            # built-in preset name, or a path to an HF model directory
device: cpu                    # cpu | cuda
seed: 0                        # deterministic initial weights when no safetensors are given
policy:
  backend: fsdp2               # fsdp2 | megatron
  world_size: 2                # trainer ranks
  dtype: float32               # trainer master dtype: float32 | bfloat16
  megatron: {tp: 1, pp: 1, ep: 1}   # only for backend: megatron; world_size = tp*pp*dp
generation:
  backend: sglang              # sglang | vllm
  colocated: false
  weight_transfer_mode: broadcast   # broadcast | ipc; may be omitted: derived from colocated
  num_engines: 1
  tp_size: 2
refit:
  target_precision: bf16
  buffer_size_bytes: 268435456
  num_buffers: 2
  timeout_s: 60
)";
}

std::string config_to_yaml(const Config& c) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "model" << YAML::Value << c.model;
  out << YAML::Key << "device" << YAML::Value << std::string(device_name(c.device));
  out << YAML::Key << "seed" << YAML::Value << c.seed;

  out << YAML::Key << "policy" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "backend" << YAML::Value
      << std::string(policy_backend_name(c.policy.backend));
  out << YAML::Key << "world_size" << YAML::Value << c.policy.world_size;
  out << YAML::Key << "dtype" << YAML::Value << std::string(dtype_name(c.policy.dtype));
  out << YAML::Key << "megatron" << YAML::Value << YAML::Flow << YAML::BeginMap;
  out << YAML::Key << "tp" << YAML::Value << c.policy.megatron.tp;
  out << YAML::Key << "pp" << YAML::Value << c.policy.megatron.pp;
  out << YAML::Key << "ep" << YAML::Value << c.policy.megatron.ep;
  out << YAML::EndMap << YAML::EndMap;

  const auto& g = c.generation;
  out << YAML::Key << "generation" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "backend" << YAML::Value << std::string(engine_protocol_name(g.backend));
  out << YAML::Key << "colocated" << YAML::Value << g.colocated;
  out << YAML::Key << "weight_transfer_mode" << YAML::Value
      << std::string(transfer_mode_name(g.weight_transfer_mode));
  out << YAML::Key << "num_engines" << YAML::Value << g.num_engines;
  out << YAML::Key << "tp_size" << YAML::Value << g.tp_size;
  out << YAML::Key << "layout" << YAML::Value << std::string(engine_layout_name(g.layout));
  out << YAML::EndMap;

  const auto& r = c.refit;
  out << YAML::Key << "refit" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "target_precision" << YAML::Value
      << std::string(dtype_name(r.target_precision));
  out << YAML::Key << "buffer_size_bytes" << YAML::Value << r.buffer_size_bytes;
  out << YAML::Key << "num_buffers" << YAML::Value << r.num_buffers;
  // Shortest text that reads back as the same double ("60", "0.5").
  out << YAML::Key << "timeout_s" << YAML::Value << fmt::format("{}", r.timeout_s);
  out << YAML::Key << "executor" << YAML::Value << std::string(executor_name(r.executor));
  out << YAML::Key << "checksum" << YAML::Value << r.checksum;
  out << YAML::Key << "keep_previous" << YAML::Value << r.keep_previous;
  out << YAML::Key << "delta" << YAML::Value << std::string(delta_mode_name(r.delta));
  out << YAML::Key << "staged" << YAML::Value << r.staged;
  if (r.fp8.given) {  // written only when given: a model directory's quantization_config decides otherwise
    out << YAML::Key << "fp8" << YAML::Value << YAML::Flow << YAML::BeginMap;
    out << YAML::Key << "scheme" << YAML::Value << std::string(fp8_scheme_name(r.fp8.scheme));
    out << YAML::Key << "block" << YAML::Value << YAML::Flow << YAML::BeginSeq << r.fp8.block_rows
        << r.fp8.block_cols << YAML::EndSeq;
    out << YAML::EndMap;
  }
  out << YAML::EndMap;

  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::string config_to_json(const Config& c) {
  nlohmann::ordered_json j;
  j["model"] = c.model;
  j["device"] = device_name(c.device);
  j["seed"] = c.seed;
  j["policy"] = {
      {"backend", policy_backend_name(c.policy.backend)},
      {"world_size", c.policy.world_size},
      {"dtype", dtype_name(c.policy.dtype)},
      {"megatron",
       {{"tp", c.policy.megatron.tp}, {"pp", c.policy.megatron.pp}, {"ep", c.policy.megatron.ep}}},
  };
  j["generation"] = {
      {"backend", engine_protocol_name(c.generation.backend)},
      {"colocated", c.generation.colocated},
      {"weight_transfer_mode", transfer_mode_name(c.generation.weight_transfer_mode)},
      {"num_engines", c.generation.num_engines},
      {"tp_size", c.generation.tp_size},
      {"layout", engine_layout_name(c.generation.layout)},
  };
  j["refit"] = {
      {"target_precision", dtype_name(c.refit.target_precision)},
      {"buffer_size_bytes", c.refit.buffer_size_bytes},
      {"num_buffers", c.refit.num_buffers},
      {"timeout_s", c.refit.timeout_s},
      {"executor", executor_name(c.refit.executor)},
      {"checksum", c.refit.checksum},
      {"keep_previous", c.refit.keep_previous},
      {"delta", delta_mode_name(c.refit.delta)},
      {"staged", c.refit.staged},
  };
  if (c.refit.fp8.given)
    j["refit"]["fp8"] = {{"scheme", fp8_scheme_name(c.refit.fp8.scheme)},
                         {"block", {c.refit.fp8.block_rows, c.refit.fp8.block_cols}}};
  return j.dump(2);
}

}  // namespace refit
