// refit.checksum with the transfer plan: the pair checksums of an engine rank, added up so that
// the control messages carry two numbers per engine rank instead of one checksum per pair, and
// still name the pair when exactly one of them differs (docs/protocol.md, "Relays").
//
// Each pair's checksum c (common/checksum.h) counts as c mod P, P = 2^61 - 1 (a prime). The
// feeders of an engine rank add up
//   sum    = Σ c mod P
//   first  = Σ (t + 1) · c mod P          (t: the feeding trainer rank)
//   second = Σ (t + 1)² · c mod P
// and the engine rank adds up the same over what landed from each. If only trainer rank t's pair
// differs, by d ≠ 0, the differences are d, (t + 1) · d and (t + 1)² · d: (t + 1) = Δfirst / Δsum
// and its square is Δsecond / Δsum (mod P). Two or more damaged pairs pass both only by chance
// (about 2^-61; two pairs damaged by the same d would pass the first alone, naming the rank
// between them).
#pragma once

#include <cstdint>
#include <optional>

namespace refit {

class PairSums {
 public:
  static constexpr std::uint64_t kPrime = (std::uint64_t{1} << 61) - 1;

  PairSums() = default;
  PairSums(std::uint64_t sum, std::uint64_t first, std::uint64_t second)
      : sum_(sum), first_(first), second_(second) {}

  // Trainer rank `trainer`'s pair, whose checksum is `checksum`.
  void add(std::uint64_t checksum, int trainer) {
    const std::uint64_t c = checksum % kPrime;
    const std::uint64_t w = static_cast<std::uint64_t>(trainer) + 1;
    sum_ = plus(sum_, c);
    first_ = plus(first_, times(c, w));
    second_ = plus(second_, times(times(c, w), w));
  }
  void add(const PairSums& other) {
    sum_ = plus(sum_, other.sum_);
    first_ = plus(first_, other.first_);
    second_ = plus(second_, other.second_);
  }

  std::uint64_t sum() const { return sum_; }
  std::uint64_t first() const { return first_; }
  std::uint64_t second() const { return second_; }
  // All below kPrime: what a well-formed message carries.
  bool valid() const { return sum_ < kPrime && first_ < kPrime && second_ < kPrime; }
  bool operator==(const PairSums&) const = default;

  // `landed` (an engine rank's) against `sent` (its feeders'): the trainer rank whose pair alone
  // explains the difference, or nullopt when none does (several pairs differ, or they agree).
  static std::optional<int> damaged_feeder(const PairSums& sent, const PairSums& landed) {
    const std::uint64_t d = minus(landed.sum_, sent.sum_);
    if (d == 0) return std::nullopt;
    const std::uint64_t inv = inverse(d);
    const std::uint64_t w = times(minus(landed.first_, sent.first_), inv);
    const std::uint64_t w2 = times(minus(landed.second_, sent.second_), inv);
    if (w == 0 || w > (std::uint64_t{1} << 31) || times(w, w) != w2) return std::nullopt;
    return static_cast<int>(w - 1);
  }

 private:
  static std::uint64_t plus(std::uint64_t a, std::uint64_t b) {
    const std::uint64_t s = a + b;  // both < 2^61: no overflow
    return s >= kPrime ? s - kPrime : s;
  }
  static std::uint64_t minus(std::uint64_t a, std::uint64_t b) {
    return a >= b ? a - b : a + kPrime - b;
  }
  static std::uint64_t times(std::uint64_t a, std::uint64_t b) {
    const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
    // 2^61 ≡ 1 (mod P): fold the high bits onto the low ones.
    std::uint64_t r = static_cast<std::uint64_t>(p & kPrime) + static_cast<std::uint64_t>(p >> 61);
    r = (r & kPrime) + (r >> 61);
    return r >= kPrime ? r - kPrime : r;
  }
  // a^(P - 2): the inverse of a ≠ 0 (Fermat).
  static std::uint64_t inverse(std::uint64_t a) {
    std::uint64_t result = 1, base = a;
    for (std::uint64_t e = kPrime - 2; e != 0; e >>= 1) {
      if (e & 1) result = times(result, base);
      base = times(base, base);
    }
    return result;
  }

  std::uint64_t sum_ = 0, first_ = 0, second_ = 0;
};

}  // namespace refit
