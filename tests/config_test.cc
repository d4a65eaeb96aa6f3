// Config parsing, setup-time validation, and the `refit check` / `refit matrix` commands.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <filesystem>

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <tuple>

#include "engine/engine_layout.h"
#include "refit/config.h"
#include "refit/model_spec.h"
#include "test_util.h"

namespace refit {
namespace {

// gmock is not linked into refit_tests; a substring check with a readable failure.
#define EXPECT_CONTAINS(text, part)                          \
  EXPECT_NE(std::string(text).find(part), std::string::npos) \
      << "missing \"" << (part) << "\" in: " << (text)

// Asserts that `status` failed with `code` and that its message holds every substring.
void ExpectError(const Status& status, StatusCode code, std::initializer_list<std::string> parts) {
  ASSERT_FALSE(status.ok()) << "expected an error containing " << *parts.begin();
  EXPECT_EQ(status.code(), code) << status.to_string();
  for (const auto& p : parts) EXPECT_CONTAINS(status.message(), p);
}

Config Parse(const std::string& yaml) {
  auto c = parse_config(yaml);
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return c.ok() ? *c : Config{};
}

ModelSpec Spec(const std::string& model) {
  auto s = load_model_spec(model);
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return s.ok() ? *s : ModelSpec{};
}

// Parses and validates against the config's own model.
Status ParseAndValidate(const std::string& yaml) {
  auto c = parse_config(yaml);
  if (!c.ok()) return c.status();
  auto spec = load_model_spec(c->model);
  if (!spec.ok()) return spec.status();
  return validate_config(*c, *spec);
}

// ---------------------------------------------------------------------------------------------
// Parsing

TEST(ConfigParse, DefaultYamlHasDesignValues) {
  Config c = Parse(std::string(default_config_yaml()));
  EXPECT_EQ(c.model, "qwen2.5-0.5b");
  EXPECT_EQ(c.device, Device::kCpu);
  EXPECT_EQ(c.seed, 0u);
  EXPECT_EQ(c.policy.backend, PolicyBackend::kFsdp2);
  EXPECT_EQ(c.policy.world_size, 2);
  EXPECT_EQ(c.policy.dtype, DType::kFloat32);
  EXPECT_EQ(c.generation.backend, EngineProtocol::kSglang);
  EXPECT_FALSE(c.generation.colocated);
  EXPECT_EQ(c.generation.weight_transfer_mode, TransferMode::kBroadcast);
  EXPECT_EQ(c.generation.num_engines, 1);
  EXPECT_EQ(c.generation.tp_size, 2);
  EXPECT_EQ(c.refit.target_precision, DType::kBFloat16);
  EXPECT_EQ(c.refit.buffer_size_bytes, 268435456);
  EXPECT_EQ(c.refit.num_buffers, 2);
  EXPECT_EQ(c.refit.timeout_s, 60.0);
  EXPECT_TRUE(validate_config(c, Spec(c.model)).ok());
  // The text is also exactly what a default-constructed Config means.
  EXPECT_EQ(config_to_yaml(c), config_to_yaml(Config{}));
}

TEST(ConfigParse, EmptyDocumentIsAllDefaults) {
  EXPECT_EQ(config_to_yaml(Parse("")), config_to_yaml(Config{}));
  EXPECT_EQ(config_to_yaml(Parse("# only a comment\n")), config_to_yaml(Config{}));
}

TEST(ConfigParse, TransferModeDerivedFromColocatedWhenAbsent) {
  EXPECT_EQ(Parse("generation: {colocated: true}").generation.weight_transfer_mode,
            TransferMode::kIpc);
  EXPECT_EQ(Parse("generation: {colocated: false}").generation.weight_transfer_mode,
            TransferMode::kBroadcast);
  EXPECT_EQ(Parse("generation: {num_engines: 2}").generation.weight_transfer_mode,
            TransferMode::kBroadcast);
  // Present: kept as written (validate_config judges the combination).
  EXPECT_EQ(Parse("generation: {colocated: false, weight_transfer_mode: ipc}")
                .generation.weight_transfer_mode,
            TransferMode::kIpc);
}

TEST(ConfigParse, AcceptedSpellings) {
  EXPECT_EQ(Parse("refit: {target_precision: bfloat16}").refit.target_precision, DType::kBFloat16);
  EXPECT_EQ(Parse("refit: {target_precision: fp8}").refit.target_precision, DType::kFloat8E4M3);
  EXPECT_EQ(Parse("refit: {target_precision: float8_e4m3}").refit.target_precision,
            DType::kFloat8E4M3);
  EXPECT_EQ(Parse("policy: {dtype: bfloat16}").policy.dtype, DType::kBFloat16);
  EXPECT_EQ(Parse("policy: {dtype: bf16}").policy.dtype, DType::kBFloat16);
  EXPECT_EQ(Parse("refit: {timeout_s: 2.5}").refit.timeout_s, 2.5);
  EXPECT_EQ(Parse("refit: {timeout_s: 1e2}").refit.timeout_s, 100.0);
  EXPECT_EQ(Parse("seed: 18446744073709551615").seed, 18446744073709551615ull);
  EXPECT_EQ(Parse("model: \"some dir/with spaces\"").model, "some dir/with spaces");
  EXPECT_EQ(Parse("device: cuda").device, Device::kCuda);
}

TEST(ConfigParse, YamlAndJsonRoundTripEveryKey) {
  const std::string yaml = R"(
model: tiny-moe
device: cpu
seed: 7
policy: {backend: megatron, world_size: 8, dtype: bfloat16, megatron: {tp: 2, pp: 2, ep: 2}}
generation: {backend: vllm, colocated: true, num_engines: 4, tp_size: 2}
refit: {target_precision: bf16, buffer_size_bytes: 4096, num_buffers: 3, timeout_s: 0.25}
)";
  Config c = Parse(yaml);
  const std::string text = config_to_yaml(c);
  EXPECT_CONTAINS(text, "weight_transfer_mode: ipc");  // filled in
  EXPECT_EQ(config_to_yaml(Parse(text)), text);

