// Same-host lanes of the mailboxes (control/mailbox.cc; docs/runtime.md, "Latency of the control
// hops"; docs/security.md, "Same-host lanes").
//
// A message through ZeroMQ wakes an I/O thread in the sender and another in the receiver before
// the receiving thread sees it: 0.15-0.3 ms per hop on the H200 hosts, most of a small refit's
// overhead. A lane is a Unix stream socket between two mailboxes on one host, written by the
// sender's thread and read by the receiver's: one system call each way.
//
// A mailbox listens on an abstract Unix socket with a random name (no file: nothing is left
// behind when a rank is killed) and publishes "<host identity>\n@<name>\n<key>" under
// "lane/<id>", where key is the hex of a key pair it made for the lane. A sender on the same host
// (and network namespace) connects and sends a hello naming itself. The receiver takes a
// connection only from its own user (SO_PEERCRED) and, with an authenticated control plane, only
// with a hello that proves the sender holds the secret key it registered under
// "auth/key/<sender>" (a crypto_box from that key to the lane's key, which only the receiving
// process knows). Every frame after the hello comes from that sender.
//
// Frames: [u32 length of the rest, little-endian][u8 type][u32 epoch, little-endian][payload].
// The hello's type is kHelloFrame and its payload [u8 id length][sender id][proof].
#pragma once

#include <sys/socket.h>
#include <sys/un.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "refit/status.h"

namespace refit::lane {

inline constexpr std::uint8_t kHelloFrame = 0xFF;

// A socket descriptor, closed with its owner.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// A listening lane: the socket and its key pair.
class Listener {
 public:
  static Result<Listener> open(const std::string& who);
  Listener(Listener&& o) noexcept;
  Listener& operator=(Listener&&) = delete;
  Listener(const Listener&) = delete;
  ~Listener();
  int fd() const { return fd_; }
  // The value published under "lane/<id>".
  std::string address() const;
  // A pending connection from this process's user, non-blocking; an empty Fd when none is pending
  // (or one from another user was refused: `refused` says whose).
  Fd accept(std::string& refused);
  const unsigned char* secret_key() const { return sk_; }

 private:
  Listener() = default;
  int fd_ = -1;
  std::string name_;
  unsigned char pk_[32] = {}, sk_[32] = {};
};

// Where a published lane is: its socket's abstract name and its key, when it is on this host.
struct Address {
  std::string name;
  std::string key;  // 32 bytes
};
std::optional<Address> parse_address(const std::string& published);
// The socket address of the abstract name `name` (no file: nothing is left behind when a rank is
// killed, and only this network namespace reaches it); returns its length.
socklen_t abstract_address(const std::string& name, sockaddr_un& addr);

// Connects (blocking, local) to the lane at `a` and sends the hello: `proof` with an
// authenticated control plane (make_proof), else empty. The socket is returned in blocking mode.
Result<Fd> connect(const Address& a, const std::string& sender, const std::string& proof,
                   std::chrono::milliseconds timeout);

// The hello's proof that `sender` holds `sender_secret` (32 bytes; its registered key pair's),
// addressed to the lane key `lane_key`: a nonce and a crypto_box of
// "refit-lane:<receiver>:<sender>".
std::string make_proof(const std::string& sender, const std::string& receiver,
                       const std::string& lane_key, const unsigned char* sender_secret);
// Whether `proof` is such a box from the holder of `sender_public` (32 bytes) to the listener.
bool check_proof(std::string_view proof, const std::string& sender, const std::string& receiver,
                 const unsigned char* sender_public, const unsigned char* lane_secret);

// Writes one frame, all of it, within `timeout` (MSG_NOSIGNAL: a closed peer is an error, not a
// signal).
Status write_frame(int fd, std::uint8_t type, std::uint32_t epoch, std::string_view payload,
                   std::chrono::milliseconds timeout);

// The frames arriving on one accepted connection.
struct Frame {
  std::uint8_t type = 0;
  std::uint32_t epoch = 0;
  std::string payload;
};
class Reader {
 public:
  explicit Reader(Fd fd) : fd_(std::move(fd)) {}
  int fd() const { return fd_.get(); }
  // Reads what the socket holds without blocking. False at end of stream or on an error.
  bool fill();
  // The next whole frame, nullopt when incomplete; an error for a frame longer than `max_bytes`.
  Result<std::optional<Frame>> next(std::int64_t max_bytes);

 private:
  Fd fd_;
  std::string buf_;
  std::size_t at_ = 0;
};

// Key text as the mailbox keeps it (ZeroMQ's Z85, 40 characters) to 32 bytes; false when malformed.
bool z85_key(const std::string& text, unsigned char* out);

}  // namespace refit::lane
