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
#include <array>
#include <cerrno>
#include <cstddef>
#include <cstring>

#include "common/log.h"
#include "control/fd_limit.h"

namespace refit::lane {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kProofLabel[] = "refit-lane-2";

std::string hex(const unsigned char* b, std::size_t n) {
  std::string s(2 * n + 1, '\0');
  sodium_bin2hex(s.data(), s.size(), b, n);
  s.pop_back();
  return s;
}

// [label][u8 n][receiver][u8 n][sender][challenge]: what a proof's box holds before the lane key.
std::string proof_head(const std::string& receiver, const std::string& sender,
                       std::string_view challenge) {
  std::string s = kProofLabel;
  s.push_back(static_cast<char>(receiver.size()));
  s += receiver;
  s.push_back(static_cast<char>(sender.size()));
  s += sender;
  s += challenge;
  return s;
}

int millis_left(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::max<std::int64_t>(left.count(), 0));
}

// Writes every part, all of it, by `deadline`.
Status write_all(int fd, std::array<iovec, 3> parts, Clock::time_point deadline) {
  std::size_t left = 0;
  for (const iovec& p : parts) left += p.iov_len;
  std::size_t first = 0;
  while (left > 0) {
    while (first < parts.size() && parts[first].iov_len == 0) ++first;
    msghdr m{};
    m.msg_iov = parts.data() + first;
    m.msg_iovlen = parts.size() - first;
    const ssize_t n = ::sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return Status::IOError(errno_text(errno));
    if (n < 0) {
      const int wait = millis_left(deadline);
      if (wait <= 0) return Status::Timeout("the peer did not take it");
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, wait);
      continue;
    }
    auto done = static_cast<std::size_t>(n);
    left -= done;
    while (first < parts.size() && done >= parts[first].iov_len) done -= parts[first++].iov_len;
    if (first < parts.size()) {
      parts[first].iov_base = static_cast<char*>(parts[first].iov_base) + done;
      parts[first].iov_len -= done;
    }
  }
  return Status::Ok();
}

// Reads exactly `n` bytes by `deadline`; `closed` and `late` say what the receiver's close and
// the deadline mean at this step.
Status read_exactly(int fd, char* out, std::size_t n, Clock::time_point deadline,
                    const char* closed, const char* late) {
  std::size_t got = 0;
  while (got < n) {
    const ssize_t r = ::recv(fd, out + got, n - got, MSG_DONTWAIT);
    if (r > 0) {
      got += static_cast<std::size_t>(r);
      continue;
    }
    if (r == 0) return Status::IOError(closed);
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return Status::IOError(errno_text(errno));
    const int wait = millis_left(deadline);
    if (wait <= 0) return Status::Timeout(late);
    pollfd p{fd, POLLIN, 0};
    ::poll(&p, 1, wait);
  }
  return Status::Ok();
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

std::string publish_address(const std::string& host_identity, const std::string& name,
                            const unsigned char* key) {
  return host_identity + "\n@" + name + "\n" + hex(key, kKeyBytes);
}

std::optional<Address> parse_address(const std::string& published,
                                     const std::string& host_identity) {
  const std::size_t a = published.find('\n');
  const std::size_t b = a == std::string::npos ? a : published.find('\n', a + 1);
  if (b == std::string::npos || host_identity.empty() || published.substr(0, a) != host_identity)
    return std::nullopt;
  if (published.compare(a + 1, 1, "@") != 0) return std::nullopt;
  Address out;
  out.name = published.substr(a + 2, b - a - 2);
  out.key.resize(kKeyBytes);
  std::size_t n = 0;
  const std::string key_hex = published.substr(b + 1);
  if (sodium_hex2bin(reinterpret_cast<unsigned char*>(out.key.data()), kKeyBytes, key_hex.data(),
                     key_hex.size(), nullptr, &n, nullptr) != 0 ||
      n != kKeyBytes)
    return std::nullopt;
  return out;
}

FrameSeal::FrameSeal(const unsigned char* key) : keyed_(true) {
  static_assert(sizeof(crypto_generichash_state) <= sizeof keyed_state_ &&
                alignof(crypto_generichash_state) <= 64);  // keyed_state_ is alignas(64)
  crypto_generichash_init(reinterpret_cast<crypto_generichash_state*>(keyed_state_), key,
                          kKeyBytes, kTagBytes);
}

FrameSeal FrameSeal::answers(const unsigned char* lane_key) {
  static constexpr char kLabel[] = "refit lane answers 1";
  unsigned char key[kKeyBytes];
  crypto_generichash(key, sizeof key, reinterpret_cast<const unsigned char*>(kLabel),
                     sizeof kLabel - 1, lane_key, kKeyBytes);
  FrameSeal seal(key);
  sodium_memzero(key, sizeof key);
  return seal;
}

FrameSeal::FrameSeal(FrameSeal&& o) noexcept : seq_(o.seq_), keyed_(o.keyed_) {
  std::memcpy(keyed_state_, o.keyed_state_, sizeof keyed_state_);
  sodium_memzero(o.keyed_state_, sizeof o.keyed_state_);
  o.keyed_ = false;
}

FrameSeal& FrameSeal::operator=(FrameSeal&& o) noexcept {
  if (this != &o) {
    std::memcpy(keyed_state_, o.keyed_state_, sizeof keyed_state_);
    seq_ = o.seq_;
    keyed_ = o.keyed_;
    sodium_memzero(o.keyed_state_, sizeof o.keyed_state_);
    o.keyed_ = false;
  }
  return *this;
}

FrameSeal::~FrameSeal() { sodium_memzero(keyed_state_, sizeof keyed_state_); }

void FrameSeal::tag(std::uint8_t type, std::uint32_t epoch, std::string_view payload,
                    unsigned char* out) {
  unsigned char head[13];
  for (int i = 0; i < 8; ++i) head[i] = static_cast<unsigned char>(seq_ >> (8 * i));
  head[8] = type;
  for (int i = 0; i < 4; ++i) head[9 + i] = static_cast<unsigned char>(epoch >> (8 * i));
  ++seq_;
  // The keyed state is plain data: a copy hashes as the original would.
  crypto_generichash_state st;
  std::memcpy(&st, keyed_state_, sizeof st);
  crypto_generichash_update(&st, head, sizeof head);
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(payload.data()),
                            payload.size());
  crypto_generichash_final(&st, out, kTagBytes);
  sodium_memzero(&st, sizeof st);
}

