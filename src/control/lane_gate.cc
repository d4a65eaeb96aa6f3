// The gate of a same-host lane (control/lane_gate.h).
#include "control/lane_gate.h"

#include <fmt/format.h>
#include <poll.h>
#include <sodium.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "common/log.h"
#include "common/log_throttle.h"
#include "control/fd_limit.h"

namespace refit::lane {
namespace {

using Clock = std::chrono::steady_clock;

// After accept() ran out of descriptors, the listening socket is left alone this long (the
// connection waits in the listen queue; polling it again at once would spin).
constexpr std::chrono::milliseconds kAcceptBackoff{100};

std::string hex(const unsigned char* b, std::size_t n) {
  std::string s(2 * n + 1, '\0');
  sodium_bin2hex(s.data(), s.size(), b, n);
  s.pop_back();
  return s;
}

int millis_until(Clock::time_point t) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now());
  return static_cast<int>(std::clamp<std::int64_t>(left.count(), 0, 1000));
}

// A connection accepted and not yet through its hello.
struct Pending {
  Fd fd;
  pid_t pid = 0;
  Clock::time_point deadline;
  std::array<char, kChallengeBytes> challenge{};
  std::string buf;  // what arrived of the first frame (at most 4 + kMaxHelloBytes)
  bool done = false;
};

class GateImpl final : public Gate {
 public:
  explicit GateImpl(GateOptions o) : o_(std::move(o)) {}
  ~GateImpl() override {
    if (thread_.joinable()) {
      const std::uint64_t one = 1;
      (void)!::write(stop_.get(), &one, sizeof one);
      thread_.join();
    }
    if (const std::int64_t held = o_.throttle == nullptr ? own_throttle_.suppressed() : 0; held > 0)
      log::warn(
          "{}: {} more line(s) about refused same-host lane connections were held back by "
          "the log's rate limit",
          o_.who, held);
    sodium_memzero(sk_, sizeof sk_);
  }
  GateImpl(const GateImpl&) = delete;
  GateImpl& operator=(const GateImpl&) = delete;

