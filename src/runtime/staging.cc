#include "runtime/staging.h"

namespace refit {

Result<const Registry*> Staging::area(DataPlane& plane, const Registry& params,
                                      const std::string& name, const std::string& who) {
  if (slots_) return slots_.get();
  auto slots = std::make_unique<Registry>(params.slots(), who + " (staging)");
  REFIT_RETURN_IF_ERROR(exports_.allocate(plane, *slots, name, who)
                            .with_context(who + ": refit.staged: allocating the staging area"));
  std::vector<std::byte*> copies;
  for (void* p : slots->ptrs()) copies.push_back(static_cast<std::byte*>(p));
  std::vector<CopyRun> seed;
  whole_slot_runs(params, copies, seed, to_params_);
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
