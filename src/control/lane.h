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
// "lane/<id>", where key is the hex of a key pair it made for the lane. Its gate (lane_gate.h)
// takes each connection from its own user (SO_PEERCRED) and sends it a random challenge; the
// sender answers with a hello naming itself. With an authenticated control plane the hello
// carries a crypto_box, from the key the sender registered under "auth/key/<sender>" to the lane's
// key, of the challenge and a fresh lane key. The box opens only with the lane's secret half
// (which never leaves the receiving process) and can be made only with the sender's secret key;
// the challenge makes it good for this one connection. Every later frame carries a tag keyed
// with the lane key over its sequence number, so a frame that was not written by that sender on
// that connection, in that order, is refused.
//
// Frames: [u32 length of the rest, little-endian][u8 type][u32 epoch, little-endian][payload]
// [tag: 16 bytes, only on an authenticated lane after the hello]. The challenge's type is
// kChallengeFrame and its payload 32 random bytes; the hello's type is kHelloFrame and its
// payload [u8 id length][sender id][proof]; the accept's type is kAcceptFrame (below).
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

inline constexpr std::uint8_t kChallengeFrame = 0xFE;
inline constexpr std::uint8_t kHelloFrame = 0xFF;
// The gate's answer to a hello it accepted, the last frame of the handshake: connect() returns
// only after it, so a hello the gate refuses (forged, late, from a sender whose key it cannot
// read) fails the connect instead of losing the first frame written behind it. On an
// authenticated lane its payload is accept_tag(lane key, challenge): only the mailbox holding the
// lane's secret half can open the hello and learn that key, so the sender also knows that it
// writes to that mailbox. Without a run secret the payload is empty.
inline constexpr std::uint8_t kAcceptFrame = 0xFD;
inline constexpr std::size_t kChallengeBytes = 32;
inline constexpr std::size_t kKeyBytes = 32;
inline constexpr std::size_t kTagBytes = 16;
// The longest first frame a gate reads (the length field's value): a hello is at most 5 + 1 +
// 255 + 24 + 16 + 13 + 2 * 256 + 64 = 890 bytes. A longer one is refused from its length field,
// before its bytes arrive.
inline constexpr std::uint32_t kMaxHelloBytes = 1024;
// Mailbox ids are at most this long (they travel in a hello's one-byte length).
inline constexpr std::size_t kMaxIdBytes = 255;

// What a gate holds for connections that have not yet proved who sends on them.
struct Limits {
  // From accept to a complete hello; a connection still without one is closed.
  std::chrono::milliseconds hello_deadline{2000};
  // Connections accepted and waiting for their hello; while this many wait, new ones stay in the
  // kernel's listen queue (a sender's connect then waits up to its own timeout).
  int max_pending = 64;
};

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

