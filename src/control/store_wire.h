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
//   kPing     -                                      -
//   kSet      key, value                             -
//   kGet      timeout ms (int64), key                value            (or kTimeout: key)
//   kTryGet   key                                    value            (or kAbsent)
//   kWait     timeout ms (int64), key, key, ...      -                (or kTimeout: missing keys)
//   kAdd      key, delta (int64)                     new value (int64)
// Integers are 8 bytes, little-endian (host order: the control plane runs on x86/arm64 hosts).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace refit::store_wire {

enum class Op : std::uint8_t {
  kPing = 1,
  kSet,
  kGet,
  kTryGet,
  kWait,
  kAdd,
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

}  // namespace refit::store_wire
