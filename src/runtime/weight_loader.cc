#include "runtime/weight_loader.h"

#include <fmt/format.h>

#include <string_view>

#include "common/log.h"

namespace refit {

Status WeightLoader::load(const Registry& params, int device, std::int64_t limit,
                          const std::string& who, const char* what, int step) const {
  if (!hook_) return Status::Ok();
  const std::vector<TensorSlot>& slots = params.slots();
  std::vector<ParamView> batch;
  std::int64_t bytes = 0;
  int calls = 0;
  auto flush = [&]() -> Status {
    if (batch.empty()) return Status::Ok();
    ++calls;
    Status st = hook_(batch);
    batch.clear();
    bytes = 0;
    if (!st.ok())
      return st.with_context(fmt::format("{}: the load_weights hook ({}, step {})", who, what,
                                         step));
    return Status::Ok();
  };
  // Units: a decoder layer's consecutive parameters, or one parameter outside the layers. A unit
  // goes whole into a batch; a batch ends before a unit that would take it over the limit.
  for (std::size_t i = 0; i < slots.size();) {
    const std::int64_t layer = layer_of_name(slots[i].name);
    std::size_t end = i + 1;
    while (layer >= 0 && end < slots.size() && layer_of_name(slots[end].name) == layer) ++end;
    std::int64_t unit = 0;
    for (std::size_t k = i; k < end; ++k) unit += static_cast<std::int64_t>(params.bytes(k));
    if (bytes + unit > limit) REFIT_RETURN_IF_ERROR(flush());
    for (std::size_t k = i; k < end; ++k)
      batch.push_back(
          ParamView{slots[k].name, slots[k].shape, slots[k].dtype, params.ptrs()[k], device});
    bytes += unit;
    i = end;
  }
  REFIT_RETURN_IF_ERROR(flush());
  log::write(std::string_view(what) == "the refit" ? log::Level::kDebug : log::Level::kInfo,
             fmt::format("{}: load_weights hook: {} parameters in {} call(s) ({})", who,
                         slots.size(), calls, what));
  return Status::Ok();
}

}  // namespace refit