  auto j = nlohmann::json::parse(config_to_json(c));
  EXPECT_EQ(j["model"], "tiny-moe");
  EXPECT_EQ(j["seed"], 7);
  EXPECT_EQ(j["policy"]["backend"], "megatron");
  EXPECT_EQ(j["policy"]["dtype"], "bfloat16");
  EXPECT_EQ(j["policy"]["megatron"]["pp"], 2);
  EXPECT_EQ(j["generation"]["backend"], "vllm");
  EXPECT_EQ(j["generation"]["colocated"], true);
  EXPECT_EQ(j["generation"]["weight_transfer_mode"], "ipc");
  EXPECT_EQ(j["refit"]["target_precision"], "bfloat16");
  EXPECT_EQ(j["refit"]["buffer_size_bytes"], 4096);
  EXPECT_EQ(j["refit"]["num_buffers"], 3);
  EXPECT_EQ(j["refit"]["timeout_s"], 0.25);
  EXPECT_TRUE(validate_config(c, Spec("tiny-moe")).ok());
}

TEST(ConfigParse, DeltaAndStagedKeys) {
  const Config d = Parse("");
  EXPECT_EQ(d.refit.delta, DeltaMode::kOff);
  EXPECT_FALSE(d.refit.staged);
  EXPECT_EQ(Parse("refit: {delta: on}").refit.delta, DeltaMode::kOn);
  EXPECT_EQ(Parse("refit: {delta: auto}").refit.delta, DeltaMode::kAuto);
  EXPECT_EQ(Parse("refit: {delta: off}").refit.delta, DeltaMode::kOff);
  EXPECT_TRUE(Parse("refit: {staged: true}").refit.staged);
  const Config both = Parse("refit: {delta: auto, staged: true}");
  EXPECT_EQ(config_to_yaml(Parse(config_to_yaml(both))), config_to_yaml(both));
  auto j = nlohmann::json::parse(config_to_json(both));
  EXPECT_EQ(j["refit"]["delta"], "auto");
  EXPECT_EQ(j["refit"]["staged"], true);
  ExpectError(parse_config("refit: {delta: yes}").status(), StatusCode::kInvalidArgument,
              {"refit.delta", "yes", "off", "on", "auto"});
  ExpectError(parse_config("refit: {staged: 3}").status(), StatusCode::kInvalidArgument,
              {"refit.staged"});
  // Refused at setup with gather, naming the key.
  ExpectError(ParseAndValidate("model: tiny-qwen3\nrefit: {delta: on, executor: gather}\n"),
              StatusCode::kInvalidArgument, {"refit.delta", "executor gather moves buckets"});
  ExpectError(ParseAndValidate("model: tiny-qwen3\nrefit: {staged: true, executor: gather}\n"),
              StatusCode::kInvalidArgument, {"refit.staged", "executor gather moves buckets"});
  EXPECT_TRUE(ParseAndValidate("model: tiny-qwen3\nrefit: {delta: auto}\n").ok());
  EXPECT_TRUE(ParseAndValidate("model: tiny-qwen3\nrefit: {delta: on, executor: p2p}\n").ok());
  EXPECT_TRUE(ParseAndValidate("model: tiny-qwen3\nrefit: {staged: true}\n").ok());
  EXPECT_TRUE(ParseAndValidate("model: tiny-qwen3\nrefit: {staged: true, delta: on}\n").ok());
  EXPECT_TRUE(ParseAndValidate("model: tiny-qwen3\nrefit: {delta: off, staged: false}\n").ok());
}

TEST(ConfigParse, UnknownKeysNameTheDottedKeyAndTheAllowedKeys) {
  ExpectError(parse_config("refit:\n  buffer_size: 1024\n").status(), StatusCode::kInvalidArgument,
              {"unknown key \"refit.buffer_size\"",
               "allowed keys under refit: target_precision, buffer_size_bytes, num_buffers, "
               "timeout_s",
               "line 2", "did you mean \"buffer_size_bytes\""});
  ExpectError(parse_config("modle: x").status(), StatusCode::kInvalidArgument,
              {"unknown key \"modle\"",
               "allowed keys at the top level: model, device, seed, policy, generation, refit"});
  ExpectError(parse_config("policy: {world: 2}").status(), StatusCode::kInvalidArgument,
              {"unknown key \"policy.world\"",
               "allowed keys under policy: backend, world_size, dtype, megatron"});
  ExpectError(
      parse_config("policy: {backend: megatron, megatron: {dp: 2}}").status(),
      StatusCode::kInvalidArgument,
      {"unknown key \"policy.megatron.dp\"", "allowed keys under policy.megatron: tp, pp, ep"});
  ExpectError(parse_config("generation: {engines: 2}").status(), StatusCode::kInvalidArgument,
              {"unknown key \"generation.engines\"",
               "backend, colocated, weight_transfer_mode, num_engines, tp_size"});
}

TEST(ConfigParse, DuplicateKeyIsAnError) {
  ExpectError(parse_config("seed: 1\nseed: 2\n").status(), StatusCode::kInvalidArgument,
              {"duplicate key \"seed\"", "line 2"});
}

// (yaml, substrings the message must hold)
using Case = std::tuple<const char*, std::vector<std::string>>;

class ConfigParseError : public ::testing::TestWithParam<Case> {};

TEST_P(ConfigParseError, NamesKeyValueAndAllowed) {
  const auto& [yaml, parts] = GetParam();
  auto c = parse_config(yaml);
  ASSERT_FALSE(c.ok()) << yaml;
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  for (const auto& p : parts) EXPECT_CONTAINS(c.status().message(), p) << yaml;
}

INSTANTIATE_TEST_SUITE_P(
    ConfigTypes, ConfigParseError,
    ::testing::Values(
        Case{"policy: {world_size: two}",
             {"policy.world_size: expected an integer; got two", "allowed: an integer from 1 to 16384"}},
        Case{"policy: {world_size: 2.5}", {"policy.world_size: expected an integer; got 2.5"}},
        Case{"policy: {world_size: \"2\"}", {"policy.world_size: expected an integer; got \"2\""}},
        Case{"policy: {world_size: 99999999999}",
             {"policy.world_size: must be between 1 and 16384; got 99999999999"}},
        Case{"refit: {buffer_size_bytes: 99999999999999999999}",
             {"refit.buffer_size_bytes: is out of range; got 99999999999999999999"}},
        Case{"generation: {colocated: yes}",
             {"generation.colocated: expected a boolean; got yes", "allowed: true | false"}},
        Case{"generation: {colocated: 1}", {"generation.colocated: expected a boolean; got 1"}},
        Case{"refit: {timeout_s: fast}", {"refit.timeout_s: expected a number; got fast"}},
        Case{"refit: {timeout_s: .inf}", {"refit.timeout_s: expected a number; got .inf"}},
        Case{"seed: abc", {"seed: expected a non-negative integer; got abc"}},
        Case{"seed: 18446744073709551616", {"seed: is out of range", "18446744073709551615"}},
        Case{"model: [a, b]", {"model: expected a string; got a sequence [a, b]"}},
        Case{"model: \"\"", {"model: must not be empty"}},
        Case{"policy: 3",
             {"policy: expected a mapping; got 3",
              "a mapping with keys backend, world_size, dtype, megatron"}},
        Case{"refit: [1]", {"refit: expected a mapping; got a sequence [1]"}},
        Case{"seed:", {"seed: has no value; got null"}},
        Case{"- a\n- b\n", {"config: expected a mapping at the top level"}},
        Case{"policy: {world_size: [1}", {"config: invalid YAML at line 1"}}));

INSTANTIATE_TEST_SUITE_P(
    ConfigValues, ConfigParseError,
    ::testing::Values(
        Case{"policy: {world_size: 0}", {"policy.world_size: must be between 1 and 16384; got 0 (line 1)"}},
        Case{"generation: {num_engines: -1}", {"generation.num_engines: must be between 1 and 16384; got -1"}},
        Case{"generation: {tp_size: 0}", {"generation.tp_size: must be between 1 and 16384; got 0"}},
        Case{"refit: {buffer_size_bytes: 255}",
             {"refit.buffer_size_bytes: must be at least 256 bytes", "got 255",
              "allowed: an integer >= 256"}},
        Case{"refit: {num_buffers: 0}",
             {"refit.num_buffers: must be between 1 and 16; got 0",
              "allowed: an integer from 1 to 16"}},
        Case{"refit: {num_buffers: 17}", {"refit.num_buffers: must be between 1 and 16; got 17"}},
        Case{"refit: {timeout_s: 0}", {"refit.timeout_s: must be > 0", "got 0"}},
        Case{"refit: {timeout_s: -3}", {"refit.timeout_s: must be > 0", "got -3"}},
        Case{"seed: -1", {"seed: must be a non-negative integer; got -1"}},
        Case{"device: gpu", {"device: unknown value; got gpu", "allowed: cpu | cuda"}},
        Case{"policy: {backend: deepspeed}",
             {"policy.backend: unknown value; got deepspeed", "allowed: fsdp2 | megatron"}},
        Case{"policy: {dtype: float16}",
             {"policy.dtype: unknown value; got float16", "float32", "bfloat16"}},
        Case{"generation: {backend: trtllm}",
             {"generation.backend: unknown value; got trtllm", "allowed: sglang | vllm"}},
        Case{"generation: {weight_transfer_mode: nccl}",
             {"generation.weight_transfer_mode: unknown value; got nccl",
              "allowed: broadcast | ipc"}},
        Case{"refit: {executor: fast}",
             {"refit.executor: unknown value; got fast", "allowed: auto | peer | p2p | gather"}},
        Case{"refit: {target_precision: fp16}",
             {"refit.target_precision: unknown value; got fp16",
              "allowed: bf16 | bfloat16 | fp8 | float8_e4m3"}},
        Case{"policy: {backend: megatron, megatron: {tp: 0}}",
             {"policy.megatron.tp: must be between 1 and 16384; got 0"}},
        Case{"policy: {backend: megatron, megatron: {pp: x}}",
             {"policy.megatron.pp: expected an integer; got x"}},
        Case{"policy: {megatron: {ep: 2}}",
             {"policy.megatron.ep: only used with policy.backend: megatron", "got 2",
              "set policy.backend: megatron"}}));

TEST(ConfigParse, MegatronBlockWithFsdp2OnlyAsNoOp) {
  EXPECT_TRUE(parse_config("policy: {backend: fsdp2, megatron: {tp: 1, pp: 1, ep: 1}}").ok());
  EXPECT_TRUE(parse_config("policy: {megatron: {}}").ok());
  // Order of keys does not matter: backend is known before megatron is judged.
  EXPECT_TRUE(parse_config("policy: {megatron: {tp: 2}, backend: megatron}").ok());
}

TEST(ConfigFile, LoadsFileAndNamesPathInErrors) {
  testing::TempDir dir;
  auto ok = load_config_file(dir.write("ok.yaml", "model: tiny-qwen3\nseed: 5\n"));
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(ok->seed, 5u);

  const std::string bad = dir.write("bad.yaml", "refit:\n  num_buffers: 99\n");
  ExpectError(load_config_file(bad).status(), StatusCode::kInvalidArgument,
              {bad + ": refit.num_buffers: must be between 1 and 16; got 99 (line 2)"});

  const std::string missing = dir.path() + "/nope.yaml";
  ExpectError(load_config_file(missing).status(), StatusCode::kNotFound, {missing});
  ExpectError(load_config_file(dir.path()).status(), StatusCode::kInvalidArgument,
              {dir.path(), "is a directory"});
}

// ---------------------------------------------------------------------------------------------
// Validation

TEST(ConfigValidate, TransferModeMustMatchColocation) {
  ExpectError(ParseAndValidate("model: tiny-qwen3\n"
                               "generation: {colocated: false, weight_transfer_mode: ipc}"),
              StatusCode::kInvalidArgument,
              {"generation.weight_transfer_mode: ipc requires generation.colocated: true",
               "got ipc with generation.colocated: false", "allowed: broadcast"});
  ExpectError(ParseAndValidate("model: tiny-qwen3\n"
                               "generation: {colocated: true, weight_transfer_mode: broadcast}"),
              StatusCode::kInvalidArgument,
              {"generation.weight_transfer_mode", "got broadcast with generation.colocated: true",
               "allowed: ipc"});
  EXPECT_TRUE(ParseAndValidate("model: tiny-qwen3\ngeneration: {colocated: true}").ok());
}

TEST(ConfigValidate, ColocatedNeedsOneEngineRankPerTrainerRank) {
  ExpectError(
      ParseAndValidate("model: tiny-qwen3\npolicy: {world_size: 4}\n"
                       "generation: {colocated: true, num_engines: 1, tp_size: 2}"),
      StatusCode::kInvalidArgument,
      {"generation.colocated", "generation.num_engines 1", "generation.tp_size 2",
       "policy.world_size 4", "allowed: policy.world_size: 2, or generation.num_engines: 2"});
  EXPECT_TRUE(ParseAndValidate("model: tiny-qwen3\npolicy: {world_size: 4}\n"
                               "generation: {colocated: true, num_engines: 2, tp_size: 2}")
                  .ok());
  // Non-colocated: any counts.
  EXPECT_TRUE(ParseAndValidate("model: tiny-qwen3\npolicy: {world_size: 3}\n"
                               "generation: {num_engines: 2, tp_size: 4}")
                  .ok());
}

TEST(ConfigValidate, TargetPrecisionPerEngineProtocol) {
  // fp8 is accepted by both protocols; tiny-qwen3's TP 2 slices (32 rows) cut 128 x 128 blocks.
  for (const char* engine : {"sglang", "vllm"}) {
    const std::string base = fmt::format("model: tiny-qwen3\ngeneration: {{backend: {}}}\n", engine);
    ExpectError(ParseAndValidate(base + "refit: {target_precision: fp8}"),
                StatusCode::kInvalidArgument,
                {"refit.fp8: engine tp rank 0 of 2", "qkv_proj.weight", "q_proj.weight [64, 64]",
                 "cuts a 128 x 128 block"});
    Status ok = ParseAndValidate(base + "refit: {target_precision: float8_e4m3, fp8: {block: [16, 16]}}");
    EXPECT_TRUE(ok.ok()) << ok.to_string();
    ok = ParseAndValidate(base + "refit: {target_precision: fp8, fp8: {scheme: tensor}}");
    EXPECT_TRUE(ok.ok()) << ok.to_string();
  }
  ExpectError(ParseAndValidate("model: tiny-qwen3\nrefit: {target_precision: fp8, executor: "
                               "gather, fp8: {scheme: tensor}}"),
              StatusCode::kInvalidArgument,
              {"refit.executor", "got gather with refit.target_precision: fp8",
               "allowed: auto, peer or p2p"});
  ExpectError(ParseAndValidate("model: tiny-qwen3\nrefit: {target_precision: fp8, checksum: "
                               "true, fp8: {scheme: tensor}}"),
              StatusCode::kInvalidArgument, {"refit.checksum", "reference quantizer"});
  ExpectError(ParseAndValidate("model: tiny-qwen3\nrefit: {fp8: {scheme: tensor}}"),
              StatusCode::kInvalidArgument,
              {"refit.fp8", "only with refit.target_precision: fp8"});
  ExpectError(ParseAndValidate("model: tiny-qwen3\nrefit: {target_precision: fp8, fp8: {block: [16]}}"),
              StatusCode::kInvalidArgument, {"refit.fp8.block", "two integers"});
  ExpectError(ParseAndValidate("model: tiny-qwen3\nrefit: {target_precision: fp8, fp8: {block: [0, 16]}}"),
              StatusCode::kInvalidArgument, {"refit.fp8.block", "between 1 and"});
  ExpectError(ParseAndValidate("model: tiny-qwen3\nrefit: {target_precision: fp8, fp8: {scheme: row}}"),
              StatusCode::kInvalidArgument, {"refit.fp8.scheme", "block", "tensor"});
  EXPECT_TRUE(ParseAndValidate("model: tiny-qwen3\ngeneration: {backend: vllm}").ok());
}

TEST(ConfigValidate, CudaNeedsACudaBuild) {
  Status s = ParseAndValidate("model: tiny-qwen3\ndevice: cuda");
#ifdef REFIT_HAVE_CUDA
  EXPECT_TRUE(s.ok()) << s.to_string();
#else
  ExpectError(s, StatusCode::kInvalidArgument, {"device:", "no CUDA", "got cuda", "allowed: cpu"});
#endif
}

TEST(ConfigValidate, EngineTpNamesKeyQuantityAndValidSizes) {
  ExpectError(ParseAndValidate("model: tiny-qwen3\ngeneration: {tp_size: 3}"),
              StatusCode::kInvalidArgument,
              {"generation.tp_size: num_attention_heads (4) is not divisible by 3; got 3",
               "allowed: 1, 2, 4 (TP sizes up to 64 that shard tiny-qwen3)"});
  // tiny-qwen2: nq 14, nkv 2, I 80.
  ExpectError(ParseAndValidate("model: tiny-qwen2\ngeneration: {tp_size: 7}"),
              StatusCode::kInvalidArgument,
              {"generation.tp_size: 7 exceeds num_key_value_heads (2) but is not a multiple",
               "got 7", "allowed: 1, 2 ("});
  ExpectError(ParseAndValidate("model: tiny-qwen2\ngeneration: {tp_size: 14}"),
              StatusCode::kInvalidArgument,
              {"intermediate_size (80) is not divisible by 14", "got 14"});
  // KV heads are replicated when tp_size is a multiple of nkv.
  EXPECT_TRUE(ParseAndValidate("model: tiny-qwen3\ngeneration: {tp_size: 4}").ok());
  EXPECT_TRUE(ParseAndValidate("model: tiny-moe\ngeneration: {tp_size: 4}").ok());
  // Vocabulary sizes (1000, 515) never constrain TP: they are padded.
  EXPECT_TRUE(check_engine_tp(Spec("tiny-qwen3"), 2).ok());
}

TEST(ConfigValidate, EngineTpChecksExpertRowsOnlyForMoeLayers) {
  // Every layer is MoE: intermediate_size (63) is unused; moe_intermediate_size (18) counts.
  auto c = parse_hf_config(R"({"architectures":["Qwen3MoeForCausalLM"],"hidden_size":16,
    "intermediate_size":63,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
    "head_dim":4,"vocab_size":50,"num_experts":4,"num_experts_per_tok":1,
    "moe_intermediate_size":18})");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  ModelSpec spec(*c, "custom-moe");
  EXPECT_TRUE(check_engine_tp(spec, 2).ok());
  ExpectError(check_engine_tp(spec, 4), StatusCode::kInvalidArgument,
              {"generation.tp_size: moe_intermediate_size (18) is not divisible by 4; got 4",
               "allowed: 1, 2 (TP sizes up to 64 that shard custom-moe)"});
  ExpectError(check_engine_tp(spec, 0), StatusCode::kInvalidArgument,
              {"generation.tp_size: must be >= 1; got 0"});
}

