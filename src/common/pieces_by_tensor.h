// Per-tensor lists of a layout's pieces in one flat array (host code only: C++20).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace refit {

// For each HF tensor index, a list of (tensor or parameter index, piece index) pairs of a layout —
// the pieces that read from it, or that a rank owns — in one flat array with an offset per tensor:
// a layout of a frontier MoE has tens of thousands of tensors, and every rank builds several at
// setup.
class PiecesByTensor {
 public:
  using Entry = std::pair<std::uint32_t, std::uint32_t>;
  // The lists of tensors [0, tensors) of what visit(add) adds: visit calls add(tensor, entry) for
  // every entry, each tensor's in order (it is called twice: count, then fill).
  template <class Visit>
  void build(std::size_t tensors, const Visit& visit) {
    offsets_.assign(tensors + 1, 0);
    visit([&](std::uint32_t t, Entry) { ++offsets_[t + 1]; });
    for (std::size_t t = 0; t < tensors; ++t) offsets_[t + 1] += offsets_[t];
    entries_.resize(offsets_[tensors]);
    std::vector<std::uint32_t> next(offsets_.begin(), offsets_.end() - 1);
    visit([&](std::uint32_t t, Entry e) { entries_[next[t]++] = e; });
  }
  std::size_t size() const { return offsets_.empty() ? 0 : offsets_.size() - 1; }
  std::span<const Entry> operator[](std::size_t t) const {
    return {entries_.data() + offsets_[t], entries_.data() + offsets_[t + 1]};
  }
  std::span<Entry> mutable_list(std::size_t t) {
    return {entries_.data() + offsets_[t], entries_.data() + offsets_[t + 1]};
  }
  bool operator==(const PiecesByTensor&) const = default;

 private:
  std::vector<std::uint32_t> offsets_;  // tensor t's entries: [offsets_[t], offsets_[t + 1])
  std::vector<Entry> entries_;
};

}  // namespace refit
