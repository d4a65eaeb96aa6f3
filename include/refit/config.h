// refit/config.h — the refit configuration (docs/design.md §5.1) and its setup-time validation.
//
// A Config is a plain value. load_config() parses YAML text or a file and applies the rule
// "absent → default, present but invalid → error"; validate_config() checks every cross-key
// constraint against the model and the support matrix. Errors name the key, the value and what
// is allowed, and `refit check` exits 2 on any of them.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "refit/dtype.h"
#include "refit/model_spec.h"
#include "refit/status.h"

namespace refit {

enum class Device { kCpu, kCuda };
enum class PolicyBackend { kFsdp2, kMegatron };
enum class EngineProtocol { kSglang, kVllm };
enum class TransferMode { kBroadcast, kIpc };
// How bytes move from trainer ranks to engine ranks (docs/config.md, refit.executor).
//  auto:   the transfer plan; per (trainer rank, engine rank) pair, peer access when both are on
//          one host and the engine's parameters are exported, point-to-point otherwise
//  peer:   the transfer plan, peer access for every pair (rejected when a pair is on two hosts)
//  p2p:    the transfer plan, point-to-point (Gloo / NCCL send-recv) for every pair
//  gather: full buckets: all-gather over the trainer group, then weight_transfer_mode
//          (broadcast from trainer rank 0, or ipc slots of the colocated trainer rank)
enum class Executor { kAuto, kPeer, kP2p, kGather };
// What an engine rank holds (docs/engines.md, generation.layout).
//  fused: the engine's own parameters, TP-sharded (vLLM / SGLang: qkv_proj, gate_up_proj, MoE
//         w13/w2, vocabulary-parallel embeddings); needs an architecture refit knows
//  hf:    every Hugging Face tensor whole, under its HF name, on every TP rank (the engine's
//         load_weights fuses and slices; costs T times the bytes of fused with TP = T)
enum class EngineLayout { kFused, kHf };
// How FP8 weights carry their scales (refit.fp8.scheme; docs/fp8.md).
//  block:  one float32 dequantization multiplier per block_rows x block_cols block
//          (`weight_scale_inv`, DeepSeek-V3 / Qwen3-FP8 / vLLM and SGLang block-FP8 layers)
//  tensor: one float32 multiplier per Hugging Face tensor (`weight_scale`)
enum class Fp8Scheme { kBlock, kTensor };
// Whether a refit sends only what changed since a pair's last refit (refit.delta; docs/delta.md).
//  off:  every refit moves every route (the default)
//  on:   every pair whose engine holds the base the trainer kept sends a delta stream
//  auto: per pair, a delta where it is predicted to be faster (the link's bandwidth measured at
//        setup, the pair's density on its last refit); full otherwise
enum class DeltaMode { kOff, kOn, kAuto };

std::string_view device_name(Device d);
std::string_view policy_backend_name(PolicyBackend b);
std::string_view engine_protocol_name(EngineProtocol p);
std::string_view transfer_mode_name(TransferMode m);
std::string_view executor_name(Executor e);
std::string_view engine_layout_name(EngineLayout l);
std::string_view fp8_scheme_name(Fp8Scheme s);
std::string_view delta_mode_name(DeltaMode m);

struct MegatronParallel {
  int tp = 1;  // tensor parallel
  int pp = 1;  // pipeline parallel
  int ep = 1;  // expert parallel (over the data-parallel ranks)
};

struct PolicyConfig {
  PolicyBackend backend = PolicyBackend::kFsdp2;
  int world_size = 2;             // trainer ranks
  DType dtype = DType::kFloat32;  // trainer master dtype: float32 | bfloat16
  MegatronParallel megatron;      // only for backend: megatron
};

struct GenerationConfig {
  EngineProtocol backend = EngineProtocol::kSglang;
  bool colocated = false;
  TransferMode weight_transfer_mode = TransferMode::kBroadcast;  // derived from colocated if absent
  int num_engines = 1;
  int tp_size = 2;
  EngineLayout layout = EngineLayout::kFused;
};

// refit.fp8: how refit.target_precision fp8 quantizes (docs/fp8.md).
struct Fp8Config {
  Fp8Scheme scheme = Fp8Scheme::kBlock;
  std::int64_t block_rows = 128;  // along the output dim (weight rows); block scheme only
  std::int64_t block_cols = 128;  // along the input dim (weight columns)
  // refit.fp8 was written in the config. Otherwise a model directory's quantization_config, when
  // it has one, decides (config.json "weight_block_size"), and the defaults above apply.
  bool given = false;
};

struct RefitConfig {
  DType target_precision = DType::kBFloat16;
  Fp8Config fp8;  // used when target_precision is fp8
  std::int64_t buffer_size_bytes = 256ll << 20;  // one bucket at most
  int num_buffers = 2;                           // in-flight buckets (>= 1)
  double timeout_s = 60.0;                       // bound on every wait inside a refit
  Executor executor = Executor::kAuto;           // how bytes move (see Executor)
  // Per-route checksums (transfer plan): every trainer rank checksums what it sends each engine
  // rank, the engine rank what landed, and the engine publishes only when they agree.
  bool checksum = false;
  // Engines keep a copy of their parameters during each refit and restore it when the refit
  // fails once bytes may have landed (costs one more copy of the rank's parameters in memory).
  bool keep_previous = false;
  // Delta refits (docs/delta.md): see DeltaMode.
  DeltaMode delta = DeltaMode::kOff;
  // Engines keep serving while a refit's bytes land in a staging area; the pause hook runs only
  // for the apply.
  bool staged = false;