TEST(ConfigValidate, MegatronParallelSizes) {
  const std::string qwen3 = "model: tiny-qwen3\n";  // nq 4, nkv 2, I 96, 2 layers
  EXPECT_TRUE(ParseAndValidate(qwen3 + "policy: {backend: megatron, world_size: 8, "
                                       "megatron: {tp: 2, pp: 2}}")
                  .ok());
  ExpectError(ParseAndValidate(qwen3 + "policy: {backend: megatron, world_size: 3, "
                                       "megatron: {tp: 2}}"),
              StatusCode::kInvalidArgument,
              {"policy.world_size: must be a multiple of policy.megatron.tp * "
               "policy.megatron.pp = 2 * 1 = 2",
               "got 3", "allowed: a multiple of 2"});
  ExpectError(ParseAndValidate(qwen3 + "policy: {backend: megatron, world_size: 4, "
                                       "megatron: {tp: 4}}"),
              StatusCode::kInvalidArgument,
              {"policy.megatron.tp: num_key_value_heads (2) is not divisible by 4", "got 4",
               "allowed: 1, 2 (for tiny-qwen3 with policy.world_size 4 and pp 1)"});
  ExpectError(
      ParseAndValidate(qwen3 + "policy: {backend: megatron, world_size: 3, "
                               "megatron: {pp: 3}}"),
      StatusCode::kInvalidArgument,
      {"policy.megatron.pp: num_hidden_layers (2) is not divisible by 3", "got 3", "allowed: 1 ("});
  ExpectError(ParseAndValidate(qwen3 + "policy: {backend: megatron, world_size: 2, "
                                       "megatron: {ep: 2}}"),
              StatusCode::kInvalidArgument,
              {"policy.megatron.ep: expert parallelism needs a MoE model", "got 2", "allowed: 1"});

  const std::string moe = "model: tiny-moe\n";  // 8 experts, moe_I 24
  EXPECT_TRUE(ParseAndValidate(moe + "policy: {backend: megatron, world_size: 8, "
                                     "megatron: {tp: 2, ep: 4}}")
                  .ok());
  ExpectError(ParseAndValidate(moe + "policy: {backend: megatron, world_size: 3, "
                                     "megatron: {ep: 3}}"),
              StatusCode::kInvalidArgument,
              {"policy.megatron.ep: num_experts (8) is not divisible by 3", "got 3",
               "allowed: 1 (for tiny-moe with data-parallel size 3)"});
  ExpectError(
      ParseAndValidate(moe + "policy: {backend: megatron, world_size: 4, "
                             "megatron: {tp: 2, ep: 4}}"),
      StatusCode::kInvalidArgument,
      {"policy.megatron.ep: must divide the data-parallel size", "= 2", "got 4", "allowed: 1, 2"});
}

