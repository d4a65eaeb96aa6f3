// The refit checksum: an order-free sum over elements, so that a trainer rank and an engine rank
// can checksum the same elements however each splits them into runs.
//
// Every element contributes checksum_term(key, bits), where `bits` are the element's bits in the
// dtype it travels in (the target precision), zero-extended, and `key` is its position in the
// receiving engine rank's parameters (the parameter's first element index in the rank's layout,
// plus the element's flat index in it). The checksum is the sum of the terms modulo 2^64. One
// changed, lost or misplaced element changes the sum, except with probability about 2^-64.
//
// It protects against corruption (a bad link, a bug, a torn write), not against an attacker who
// can write the parameters: the control plane's authentication (docs/security.md) covers that.
// The GPU kernel (device/copy_kernels.cu) computes the same terms bit for bit.
#pragma once

#include <cstdint>

namespace refit {

inline std::uint64_t checksum_term(std::uint64_t key, std::uint32_t bits) {
  std::uint64_t x = key * 0x9e3779b97f4a7c15ull + bits;
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

}  // namespace refit
