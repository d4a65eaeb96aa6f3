#include "runtime/rollback.h"

#include <algorithm>

namespace refit {

Status Rollback::keep(DataPlane& plane, const Registry& params, const std::string& version,
                      const std::string& who) {
  kept_.reset();
  if (!copy_) {
    auto c = std::make_unique<Copy>();
    std::size_t total = 0;
    std::vector<std::size_t> offsets;
    for (std::size_t i = 0; i < params.size(); ++i) {
      offsets.push_back(total);
      total += params.bytes(i);
    }
    REFIT_ASSIGN_OR_RETURN(c->buffer, plane.allocate(std::max<std::size_t>(total, 1)));
    std::vector<std::byte*> copies;
    for (std::size_t o : offsets) copies.push_back(c->buffer->data() + o);
    whole_slot_runs(params, copies, c->save, c->restore);
    copy_ = std::move(c);
  }
  REFIT_RETURN_IF_ERROR(plane.copy(copy_->save, kByteCopyDType, kByteCopyDType)
                            .with_context(who + ": refit.keep_previous: copying the parameters"));
  kept_ = version;
  return Status::Ok();
}

Status Rollback::restore(DataPlane& plane) const {
  if (!copy_ || !kept_) return Status::Internal("refit.keep_previous: nothing kept to restore");
  return plane.copy(copy_->restore, kByteCopyDType, kByteCopyDType);
}

}  // namespace refit