TEST(ConfigValidate, RechecksConfigsBuiltInCode) {
  const ModelSpec spec = Spec("tiny-qwen3");
  Config c;
  c.model = "tiny-qwen3";
  ASSERT_TRUE(validate_config(c, spec).ok());
  Config bad = c;
  bad.refit.num_buffers = 0;
  ExpectError(validate_config(bad, spec), StatusCode::kInvalidArgument,
              {"refit.num_buffers", "got 0"});
  bad = c;
  bad.refit.buffer_size_bytes = 100;
  ExpectError(validate_config(bad, spec), StatusCode::kInvalidArgument,
              {"refit.buffer_size_bytes", "at least 256", "got 100"});
  bad = c;
  bad.policy.megatron.pp = 2;
  ExpectError(validate_config(bad, spec), StatusCode::kInvalidArgument,
              {"policy.megatron", "only used with policy.backend: megatron", "pp: 2"});
  bad = c;
  bad.policy.dtype = DType::kFloat16;
  ExpectError(validate_config(bad, spec), StatusCode::kInvalidArgument,
              {"policy.dtype", "got float16"});
  bad = c;
  bad.refit.timeout_s = 0;
  ExpectError(validate_config(bad, spec), StatusCode::kInvalidArgument, {"refit.timeout_s"});
}

