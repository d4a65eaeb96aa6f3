// Helpers shared by the tests: temporary directories, running the refit CLI (and `refit run` on a
// config of the multi-process tests) as a process, time measured since a point, loopback sockets
// and relays, and skipping a test that needs a GPU.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "device/device.h"

// Skips the test unless a CUDA device is visible, saying why (no device, or a build without CUDA).
#define REFIT_REQUIRE_GPU()                                                                      \
  do {                                                                                           \
    if (::refit::device_count() == 0)                                                            \
      GTEST_SKIP() << (::refit::cuda_built() ? "no CUDA device visible" : "built without CUDA"); \
  } while (0)

namespace refit::testing {

// Seconds since `t0` on the steady clock.
inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A fresh directory under $TMPDIR, removed with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  // Writes `text` to path()/name and returns the full path.
  std::string write(const std::string& name, const std::string& text) const;

 private:
  std::string path_;
};

// A store server (control/store.h) in a forked process of its own, which a test can stop,
// resume or kill (`pid`) as a host that stalls or dies. Fork it before the test starts a thread of
// its own: a fork while another thread holds an allocator lock could leave the child deadlocked.
// The child serves for at most `lifetime_s`; the destructor kills it and reaps it.
class ForkedStoreServer {
 public:
  explicit ForkedStoreServer(int lifetime_s = 600);
  ~ForkedStoreServer() { kill(); }
  ForkedStoreServer(const ForkedStoreServer&) = delete;
  ForkedStoreServer& operator=(const ForkedStoreServer&) = delete;
  bool ok() const { return pid_ > 0 && port_ > 0; }
  int pid() const { return pid_; }
  int port() const { return port_; }
  void kill();  // SIGKILL and reap; again: nothing

 private:
  int pid_ = -1;
  int port_ = -1;
};

// A TCP socket listening on 127.0.0.1 at a port the system picks (set in `port`); -1 on failure.
int listen_on_loopback(int& port);
// A TCP connection to 127.0.0.1:`port`; -1 when it is refused.
int connect_to_loopback(int port);

// A TCP relay's listening socket on 127.0.0.1 and the thread that serves it, for tests that put
// a relay in front of a server to delay or cut its connections. `serve` runs on the thread (it
// polls stopping() and bounds its own loops); the destructor stops the thread, joins it and
// closes the socket. Make it the last member of the class whose state `serve` uses, so that the
// thread is joined before that state goes.
class LoopbackRelay {
 public:
  explicit LoopbackRelay(std::function<void(const LoopbackRelay&)> serve);
  ~LoopbackRelay();
  LoopbackRelay(const LoopbackRelay&) = delete;
  LoopbackRelay& operator=(const LoopbackRelay&) = delete;
  int port() const { return port_; }
  int listen_fd() const { return listen_; }
  bool stopping() const { return stop_.load(); }
  // One read from `from` written whole to `to`; false when either side closed or failed.
  static bool forward(int from, int to);

 private:
  int listen_ = -1, port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

struct CliResult {
  int exit_code = -1;  // exit status, or 128+signal
  std::string output;  // stdout and stderr together
};

// Runs the refit CLI with `args`, waits at most `timeout_s` (then kills it: exit_code 124).
CliResult run_cli(const std::vector<std::string>& args, double timeout_s = 300);

// Runs this test binary with `--gtest_filter=filter` and the extra environment `env_extra`
// ("NAME=value"); returns its exit status (124 after `timeout`, then it is killed; 128+signal).
int run_test_child(const std::string& filter, const std::vector<std::string>& env_extra,
                   std::chrono::seconds timeout);

// A `refit run` config of the multi-process tests: device cpu, FSDP2 (or Megatron) trainer ranks
// feeding engines of one protocol. Field order is that of the designated initializers the tests
// write (`{.engine = "vllm", .colocated = true}`).
struct RunConfig {
  std::string model = "tiny-qwen3";
  std::string engine = "sglang";  // generation.backend
  bool colocated = false;
  int world_size = 2;
  int num_engines = 1;
  int tp = 2;                     // generation.tp_size
  std::string dtype = "float32";  // policy.dtype
  long long buffer = 1 << 16;     // refit.buffer_size_bytes
  int num_buffers = 2;
  double timeout_s = 20;
  std::string executor = "auto";
  bool checksum = false;
  bool keep_previous = false;
  std::uint64_t seed = 7;
  std::string backend = "fsdp2";  // policy.backend; megatron writes policy.megatron below
  int megatron_tp = 1, megatron_pp = 1, megatron_ep = 1;
  std::string layout = "fused";    // generation.layout
  std::string delta = "off";       // refit.delta
  bool staged = false;             // refit.staged
  std::string precision = "bf16";  // refit.target_precision
  std::string fp8;                 // refit.fp8 as a YAML flow mapping ("" for none)
};
// The config file's text: every key of `c` (docs/config.md).
std::string config_yaml(const RunConfig& c);

// `refit run` on `c` (written to a temporary file) with `args`, bounded by 120 s.
CliResult run_config(const RunConfig& c,
                     const std::vector<std::string>& args = {"--steps", "2", "--verify"});

// How often `what` occurs in `text`.
std::size_t count_of(const std::string& text, const std::string& what);

}  // namespace refit::testing
