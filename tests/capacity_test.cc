// One store against a burst of processes that start at once, as the ranks of a large run do
// (docs/runtime.md, "Limits"): 256 processes, each holding the 4 connections a rank holds (its main
// client, whose first contact waits up to refit.timeout_s, and three clients whose requests are
// bounded by 2 s, as the liveness probe and the heartbeat are), all CURVE-authenticated against
// one store. Every one must connect. And `refit run` removes its run directory on a setup error.
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "control/auth.h"
#include "control/store.h"
#include "test_util.h"

extern char** environ;

namespace refit {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr int kProcesses = 256;
constexpr int kConnectionsPerProcess = kStoreConnectionsPerRank;
constexpr char kSecret[] = "capacity-test-secret-0123456789abcdef";

std::shared_ptr<const ControlAuth> auth() {
  auto a = ControlAuth::from_secret(kSecret);
  EXPECT_TRUE(a.ok());
  return std::make_shared<const ControlAuth>(*a);
}

// One of the burst: skipped unless StoreCapacity.ABurstOfProcessesAllConnect starts it.
TEST(StoreCapacity, OneProcessOfTheBurst) {
  const char* port = std::getenv("REFIT_TEST_STORE_PORT");
  if (port == nullptr) GTEST_SKIP() << "started by StoreCapacity.ABurstOfProcessesAllConnect";
  const auto a = auth();
  std::vector<std::unique_ptr<Store>> clients;
  for (int i = 0; i < kConnectionsPerProcess; ++i) {
    auto c = connect_store(StoreClientOptions{.host = "127.0.0.1",
                                              .port = std::atoi(port),
                                              .connect_timeout = 120s,
                                              .request_timeout = i == 0 ? 120s : 2s,
                                              .auth = a});
    ASSERT_TRUE(c.ok()) << "connection " << i << ": " << c.status().to_string();
    clients.push_back(std::move(c).value());
  }
  // Every connection is live at once: each answers, then the process waits for the others.
  for (auto& c : clients) ASSERT_TRUE(c->ping(10s).ok());
  ASSERT_TRUE(clients[0]->add("joined", 1).ok());
  auto go = clients[0]->get("go", 240s);
  ASSERT_TRUE(go.ok()) << go.status().to_string();
}

TEST(StoreCapacity, ABurstOfProcessesAllConnect) {
  auto server = StoreServer::start(
      StoreServerOptions{.host = "127.0.0.1", .port = 0, .auth = auth(), .ranks = kProcesses});
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  auto store = connect_store("127.0.0.1", (*server)->port(), 10s, auth());
  ASSERT_TRUE(store.ok()) << store.status().to_string();

  std::vector<std::string> env_store;
  for (char** e = environ; *e != nullptr; ++e) env_store.emplace_back(*e);
  env_store.push_back("REFIT_TEST_STORE_PORT=" + std::to_string((*server)->port()));
  std::vector<char*> envp;
  for (auto& e : env_store) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe", filter = "--gtest_filter=StoreCapacity.OneProcessOfTheBurst";
  char* argv[] = {exe.data(), filter.data(), nullptr};
  std::vector<pid_t> pids;
  for (int i = 0; i < kProcesses; ++i) {  // all at once
    pid_t pid = 0;
    ASSERT_EQ(posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, envp.data()), 0);
    pids.push_back(pid);
  }
  // Every process connected and holds its connections.
  std::int64_t joined = 0;
  const auto end = Clock::now() + 300s;
  while (Clock::now() < end) {
    auto n = (*store)->add("joined", 0);
    ASSERT_TRUE(n.ok()) << n.status().to_string();
    joined = *n;
    if (joined == kProcesses) break;
    int status = 0;
    const pid_t done = ::waitpid(-1, &status, WNOHANG);
    ASSERT_LE(done, 0) << "a process of the burst exited before every one joined (status " << status
                       << ")";
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_EQ(joined, kProcesses);
  ASSERT_TRUE((*store)->set("go", "1").ok());
  int failed = 0;
  for (pid_t pid : pids) {
    int status = 0;
    for (int k = 0; k < 3000 && ::waitpid(pid, &status, WNOHANG) == 0; ++k)
      std::this_thread::sleep_for(20ms);
    if (::waitpid(pid, &status, WNOHANG) == 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  EXPECT_EQ(failed, 0) << "of " << kProcesses << " processes";
}

// A setup error after `refit run` made its run directory (a run secret too short) leaves no
// directory behind.
TEST(RunDirectory, RemovedOnASetupError) {
  testing::TempDir tmp;
  const std::string cmd = "TMPDIR=" + tmp.path() + " REFIT_SECRET=short " + REFIT_CLI_PATH +
                          " run --steps 1 > " + tmp.path() + "/out.log 2>&1";
  const int rc = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(rc));
  EXPECT_EQ(WEXITSTATUS(rc), 2);
  int left = 0;
  for (const auto& e : std::filesystem::directory_iterator(tmp.path()))
    if (e.path().filename().string().rfind("refit-run-", 0) == 0) ++left;
  EXPECT_EQ(left, 0);
}

}  // namespace
}  // namespace refit