  Status start() {
    if (sodium_init() < 0) return Status::Internal("libsodium failed to initialise");
    unsigned char id[12];
    randombytes_buf(id, sizeof id);
    const std::string name = "refit-lane-" + hex(id, sizeof id);
    sockaddr_un addr;
    const socklen_t len = abstract_address(name, addr);
    listen_ = Fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!listen_)
      return Status::IOError(fmt::format("{}: lane socket: {}", o_.who, errno_text(errno)));
    if (::bind(listen_.get(), reinterpret_cast<const sockaddr*>(&addr), len) != 0 ||
        ::listen(listen_.get(), 128) != 0)
      return Status::IOError(
          fmt::format("{}: cannot listen on lane @{}: {}", o_.who, name, errno_text(errno)));
    ready_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    stop_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!ready_ || !stop_)
      return Status::IOError(fmt::format("{}: lane eventfd: {}", o_.who, errno_text(errno)));
    crypto_box_keypair(pk_, sk_);
    address_ = publish_address(o_.host_identity, name, pk_);
    thread_ = std::thread([this] { run(); });
    return Status::Ok();
  }

  const std::string& address() const override { return address_; }
  int ready_fd() const override { return ready_.get(); }

  std::vector<Accepted> take() override {
    std::uint64_t n = 0;
    (void)!::read(ready_.get(), &n, sizeof n);
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Accepted> out;
    out.swap(accepted_);
    return out;
  }

  std::int64_t refused() const override { return refused_.load(); }
  int pending_high_water() const override { return high_water_.load(); }

 private:
  void run() {
    std::vector<Pending> pending;
    Clock::time_point backoff_until{};
    std::vector<pollfd> fds;
    for (;;) {
      const bool listening =
          static_cast<int>(pending.size()) < o_.limits.max_pending && Clock::now() >= backoff_until;
      fds.assign(1, pollfd{stop_.get(), POLLIN, 0});
      if (listening) fds.push_back(pollfd{listen_.get(), POLLIN, 0});
      const std::size_t first = fds.size();
      int wait = 1000;
      for (const Pending& p : pending) {
        fds.push_back(pollfd{p.fd.get(), POLLIN, 0});
        wait = std::min(wait, millis_until(p.deadline));
      }
      if (!listening && static_cast<int>(pending.size()) < o_.limits.max_pending)
        wait = std::min(wait, millis_until(backoff_until));
      if (::poll(fds.data(), fds.size(), wait) < 0 && errno != EINTR) {
        log::warn("{}: lane gate: poll failed: {}", o_.who, errno_text(errno));
        std::this_thread::sleep_for(kAcceptBackoff);
      }
      if (fds[0].revents != 0) return;
      for (std::size_t i = 0; i < pending.size(); ++i)
        if (fds[first + i].revents != 0) read_hello(pending[i]);
      const auto now = Clock::now();
      for (Pending& p : pending)
        if (!p.done && now >= p.deadline)
          refuse(p, fmt::format("no complete hello within {} ms of its connection",
                                o_.limits.hello_deadline.count()));
      std::erase_if(pending, [](const Pending& p) { return p.done; });
      if (listening && (fds[1].revents & POLLIN) != 0) accept_some(pending, backoff_until);
    }
  }

  void accept_some(std::vector<Pending>& pending, Clock::time_point& backoff_until) {
    while (static_cast<int>(pending.size()) < o_.limits.max_pending) {
      const int c = ::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (c < 0) {
        if (errno == EMFILE || errno == ENFILE) {
          log::warn_throttled(throttle_,
                              "{}: cannot take a same-host lane connection: {}; it waits in the "
                              "listen queue",
                              o_.who, errno_text(errno));
          backoff_until = Clock::now() + kAcceptBackoff;
        }
        return;  // EAGAIN: none left; other errors: tried again at the next poll
      }
      Pending p;
      p.fd = Fd(c);
      ucred cred{};
      socklen_t len = sizeof cred;
      const bool known = ::getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0;
      p.pid = known ? cred.pid : 0;
      if (!known || cred.uid != ::getuid()) {
        log::warn_throttled(throttle_,
                            "{}: refused a same-host lane connection from uid {} (pid {}): only "
                            "processes of its own user may connect",
                            o_.who, known ? static_cast<long>(cred.uid) : -1L, p.pid);
        p.fd = Fd();
        ++refused_;
        continue;
      }
      randombytes_buf(p.challenge.data(), p.challenge.size());
      // The socket is new and empty: the challenge fits its buffer at once.
      if (!write_raw_frame(c, kChallengeFrame, 0,
                           std::string_view(p.challenge.data(), p.challenge.size()),
                           std::chrono::milliseconds(0))
               .ok()) {
        refuse(p, "it closed before the challenge could be sent");
        continue;
      }
      p.deadline = Clock::now() + o_.limits.hello_deadline;
      pending.push_back(std::move(p));
      high_water_.store(std::max(high_water_.load(), static_cast<int>(pending.size())));
    }
  }

  // Reads what arrived of the hello: never past it, and never more than a hello can be.
  void read_hello(Pending& p) {
    if (p.done) return;
    const std::size_t want =
        p.buf.size() < 4 ? 4 - p.buf.size() : 4 + get_u32(p.buf.data()) - p.buf.size();
    char chunk[kMaxHelloBytes + 4];
    const ssize_t n = ::recv(p.fd.get(), chunk, std::min(want, sizeof chunk), MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n == 0 || (n < 0 && errno == ECONNRESET))
      return refuse(p, p.buf.empty()
                           ? std::string("it closed without a hello")
                           : fmt::format("it closed after {} byte(s) of its hello", p.buf.size()));
    if (n < 0) return refuse(p, errno_text(errno));
    p.buf.append(chunk, static_cast<std::size_t>(n));
    if (p.buf.size() < 4) return;
    const std::uint32_t len = get_u32(p.buf.data());
    if (len < 6 || len > kMaxHelloBytes)
      return refuse(p, fmt::format("its first frame announces {} bytes; a hello has at most {}",
                                   len, kMaxHelloBytes));
    if (p.buf.size() == 4 + len) check_hello(p);
  }

  void check_hello(Pending& p) {
    if (static_cast<std::uint8_t>(p.buf[4]) != kHelloFrame)
      return refuse(p, fmt::format("its first frame is no hello (type {})",
                                   static_cast<int>(static_cast<std::uint8_t>(p.buf[4]))));
    const std::optional<Hello> hello = parse_hello(std::string_view(p.buf).substr(9));
    if (!hello) return refuse(p, "its hello names no sender");
    Accepted a;
    a.from = hello->from;
    const std::string_view challenge(p.challenge.data(), p.challenge.size());
    unsigned char tag[kTagBytes];
    std::string_view accept;  // the accept frame's payload: empty without a run secret
    if (o_.keys) {
      const Result<std::array<unsigned char, 32>> key = o_.keys(hello->from);
      if (!key.ok())
        return refuse(p, fmt::format("its hello claims to come from '{}', {}",
                                     log::escape(hello->from), key.status().message()));
      unsigned char lane_key[kKeyBytes];
      const ProofCheck proof = open_proof(hello->proof, hello->from, o_.receiver, challenge,
                                          key->data(), sk_, lane_key);
      switch (proof) {
        case ProofCheck::kValid:
          break;
        case ProofCheck::kForged:
          return refuse(p, fmt::format("its hello claims to come from '{}' without the key that "
                                       "sender registered",
                                       log::escape(hello->from)));
        case ProofCheck::kStale:
          return refuse(p, fmt::format("its hello from '{}' answers another connection's "
                                       "challenge (a replayed hello)",
                                       log::escape(hello->from)));
      }
      a.seal = FrameSeal(lane_key);
      a.answers = FrameSeal::answers(lane_key);
      accept_tag(lane_key, challenge, tag);
      accept = std::string_view(reinterpret_cast<const char*>(tag), kTagBytes);
      sodium_memzero(lane_key, sizeof lane_key);
    }
    // The sender's connect waits for this before it writes. Only the challenge went this way
    // before: the accept fits the socket's buffer at once.
    if (!write_raw_frame(p.fd.get(), kAcceptFrame, 0, accept, std::chrono::milliseconds(0)).ok())
      return refuse(p, "it closed before its hello was accepted");
    a.fd = std::move(p.fd);
    p.done = true;
    {
      std::lock_guard<std::mutex> lock(mu_);
      accepted_.push_back(std::move(a));
    }
    const std::uint64_t one = 1;
    (void)!::write(ready_.get(), &one, sizeof one);
  }

  // Logged, then closed, then counted: whoever sees the count or the closed socket finds the
  // line written.
  void refuse(Pending& p, const std::string& why) {
    log::warn_throttled(throttle_, "{}: closed a same-host lane connection from pid {}: {}", o_.who,
                        p.pid, why);
    p.done = true;
    p.fd = Fd();
    ++refused_;
  }

  const GateOptions o_;
  Fd listen_, ready_, stop_;
  unsigned char pk_[32] = {}, sk_[32] = {};
  std::string address_;
  std::mutex mu_;
  std::vector<Accepted> accepted_;  // guarded by mu_
  std::atomic<std::int64_t> refused_{0};
  std::atomic<int> high_water_{0};
  log::Throttle own_throttle_;
  log::Throttle& throttle_ = o_.throttle != nullptr ? *o_.throttle : own_throttle_;
  std::thread thread_;
};

}  // namespace

Result<std::unique_ptr<Gate>> Gate::open(GateOptions options) {
  auto g = std::make_unique<GateImpl>(std::move(options));
  REFIT_RETURN_IF_ERROR(g->start());
  return std::unique_ptr<Gate>(std::move(g));
}

Result<Fd> ready_set(const Gate& gate, const std::string& who) {
  Fd set(::epoll_create1(EPOLL_CLOEXEC));
  if (set.get() < 0)
    return Status::IOError(fmt::format("{}: epoll_create1: {}", who, errno_text(errno)));
  epoll_event ev{.events = EPOLLIN, .data = {.fd = gate.ready_fd()}};
  if (::epoll_ctl(set.get(), EPOLL_CTL_ADD, gate.ready_fd(), &ev) != 0)
    return Status::IOError(fmt::format("{}: epoll_ctl: {}", who, errno_text(errno)));
  return set;
}

}  // namespace refit::lane
