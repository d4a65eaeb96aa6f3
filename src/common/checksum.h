// The refit checksum: an order-free sum over elements, so that a trainer rank and an engine rank
// can checksum the same elements however each splits them into runs.
//
// Every element contributes checksum_term(key, bits), where `bits` are the element's bits in the
// dtype it travels in (the target precision), zero-extended, and `key` is its position in the
// receiving engine rank's parameters (the parameter's first element index in the rank's layout,
// plus the element's flat index in it). The checksum is the sum of the terms modulo 2^64.
//
// A term is 32 bits: murmur3's finaliser of (key x C1) xor (bits x C2), which for a given key is a
// bijection of the bits. So one changed element always changes the sum; several changed or
// misplaced elements leave it unchanged with probability about 2^-32. 32-bit arithmetic keeps the
// GPU kernel near memory speed (64-bit multiplies made it compute-bound: notes/gpu-runs.md, run
// 24).
//
// It protects against corruption (a bad link, a bug, a torn write), not against an attacker who
// can write the parameters: the control plane's authentication (docs/security.md) covers that.
// The GPU kernel (device/copy_kernels.cu) computes the terms with this same function.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define REFIT_HOST_DEVICE __host__ __device__
#else
#define REFIT_HOST_DEVICE
#endif

namespace refit {

REFIT_HOST_DEVICE inline std::uint64_t checksum_term(std::uint64_t key, std::uint32_t bits) {
  const auto k = static_cast<std::uint32_t>(key) ^ static_cast<std::uint32_t>(key >> 32) * 0x27d4eb2fu;
  std::uint32_t h = (k * 0x9e3779b1u) ^ (bits * 0xcc9e2d51u);
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

}  // namespace refit