  // timeout_s as a duration.
  std::chrono::milliseconds timeout() const {
    return std::chrono::milliseconds(static_cast<long long>(timeout_s * 1000));
  }
};

struct Config {
  std::string model = "qwen2.5-0.5b";  // preset name or HF model directory
  Device device = Device::kCpu;
  std::uint64_t seed = 0;
  PolicyConfig policy;
  GenerationConfig generation;
  RefitConfig refit;
  // The model's tensors as (name, global shape), set from code (refit.torch: a module's state
  // dict), never from YAML. Empty: the table of `model` (derived from config.json, or read from
  // the checkpoint's headers). Otherwise `model` still names the preset or config.json (the
  // architecture and tie_word_embeddings), and (docs/models.md): with an architecture refit
  // knows, this must list exactly the tensors config.json implies; with any other, it is the
  // table, put in natural name order, with a tied lm_head.weight left out.
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> tensor_table;

  // Total processes of a run: trainer ranks + engine ranks.
  int engine_ranks() const { return generation.num_engines * generation.tp_size; }
};

// Byte alignment of every tensor inside a bucket (and the smallest legal buffer).
inline constexpr std::int64_t kBucketAlignment = 256;

// The embedded default config of `refit run` with no CONFIG (CPU, 2 trainer ranks, one SGLang
// engine with TP 2, non-colocated), as YAML text.
std::string_view default_config_yaml();

// The model spec of `config`: load_model_spec(config.model), or built from config.tensor_table.
// Errors name the tensor at fault.
Result<ModelSpec> config_model_spec(const Config& config);

// Parses YAML text. Checks keys, types and ranges of each key on its own.
Result<Config> parse_config(std::string_view yaml_text);
// Reads and parses a YAML file; errors name the path.
Result<Config> load_config_file(const std::string& path);
// Cross-key and model checks (support matrix, TP divisibility, colocation counts, precision).
// `spec` must be the spec of config.model.
Status validate_config(const Config& config, const ModelSpec& spec);
// The bytes of one refit on the wire: one engine replica's copy of every engine parameter, each
// in the dtype the engines keep it (refit.target_precision; FP8 codes with their float32 scales;
// the tensors kept apart in float32, docs/models.md "Engine dtypes"). The same figure as
// Trainer::bytes_per_refit(), RefitStats::bytes and the report's bytes_per_refit. Errors are the
// wire model's setup errors (a quantization_config refit cannot write).
Result<std::int64_t> bytes_per_refit(const Config& config, const ModelSpec& spec);
// The resolved config as YAML (every key, defaults filled in).
std::string config_to_yaml(const Config& config);
// The resolved config as JSON text (for the --json report).
std::string config_to_json(const Config& config);

// Whether this build of refit has the CUDA data plane (device: cuda).
bool build_has_cuda();

// One cell of the support matrix.
struct MatrixCell {
  PolicyBackend policy;
  EngineProtocol engine;
  TransferMode mode;
  bool supported;
  std::string note;  // why not, or a remark
};
// The support matrix as the program knows it; `refit check` and `refit matrix` use this table.
const std::vector<MatrixCell>& support_matrix();

}  // namespace refit
