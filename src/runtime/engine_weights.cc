#include "runtime/engine_weights.h"

#include <fmt/format.h>

#include "common/log.h"
#include "common/timer.h"
#include "plane/shared_memory.h"

namespace refit {

EngineWeights::EngineWeights(const Config& config, RankId self, DataPlane& plane, Registry params)
    : cfg_(config), self_(self), plane_(plane), params_(std::move(params)) {}

Status EngineWeights::register_param(const std::string& name, void* data, DType dtype,
                                     const std::vector<std::int64_t>& shape) {
  REFIT_RETURN_IF_ERROR(params_.add(name, data, dtype, shape));
  exports_.invalidate();
  rollback_.invalidate();
  staging_.invalidate();
  return Status::Ok();
}

Result<std::vector<void*>> EngineWeights::allocate(const std::string& run_id) {
  REFIT_RETURN_IF_ERROR(exports_.allocate(
      plane_, params_, fmt::format("/refit-{}-e{}-{}", run_id, self_.rank, unguessable_suffix()),
      self_.name()));
  rollback_.invalidate();
  staging_.invalidate();
  return params_.ptrs();
}

void EngineWeights::note_published(const std::map<std::string, int>& published) {
  published_.insert(published.begin(), published.end());
}

Result<const Registry*> EngineWeights::landing(const std::string& run_id) {
  if (!staged()) return &params_;
  REFIT_RETURN_IF_ERROR(params_.check());
  return staging_.area(
      plane_, params_,
      fmt::format("/refit-{}-e{}-staging-{}", run_id, self_.rank, unguessable_suffix()),
      self_.name());
}

Status EngineWeights::admit(int step, const std::string& version) {
  REFIT_RETURN_IF_ERROR(params_.check());
  // A label names one set of weights: publishing it again for another step's would make two
  // versions indistinguishable to whoever tags rollouts with it. A retry of a step that never
  // published (or whose publication the trainers did not see) may reuse its label.
  if (auto it = published_.find(version); it != published_.end() && it->second != step)
    return Status::InvalidArgument(fmt::format(
        "{}: refit step {} would publish weight version '{}', which this engine rank already "
        "published at refit step {} for other weights; every refit that succeeds needs a version "
        "of its own (a retry of a failed refit may reuse its step)",
        self_.name(), step, version, it->second));
  return Status::Ok();
}

Status EngineWeights::pause(int step, const std::string& version) {
  REFIT_RETURN_IF_ERROR(admit(step, version));
  log::debug("pause generation for refit step {}", step);
  pause_timer_.reset();
  paused_ = true;
  pause_s_ = 0;
  if (hooks_.pause) {
    Timer took;
    const Status paused = hooks_.pause();
    if (!paused.ok()) {
      paused_ = false;
      return Status(paused.code(),
                    fmt::format("{}: the pause hook failed, so refit step {} was aborted before "
                                "any parameter changed: {}",
                                self_.name(), step, paused.message()));
    }
    // Longer than a step of a refit may take: refused here, the same to every feeder (they wait
    // longer), and generation goes on.
    if (took.seconds() > cfg_.refit.timeout_s) {
      resume();
      return Status::Timeout(fmt::format(
          "{}: the pause hook took {:.1f} s, longer than refit.timeout_s ({} s), so refit step {} "
          "was aborted before any parameter changed",
          self_.name(), took.seconds(), cfg_.refit.timeout_s, step));
    }
  }
  // refit.keep_previous: a copy of a complete version to roll back to (nothing complete to keep
  // when the weights are invalid), unless landing_begins() took it. A copy that fails refuses the
  // refit: generation resumes, the version stays.
  if (cfg_.refit.keep_previous) {
    Status kept = Status::Ok();
    if (kept_at_landing_) {
      kept = *kept_at_landing_;
      kept_at_landing_.reset();
    } else {
      rollback_.forget();
      if (version_.valid()) kept = rollback_.keep(plane_, params_, version_.label(), self_.name());
    }
    if (!kept.ok()) {
      resume();
      return kept;
    }
  }
  // From here bytes may land: the old version no longer describes the weights until this refit
  // publishes its own.
  prior_ = version_.get();
  version_.set(std::nullopt);
  return Status::Ok();
}

void EngineWeights::landing_begins(bool raw) {
  kept_at_landing_.reset();
  if (!staged()) return;
  // The parameters take only what changed (apply_staged) when they hold what the staging area
  // holds: the same complete version.
  in_step_ = staging_.holds().has_value() && staging_.holds() == version_.get();
  staging_.set_holds(std::nullopt);
  if (raw || !cfg_.refit.keep_previous) return;
  rollback_.forget();
  kept_at_landing_ = Status::Ok();
  if (!version_.valid()) return;
  kept_at_landing_ = rollback_.keep(plane_, params_, version_.label(), self_.name());
  if (kept_at_landing_->ok())
    log::debug("{}: refit.keep_previous: kept weight version '{}' while the bytes land",
               self_.name(), version_.label());
}

void EngineWeights::abandon(int step, bool paused, const std::string& why) {
  // Nothing landed: the weights are the previous version's.
  if (paused) version_.set(prior_);
  log::warn(
      "{}: refit step {} was aborted before any byte landed; weight version '{}' stays{}: "
      "{}",
      self_.name(), step, version_.label(), paused ? " and generation resumes" : "", why);
  if (paused) resume();
}

Status EngineWeights::apply_staged(int step, const std::string& version,
                                   const StagedChanges& changes, Status& refused) {
  refused = pause(step, version);
  if (!refused.ok()) return Status::Ok();
  if (in_step_ && changes) {
    REFIT_ASSIGN_OR_RETURN(const bool written, changes(params_.ptrs()));
    if (written) {
      log::debug("{}: refit.staged: refit step {} applied as its changes only", self_.name(), step);
      return Status::Ok();
    }
  }
  log::debug("{}: refit.staged: refit step {} applied as a copy of the staging area", self_.name(),
             step);
  return copy_staged();
}

Status EngineWeights::landed(int step) { return rewritten(step, "the refit"); }

Status EngineWeights::rewritten(int step, const char* what) {
  const int device = plane_.device() == Device::kCuda ? plane_.ordinal() : -1;
  REFIT_RETURN_IF_ERROR(
      loader_.load(params_, device, cfg_.refit.buffer_size_bytes, self_.name(), what, step));
  if (!hooks_.weights_changed) return Status::Ok();
  std::vector<std::string> names;
  names.reserve(params_.slots().size());
  for (const TensorSlot& s : params_.slots()) names.push_back(s.name);
  const Status st = hooks_.weights_changed(names);
  if (!st.ok())
    return st.with_context(
        fmt::format("{}: the weights_changed hook ({}, step {})", self_.name(), what, step));
  log::debug("{}: weights_changed hook: {} parameters ({})", self_.name(), names.size(), what);
  return Status::Ok();
}

void EngineWeights::publish(int step, const std::string& version) {
  version_.set(version);
  published_.emplace(version, step);
  // The staging area holds what the parameters hold (a full refit or a delta onto that base).
  if (staged()) staging_.set_holds(version);
  log::debug("resume generation at weight version {}", version);
  resume();
}

Status EngineWeights::fail(int step, const Status& why) {
  if (const std::optional<std::string>& kept = rollback_.kept()) {
    Status restored = rollback_.restore(plane_);
    // The engine's own weights took the failed refit's bytes: hand it the restored ones, and
    // tell it they changed again.
    if (restored.ok()) restored = rewritten(step, "after the rollback");
    if (restored.ok()) {
      version_.set(*kept);
      log::warn(
          "{}: refit step {} failed; rolled back to weight version '{}' "
          "(refit.keep_previous) and resumed generation: {}",
          self_.name(), step, *kept, why.message());
      resume();
      return why;
    }
    log::error("{}: refit.keep_previous: restoring the parameters failed: {}", self_.name(),
               restored.to_string());
  }
  version_.set(std::nullopt);
  log::warn(
      "{}: refit step {} failed; the weights are invalid and generation stays paused "
      "until a refit succeeds: {}",
      self_.name(), step, why.message());
  return why;
}

Status EngineWeights::verify(int step, const std::string& version) const {
  if (!hooks_.verify)
    return Status::Unsupported(self_.name() +
                               ": verification was asked for but this engine has no "
                               "verification hook");
  return hooks_.verify(step, version);
}

const ExportedParams* EngineWeights::exported() {
  if (staged()) return staging_.exported(plane_, self_.name());
  return exports_.get(plane_, params_, self_.name());
}

void EngineWeights::resume() {
  if (hooks_.resume) hooks_.resume();
  if (!paused_) return;
  pause_s_ = pause_timer_.seconds();
  paused_ = false;
}

void EngineWeights::forget_kept(const std::string& why) {
  if (!rollback_.kept()) return;
  log::warn("{}: refit.keep_previous: no rollback {}", self_.name(), why);
  rollback_.forget();
}

}  // namespace refit
