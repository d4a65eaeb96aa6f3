// Registration of caller-owned storage for the slots (tensors / parameters) of a rank.
#pragma once

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

}  // namespace refit
