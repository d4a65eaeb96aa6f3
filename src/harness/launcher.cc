#include "harness/launcher.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>

namespace refit {
namespace {

// The signal that interrupted the run; the wait loop acts on it (a handler may do little).
volatile sig_atomic_t g_signal = 0;

void note_signal(int sig) { g_signal = sig; }

}  // namespace

void catch_interrupts() {
  signal(SIGINT, note_signal);
  signal(SIGTERM, note_signal);
  signal(SIGHUP, note_signal);
}

namespace {

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return fmt::format("was killed by signal {} ({})", WTERMSIG(status),
                       strsignal(WTERMSIG(status)));
  return "stopped";
}

}  // namespace

std::string self_executable() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "refit";
  buf[n] = '\0';
  return buf;
}

Status ensure_process_limit(int ranks) {
  rlimit r{};
  if (getrlimit(RLIMIT_NPROC, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return Status::Ok();
  const auto needed = static_cast<rlim_t>(ranks) * kThreadsPerRank + 64;
  if (r.rlim_cur >= needed) return Status::Ok();
  if (r.rlim_max != RLIM_INFINITY && r.rlim_max < needed)
    return Status::InvalidArgument(fmt::format(
        "refit run: {} ranks need about {} processes and threads, but RLIMIT_NPROC is {} (hard "
        "limit {}); raise it (ulimit -u) or run fewer ranks on one machine (docs/runtime.md, "
        "\"Limits\")",
        ranks, needed, r.rlim_cur, r.rlim_max));
  r.rlim_cur = needed;
  if (setrlimit(RLIMIT_NPROC, &r) != 0)
    return Status::IOError(fmt::format("refit run: raising RLIMIT_NPROC to {} failed: {}", needed,
                                       std::strerror(errno)));
  return Status::Ok();
}

Result<LaunchResult> launch_and_wait(
    const std::string& executable, const std::vector<ChildSpec>& children, double timeout_s,
    const std::function<void(const std::string&, const std::string&)>& on_failure,
    double deadline_s) {
  const auto overall = deadline_s > 0
                           ? std::chrono::steady_clock::now() +
                                 std::chrono::milliseconds(static_cast<long long>(deadline_s * 1000))
                           : std::chrono::steady_clock::time_point::max();
  std::vector<pid_t> pids(children.size(), -1);
  catch_interrupts();
  if (g_signal != 0) {  // before any child started: nothing to stop
    LaunchResult early;
    early.interrupted = g_signal;
    early.summary = fmt::format("interrupted by signal {} ({}) before any rank started",
                                static_cast<int>(g_signal), strsignal(g_signal));
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGHUP, SIG_DFL);
    return early;
  }
  const pid_t parent = getpid();
  for (std::size_t i = 0; i < children.size(); ++i) {
    pid_t pid = fork();
    if (pid < 0) {
      for (pid_t p : pids)
        if (p > 0) kill(p, SIGKILL);
      return Status::IOError(
          fmt::format("fork of {} failed: {}", children[i].name, std::strerror(errno)));
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);  // the launcher already died
      for (const auto& [k, v] : children[i].env) setenv(k.c_str(), v.c_str(), 1);
      std::vector<std::string> args = children[i].args;
      std::vector<char*> argv;
      std::string exe = executable;
      argv.push_back(exe.data());
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(exe.c_str(), argv.data());
      _exit(127);
    }
    pids[i] = pid;
  }

  LaunchResult result;
  std::size_t alive = children.size();
  std::vector<int> statuses(children.size(), 0);
  std::vector<bool> stopped(children.size(), false);  // SIGSTOPped, not yet continued
  std::vector<std::chrono::steady_clock::time_point> stopped_at(children.size());
  bool failed = false;
  auto deadline = std::chrono::steady_clock::time_point::max();
  // SIGKILLs every child still running (but for stopped ones when `stopped_too` is false); returns
  // their names.
  auto kill_remaining = [&](bool stopped_too = true) {
    std::string killed;
    for (std::size_t i = 0; i < pids.size(); ++i)
      if (pids[i] > 0 && (stopped_too || !stopped[i])) {
        kill(pids[i], SIGKILL);
        killed += (killed.empty() ? "" : ", ") + children[i].name;
      }
    return killed;
  };
  // Whether the child that hosts the store has exited or is stopped.
  auto store_gone = [&] {
    for (std::size_t i = 0; i < children.size(); ++i)
      if (children[i].hosts_store && (pids[i] < 0 || stopped[i])) return true;
    return false;
  };
  // Waits for every child still running (after kill_remaining) and records how each ended.
  auto reap_remaining = [&] {
    while (alive > 0) {
      int st = 0;
      const pid_t p = waitpid(-1, &st, 0);
      if (p <= 0) break;
      for (std::size_t i = 0; i < pids.size(); ++i)
        if (pids[i] == p) {
          pids[i] = -1;
          statuses[i] = st;
          --alive;
        }
    }
  };
  while (alive > 0) {
    if (g_signal !=
        0) {  // SIGINT/SIGTERM/SIGHUP: stop every child now, reap them, let the caller clean up
      kill_remaining();
      reap_remaining();
      result.interrupted = g_signal;
      result.summary = fmt::format("interrupted by signal {} ({}); every rank was stopped",
                                   static_cast<int>(g_signal), strsignal(g_signal));
      failed = true;
      break;
    }
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG | WUNTRACED | WCONTINUED);
    if (pid > 0 && (WIFSTOPPED(status) || WIFCONTINUED(status))) {
      for (std::size_t i = 0; i < pids.size(); ++i)
        if (pids[i] == pid) {
          stopped[i] = WIFSTOPPED(status);
          stopped_at[i] = std::chrono::steady_clock::now();
        }
      continue;
    }
    if (pid > 0) {
      // Every child that has ended by now: a rank killed by a signal and the ranks that exited
      // because of it (they name it in their own errors) can end between two polls, and the
      // kernel hands them back in the order they were started, not the order they ended. The
      // run's failure is the first one a signal ended, else the first that failed.
      std::vector<std::size_t> ended;
      const auto take = [&](pid_t p, int st) {
        for (std::size_t i = 0; i < pids.size(); ++i) {
          if (pids[i] != p) continue;
          pids[i] = -1;
          stopped[i] = false;
          statuses[i] = st;
          --alive;
          ended.push_back(i);
        }
      };
      take(pid, status);
      for (pid_t more; (more = waitpid(-1, &status, WNOHANG)) > 0;) take(more, status);
      std::optional<std::size_t> first;  // the first signalled, else the first that failed
      for (std::size_t i : ended) {
        if (WIFSIGNALED(statuses[i])) {
          first = i;
          break;
        }
        if (!first && WEXITSTATUS(statuses[i]) != 0) first = i;
      }
      if (first && !failed) {
        const std::size_t i = *first;
        failed = true;
        result.summary = fmt::format("{} {}", children[i].name, describe_exit(statuses[i]));
        result.first_failed = static_cast<int>(i);
        result.first_how = describe_exit(statuses[i]);
        result.first_killed = WIFSIGNALED(statuses[i]);
        if (on_failure) on_failure(children[i].name, describe_exit(statuses[i]));
        deadline = std::chrono::steady_clock::now() +
                   std::chrono::milliseconds(static_cast<long long>(timeout_s * 1000) + 5000);
      }
      continue;
    }
    // The store's host stopped with no failure yet: the ranks connected to the store name it
    // within 5.5 s and exit; ranks still making their first connection cannot tell a stopped
    // store from one not up yet (the kernel accepts for it). Stopped for kStoppedStoreHostFails,
    // it is the run's failure.
    for (std::size_t i = 0; i < children.size() && !failed; ++i)
      if (children[i].hosts_store && pids[i] > 0 && stopped[i] &&
          std::chrono::steady_clock::now() - stopped_at[i] >= kStoppedStoreHostFails) {
        failed = true;
        result.summary = fmt::format(
            "{} is stopped (SIGSTOP) and hosts the store: no rank can make progress",
            children[i].name);
        result.first_failed = static_cast<int>(i);
        result.first_how = "was stopped (SIGSTOP)";
        deadline = std::chrono::steady_clock::now();  // the others go now, the stopped one last
      }
    // After a failure, with the store's host dead or stopped, no rank can make progress.
    if (failed && store_gone()) {
      const auto soon = std::chrono::steady_clock::now() + kStoreLossGrace;
      if (soon < deadline) deadline = soon;
    }
    // After a failure, children that are stopped (SIGSTOP) while every other one has exited would
    // never finish: they go at once instead of at the deadline.
    bool only_stopped_left = failed && alive > 0;
    for (std::size_t i = 0; i < pids.size(); ++i)
      if (pids[i] > 0 && !stopped[i]) only_stopped_left = false;
    if (only_stopped_left) {
      result.summary += fmt::format("; killed, stopped (SIGSTOP) after every other rank exited: {}",
                                    kill_remaining());
      reap_remaining();
      continue;
    }
    if (std::chrono::steady_clock::now() > overall) {
      const std::string why = fmt::format(
          "the run passed its overall deadline of {:.0f} s (refit run --deadline); killed: {}",
          deadline_s, kill_remaining());
      result.summary = failed ? result.summary + "; " + why : why;
      failed = true;
      reap_remaining();
      break;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      // Stopped children go next, named as such, once every other one was reaped (above).
      const std::string killed = kill_remaining(/*stopped_too=*/false);
      if (!killed.empty())
        result.summary += fmt::format(
            "; killed after the {}: {}",
            store_gone() ? "loss of the store's host" : "timeout", killed);
      deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  signal(SIGHUP, SIG_DFL);
  if (failed && result.interrupted == 0) {
    std::string others;
    for (std::size_t i = 0; i < children.size(); ++i)
      others += fmt::format("\n  {}: {}", children[i].name, describe_exit(statuses[i]));
    result.summary += others;
  }
  result.ok = !failed;
  return result;
}

int remove_run_segments(const std::string& run_id) {
  const std::string prefix = "refit-" + run_id + "-";
  int removed = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/dev/shm", ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    if (shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  return removed;
}

}  // namespace refit
