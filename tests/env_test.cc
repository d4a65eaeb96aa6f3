// The environment variables refit reads (common/env.h): typed parses, errors that name the
// variable, the value and what is accepted, and the CLI refusing a bad value at setup (exit 2).
#include "common/env.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cctype>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include "test_util.h"

namespace refit {
namespace {

using testing::run_cli;
using testing::TempDir;

// Sets `name` for the life of the guard (the CLI child inherits it), then restores it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = ::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(EnvParse, GoodValues) {
  EXPECT_EQ(*env::parse_device("3"), std::optional<int>(3));
  EXPECT_EQ(*env::parse_device("0"), std::optional<int>(0));
  EXPECT_EQ(*env::parse_cpu_threads("4"), 4);
  EXPECT_EQ(*env::parse_cpu_threads("64"), 64);
  EXPECT_EQ(*env::parse_log_level("debug"), log::Level::kDebug);
  EXPECT_EQ(*env::parse_log_level("warn"), log::Level::kWarn);
  EXPECT_EQ(*env::parse_log_level("error"), log::Level::kError);
  EXPECT_EQ(*env::parse_copy_engine("1"), env::CopyEngineUse::kCopyEngines);
  EXPECT_EQ(*env::parse_copy_engine("0"), env::CopyEngineUse::kKernel);
  EXPECT_EQ(*env::parse_copy_engine("auto"), env::CopyEngineUse::kAuto);
  EXPECT_EQ(*env::parse_master_port("29501"), 29501);
  EXPECT_EQ(*env::parse_rank("0"), std::optional<int>(0));
  EXPECT_EQ(*env::parse_world_size("2"), std::optional<int>(2));
  EXPECT_EQ(*env::parse_engine_rank("3"), std::optional<int>(3));
}

TEST(EnvParse, UnsetOrEmptyGivesTheDefault) {
  for (env::Text unset : {env::Text(), env::Text("")}) {
    EXPECT_EQ(*env::parse_device(unset), std::nullopt);
    const int threads = *env::parse_cpu_threads(unset);
    EXPECT_GE(threads, 1);
    EXPECT_LE(threads, 8);
    EXPECT_EQ(*env::parse_log_level(unset), log::Level::kInfo);
    EXPECT_EQ(*env::parse_copy_engine(unset), env::CopyEngineUse::kAuto);
    EXPECT_EQ(*env::parse_master_port(unset), 29500);
    EXPECT_EQ(*env::parse_rank(unset), std::nullopt);
    EXPECT_EQ(*env::parse_world_size(unset), std::nullopt);
    EXPECT_EQ(*env::parse_engine_rank(unset), std::nullopt);
  }
}

// refit's store port: REFIT_PORT, else torch.distributed's MASTER_PORT + 1 (never MASTER_PORT
// itself), else 29501.
TEST(EnvParse, TheStorePortNeverTakesTorchsPort) {
  EXPECT_EQ(*env::parse_store_port(env::Text(), env::Text()), 29501);
  EXPECT_EQ(*env::parse_store_port(env::Text(""), env::Text("")), 29501);
  EXPECT_EQ(*env::parse_store_port(env::Text(), env::Text("29500")), 29501);
  EXPECT_EQ(*env::parse_store_port(env::Text(), env::Text("12000")), 12001);
  EXPECT_EQ(*env::parse_store_port(env::Text("40000"), env::Text("12000")), 40000);
  EXPECT_EQ(*env::parse_store_port(env::Text("0"), env::Text()), 0);
  const Status too_big = env::parse_store_port(env::Text("70000"), env::Text()).status();
  EXPECT_NE(too_big.message().find("REFIT_PORT='70000' is not valid"), std::string::npos)
      << too_big.to_string();
  const Status last = env::parse_store_port(env::Text(), env::Text("65535")).status();
  EXPECT_NE(last.message().find("MASTER_PORT=65535 leaves no port above it"), std::string::npos)
      << last.to_string();
  const Status torch = env::parse_store_port(env::Text(), env::Text("x")).status();
  EXPECT_NE(torch.message().find("MASTER_PORT='x' is not valid"), std::string::npos)
      << torch.to_string();
}

struct Bad {
  std::string name;
  std::string value;
  std::string accepted;  // a part of the message saying what is accepted
  std::function<Status(env::Text)> parse;
};

TEST(EnvParse, BadValuesNameTheVariableTheValueAndWhatIsAccepted) {
  auto st = [](auto parse) { return [parse](env::Text t) { return parse(t).status(); }; };
  const std::vector<Bad> cases = {
      {"REFIT_DEVICE", "abc", "a non-negative integer", st(env::parse_device)},
      {"REFIT_DEVICE", "-1", "a non-negative integer", st(env::parse_device)},
      {"REFIT_DEVICE", "1x", "a non-negative integer", st(env::parse_device)},
      {"REFIT_DEVICE", " 1", "a non-negative integer", st(env::parse_device)},
      {"REFIT_DEVICE", "99999999999", "a non-negative integer", st(env::parse_device)},
      {"REFIT_CPU_THREADS", "-3", "an integer from 1 to 64", st(env::parse_cpu_threads)},
      {"REFIT_CPU_THREADS", "0", "an integer from 1 to 64", st(env::parse_cpu_threads)},
      {"REFIT_CPU_THREADS", "65", "an integer from 1 to 64", st(env::parse_cpu_threads)},
      {"REFIT_LOG", "loud", "one of debug, info, warn, error", st(env::parse_log_level)},
      {"REFIT_LOG", "DEBUG", "one of debug, info, warn, error", st(env::parse_log_level)},
      {"REFIT_COPY_ENGINE", "yes", "one of 0, 1, auto", st(env::parse_copy_engine)},
      {"REFIT_CONTROL_SPIN_US", "-1", "an integer from 0 to 1000000",
       st(env::parse_control_spin_us)},
      {"REFIT_CONTROL_SPIN_US", "2000000", "an integer from 0 to 1000000",
       st(env::parse_control_spin_us)},
      {"MASTER_PORT", "70000", "an integer from 1 to 65535", st(env::parse_master_port)},
      {"MASTER_PORT", "0", "an integer from 1 to 65535", st(env::parse_master_port)},
      {"RANK", "-1", "a non-negative integer", st(env::parse_rank)},
      {"WORLD_SIZE", "0", "a positive integer", st(env::parse_world_size)},
      {"ENGINE_RANK", "two", "a non-negative integer", st(env::parse_engine_rank)},
  };
  for (const Bad& c : cases) {
    const Status s = c.parse(c.value);
    SCOPED_TRACE(c.name + "=" + c.value);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(c.name + "='" + c.value + "'"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(c.accepted), std::string::npos) << s.message();
  }
}

TEST(EnvParse, Helpers) {
  EXPECT_EQ(*env::parse_int("X", "7", 0, 10), std::optional<int>(7));
  EXPECT_FALSE(env::parse_int("X", "+7", 0, 10).ok());
  EXPECT_FALSE(env::parse_int("X", "11", 0, 10).ok());
  EXPECT_EQ(*env::parse_word("X", "b", {"a", "b"}), std::optional<int>(1));
  EXPECT_EQ(*env::parse_word("X", env::Text(), {"a", "b"}), std::nullopt);
  EXPECT_EQ(env::parse_string("host-a"), std::optional<std::string>("host-a"));
  EXPECT_EQ(env::parse_string(""), std::nullopt);
}

TEST(EnvRead, EmptyCountsAsUnset) {
  {
    ScopedEnv e("REFIT_ENV_TEST_VALUE", "");
    EXPECT_EQ(env::read("REFIT_ENV_TEST_VALUE"), std::nullopt);
  }
  {
    ScopedEnv e("REFIT_ENV_TEST_VALUE", "x");
    EXPECT_EQ(env::read("REFIT_ENV_TEST_VALUE"), std::optional<std::string>("x"));
  }
  EXPECT_EQ(env::read("REFIT_ENV_TEST_VALUE"), std::nullopt);
}

// `refit run` refuses a bad value of any REFIT_ variable before a rank starts, even one this run
// (device: cpu) would not use.
TEST(EnvCli, RunRefusesABadDeviceAtSetup) {
  ScopedEnv e("REFIT_DEVICE", "abc");
  auto r = run_cli({"run", "--steps", "1"}, 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("REFIT_DEVICE='abc'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("non-negative integer"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("trainer rank"), std::string::npos) << r.output;  // nothing started
}

TEST(EnvCli, RunRefusesABadLogLevel) {
  ScopedEnv e("REFIT_LOG", "loud");
  auto r = run_cli({"run", "--steps", "1"}, 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("REFIT_LOG='loud'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("one of debug, info, warn, error"), std::string::npos) << r.output;
}

const char* kTinyConfig =
    "model: tiny-qwen3\ndevice: cpu\nseed: 7\n"
    "policy:\n  backend: fsdp2\n  world_size: 1\n  dtype: float32\n"
    "generation:\n  backend: sglang\n  colocated: false\n  num_engines: 1\n  tp_size: 1\n"
    "refit:\n  target_precision: bf16\n  timeout_s: 20\n";

// One rank started on its own (torchrun-style): a bad ENGINE_RANK is a setup error naming it.
TEST(EnvCli, EngineRefusesABadEngineRank) {
  TempDir dir;
  ScopedEnv e("ENGINE_RANK", "two");
  auto r = run_cli({"engine", dir.write("c.yaml", kTinyConfig)}, 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("ENGINE_RANK='two'"), std::string::npos) << r.output;
}

// Good values are taken, and each chosen value is logged once at debug level.
TEST(EnvCli, GoodValuesAreUsedAndLoggedAtDebug) {
  TempDir dir;
  ScopedEnv log("REFIT_LOG", "debug");
  ScopedEnv threads("REFIT_CPU_THREADS", "1");
  auto r = run_cli({"run", dir.write("c.yaml", kTinyConfig), "--steps", "1", "--verify"}, 120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("environment: REFIT_CPU_THREADS=1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("environment: REFIT_LOG=debug"), std::string::npos) << r.output;
}

// The sum of N over the lines "...N<tail>" of `output`.
// Whether a line of `output` holds `first` and, after it, `then`.
bool a_line_has(const std::string& output, const std::string& first, const std::string& then) {
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);)
    if (const std::size_t at = line.find(first);
        at != std::string::npos && line.find(then, at) != std::string::npos)
      return true;
  return false;
}

std::int64_t count_in_lines(const std::string& output, const std::string& tail) {
  std::int64_t n = 0;
  for (std::size_t at = output.find(tail); at != std::string::npos;
       at = output.find(tail, at + 1)) {
    std::size_t b = at;
    while (b > 0 && std::isdigit(static_cast<unsigned char>(output[b - 1]))) --b;
    if (b < at) n += std::stoll(output.substr(b, at - b));
  }
  return n;
}

// REFIT_CONTROL_SPIN_US: the ranks' mailboxes poll without blocking for that long after each
// message; the refit's messages (paused, proceed, commit, ...) then arrive while they spin, and
// each mailbox counts those at exit. The default is 0 on this 2-core machine, 50000 with 8 cores.
TEST(EnvCli, ControlSpinCatchesTheRefitsMessages) {
  EXPECT_EQ(*env::parse_control_spin_us("0"), 0);
  EXPECT_EQ(*env::parse_control_spin_us(env::Text()),
            std::thread::hardware_concurrency() >= 8 ? 50000 : 0);
  TempDir dir;
  ScopedEnv log("REFIT_LOG", "debug");
  ScopedEnv spin("REFIT_CONTROL_SPIN_US", "500000");
  auto r = run_cli({"run", dir.write("c.yaml", kTinyConfig), "--steps", "3", "--verify"}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("environment: REFIT_CONTROL_SPIN_US=500000"), std::string::npos);
  // "mailbox 'trainer/0': N message(s) arrived while it spun": N > 0 for some mailbox.
  EXPECT_GT(
      count_in_lines(r.output, " message(s) arrived while it spun (REFIT_CONTROL_SPIN_US=500000)"),
      0)
      << r.output;
}

// REFIT_CONTROL_LANES: ranks on one host exchange the refit's messages over same-host lanes
// (control/lane.h), each mailbox counting at exit what came that way, and the ranks on the store's
// host beat over a lane to it (control/store_lanes.h), which the store logs for each; with 0, none
// does, and the refit runs over ZeroMQ alone.
TEST(EnvCli, SameHostLanesCarryTheRefitsMessages) {
  EXPECT_TRUE(*env::parse_control_lanes(env::Text()));
  EXPECT_FALSE(*env::parse_control_lanes("0"));
  EXPECT_FALSE(env::parse_control_lanes("yes").ok());
  TempDir dir;
  ScopedEnv log("REFIT_LOG", "debug");
  const std::string cfg = dir.write("c.yaml", kTinyConfig);
  const std::string tail = " message(s) arrived over same-host lanes";
  {
    auto r = run_cli({"run", cfg, "--steps", "3", "--verify"}, 120);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_GT(count_in_lines(r.output, tail), 0) << r.output;
    EXPECT_NE(r.output.find("over its same-host lane"), std::string::npos) << r.output;
    for (const std::string rank : {"trainer/0", "engine/0"})
      EXPECT_TRUE(a_line_has(r.output, "store server ", "'" + rank + "' beats over a same-host lane"))
          << rank << ":\n" << r.output;
  }
  ScopedEnv off("REFIT_CONTROL_LANES", "0");
  auto r = run_cli({"run", cfg, "--steps", "3", "--verify"}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("environment: REFIT_CONTROL_LANES=0"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(tail), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("over its same-host lane"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("beats over a same-host lane"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace refit
