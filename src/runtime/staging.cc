#include "runtime/staging.h"

namespace refit {

Result<const Registry*> Staging::area(DataPlane& plane, const Registry& params,
                                      const std::string& name, const std::string& who) {
  if (slots_) return slots_.get();
  auto slots = std::make_unique<Registry>(params.slots(), who + " (staging)");
  REFIT_RETURN_IF_ERROR(exports_.allocate(plane, *slots, name, who)
                            .with_context(who + ": refit.staged: allocating the staging area"));
  to_params_.clear();
  std::vector<CopyRun> seed;
  for (std::size_t i = 0; i < params.size(); ++i) {
    // As bytes: the parameters' dtypes may differ (fp8).
    const auto n = static_cast<std::int64_t>(params.bytes(i));
    if (n == 0) continue;
    auto* staged = static_cast<std::byte*>(slots->ptrs()[i]);
    auto* param = static_cast<std::byte*>(params.ptrs()[i]);
    to_params_.push_back({staged, param, {0, n, 0, n, 1, n}});
    seed.push_back({param, staged, {0, n, 0, n, 1, n}});
  }
  // Seeded with the parameters: the apply copies whole parameters, and bytes no route writes (an
  // engine's padding rows) keep what the engine put there.
  REFIT_RETURN_IF_ERROR(plane.copy(seed, kByteCopyDType, kByteCopyDType)
                            .with_context(who + ": refit.staged: seeding the staging area"));
  slots_ = std::move(slots);
  holds_.reset();  // what the parameters hold is not known to be a complete version
  return slots_.get();
}

const ExportedParams* Staging::exported(DataPlane& plane, const std::string& who) {
  if (!slots_) return nullptr;
  return exports_.get(plane, *slots_, who);
}

Status Staging::apply(DataPlane& plane, const std::string& who) const {
  if (!slots_) return Status::Internal(who + ": refit.staged: no staging area to apply");
  return plane.copy(to_params_, kByteCopyDType, kByteCopyDType)
      .with_context(who + ": refit.staged: copying the staging area into the parameters");
}

void Staging::invalidate() {
  slots_.reset();
  to_params_.clear();
  exports_ = ExportCache{};
  holds_.reset();
}

}  // namespace refit