// The frames' integers: 4 bytes, little-endian.
inline void put_u32(std::string& s, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
inline std::uint32_t get_u32(const char* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<std::uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

// Where a published lane is: its socket's abstract name and its key, when it is on this host.
struct Address {
  std::string name;
  std::string key;  // 32 bytes
};
// The published value of a lane listening on `name` with public key `key` (32 bytes).
std::string publish_address(const std::string& host_identity, const std::string& name,
                            const unsigned char* key);
// nullopt when `published` is malformed or names another host identity.
std::optional<Address> parse_address(const std::string& published,
                                     const std::string& host_identity);
// The socket address of the abstract name `name` (no file: nothing is left behind when a rank is
// killed, and only this network namespace reaches it); returns its length.
socklen_t abstract_address(const std::string& name, sockaddr_un& addr);

// The tag of every frame after the hello on an authenticated lane: BLAKE2b-128 keyed with the
// lane key over [u64 sequence number][u8 type][u32 epoch][payload]. Each side counts the frames
// itself, so a frame replayed, dropped or reordered fails its tag. Unkeyed (no run secret):
// frames carry no tag.
class FrameSeal {
 public:
  FrameSeal() = default;
  explicit FrameSeal(const unsigned char* key);
  // The seal of the frames the receiver writes back on a lane that carries answers too (the
  // store's, control/store_lanes.h): keyed with BLAKE2b of the lane key under a label of its own,
  // so that a frame of one direction never passes for one of the other.
  static FrameSeal answers(const unsigned char* lane_key);
  FrameSeal(FrameSeal&& o) noexcept;
  FrameSeal& operator=(FrameSeal&& o) noexcept;
  ~FrameSeal();
  bool keyed() const { return keyed_; }
  // The tag of the next frame (advances the sequence number).
  void tag(std::uint8_t type, std::uint32_t epoch, std::string_view payload, unsigned char* out);
  // Whether `got` is the next frame's tag (advances the sequence number either way).
  bool check(std::uint8_t type, std::uint32_t epoch, std::string_view payload,
             const unsigned char* got);

 private:
  // BLAKE2b keyed with the lane key, before any input: each tag starts from a copy of it.
  alignas(64) unsigned char keyed_state_[384] = {};
  std::uint64_t seq_ = 0;
  bool keyed_ = false;
};

// The sending end of a lane.
struct Outgoing {
  Fd fd;
  FrameSeal seal;
  FrameSeal answers;  // of the frames the receiver writes back (FrameSeal::answers)
};

// Connects (blocking, local) to the lane at `a` as `sender`, reads the gate's challenge, answers
// with the hello and waits for the gate's accept. With `sender_secret` (32 bytes: the secret half of the key pair
// `sender` registered; nullptr without a run secret) the hello proves it and the lane's frames are
// sealed with a fresh key. Every step is bounded by `timeout`.
Result<Outgoing> connect(const Address& a, const std::string& sender, const std::string& receiver,
                         const unsigned char* sender_secret, std::chrono::milliseconds timeout);

// The accept frame's payload on an authenticated lane: BLAKE2b-128 keyed with the lane key over
// [label][challenge].
void accept_tag(const unsigned char* lane_key, std::string_view challenge, unsigned char* out);

// Writes one frame, all of it, within `timeout` (MSG_NOSIGNAL: a closed peer is an error, not a
// signal); sealed when the lane is keyed.
Status write_frame(Outgoing& lane, std::uint8_t type, std::uint32_t epoch, std::string_view payload,
                   std::chrono::milliseconds timeout);
// The same on socket `fd` with `seal`: an answer written back on a lane, with its answers' seal.
Status write_frame(int fd, FrameSeal& seal, std::uint8_t type, std::uint32_t epoch,
                   std::string_view payload, std::chrono::milliseconds timeout);
// The same on a bare socket, never sealed (the gate's challenge; tests).
Status write_raw_frame(int fd, std::uint8_t type, std::uint32_t epoch, std::string_view payload,
                       std::chrono::milliseconds timeout);

// The hello's proof: a nonce and a crypto_box, from the sender's registered key pair to the lane
// key `lane_public`, of [label][receiver][sender][challenge][lane key] (ids length-prefixed).
// `lane_key` receives the fresh lane key it carries.
std::string make_proof(const std::string& sender, const std::string& receiver,
                       std::string_view challenge, const std::string& lane_public,
                       const unsigned char* sender_secret, unsigned char* lane_key);
// Whether `proof` is such a box from the holder of `sender_public` (32 bytes) to the lane whose
// secret half is `lane_secret`, for `challenge`: kValid (then `lane_key` holds the lane key);
// kForged when the box does not open or names other mailboxes; kStale when it is the sender's own
// box for another challenge (a hello replayed from another connection).
enum class ProofCheck { kValid, kForged, kStale };
ProofCheck open_proof(std::string_view proof, const std::string& sender,
                      const std::string& receiver, std::string_view challenge,
                      const unsigned char* sender_public, const unsigned char* lane_secret,
                      unsigned char* lane_key);

// A hello's parts: nullopt when `payload` is no hello naming a sender.
struct Hello {
  std::string from;
  std::string_view proof;
};
std::optional<Hello> parse_hello(std::string_view payload);

// The frames arriving on one authenticated connection.
struct Frame {
  std::uint8_t type = 0;
  std::uint32_t epoch = 0;
  std::string payload;
};
class Reader {
 public:
  Reader(Fd fd, FrameSeal seal) : fd_(std::move(fd)), seal_(std::move(seal)) {}
  int fd() const { return fd_.get(); }
  // Reads what the socket holds without blocking. False at end of stream or on an error.
  bool fill();
  // The next whole frame, nullopt when incomplete; an error for a frame longer than `max_bytes`
  // or whose tag does not match.
  Result<std::optional<Frame>> next(std::int64_t max_bytes);
  // Bytes of an incomplete frame it holds (a lane that ends with some was cut mid-frame).
  std::size_t buffered() const { return buf_.size() - at_; }

 private:
  Fd fd_;
  FrameSeal seal_;
  std::string buf_;
  std::size_t at_ = 0;
};

// Key text as the mailbox keeps it (ZeroMQ's Z85, 40 characters) to 32 bytes; false when malformed.
bool z85_key(const std::string& text, unsigned char* out);

}  // namespace refit::lane