bool FrameSeal::check(std::uint8_t type, std::uint32_t epoch, std::string_view payload,
                      const unsigned char* got) {
  unsigned char want[kTagBytes];
  tag(type, epoch, payload, want);
  return sodium_memcmp(want, got, kTagBytes) == 0;
}

std::string make_proof(const std::string& sender, const std::string& receiver,
                       std::string_view challenge, const std::string& lane_public,
                       const unsigned char* sender_secret, unsigned char* lane_key) {
  randombytes_buf(lane_key, kKeyBytes);
  std::string msg = proof_head(receiver, sender, challenge);
  msg.append(reinterpret_cast<const char*>(lane_key), kKeyBytes);
  std::string out(crypto_box_NONCEBYTES + crypto_box_MACBYTES + msg.size(), '\0');
  auto* o = reinterpret_cast<unsigned char*>(out.data());
  randombytes_buf(o, crypto_box_NONCEBYTES);
  const int rc = crypto_box_easy(
      o + crypto_box_NONCEBYTES, reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), o,
      reinterpret_cast<const unsigned char*>(lane_public.data()), sender_secret);
  sodium_memzero(msg.data(), msg.size());
  return rc == 0 ? out : std::string();
}

ProofCheck open_proof(std::string_view proof, const std::string& sender,
                      const std::string& receiver, std::string_view challenge,
                      const unsigned char* sender_public, const unsigned char* lane_secret,
                      unsigned char* lane_key) {
  const std::string want = proof_head(receiver, sender, challenge);
  if (proof.size() != crypto_box_NONCEBYTES + crypto_box_MACBYTES + want.size() + kKeyBytes)
    return ProofCheck::kForged;
  const auto* p = reinterpret_cast<const unsigned char*>(proof.data());
  std::string got(want.size() + kKeyBytes, '\0');
  auto* g = reinterpret_cast<unsigned char*>(got.data());
  ProofCheck out = ProofCheck::kForged;
  if (crypto_box_open_easy(g, p + crypto_box_NONCEBYTES, proof.size() - crypto_box_NONCEBYTES, p,
                           sender_public, lane_secret) == 0) {
    const std::size_t ids = want.size() - challenge.size();
    if (sodium_memcmp(got.data(), want.data(), ids) != 0)
      out = ProofCheck::kForged;
    else if (sodium_memcmp(got.data() + ids, want.data() + ids, challenge.size()) != 0)
      out = ProofCheck::kStale;
    else
      out = ProofCheck::kValid;
  }
  if (out == ProofCheck::kValid) std::memcpy(lane_key, g + want.size(), kKeyBytes);
  sodium_memzero(got.data(), got.size());
  return out;
}

