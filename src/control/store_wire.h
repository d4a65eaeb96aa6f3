// The wire protocol between StoreClient (a DEALER socket) and StoreServer (a ROUTER socket).
// Internal to src/control.
//
// Every message is a ZeroMQ multipart message. A request is
//   [request id: 8 bytes][op: 1 byte][arguments...]
// (the ROUTER sees the client's identity frame in front). A reply is
//   [request id: 8 bytes][reply code: 1 byte][payload]
// The request id lets a client drop a late reply to a request that already timed out.
//
//   op        arguments                              ok reply payload
//   kPing     -                                      the address of the store's same-host lanes
//                                                    (control/store_lanes.h), or empty
//   kSet      key, value                             -
//   kGet      timeout ms (int64), key                value            (or kTimeout: key)
//   kTryGet   key                                    value            (or kAbsent)
//   kWait     timeout ms (int64), key, key, ...      -                (or kTimeout: missing keys)
//   kAdd      key, delta (int64)                     new value (int64)
//   kErase    key                                    -                (absent keys too)
//   kTryGetMany key, key, ...                        per key: 1 byte (1: present, 0: absent),
//                                                    then when present its length (int64) and
//                                                    value (encode_values)
//   kWatch    silence ms (int64), prefix, beat,      the number of stale keys (int64), then
//                                                    encode_values of the keys' values and of
//                                                    [key, age] for each stale key: age is the
//                                                    decimal ms since it last changed, or
//                                                    kClosedMark and the ms since the
//                                                    connection that counted it closed without
//                                                    leaving (reported whatever the silence)
//             key, ...                               A non-empty `beat` is a heartbeat: the
//                                                    server first adds 1 to it as kAdd does
//                                                    (a rank's beat and liveness read in one
//                                                    request)
// A key's age in kWatch counts the server's time only while it hears requests: a stretch of more
// than kDeafGap in which it received none at all, from any connection, is left out beyond its
// first kDeafGap. Every live rank of a run beats every 0.5 s, so such a stretch is the server's
// own (its process stalled: a fork, a long page-table operation, a stopped host; or it could not
// read), and must not read as every rank's heartbeat standing still.
// Integers are 8 bytes, little-endian (host order: the control plane runs on x86/arm64 hosts).
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace refit::store_wire {

inline constexpr std::int64_t kDeafGapMs = 1000;

// In a kWatch reply, in front of the age of a key whose counting connection closed.
inline constexpr char kClosedMark[] = "closed:";

enum class Op : std::uint8_t {
  kPing = 1,
  kSet,
  kGet,
  kTryGet,
  kWait,
  kAdd,
  kTryGetMany,
  kWatch,
  kErase,
};

enum class Reply : std::uint8_t {
  kOk = 0,
  kAbsent,   // try_get: the key does not exist
  kTimeout,  // get/wait: the deadline passed; payload names the missing keys
  kError,    // payload is the message
};

inline std::string encode_i64(std::int64_t v) {
  std::string s(sizeof v, '\0');
  std::memcpy(s.data(), &v, sizeof v);
  return s;
}

// False when `s` is not exactly 8 bytes.
inline bool decode_i64(const std::string& s, std::int64_t* v) {
  if (s.size() != sizeof *v) return false;
  std::memcpy(v, s.data(), sizeof *v);
  return true;
}

// kTryGetMany's reply payload.
inline std::string encode_values(const std::vector<std::optional<std::string>>& values) {
  std::string s;
  for (const auto& v : values) {
    s.push_back(v ? '\1' : '\0');
    if (!v) continue;
    s += encode_i64(static_cast<std::int64_t>(v->size()));
    s += *v;
  }
  return s;
}

// False when `s` does not hold exactly `n` values.
inline bool decode_values(const std::string& s, std::size_t n,
                          std::vector<std::optional<std::string>>* out) {
  out->clear();
  std::size_t at = 0;
  while (out->size() < n) {
    if (at >= s.size()) return false;
    const char present = s[at++];
    if (present == '\0') {
      out->emplace_back();
      continue;
    }
    std::int64_t len = 0;
    if (present != '\1' || s.size() - at < sizeof len ||
        !decode_i64(s.substr(at, sizeof len), &len))
      return false;
    at += sizeof len;
    if (len < 0 || static_cast<std::uint64_t>(len) > s.size() - at) return false;
    out->emplace_back(s.substr(at, static_cast<std::size_t>(len)));
    at += static_cast<std::size_t>(len);
  }
  return at == s.size();
}

}  // namespace refit::store_wire
