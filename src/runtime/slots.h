// The slots of a rank — its local tensors (trainer) or parameters (engine) — and the caller-owned
// storage registered for them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "refit/session.h"

namespace refit {

struct CopyRun;  // plane/data_plane.h

class Registry {
 public:
  Registry() = default;
  Registry(std::vector<TensorSlot> slots, std::string who)
      : slots_(std::move(slots)), ptrs_(slots_.size(), nullptr), who_(std::move(who)) {}

  const std::vector<TensorSlot>& slots() const { return slots_; }
  // The registered storage of each slot (nullptr until registered), in slots() order.
  const std::vector<void*>& ptrs() const { return ptrs_; }
  std::size_t size() const { return slots_.size(); }
  std::size_t bytes(std::size_t i) const;

  // Registers `data` for slot `name`; errors name the rank, the tensor and the expected
  // shape/dtype. Storage that overlaps another slot's registered bytes is refused, naming both
  // tensors: a refit would write one over the other (or send one's bytes as the other's).
  Status add(const std::string& name, void* data, DType dtype,
             const std::vector<std::int64_t>& shape);
  // Points every slot at `ptrs` (storage refit allocated itself, one slot after another).
  void place(std::vector<void*> ptrs) {
    ranges_.clear();
    ptrs_ = std::move(ptrs);
  }
  // Every slot registered? Otherwise names the first missing ones.
  Status check() const;

 private:
  Status claim(std::size_t i, void* data);

  std::vector<TensorSlot> slots_;
  std::vector<void*> ptrs_;
  std::string who_;
  // Registered byte ranges by start address: start -> slot index (slots of zero bytes are not
  // kept; they occupy nothing).
  std::map<std::uintptr_t, std::size_t> ranges_;
};

// Every slot's whole bytes between its registered storage and `copies` (one pointer per slot, in
// slots() order), as runs of bytes (the slots' dtypes may differ: fp8): `to` writes the copies,
// `back` writes the slots from them. Slots of zero bytes have none.
void whole_slot_runs(const Registry& params, const std::vector<std::byte*>& copies,
                     std::vector<CopyRun>& to, std::vector<CopyRun>& back);

// One region holding every slot, as Engine::allocate_params() lays it out: the slots back to
// back in order, each starting 256-byte aligned. Returns each slot's byte offset; `total` gets
// the region's size (0 for no slots).
std::vector<std::size_t> slot_offsets(const std::vector<TensorSlot>& slots, std::size_t* total);

}  // namespace refit
