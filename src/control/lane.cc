// Same-host lanes of the mailboxes (control/lane.h).
#include "control/lane.h"

#include <fmt/format.h>
#include <poll.h>
#include <sodium.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <zmq.h>
#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>

#include "common/env.h"

namespace refit::lane {
namespace {

using Clock = std::chrono::steady_clock;

std::string hex(const unsigned char* b, std::size_t n) {
  std::string s(2 * n + 1, '\0');
  sodium_bin2hex(s.data(), s.size(), b, n);
  s.pop_back();
  return s;
}

std::string errno_text() { return std::strerror(errno); }

std::string proof_text(const std::string& receiver, const std::string& sender) {
  return "refit-lane:" + receiver + ":" + sender;
}

void put_u32(std::string& s, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

std::uint32_t get_u32(const char* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<std::uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

}  // namespace

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

socklen_t abstract_address(const std::string& name, sockaddr_un& addr) {
  addr = sockaddr_un{};
  addr.sun_family = AF_UNIX;
  const std::size_t n = std::min(name.size(), sizeof(addr.sun_path) - 1);
  std::memcpy(addr.sun_path + 1, name.data(), n);  // sun_path[0] = 0: the abstract namespace
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

Result<Listener> Listener::open(const std::string& who) {
  if (sodium_init() < 0) return Status::Internal("libsodium failed to initialise");
  Listener l;
  unsigned char id[12];
  randombytes_buf(id, sizeof id);
  l.name_ = "refit-lane-" + hex(id, sizeof id);
  sockaddr_un addr;
  const socklen_t len = abstract_address(l.name_, addr);
  l.fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (l.fd_ < 0) return Status::IOError(fmt::format("{}: lane socket: {}", who, errno_text()));
  if (::bind(l.fd_, reinterpret_cast<const sockaddr*>(&addr), len) != 0 ||
      ::listen(l.fd_, 128) != 0)
    return Status::IOError(
        fmt::format("{}: cannot listen on lane @{}: {}", who, l.name_, errno_text()));
  crypto_box_keypair(l.pk_, l.sk_);
  return l;
}

Listener::Listener(Listener&& o) noexcept : fd_(o.fd_), name_(std::move(o.name_)) {
  std::memcpy(pk_, o.pk_, sizeof pk_);
  std::memcpy(sk_, o.sk_, sizeof sk_);
  o.fd_ = -1;
}

Listener::~Listener() {
  if (fd_ >= 0) ::close(fd_);
  sodium_memzero(sk_, sizeof sk_);
}

std::string Listener::address() const {
  return env::host_identity() + "\n@" + name_ + "\n" + hex(pk_, sizeof pk_);
}

Fd Listener::accept(std::string& refused) {
  Fd c(::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
  if (!c) return c;  // EAGAIN: none pending (errors: tried again at the next poll)
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(c.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.uid == ::getuid())
    return c;
  refused = fmt::format("uid {} (pid {})", cred.uid, cred.pid);
  return Fd();
}

std::optional<Address> parse_address(const std::string& published) {
  const std::size_t a = published.find('\n');
  const std::size_t b = a == std::string::npos ? a : published.find('\n', a + 1);
  if (b == std::string::npos || published.substr(0, a) != env::host_identity()) return std::nullopt;
  if (published.compare(a + 1, 1, "@") != 0) return std::nullopt;
  Address out;
  out.name = published.substr(a + 2, b - a - 2);
  out.key.resize(32);
  std::size_t n = 0;
  const std::string key_hex = published.substr(b + 1);
  if (sodium_hex2bin(reinterpret_cast<unsigned char*>(out.key.data()), 32, key_hex.data(),
                     key_hex.size(), nullptr, &n, nullptr) != 0 ||
      n != 32)
    return std::nullopt;
  return out;
}

Result<Fd> connect(const Address& a, const std::string& sender, const std::string& proof,
                   std::chrono::milliseconds timeout) {
  if (sender.size() > 255) return Status::InvalidArgument("lane: sender id too long");
  sockaddr_un addr;
  const socklen_t len = abstract_address(a.name, addr);
  Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return Status::IOError("lane socket: " + errno_text());
  // A full backlog makes a blocking connect wait: at most the timeout.
  timeval tv{static_cast<time_t>(timeout.count() / 1000),
             static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  // Room for a refit's messages while the receiver is busy (the kernel caps it at wmem_max).
  const int sndbuf = 4 << 20;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), len) != 0)
    return Status::IOError(fmt::format("lane @{}: {}", a.name, errno_text()));
  std::string hello;
  hello.push_back(static_cast<char>(sender.size()));
  hello += sender;
  hello += proof;
  REFIT_RETURN_IF_ERROR(write_frame(fd.get(), kHelloFrame, 0, hello, timeout));
  return fd;
}

std::string make_proof(const std::string& sender, const std::string& receiver,
                       const std::string& lane_key, const unsigned char* sender_secret) {
  const std::string msg = proof_text(receiver, sender);
  std::string out(crypto_box_NONCEBYTES + crypto_box_MACBYTES + msg.size(), '\0');
  auto* o = reinterpret_cast<unsigned char*>(out.data());
  randombytes_buf(o, crypto_box_NONCEBYTES);
  if (crypto_box_easy(o + crypto_box_NONCEBYTES, reinterpret_cast<const unsigned char*>(msg.data()),
                      msg.size(), o, reinterpret_cast<const unsigned char*>(lane_key.data()),
                      sender_secret) != 0)
    return {};
  return out;
}

bool check_proof(std::string_view proof, const std::string& sender, const std::string& receiver,
                 const unsigned char* sender_public, const unsigned char* lane_secret) {
  const std::string want = proof_text(receiver, sender);
  if (proof.size() != crypto_box_NONCEBYTES + crypto_box_MACBYTES + want.size()) return false;
  const auto* p = reinterpret_cast<const unsigned char*>(proof.data());
  std::string got(want.size(), '\0');
  if (crypto_box_open_easy(reinterpret_cast<unsigned char*>(got.data()), p + crypto_box_NONCEBYTES,
                           proof.size() - crypto_box_NONCEBYTES, p, sender_public,
                           lane_secret) != 0)
    return false;
  return sodium_memcmp(got.data(), want.data(), want.size()) == 0;
}

Status write_frame(int fd, std::uint8_t type, std::uint32_t epoch, std::string_view payload,
                   std::chrono::milliseconds timeout) {
  std::string head;
  put_u32(head, static_cast<std::uint32_t>(5 + payload.size()));
  head.push_back(static_cast<char>(type));
  put_u32(head, epoch);
  const auto deadline = Clock::now() + timeout;
  iovec parts[2] = {{head.data(), head.size()},
                    {const_cast<char*>(payload.data()), payload.size()}};
  std::size_t left = head.size() + payload.size();
  int first = 0;
  while (left > 0) {
    msghdr m{};
    m.msg_iov = parts + first;
    m.msg_iovlen = static_cast<std::size_t>(2 - first);
    const ssize_t n = ::sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return Status::IOError(errno_text());
    if (n < 0) {
      const auto wait =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (wait.count() <= 0) return Status::Timeout("the peer did not take it");
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, static_cast<int>(wait.count()));
      continue;
    }
    auto done = static_cast<std::size_t>(n);
    left -= done;
    while (first < 2 && done >= parts[first].iov_len) done -= parts[first++].iov_len;
    if (first < 2) {
      parts[first].iov_base = static_cast<char*>(parts[first].iov_base) + done;
      parts[first].iov_len -= done;
    }
  }
  return Status::Ok();
}

bool Reader::fill() {
  char chunk[65536];
  // At most 4 MiB per call: the frames it holds are taken before more is read.
  for (int k = 0; k < 64; ++k) {
    const ssize_t n = ::recv(fd_.get(), chunk, sizeof chunk, MSG_DONTWAIT);
    if (n > 0) {
      buf_.append(chunk, static_cast<std::size_t>(n));
      continue;
    }
    if (n == 0) return false;
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  }
  return true;
}

Result<std::optional<Frame>> Reader::next(std::int64_t max_bytes) {
  if (buf_.size() - at_ < 4) return std::optional<Frame>();
  const std::uint32_t len = get_u32(buf_.data() + at_);
  if (len < 5 || static_cast<std::int64_t>(len) > max_bytes + 5)
    return Status::Corruption(fmt::format("a frame of {} bytes", len));
  if (buf_.size() - at_ - 4 < len) return std::optional<Frame>();
  Frame f;
  const char* p = buf_.data() + at_ + 4;
  f.type = static_cast<std::uint8_t>(p[0]);
  f.epoch = get_u32(p + 1);
  f.payload.assign(p + 5, len - 5);
  at_ += 4 + len;
  if (at_ == buf_.size()) {
    buf_.clear();
    at_ = 0;
  } else if (at_ > (1u << 20)) {
    buf_.erase(0, at_);
    at_ = 0;
  }
  return std::optional<Frame>(std::move(f));
}

bool z85_key(const std::string& text, unsigned char* out) {
  return text.size() == 40 && zmq_z85_decode(out, text.c_str()) != nullptr;
}

}  // namespace refit::lane
