#include "runtime/slots.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace refit {

std::int64_t TensorSlot::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::int64_t ParamView::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

Status register_slot(const std::vector<TensorSlot>& slots, std::vector<void*>& ptrs,
                     const std::string& who, const std::string& name, void* data, DType dtype,
                     const std::vector<std::int64_t>& shape) {
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].name != name) continue;
    if (dtype != slots[i].dtype || shape != slots[i].shape)
      return Status::InvalidArgument(
          fmt::format("{}: tensor {} registered as {} {}, expected {} {}", who, name,
                      dtype_name(dtype), nlohmann::json(shape).dump(), dtype_name(slots[i].dtype),
                      nlohmann::json(slots[i].shape).dump()));
    if (data == nullptr && slots[i].numel() > 0)
      return Status::InvalidArgument(
          fmt::format("{}: tensor {} registered with no storage", who, name));
    ptrs[i] = data;
    return Status::Ok();
  }
  return Status::NotFound(
      fmt::format("{}: no tensor named {} on this rank ({} tensors; see "
                  "tensors() / params() for the names)",
                  who, name, slots.size()));
}

Status check_registered(const std::vector<TensorSlot>& slots, const std::vector<void*>& ptrs,
                        const std::string& who) {
  std::string missing;
  int count = 0;
  for (std::size_t i = 0; i < slots.size(); ++i)
    if (ptrs[i] == nullptr && slots[i].numel() > 0) {
      if (++count <= 3) missing += (missing.empty() ? "" : ", ") + slots[i].name;
    }
  if (count == 0) return Status::Ok();
  return Status::InvalidArgument(
      fmt::format("{}: {} tensor(s) not registered before the refit: "
                  "{}{}",
                  who, count, missing, count > 3 ? ", ..." : ""));
}

std::vector<std::size_t> slot_offsets(const std::vector<TensorSlot>& slots, std::size_t* total) {
  std::vector<std::size_t> offsets;
  std::size_t end = 0;
  for (const TensorSlot& s : slots) {
    offsets.push_back(end);
    end += static_cast<std::size_t>(s.numel()) * dtype_size(s.dtype);
    end = (end + 255) / 256 * 256;
  }
  *total = end;
  return offsets;
}

}  // namespace refit
