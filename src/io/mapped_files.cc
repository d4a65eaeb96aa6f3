#include "io/mapped_files.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>

namespace refit {
namespace {

constexpr int kSlots = 1024;
constexpr std::size_t kPathBytes = 512;

// Read by the signal handler: only atomics and fixed arrays.
struct Slot {
  std::atomic<bool> used{false};
  std::atomic<std::uintptr_t> begin{0}, end{0};
  char path[kPathBytes] = {};
};
Slot g_slots[kSlots];
struct sigaction g_previous {};
std::mutex g_mu;  // registration only

void write_all(const char* s, std::size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<std::size_t>(w);
  }
}

void on_sigbus(int sig, siginfo_t* info, void* context) {
  const auto at = reinterpret_cast<std::uintptr_t>(info->si_addr);
  for (const Slot& s : g_slots) {
    if (!s.used.load(std::memory_order_acquire)) continue;
    if (at < s.begin.load(std::memory_order_relaxed) || at >= s.end.load(std::memory_order_relaxed))
      continue;
    static const char kHead[] = "refit: error: ";
    static const char kTail[] =
        " changed while refit was reading it (a mapped page is gone: the file was truncated or "
        "replaced during the run); the run cannot go on\n";
    write_all(kHead, sizeof kHead - 1);
    write_all(s.path, ::strnlen(s.path, kPathBytes));
    write_all(kTail, sizeof kTail - 1);
    ::_exit(1);
  }
  // Not a mapping of ours: whatever handled SIGBUS before does (by default, the process dies of
  // it when the faulting access runs again).
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) return g_previous.sa_sigaction(sig, info, context);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN &&
             g_previous.sa_handler != nullptr) {
    return g_previous.sa_handler(sig);
  }
  ::signal(SIGBUS, SIG_DFL);
}

void install_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction a {};
    a.sa_sigaction = on_sigbus;
    a.sa_flags = SA_SIGINFO;
    sigemptyset(&a.sa_mask);
    ::sigaction(SIGBUS, &a, &g_previous);
  });
}

}  // namespace

int register_mapped_file(const void* base, std::size_t bytes, const std::string& path) {
  install_once();
  std::lock_guard<std::mutex> lock(g_mu);
  for (int i = 0; i < kSlots; ++i) {
    Slot& s = g_slots[i];
    if (s.used.load(std::memory_order_relaxed)) continue;
    const std::size_t n = std::min(path.size(), kPathBytes - 1);
    std::memcpy(s.path, path.data(), n);
    s.path[n] = '\0';
    s.begin.store(reinterpret_cast<std::uintptr_t>(base), std::memory_order_relaxed);
    s.end.store(reinterpret_cast<std::uintptr_t>(base) + bytes, std::memory_order_relaxed);
    s.used.store(true, std::memory_order_release);
    return i;
  }
  return -1;
}

void unregister_mapped_file(int slot) {
  if (slot < 0 || slot >= kSlots) return;
  std::lock_guard<std::mutex> lock(g_mu);
  g_slots[slot].used.store(false, std::memory_order_release);
}

}  // namespace refit
