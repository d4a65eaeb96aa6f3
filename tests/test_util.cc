#include "test_util.h"

#include <spawn.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "control/store.h"

namespace refit::testing {

int listen_on_loopback(int& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(fd, 16) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  port = ntohs(a.sin_port);
  return fd;
}

int connect_to_loopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return fd;
  if (fd >= 0) ::close(fd);
  return -1;
}

LoopbackRelay::LoopbackRelay(std::function<void(const LoopbackRelay&)> serve) {
  listen_ = listen_on_loopback(port_);
  if (listen_ < 0) throw std::runtime_error("LoopbackRelay: cannot listen on 127.0.0.1");
  thread_ = std::thread([this, serve = std::move(serve)] { serve(*this); });
}

LoopbackRelay::~LoopbackRelay() {
  stop_ = true;
  thread_.join();
  ::close(listen_);
}

bool LoopbackRelay::forward(int from, int to) {
  char buf[65536];
  const ssize_t n = ::recv(from, buf, sizeof buf, 0);
  return n > 0 && ::send(to, buf, static_cast<std::size_t>(n), MSG_NOSIGNAL) == n;
}

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string templ = std::string(base ? base : "/tmp") + "/refit-test-XXXXXX";
  if (!mkdtemp(templ.data())) throw std::runtime_error("mkdtemp failed");
  path_ = templ;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string TempDir::write(const std::string& name, const std::string& text) const {
  std::string p = path_ + "/" + name;
  std::filesystem::create_directories(std::filesystem::path(p).parent_path());
  std::ofstream(p, std::ios::binary) << text;
  return p;
}

ForkedStoreServer::ForkedStoreServer(int lifetime_s) {
  int port_pipe[2];
  if (pipe(port_pipe) != 0) return;
  pid_ = fork();
  if (pid_ < 0) {
    close(port_pipe[0]);
    close(port_pipe[1]);
    return;
  }
  if (pid_ == 0) {
    close(port_pipe[0]);
    auto server = StoreServer::start("127.0.0.1", 0, nullptr);
    const int p = server.ok() ? (*server)->port() : -1;
    (void)!write(port_pipe[1], &p, sizeof p);
    close(port_pipe[1]);
    for (int i = 0; server.ok() && i < lifetime_s; ++i) sleep(1);  // bounded if never killed
    _exit(0);
  }
  close(port_pipe[1]);
  pollfd port_fd{port_pipe[0], POLLIN, 0};
  if (poll(&port_fd, 1, 10000) <= 0 ||
      read(port_pipe[0], &port_, sizeof port_) != static_cast<ssize_t>(sizeof port_))
    port_ = -1;
  close(port_pipe[0]);
}

void ForkedStoreServer::kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

CliResult run_cli(const std::vector<std::string>& args, double timeout_s) {
  int fds[2];
  if (pipe(fds) != 0) throw std::runtime_error("pipe failed");
  pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    close(fds[0]);
    close(fds[1]);
    std::vector<char*> argv;
    std::string exe = REFIT_CLI_PATH;
    argv.push_back(exe.data());
    std::vector<std::string> copy = args;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(exe.c_str(), argv.data());
    _exit(127);
  }
  close(fds[1]);
  fcntl(fds[0], F_SETFL, O_NONBLOCK);
  CliResult result;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int status = 0;
  bool done = false;
  char buf[4096];
  while (true) {
    ssize_t n;
    while ((n = read(fds[0], buf, sizeof(buf))) > 0) result.output.append(buf, n);
    if (!done && waitpid(pid, &status, WNOHANG) == pid) done = true;
    if (done && n == 0) break;  // EOF after exit: every child of the CLI closed the pipe too
    if (std::chrono::steady_clock::now() > deadline) {
      kill(-pid, SIGKILL);
      if (!done) waitpid(pid, &status, 0);
      close(fds[0]);
      result.exit_code = 124;
      result.output += "\n[test harness: killed after timeout]";
      return result;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  close(fds[0]);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

// Runs this test binary with a filter and extra environment; returns its exit status.
int run_test_child(const std::string& filter, const std::vector<std::string>& env_extra,
              std::chrono::seconds timeout) {
  std::vector<std::string> env_store;
  for (char** e = environ; *e != nullptr; ++e) env_store.emplace_back(*e);
  for (const auto& e : env_extra) env_store.push_back(e);
  std::vector<char*> envp;
  for (auto& e : env_store) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe", arg = "--gtest_filter=" + filter;
  char* argv[] = {exe.data(), arg.data(), nullptr};
  pid_t pid = 0;
  if (posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, envp.data()) != 0) return -1;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return 124;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string config_yaml(const RunConfig& c) {
  std::ostringstream y;
  y << "model: " << c.model << "\n"
    << "device: cpu\nseed: " << c.seed << "\n"
    << "policy:\n  backend: " << c.backend << "\n  world_size: " << c.world_size
    << "\n  dtype: " << c.dtype << "\n";
  if (c.backend == "megatron")
    y << "  megatron: {tp: " << c.megatron_tp << ", pp: " << c.megatron_pp
      << ", ep: " << c.megatron_ep << "}\n";
  y << "generation:\n  backend: " << c.engine
    << "\n  colocated: " << (c.colocated ? "true" : "false") << "\n  num_engines: " << c.num_engines
    << "\n  tp_size: " << c.tp << "\n  layout: " << c.layout << "\n"
    << "refit:\n  target_precision: " << c.precision << "\n  buffer_size_bytes: " << c.buffer
    << "\n  num_buffers: " << c.num_buffers << "\n  timeout_s: " << c.timeout_s
    << "\n  executor: " << c.executor << "\n  checksum: " << (c.checksum ? "true" : "false")
    << "\n  keep_previous: " << (c.keep_previous ? "true" : "false") << "\n  delta: " << c.delta
    << "\n  staged: " << (c.staged ? "true" : "false")
    << "\n";
  if (!c.fp8.empty()) y << "  fp8: " << c.fp8 << "\n";
  return y.str();
}

CliResult run_config(const RunConfig& c, const std::vector<std::string>& args) {
  TempDir dir;
  std::vector<std::string> all = {"run", dir.write("config.yaml", config_yaml(c))};
  all.insert(all.end(), args.begin(), args.end());
  return run_cli(all, 120);
}

std::size_t count_of(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace refit::testing
