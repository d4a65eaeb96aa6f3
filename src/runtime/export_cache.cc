#include "runtime/export_cache.h"

#include <algorithm>

#include "common/log.h"

namespace refit {

Status ExportCache::allocate(DataPlane& plane, Registry& params, const std::string& name,
                             const std::string& who) {
  if (region_) return Status::InvalidArgument(who + ": allocate_params() called twice");
  std::size_t total = 0;
  const std::vector<std::size_t> offsets = slot_offsets(params.slots(), &total);
  REFIT_ASSIGN_OR_RETURN(region_, plane.allocate_exported(std::max<std::size_t>(total, 1), name,
                                                          &region_handle_));
  std::vector<void*> ptrs;
  for (std::size_t o : offsets) ptrs.push_back(region_->data() + o);
  params.place(std::move(ptrs));
  export_.reset();  // the parameters moved into the region
  return Status::Ok();
}

void ExportCache::invalidate() {
  handles_.clear();
  export_.reset();
  failed_ = false;
}

const ExportedParams* ExportCache::get(DataPlane& plane, const Registry& params,
                                       const std::string& who) {
  if (export_) return &*export_;
  ExportedParams e;
  if (region_) {
    e.handle = region_handle_;
    e.bytes = region_->size();
    for (void* p : params.ptrs())
      e.offsets.push_back(
          static_cast<std::uint64_t>(static_cast<std::byte*>(p) - region_->data()));
  } else {
    if (!plane.can_export_existing() || failed_) return nullptr;
    if (handles_.empty()) {
      for (std::size_t i = 0; i < params.size(); ++i) {
        if (params.bytes(i) == 0) {
          handles_.emplace_back();
          continue;
        }
        auto h = plane.export_existing(static_cast<std::byte*>(params.ptrs()[i]), params.bytes(i));
        if (!h.ok()) {
          log::warn("{}: parameter {} cannot be exported for peer access ({}); feeders on this "
                    "host use point-to-point",
                    who, params.slots()[i].name, h.status().message());
          handles_.clear();
          failed_ = true;
          return nullptr;
        }
        handles_.push_back(std::move(h).value());
      }
    }
    e.handles = handles_;
  }
  e.digest = export_digest(e);
  export_ = std::move(e);
  return &*export_;
}

void ExportCache::release_name() {
  if (region_) region_->release_name();
}

}  // namespace refit
