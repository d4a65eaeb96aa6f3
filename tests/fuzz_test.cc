// Bounded fuzzing, run by CTest in CI (default and ASan builds): every control-message decoder,
// the SGLang bucket metadata, the safetensors header parser, the HF config.json parser and the
// config YAML parser each get 10,000 inputs mutated from a valid seed. The generator's seeds are
// fixed below, so a failure reproduces exactly; change kRounds or the seeds to explore further.
//
// An input may be accepted or refused. What must never happen is a crash, a sanitizer report, an
// exception escaping the parser, or a hang (each parser call is a few microseconds; CTest's
// timeout bounds the whole). Each target must see both outcomes, which shows that the mutations
// reach past the first check.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "control/messages.h"
#include "executor/bucket_meta.h"
#include "io/safetensors.h"
#include "plan/bucket_plan.h"
#include "refit/config.h"
#include "refit/model_spec.h"

namespace refit {
namespace {

using json = nlohmann::json;

constexpr int kRounds = 10000;

// A random JSON value: the types and extremes parsers trip over.
json random_value(std::mt19937_64& rng, int depth = 0) {
  switch (rng() % (depth > 2 ? 9 : 11)) {
    case 0: return nullptr;
    case 1: return rng() % 2 == 0;
    case 2: return static_cast<std::int64_t>(rng());
    case 3: return -1;
    case 4: return 0;
    case 5: return 1e308 * ((rng() % 2) ? 1 : -1);
    case 6: return 0.5;
    case 7: return std::string(rng() % 40, static_cast<char>('a' + rng() % 26));
    case 8: return std::uint64_t{18446744073709551615ull};
    case 9: {
      json a = json::array();
      for (int i = 0, n = static_cast<int>(rng() % 4); i < n; ++i)
        a.push_back(random_value(rng, depth + 1));
      return a;
    }
    default: {
      json o = json::object();
      for (int i = 0, n = static_cast<int>(rng() % 4); i < n; ++i)
        o[std::string(1, static_cast<char>('a' + rng() % 26))] = random_value(rng, depth + 1);
      return o;
    }
  }
}

// Replaces, removes or adds one node somewhere in `j`.
void mutate_tree(json& j, std::mt19937_64& rng) {
  json* at = &j;
  for (int depth = 0; depth < 6 && (at->is_object() || at->is_array()) && !at->empty() &&
                      rng() % 3 != 0;
       ++depth) {
    auto it = at->begin();
    std::advance(it, static_cast<long>(rng() % at->size()));
    at = &*it;
  }
  const int op = static_cast<int>(rng() % 3);
  if (op == 0 || !(at->is_object() || at->is_array())) {
    *at = random_value(rng);
  } else if (op == 1 && !at->empty()) {
    if (at->is_object())
      at->erase(std::next(at->begin(), static_cast<long>(rng() % at->size())).key());
    else
      at->erase(static_cast<std::size_t>(rng() % at->size()));
  } else if (at->is_object()) {
    (*at)[std::string(1 + rng() % 8, 'k')] = random_value(rng);
  } else {
    at->push_back(random_value(rng));
  }
}

// Byte-level damage: flips, bytes JSON and YAML care about, insertions, deletions, truncation,
// duplication.
void mutate_bytes(std::string& s, std::mt19937_64& rng) {
  static const std::string kSpecial = "{}[]\":,-.0123456789eE\\ \n\t#&*!|>'%@`\x00\xff\x80";
  for (int n = 1 + static_cast<int>(rng() % 4); n > 0; --n) {
    const std::size_t at = s.empty() ? 0 : rng() % s.size();
    switch (rng() % 6) {
      case 0:
        if (!s.empty()) s[at] = static_cast<char>(s[at] ^ (1 << (rng() % 8)));
        break;
      case 1:
        if (!s.empty()) s[at] = kSpecial[rng() % kSpecial.size()];
        break;
      case 2: s.insert(at, 1 + rng() % 8, kSpecial[rng() % kSpecial.size()]); break;
      case 3: s.erase(at, 1 + rng() % 16); break;
      case 4: s.resize(at); break;
      default:
        if (!s.empty()) s.insert(rng() % s.size(), s.substr(at, 1 + rng() % 32));
    }
  }
}

// Runs `parse` on kRounds inputs mutated from `seed` (tree mutations when `tree`); returns
// {accepted, refused}.
std::pair<int, int> fuzz(std::uint64_t rng_seed, const std::string& seed, bool tree,
                         const std::function<bool(const std::string&)>& parse) {
  std::mt19937_64 rng(rng_seed);
  const json parsed = tree ? json::parse(seed) : json();
  int accepted = 0, refused = 0;
  for (int i = 0; i < kRounds; ++i) {
    std::string input;
    if (tree && rng() % 2 == 0) {
      json j = parsed;
      for (int k = 1 + static_cast<int>(rng() % 3); k > 0; --k) mutate_tree(j, rng);
      input = j.dump();
    } else {
      input = seed;
      mutate_bytes(input, rng);
    }
    (parse(input) ? accepted : refused)++;
  }
  return {accepted, refused};
}

void expect_both(const char* what, std::pair<int, int> r) {
  EXPECT_GT(r.first, 0) << what << ": no mutated input was accepted";
  EXPECT_GT(r.second, 0) << what << ": no mutated input was refused";
  std::printf("fuzz %-22s %d inputs: %d accepted, %d refused\n", what, kRounds, r.first, r.second);
}

TEST(Fuzz, ControlMessageDecoders) {
  HelloMessage hello;
  hello.engine_rank = 3;
  hello.plan_hash = "abc";
  hello.total_parameters = 1000;
  hello.settings = {{"refit.buffer_size_bytes", "4096"}, {"generation.tp_size", "2"}};
  const std::string from = "engine 0 tp rank 1";
  expect_both("hello", fuzz(101, encode(hello), true, [&](const std::string& p) {
                return decode_hello(p, from).ok() && check_peer_versions(p, from, "me").ok();
              }));
  expect_both(
      "begin",
      fuzz(102, encode(BeginMessage{.step = 2, .version = "v2", .verify = true, .buckets = 3}),
           true, [&](const std::string& p) { return decode_begin(p, from).ok(); }));
  PausedMessage paused;
  paused.step = 2;
  paused.direct = ExportedParams{.handle = "h", .bytes = 4096, .offsets = {0, 256, 1024}};
  expect_both("paused", fuzz(103, encode(paused), true,
                             [&](const std::string& p) { return decode_paused(p, from).ok(); }));
  expect_both("commit", fuzz(104, encode(CommitMessage{.step = 7}), true,
                             [&](const std::string& p) { return decode_commit(p, from).ok(); }));
  expect_both(
      "committed",
      fuzz(105,
           encode(CommittedMessage{
               .step = 2, .apply_s = 0.5, .checksums = "trainer/0=ab", .checksum_sums = PairSums(0xab, 0xcd, 0xef)}),
           true, [&](const std::string& p) { return decode_committed(p, from).ok(); }));
  const FailureOrigin failed{
      .rank = RankId::engine(3, 2), .code = StatusCode::kCorruption, .error = "x"};
  expect_both("verified", fuzz(106, encode(VerifiedMessage{.step = 2, .failed = failed}), true,
                               [&](const std::string& p) { return decode_verified(p, from).ok(); }));
  expect_both("proceed", fuzz(110, encode(ProceedMessage{.step = 3, .refused = failed}),
                              true, [&](const std::string& p) { return decode_proceed(p, from).ok(); }));
  expect_both("outcome", fuzz(109, encode(OutcomeMessage{.step = 3, .failed = failed}), true,
                              [&](const std::string& p) { return decode_outcome(p, from).ok(); }));
  expect_both("outcome-heard",
              fuzz(111, encode(OutcomeHeardMessage{.step = 3, .valid = true, .weight_version = "3"}),
                   true, [&](const std::string& p) { return decode_outcome_heard(p, from).ok(); }));
  expect_both("abort-heard", fuzz(112, encode(AbortHeardMessage{.step = 4}), true, [&](const std::string& p) {
                return decode_abort_heard(p, from).ok();
              }));
  expect_both("bucket",
              fuzz(113, encode(BucketMessage{.slot = 1, .step = 2, .bucket = 3, .bytes = 4096, .meta = "m"}),
                   true, [&](const std::string& p) { return decode_bucket(p, from).ok(); }));
  expect_both("bucket-done",
              fuzz(114, encode(BucketDoneMessage{.slot = 1, .step = 2, .bucket = 3}), true,
                   [&](const std::string& p) { return decode_bucket_done(p, from).ok(); }));
  expect_both("failure record", fuzz(115, encode_failure(failed), true, [&](const std::string& p) {
                return decode_failure(p, from).ok();
              }));
  RoutesMessage routes;
  routes.routes = {{.round = 0, .param = "w", .row = 0, .col = 0, .rows = 2, .cols = 3, .offset = 0},
                   {.round = 1, .param = "b", .row = 1, .col = 0, .rows = 1, .cols = 3, .offset = 6}};
  expect_both("routes", fuzz(107, encode(routes), true,
                             [&](const std::string& p) { return decode_routes(p, from).ok(); }));
  expect_both("version stamp",
              fuzz(108, encode_version_stamp(version(), {{"refit.executor", "auto"}}), true,
                   [&](const std::string& p) { return decode_stamp_settings(p, from).ok(); }));
  // The compact ones (control/fields.h): byte mutations only, they are no JSON.
  EnginesPausedMessage paused_all{.step = 5,
                                  .refused = failed,
                                  .exports = {std::string("0123456789abcdef"), std::nullopt}};
  paused_all.delta = {DeltaBase{.rank = 1, .digest = "00000000000000ff", .version = "4"}};
  paused_all.group_delta[3] = {DeltaBase{.rank = 0, .digest = std::nullopt, .version = "4"}};
  expect_both("engines-paused", fuzz(116, encode(paused_all), false, [&](const std::string& p) {
                return decode_engines_paused(p, from).ok();
              }));
  expect_both("sent",
              fuzz(117,
                   encode(SentMessage{.step = 5,
                                      .sums = {{"engine/0", PairSums(1, 2, 3)},
                                               {"engine/1", PairSums(4, 5, 6)}}}),
                   false, [&](const std::string& p) { return decode_sent(p, from).ok(); }));
  expect_both("refit-done",
              fuzz(118, encode(RefitDoneMessage{.step = 5, .failed = failed, .apply_s = 0.25}),
                   false, [&](const std::string& p) { return decode_refit_done(p, from).ok(); }));
}

TEST(Fuzz, SglangBucketMetadata) {
  auto spec = load_model_spec("tiny-qwen3");
  ASSERT_TRUE(spec.ok());
  auto plan = make_bucket_plan(*spec, DType::kBFloat16, 1 << 16, kBucketAlignment);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  const std::string seed = encode_sglang_meta(*spec, plan->buckets[0], DType::kBFloat16);
  ASSERT_TRUE(decode_sglang_meta(*spec, seed, DType::kBFloat16, 0, 1 << 16).ok());
  expect_both("sglang bucket meta", fuzz(201, seed, true, [&](const std::string& p) {
                return decode_sglang_meta(*spec, p, DType::kBFloat16, 0, 1 << 16).ok();
              }));
}

TEST(Fuzz, SafetensorsHeader) {
  const std::string seed =
      R"({"__metadata__":{"format":"pt"},"a.weight":{"dtype":"F32","shape":[2,3],)"
      R"("data_offsets":[0,24]},"b":{"dtype":"BF16","shape":[4],"data_offsets":[24,32]}})";
  ASSERT_TRUE(SafetensorsFile::check_header(seed, 32, "seed").ok());
  expect_both("safetensors header", fuzz(301, seed, true, [](const std::string& p) {
                return SafetensorsFile::check_header(p, 32, "fuzz").ok();
              }));
}

TEST(Fuzz, HfConfigJson) {
  const std::string seed =
      R"({"architectures":["Qwen3ForCausalLM"],"hidden_size":64,"intermediate_size":128,)"
      R"("num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,)"
      R"("vocab_size":256,"head_dim":16,"tie_word_embeddings":false,"torch_dtype":"bfloat16"})";
  auto ok = parse_hf_config(seed);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  expect_both("config.json", fuzz(401, seed, true, [](const std::string& p) {
                return parse_hf_config(p).ok();
              }));
}

TEST(Fuzz, ConfigYaml) {
  const std::string seed =
      "model: tiny-qwen3\ndevice: cpu\nseed: 7\n"
      "policy:\n  backend: fsdp2\n  world_size: 2\n  dtype: float32\n"
      "generation:\n  backend: sglang\n  colocated: false\n  num_engines: 1\n  tp_size: 2\n"
      "refit:\n  target_precision: bf16\n  buffer_size_bytes: 65536\n  num_buffers: 2\n"
      "  timeout_s: 20\n  executor: auto\n";
  ASSERT_TRUE(parse_config(seed).ok());
  expect_both("config yaml", fuzz(501, seed, false, [](const std::string& p) {
                return parse_config(p).ok();
              }));
}

}  // namespace
}  // namespace refit