TEST(ConfigMatrix, EveryDesignCellIsSupportedOnce) {
  const auto& cells = support_matrix();
  EXPECT_EQ(cells.size(), 8u);
  std::set<std::tuple<PolicyBackend, EngineProtocol, TransferMode>> seen;
  for (const auto& c : cells) {
    EXPECT_TRUE(c.supported) << c.note;
    EXPECT_FALSE(c.note.empty());
    seen.insert({c.policy, c.engine, c.mode});
  }
  EXPECT_EQ(seen.size(), 8u);
  // Every supported cell validates end to end on a tiny model.
  for (const auto& c : cells) {
    Config cfg;
    cfg.model = "tiny-qwen3";
    cfg.policy.backend = c.policy;
    cfg.generation.backend = c.engine;
    cfg.generation.weight_transfer_mode = c.mode;
    cfg.generation.colocated = c.mode == TransferMode::kIpc;
    EXPECT_TRUE(validate_config(cfg, Spec("tiny-qwen3")).ok()) << config_to_yaml(cfg);
  }
}

// ---------------------------------------------------------------------------------------------
// CLI

// refit.staged: check says what it costs (a staging copy per engine rank); without it, nothing.
TEST(ConfigCli, CheckSaysWhatAStagedApplyHolds) {
  testing::TempDir dir;
  auto staged = testing::run_cli(
      {"check", dir.write("s.yaml", "model: tiny-qwen3\nrefit: {staged: true}\n")}, 60);
  ASSERT_EQ(staged.exit_code, 0) << staged.output;
  EXPECT_CONTAINS(staged.output, "refit.staged: every engine rank also holds a staging copy");
  auto plain = testing::run_cli({"check", dir.write("p.yaml", "model: tiny-qwen3\n")}, 60);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_EQ(plain.output.find("refit.staged"), std::string::npos) << plain.output;
}

