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
    for (std::size_t i = 0; i < params.size(); ++i) {
      // As bytes: the parameters' dtypes may differ (fp8).
      const auto n = static_cast<std::int64_t>(params.bytes(i));
      if (n == 0) continue;
      std::byte* param = static_cast<std::byte*>(params.ptrs()[i]);
      std::byte* copy = c->buffer->data() + offsets[i];
      c->save.push_back({param, copy, {0, n, 0, n, 1, n}});
      c->restore.push_back({copy, param, {0, n, 0, n, 1, n}});
    }
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
