// The support matrix (docs/design.md §1) and the target precisions each engine protocol accepts.
#include <fmt/format.h>

#include "config/support.h"

namespace refit {
namespace {

std::string cell_note(PolicyBackend policy, EngineProtocol engine, TransferMode mode) {
  std::string source;
  switch (policy) {
    case PolicyBackend::kFsdp2:
      source = "FSDP2 all-gather";
      break;
    case PolicyBackend::kMegatron:
      source = "Megatron bridge (TP gather, de-fusing, PP/EP movement)";
      break;
  }
  std::string wire;
  switch (mode) {
    case TransferMode::kBroadcast:
      wire = "broadcast from trainer rank 0 (NCCL on cuda, Gloo on cpu)";
      break;
    case TransferMode::kIpc:
      wire = "ipc per device (CUDA IPC on cuda, POSIX shared memory on cpu)";
      break;
  }
  std::string protocol;
  switch (engine) {
    case EngineProtocol::kSglang:
      protocol = "bucket metadata with every bucket";
      break;
    case EngineProtocol::kVllm:
      protocol = "manifest and plan hash checked at setup";
      break;
  }
  std::string note = fmt::format("{}, {}, {}", source, wire, protocol);
  if (policy == PolicyBackend::kFsdp2 && engine == EngineProtocol::kSglang &&
      mode == TransferMode::kBroadcast)
    note += " (the seed's cell)";
  return note;
}

}  // namespace

const std::vector<MatrixCell>& support_matrix() {
  static const std::vector<MatrixCell> table = [] {
    std::vector<MatrixCell> cells;
    for (PolicyBackend policy : {PolicyBackend::kFsdp2, PolicyBackend::kMegatron})
      for (EngineProtocol engine : {EngineProtocol::kVllm, EngineProtocol::kSglang})
        for (TransferMode mode : {TransferMode::kIpc, TransferMode::kBroadcast})
          cells.push_back({policy, engine, mode, true, cell_note(policy, engine, mode)});
    return cells;
  }();
  return table;
}

const MatrixCell* find_matrix_cell(PolicyBackend policy, EngineProtocol engine, TransferMode mode) {
  for (const auto& cell : support_matrix())
    if (cell.policy == policy && cell.engine == engine && cell.mode == mode) return &cell;
  return nullptr;
}

const std::vector<DType>& parseable_target_precisions() {
  static const std::vector<DType> list = {DType::kBFloat16, DType::kFloat8E4M3};
  return list;
}

const std::vector<PrecisionSupport>& precision_support() {
  static const std::vector<PrecisionSupport> table = {
      {EngineProtocol::kVllm, DType::kBFloat16, true, "supported"},
      {EngineProtocol::kVllm, DType::kFloat8E4M3, true, "supported (refit.fp8, docs/fp8.md)"},
      {EngineProtocol::kSglang, DType::kBFloat16, true, "supported"},
      {EngineProtocol::kSglang, DType::kFloat8E4M3, true, "supported (refit.fp8, docs/fp8.md)"},
  };
  return table;
}

std::string transfer_mode_label(TransferMode mode) {
  switch (mode) {
    case TransferMode::kBroadcast:
      return "non-colocated (broadcast)";
    case TransferMode::kIpc:
      return "colocated (ipc)";
  }
  return "?";
}

std::string_view engine_protocol_display_name(EngineProtocol engine) {
  switch (engine) {
    case EngineProtocol::kSglang:
      return "SGLang";
    case EngineProtocol::kVllm:
      return "vLLM";
  }
  return "?";
}

std::string_view policy_backend_display_name(PolicyBackend policy) {
  switch (policy) {
    case PolicyBackend::kFsdp2:
      return "fsdp2 (DTensor)";
    case PolicyBackend::kMegatron:
      return "megatron";
  }
  return "?";
}

}  // namespace refit