TEST(ConfigCli, CheckDefaultConfigExitsZeroAndPrintsTheCell) {
  testing::TempDir dir;
  auto r = testing::run_cli({"check", dir.write("c.yaml", std::string(default_config_yaml()))}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_CONTAINS(r.output, "ok: fsdp2 -> sglang, non-colocated (broadcast) — supported");
  EXPECT_CONTAINS(r.output, "qwen2.5-0.5b (Qwen2ForCausalLM): 290 tensors, 494032768");
  // The transfer plan: every pair's bytes, each engine rank of TP 2 with half of the model.
  EXPECT_CONTAINS(r.output, "moved along the transfer plan");
  EXPECT_CONTAINS(r.output, "trainer rank 1 -> engine rank 0 (engine 0 tp rank 0): ");
  EXPECT_CONTAINS(r.output, "engine rank 1 receives");
  EXPECT_CONTAINS(r.output, "(0.50");
}

// One rank's view: what that rank derives at setup — its pairs, routes (compact over the experts
// and the layers) and rounds — and the errors naming a rank that does not exist.
TEST(ConfigCli, CheckOneRankPrintsItsView) {
  testing::TempDir dir;
  const std::string cfg = dir.write(
      "c.yaml",
      "model: tiny-moe\npolicy: {world_size: 3}\ngeneration: {num_engines: 2, tp_size: 2}\n"
      "refit: {buffer_size_bytes: 8192}\n");
  auto all = testing::run_cli({"check", cfg}, 60);
  ASSERT_EQ(all.exit_code, 0) << all.output;
  EXPECT_CONTAINS(all.output, "every pair's routes agree on both sides");
  EXPECT_CONTAINS(all.output, "trainer rank 2 sends ");
  EXPECT_CONTAINS(all.output, "engine rank 3 receives ");
  auto t = testing::run_cli({"check", cfg, "--rank", "trainer:1"}, 60);
  ASSERT_EQ(t.exit_code, 0) << t.output;
  EXPECT_CONTAINS(t.output, "trainer rank 1: transfer plan ");
  EXPECT_CONTAINS(t.output, "sends ");
  EXPECT_CONTAINS(t.output, "to 4 engine rank(s)");
  EXPECT_CONTAINS(t.output, "-> engine rank 3 (engine 1 tp rank 1): ");
  // All 8 experts of a layer in one route, stacked in w13_weight one expert apart.
  EXPECT_CONTAINS(t.output, "to model.layers.0.mlp.experts.w13_weight");
  EXPECT_CONTAINS(t.output, ", x 8 (step: tensor +3");
  auto e = testing::run_cli({"check", cfg, "--rank", "engine:2"}, 60);
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_CONTAINS(e.output, "engine rank 2 (engine 1 tp rank 0): transfer plan ");
  EXPECT_CONTAINS(e.output, "from 3 trainer rank(s)");
  EXPECT_CONTAINS(e.output, "<- trainer rank 2: ");
  // Both sides of a pair print the same digest.
  const auto digest = [](const std::string& out, const std::string& line) {
    const auto at = out.find(line);
    if (at == std::string::npos) return std::string("none");
    const auto d = out.find("routes digest ", at);
    return out.substr(d + 14, 16);
  };
  auto t2 = testing::run_cli({"check", cfg, "--rank", "trainer:2"}, 60);
  EXPECT_EQ(digest(t2.output, "-> engine rank 2 "), digest(e.output, "<- trainer rank 2:"));
  for (const char* bad : {"trainer:3", "engine:4", "engine", "model:0", "trainer:1x"}) {
    auto r = testing::run_cli({"check", cfg, "--rank", bad}, 60);
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.output;
    EXPECT_CONTAINS(r.output, std::string("--rank ") + bad);
  }
}

TEST(ConfigCli, CheckWithTheGatherExecutorPrintsTheFullBucketPath) {
  testing::TempDir dir;
  auto r = testing::run_cli(
      {"check", dir.write("c.yaml", "model: tiny-qwen3\nrefit: {executor: gather}\n")}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_CONTAINS(r.output, "executor: gather");
  EXPECT_CONTAINS(r.output, "each receives the whole model");
}

TEST(ConfigCli, P2pWithColocatedCudaRanksIsASetupError) {
  if (!build_has_cuda()) GTEST_SKIP() << "device: cuda is refused earlier in a CPU-only build";
  testing::TempDir dir;
  auto r = testing::run_cli(
      {"check", dir.write("c.yaml", "model: tiny-qwen3\ndevice: cuda\n"
                                    "generation: {colocated: true, tp_size: 2}\n"
                                    "refit: {executor: p2p}\n")},
      60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_CONTAINS(r.output, "refit.executor: p2p uses NCCL send/recv");
}

TEST(ConfigCli, CheckPrintsResolvedConfig) {
  testing::TempDir dir;
  auto r = testing::run_cli({"check", "--print-config",
                             dir.write("c.yaml",
                                       "model: tiny-qwen3\ngeneration: {colocated: true, "
                                       "backend: vllm}\n")},
                            60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_CONTAINS(r.output, "ok: fsdp2 -> vllm, colocated (ipc) — supported");
  EXPECT_CONTAINS(r.output, "weight_transfer_mode: ipc");
}

TEST(ConfigCli, CheckExitsTwoOnEverySetupError) {
  testing::TempDir dir;
  auto tp = testing::run_cli(
      {"check", dir.write("tp.yaml", "model: tiny-qwen3\ngeneration: {tp_size: 3}\n")}, 60);
  EXPECT_EQ(tp.exit_code, 2) << tp.output;
  EXPECT_CONTAINS(tp.output, "tp.yaml: generation.tp_size");

  auto key = testing::run_cli({"check", dir.write("key.yaml", "refit: {buffer_size: 1}\n")}, 60);
  EXPECT_EQ(key.exit_code, 2) << key.output;
  EXPECT_CONTAINS(key.output, "unknown key \"refit.buffer_size\"");

  const std::string missing = dir.path() + "/missing.yaml";
  auto file = testing::run_cli({"check", missing}, 60);
  EXPECT_EQ(file.exit_code, 2) << file.output;
  EXPECT_CONTAINS(file.output, missing);

  const std::string no_model = dir.path() + "/no-such-model";
  auto model = testing::run_cli({"check", dir.write("m.yaml", "model: " + no_model + "\n")}, 60);
  EXPECT_EQ(model.exit_code, 2) << model.output;
  EXPECT_CONTAINS(model.output, no_model);
}

TEST(ConfigCli, CheckAcceptsAnHfModelDirectory) {
  testing::TempDir dir;
  auto json = preset_config_json("tiny-qwen2");
  ASSERT_TRUE(json.ok());
  dir.write("model/config.json", *json);
  auto r = testing::run_cli({"check", dir.write("c.yaml", "model: " + dir.path() +
                                                              "/model\n"
                                                              "generation: {tp_size: 2}\n")},
                            60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_CONTAINS(r.output, "Qwen2ForCausalLM");
}

// A FIFO (or any non-regular file) where refit expects a file is refused at once, naming it: a
// config, a model's config.json, a checkpoint's safetensors file. Each command is bounded by
// run_cli's timeout; before the fix the first two hung in open() and the third loaded random
// weights.
TEST(ConfigCli, NonRegularInputsAreRefusedWithoutBlocking) {
  testing::TempDir dir;
  const std::string fifo = dir.path() + "/config.yaml";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  auto config = testing::run_cli({"check", fifo}, 30);
  EXPECT_EQ(config.exit_code, 2) << config.output;
  EXPECT_CONTAINS(config.output, "config file " + fifo + " is a FIFO");

  const std::string model = dir.path() + "/model";
  std::filesystem::create_directories(model);
  ASSERT_EQ(mkfifo((model + "/config.json").c_str(), 0600), 0);
  const std::string cfg = dir.write("m.yaml", "model: " + model + "\n");
  auto json = testing::run_cli({"check", cfg}, 30);
  EXPECT_EQ(json.exit_code, 2) << json.output;
  EXPECT_CONTAINS(json.output, "model config " + model + "/config.json is a FIFO");

  auto text = preset_config_json("tiny-qwen3");
  ASSERT_TRUE(text.ok());
  const std::string ckpt = dir.path() + "/ckpt";
  dir.write("ckpt/config.json", *text);
  ASSERT_EQ(mkfifo((ckpt + "/model.safetensors").c_str(), 0600), 0);
  auto run = testing::run_cli(
      {"run", dir.write("r.yaml", "model: " + ckpt +
                                      "\npolicy: {world_size: 1}\ngeneration: {tp_size: 1}\n"),
       "--steps", "1"},
      60);
  EXPECT_NE(run.exit_code, 0) << run.output;
  EXPECT_CONTAINS(run.output, ckpt + "/model.safetensors is not a regular file");
  EXPECT_EQ(run.output.find("verified"), std::string::npos) << run.output;
}

// A broken checkpoint is a setup error of `refit check` and of `refit run` before any rank starts
// (exit 2, naming the file), not a failure of every rank at its setup.
TEST(ConfigCli, BrokenCheckpointIsRefusedBeforeAnyRankStarts) {
  testing::TempDir dir;
  auto text = preset_config_json("tiny-qwen3");
  ASSERT_TRUE(text.ok());
  dir.write("ckpt/config.json", *text);
  // A header length of 2^40 bytes in a 20-byte file.
  dir.write("ckpt/model.safetensors", std::string("\x00\x00\x00\x00\x00\x01\x00\x00{}", 10) +
                                          std::string(10, ' '));
  const std::string file = dir.path() + "/ckpt/model.safetensors";
  const std::string cfg = dir.write(
      "c.yaml", "model: " + dir.path() + "/ckpt\npolicy: {world_size: 1}\ngeneration: {tp_size: 1}\n");
  auto check = testing::run_cli({"check", cfg}, 60);
  EXPECT_EQ(check.exit_code, 2) << check.output;
  EXPECT_CONTAINS(check.output, file);
  auto run = testing::run_cli({"run", cfg, "--steps", "1"}, 60);
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_CONTAINS(run.output, file);
  EXPECT_EQ(run.output.find("trainer rank 0:"), std::string::npos)
      << "a rank started:\n" << run.output;
}

TEST(ConfigCli, MatrixPrintsTableAndJson) {
  auto r = testing::run_cli({"matrix"}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_CONTAINS(r.output, "| policy backend");
  EXPECT_CONTAINS(r.output, "SGLang non-colocated (broadcast)");
  EXPECT_CONTAINS(r.output, "| fsdp2 (DTensor) ");
  EXPECT_CONTAINS(r.output, "| megatron ");
  EXPECT_CONTAINS(r.output, "| fp8 (float8_e4m3) | supported | supported |");

  auto j = testing::run_cli({"matrix", "--json"}, 60);
  ASSERT_EQ(j.exit_code, 0) << j.output;
  auto doc = nlohmann::json::parse(j.output);
  ASSERT_EQ(doc["cells"].size(), 8u);
  for (const auto& cell : doc["cells"]) EXPECT_TRUE(cell["supported"].get<bool>());
  int fp8_supported = 0;
  for (const auto& p : doc["target_precisions"])
    if (p["precision"] == "float8_e4m3") fp8_supported += p["supported"].get<bool>() ? 1 : 0;
  EXPECT_EQ(fp8_supported, 2);  // vllm and sglang
}

}  // namespace
}  // namespace refit
