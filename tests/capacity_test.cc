// One store against a burst of processes that start at once, as the ranks of a large run do
// (docs/runtime.md, "Limits"): 256 processes, each holding the 4 connections a rank holds (its main
// client, whose first contact waits up to refit.timeout_s, and three clients whose requests are
// bounded by 2 s, as the liveness probe and the heartbeat are), all CURVE-authenticated against
// one store. Every one must connect. And `refit run` removes its run directory on a setup error
// and on SIGINT.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
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

int run_directories_in(const std::string& dir) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().rfind("refit-run-", 0) == 0) ++n;
  return n;
}

// A setup error after `refit run` made its run directory leaves no directory behind: REFIT_PORT
// names a port another server holds, so trainer rank 0, started with its config in the run
// directory, cannot host the store.
TEST(RunDirectory, RemovedOnASetupError) {
  testing::TempDir tmp;
  const int held = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ASSERT_EQ(::bind(held, reinterpret_cast<const sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(held, 4), 0);
  ASSERT_EQ(::getsockname(held, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const int port = ntohs(a.sin_port);
  const std::string cmd = "TMPDIR=" + tmp.path() + " REFIT_PORT=" + std::to_string(port) + " " +
                          REFIT_CLI_PATH + " run --steps 1 > " + tmp.path() + "/out.log 2>&1";
  const int rc = std::system(cmd.c_str());
  ::close(held);
  std::ifstream in(tmp.path() + "/out.log");
  const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_TRUE(WIFEXITED(rc));
  EXPECT_EQ(WEXITSTATUS(rc), 1) << out;
  // The ranks started (they read their config from the run directory) and trainer rank 0 failed.
  EXPECT_NE(out.find("trainer rank 0: I/O error: store server: port " + std::to_string(port)),
            std::string::npos)
      << out;
  EXPECT_EQ(run_directories_in(tmp.path()), 0);
}

// SIGINT to `refit run` while its ranks run: every rank is stopped, the run directory removed, and
// `refit run` dies of the signal.
TEST(RunDirectory, RemovedOnSigint) {
  testing::TempDir tmp;
  const std::string log = tmp.path() + "/out.log";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::setenv("TMPDIR", tmp.path().c_str(), 1);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::execl(REFIT_CLI_PATH, REFIT_CLI_PATH, "run", "--steps", "100000", nullptr);
    ::_exit(127);
  }
  // Once the run directory holds its config, the ranks are being started.
  bool made = false;
  for (int k = 0; k < 600 && !made; ++k) {
    for (const auto& e : std::filesystem::directory_iterator(tmp.path()))
      if (e.path().filename().string().rfind("refit-run-", 0) == 0 &&
          std::filesystem::exists(e.path() / "config.yaml"))
        made = true;
    if (!made) std::this_thread::sleep_for(50ms);
  }
  EXPECT_TRUE(made) << "no run directory within 30 s";
  std::this_thread::sleep_for(500ms);
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  int status = 0;
  pid_t done = 0;
  for (int k = 0; k < 600 && done == 0; ++k) {
    done = ::waitpid(pid, &status, WNOHANG);
    if (done == 0) std::this_thread::sleep_for(50ms);
  }
  if (done == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    FAIL() << "refit run did not end within 30 s of SIGINT";
  }
  std::ifstream in(log);
  const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT) << status << "\n" << out;
  EXPECT_NE(out.find("interrupted by signal 2"), std::string::npos) << out;
  EXPECT_EQ(run_directories_in(tmp.path()), 0);
}

}  // namespace
}  // namespace refit