std::optional<Hello> parse_hello(std::string_view payload) {
  if (payload.empty()) return std::nullopt;
  const auto n = static_cast<std::size_t>(static_cast<unsigned char>(payload[0]));
  if (n == 0 || payload.size() < 1 + n) return std::nullopt;
  return Hello{std::string(payload.substr(1, n)), payload.substr(1 + n)};
}

Result<Outgoing> connect(const Address& a, const std::string& sender, const std::string& receiver,
                         const unsigned char* sender_secret, std::chrono::milliseconds timeout) {
  if (sender.empty() || sender.size() > kMaxIdBytes || receiver.size() > kMaxIdBytes)
    return Status::InvalidArgument("lane: a mailbox id must have 1 to 255 bytes");
  const auto deadline = Clock::now() + timeout;
  sockaddr_un addr;
  const socklen_t len = abstract_address(a.name, addr);
  Outgoing out;
  out.fd = Fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!out.fd) return Status::IOError("lane socket: " + errno_text(errno));
  // A full listen queue makes a blocking connect wait: at most the timeout.
  timeval tv{static_cast<time_t>(timeout.count() / 1000),
             static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  ::setsockopt(out.fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  // Room for a refit's messages while the receiver is busy (the kernel caps it at wmem_max).
  const int sndbuf = 4 << 20;
  ::setsockopt(out.fd.get(), SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
  if (::connect(out.fd.get(), reinterpret_cast<const sockaddr*>(&addr), len) != 0)
    return Status::IOError(fmt::format("lane @{}: {}", a.name, errno_text(errno)));
  // Only a process of this user listens on a rank's lane: the frames are sealed, not encrypted,
  // and a name a rank freed as it exited can be bound by anyone in the network namespace.
  ucred cred{};
  socklen_t cred_len = sizeof cred;
  if (::getsockopt(out.fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0 ||
      cred.uid != ::getuid())
    return Status::IOError(fmt::format(
        "lane @{}: its listener is not a process of this user (uid {}, this process's {})",
        log::escape(a.name), cred.uid, ::getuid()));
  std::array<char, 4 + 5 + kChallengeBytes> challenge{};
  REFIT_RETURN_IF_ERROR(
      read_exactly(out.fd.get(), challenge.data(), challenge.size(), deadline,
                   "the receiver closed the lane",
                   "no challenge from the receiver in time (its gate is full or busy)")
          .with_context(fmt::format("lane @{}", a.name)));
  if (get_u32(challenge.data()) != 5 + kChallengeBytes ||
      static_cast<std::uint8_t>(challenge[4]) != kChallengeFrame)
    return Status::IOError(fmt::format("lane @{}: the receiver sent no challenge", a.name));
  const std::string_view nonce(challenge.data() + 9, kChallengeBytes);
  std::string hello;
  hello.push_back(static_cast<char>(sender.size()));
  hello += sender;
  unsigned char key[kKeyBytes];
  if (sender_secret != nullptr) {
    const std::string proof = make_proof(sender, receiver, nonce, a.key, sender_secret, key);
    if (proof.empty()) return Status::Internal("lane: crypto_box failed");
    hello += proof;
  }
  Status sent = write_raw_frame(out.fd.get(), kHelloFrame, 0, hello, timeout);
  // The gate's accept: until it arrives the hello may still be refused, and a frame written now
  // would be lost with the connection.
  const std::size_t accept_bytes = 4 + 5 + (sender_secret != nullptr ? kTagBytes : 0);
  std::array<char, 4 + 5 + kTagBytes> accept{};
  if (sent.ok())
    sent = read_exactly(out.fd.get(), accept.data(), accept_bytes, deadline,
                        "the receiver refused the hello (its log says why)",
                        "no answer to the hello in time (the receiver's gate is busy)");
  if (sent.ok() && (get_u32(accept.data()) != accept_bytes - 4 ||
                    static_cast<std::uint8_t>(accept[4]) != kAcceptFrame))
    sent = Status::IOError("the receiver answered the hello with something else than an accept");
  if (sent.ok() && sender_secret != nullptr) {
    unsigned char want[kTagBytes];
    accept_tag(key, nonce, want);
    if (sodium_memcmp(want, accept.data() + 9, kTagBytes) != 0)
      sent = Status::IOError(
          "the receiver's accept does not carry the lane key: its listener is not the mailbox "
          "that published the lane");
  }
  if (sent.ok() && sender_secret != nullptr) {
    out.seal = FrameSeal(key);
    out.answers = FrameSeal::answers(key);
  }
  sodium_memzero(key, sizeof key);
  if (!sent.ok()) return sent.with_context(fmt::format("lane @{}", log::escape(a.name)));
  return out;
}

void accept_tag(const unsigned char* lane_key, std::string_view challenge, unsigned char* out) {
  static constexpr char kLabel[] = "refit lane accept 1";
  crypto_generichash_state st;
  crypto_generichash_init(&st, lane_key, kKeyBytes, kTagBytes);
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(kLabel), sizeof kLabel - 1);
  crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(challenge.data()),
                            challenge.size());
  crypto_generichash_final(&st, out, kTagBytes);
}

Status write_raw_frame(int fd, std::uint8_t type, std::uint32_t epoch, std::string_view payload,
                       std::chrono::milliseconds timeout) {
  std::string head;
  put_u32(head, static_cast<std::uint32_t>(5 + payload.size()));
  head.push_back(static_cast<char>(type));
  put_u32(head, epoch);
  return write_all(fd,
                   {iovec{head.data(), head.size()},
                    iovec{const_cast<char*>(payload.data()), payload.size()}, iovec{nullptr, 0}},
                   Clock::now() + timeout);
}

Status write_frame(Outgoing& lane, std::uint8_t type, std::uint32_t epoch, std::string_view payload,
                   std::chrono::milliseconds timeout) {
  return write_frame(lane.fd.get(), lane.seal, type, epoch, payload, timeout);
}

Status write_frame(int fd, FrameSeal& seal, std::uint8_t type, std::uint32_t epoch,
                   std::string_view payload, std::chrono::milliseconds timeout) {
  if (!seal.keyed()) return write_raw_frame(fd, type, epoch, payload, timeout);
  std::string head;
  put_u32(head, static_cast<std::uint32_t>(5 + payload.size() + kTagBytes));
  head.push_back(static_cast<char>(type));
  put_u32(head, epoch);
  unsigned char tag[kTagBytes];
  seal.tag(type, epoch, payload, tag);
  return write_all(
      fd,
      {iovec{head.data(), head.size()}, iovec{const_cast<char*>(payload.data()), payload.size()},
       iovec{tag, kTagBytes}},
      Clock::now() + timeout);
}

bool Reader::fill() {
  char chunk[65536];
  // At most 4 MiB per call: the frames it holds are taken before more is read. A short read
  // emptied the socket; what arrives later makes it readable again (its epoll set is level
  // triggered), so it is not asked once more only to say so.
  for (int k = 0; k < 64; ++k) {
    const ssize_t n = ::recv(fd_.get(), chunk, sizeof chunk, MSG_DONTWAIT);
    if (n > 0) {
      buf_.append(chunk, static_cast<std::size_t>(n));
      if (static_cast<std::size_t>(n) < sizeof chunk) return true;
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
  const std::size_t tag = seal_.keyed() ? kTagBytes : 0;
  if (len < 5 + tag ||
      static_cast<std::int64_t>(len) > max_bytes + 5 + static_cast<std::int64_t>(tag))
    return Status::Corruption(fmt::format("a frame of {} bytes", len));
  if (buf_.size() - at_ - 4 < len) return std::optional<Frame>();
  Frame f;
  const char* p = buf_.data() + at_ + 4;
  f.type = static_cast<std::uint8_t>(p[0]);
  f.epoch = get_u32(p + 1);
  const std::string_view payload(p + 5, len - 5 - tag);
  if (seal_.keyed() &&
      !seal_.check(f.type, f.epoch, payload, reinterpret_cast<const unsigned char*>(p + len - tag)))
    return Status::Corruption(
        "a frame whose tag does not match the lane's key (not written by the lane's sender on "
        "this connection, or out of order)");
  f.payload.assign(payload);
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
