#include "runtime/slots.h"

#include <fmt/format.h>

#include <optional>

#include <nlohmann/json.hpp>

#include "plane/data_plane.h"

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

std::size_t Registry::bytes(std::size_t i) const {
  return static_cast<std::size_t>(slots_[i].numel()) * dtype_size(slots_[i].dtype);
}

// Takes [data, data + bytes(i)) for slot i, releasing what slot i held before (a slot may be
// registered again, for example after the caller reallocated it).
Status Registry::claim(std::size_t i, void* data) {
  const std::size_t n = bytes(i);
  const auto start = reinterpret_cast<std::uintptr_t>(data);
  std::optional<std::size_t> other;
  if (data != nullptr && n > 0) {
    // Ranges never overlap each other, so only the last one starting before `start + n` can
    // reach into [start, start + n); slot i's own earlier registration does not count.
    for (auto it = ranges_.lower_bound(start + n); it != ranges_.begin() && !other;) {
      --it;
      if (it->second == i) continue;
      if (it->first + bytes(it->second) > start) other = it->second;
      break;
    }
  }
  if (other)
    return Status::InvalidArgument(fmt::format(
        "{}: tensor {} ({} bytes at {:#x}) overlaps tensor {} ({} bytes at {:#x}) in memory; "
        "every tensor needs storage of its own (a refit would write one over the other)",
        who_, slots_[i].name, n, start, slots_[*other].name, bytes(*other),
        reinterpret_cast<std::uintptr_t>(ptrs_[*other])));
  if (auto mine = ranges_.find(reinterpret_cast<std::uintptr_t>(ptrs_[i]));
      mine != ranges_.end() && mine->second == i)
    ranges_.erase(mine);
  if (data != nullptr && n > 0) ranges_.emplace(start, i);
  return Status::Ok();
}

Status Registry::add(const std::string& name, void* data, DType dtype,
                     const std::vector<std::int64_t>& shape) {
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].name != name) continue;
    if (dtype != slots_[i].dtype || shape != slots_[i].shape)
      return Status::InvalidArgument(
          fmt::format("{}: tensor {} registered as {} {}, expected {} {}", who_, name,
                      dtype_name(dtype), nlohmann::json(shape).dump(), dtype_name(slots_[i].dtype),
                      nlohmann::json(slots_[i].shape).dump()));
    if (data == nullptr && slots_[i].numel() > 0)
      return Status::InvalidArgument(
          fmt::format("{}: tensor {} registered with no storage", who_, name));
    REFIT_RETURN_IF_ERROR(claim(i, data));
    ptrs_[i] = data;
    return Status::Ok();
  }
  return Status::NotFound(
      fmt::format("{}: no tensor named {} on this rank ({} tensors; see "
                  "tensors() / params() for the names)",
                  who_, name, slots_.size()));
}

Status Registry::check() const {
  std::string missing;
  int count = 0;
  for (std::size_t i = 0; i < slots_.size(); ++i)
    if (ptrs_[i] == nullptr && slots_[i].numel() > 0) {
      if (++count <= 3) missing += (missing.empty() ? "" : ", ") + slots_[i].name;
    }
  if (count == 0) return Status::Ok();
  return Status::InvalidArgument(
      fmt::format("{}: {} tensor(s) not registered before the refit: "
                  "{}{}",
                  who_, count, missing, count > 3 ? ", ..." : ""));
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

void whole_slot_runs(const Registry& params, const std::vector<std::byte*>& copies,
                     std::vector<CopyRun>& to, std::vector<CopyRun>& back) {
  to.clear();
  back.clear();
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto n = static_cast<std::int64_t>(params.bytes(i));
    if (n == 0) continue;
    auto* param = static_cast<std::byte*>(params.ptrs()[i]);
    to.push_back({param, copies[i], {0, n, 0, n, 1, n}});
    back.push_back({copies[i], param, {0, n, 0, n, 1, n}});
  }
}

}  // namespace refit
