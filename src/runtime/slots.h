// Registration of caller-owned storage for the slots (tensors / parameters) of a rank.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "refit/session.h"

namespace refit {

// Registers `data` for slot `name`; errors name `who`, the tensor and the expected shape/dtype.
Status register_slot(const std::vector<TensorSlot>& slots, std::vector<void*>& ptrs,
                     const std::string& who, const std::string& name, void* data, DType dtype,
                     const std::vector<std::int64_t>& shape);
// Every slot registered? Otherwise names the first missing ones.
Status check_registered(const std::vector<TensorSlot>& slots, const std::vector<void*>& ptrs,
                        const std::string& who);

// One region holding every slot, as Engine::allocate_params() lays it out: the slots back to
// back in order, each starting 256-byte aligned. Returns each slot's byte offset; `total` gets
// the region's size (0 for no slots).
std::vector<std::size_t> slot_offsets(const std::vector<TensorSlot>& slots, std::size_t* total);

}  // namespace refit
