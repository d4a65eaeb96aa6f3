// The bad-input corpus (tests/bad_inputs/corpus.yaml, at least 120 cases): config YAML, a model's
// config.json, safetensors checkpoints, command-line flags and environment variables. Every case
// runs the real CLI and must be refused at setup: the expected exit code (2 unless the case says
// otherwise), no rank started, no refit ran, and an error that contains every expected string.
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "refit/model_spec.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::TempDir;

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (std::size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
    s.replace(at, from.size(), to);
  return s;
}

// model.safetensors of a checkpoint case: an 8-byte little-endian length (`length`, default the
// header's size), the header, `data` zero bytes, then cut to `truncate` bytes when given.
void write_safetensors(const std::string& path, const YAML::Node& c) {
  const std::string header = c["header"].as<std::string>();
  const std::uint64_t length =
      c["length"] ? c["length"].as<std::uint64_t>() : static_cast<std::uint64_t>(header.size());
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[static_cast<std::size_t>(i)] = static_cast<char>(length >> (8 * i));
  bytes += header;
  bytes += std::string(c["data"] ? c["data"].as<std::size_t>() : 0, '\0');
  if (c["truncate"]) bytes.resize(c["truncate"].as<std::size_t>());
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST(BadInputs, EveryCaseIsRefusedAtSetupNamingTheProblem) {
  const YAML::Node corpus = YAML::LoadFile(REFIT_SOURCE_DIR "/tests/bad_inputs/corpus.yaml");
  ASSERT_TRUE(corpus.IsSequence());
  ASSERT_GE(corpus.size(), 120u);
  auto tiny = preset_config_json("tiny-qwen3");
  ASSERT_TRUE(tiny.ok());
  TempDir shared;
  const std::string good =
      shared.write("good.yaml",
                   "model: tiny-qwen3\npolicy: {world_size: 1}\ngeneration: {tp_size: 1}\n"
                   "refit: {timeout_s: 10}\n");
  const std::string one_rank = "policy: {world_size: 1}\ngeneration: {tp_size: 1}\n";
  int checked = 0;
  for (const YAML::Node& c : corpus) {
    const std::string name = c["name"].as<std::string>();
    SCOPED_TRACE(name);
    TempDir dir;
    std::vector<std::string> args;
    if (c["model_json"]) {
      dir.write("model/config.json", c["model_json"].as<std::string>());
      args = {"check", dir.write("c.yaml", "model: " + dir.path() + "/model\n" +
                                               (c["config"] ? c["config"].as<std::string>()
                                                            : one_rank))};
    } else if (c["config"]) {
      args = {"check", dir.write("c.yaml", c["config"].as<std::string>())};
    } else if (c["checkpoint"]) {
      dir.write("ckpt/config.json", *tiny);
      write_safetensors(dir.path() + "/ckpt/model.safetensors", c["checkpoint"]);
      args = {"check", dir.write("c.yaml", "model: " + dir.path() + "/ckpt\n" + one_rank)};
    }
    if (c["args"]) {
      args.clear();
      for (const YAML::Node& a : c["args"])
        args.push_back(replace_all(replace_all(a.as<std::string>(), "{config}", good), "{dir}",
                                   dir.path()));
    }
    std::map<std::string, std::string> env;
    if (c["env"]) {
      for (const auto& kv : c["env"])
        env[kv.first.as<std::string>()] = replace_all(kv.second.as<std::string>(), "{dir}", dir.path());
      if (args.empty()) args = {"run", good, "--steps", "1"};
    }
    ASSERT_FALSE(args.empty()) << "a case needs config, model_json, checkpoint, args or env";
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    const testing::CliResult r = testing::run_cli(args, 60);
    for (const auto& [k, v] : env) ::unsetenv(k.c_str());
    const int code = c["code"] ? c["code"].as<int>() : 2;
    EXPECT_EQ(r.exit_code, code) << r.output;
    for (const YAML::Node& e : c["expect"]) {
      const std::string want = replace_all(e.as<std::string>(), "{dir}", dir.path());
      EXPECT_NE(r.output.find(want), std::string::npos) << "expected \"" << want << "\" in:\n"
                                                        << r.output;
    }
    EXPECT_EQ(r.output.find("[refit trainer"), std::string::npos) << "a rank started:\n" << r.output;
    EXPECT_EQ(r.output.find("step 1/"), std::string::npos) << "a refit ran:\n" << r.output;
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(corpus.size()));
}

}  // namespace
}  // namespace refit
