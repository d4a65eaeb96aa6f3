// The parameters of one engine rank and what a refit does to them: their registration (or
// allocation), the version they hold, the caller's hooks around a refit (pause, resume, verify,
// load_weights, weights_changed), the export that trainer ranks map for peer access, and the copy
// kept for rollback (refit.keep_previous). The engine's protocol (runtime/engine_protocol.h) drives
// it, phase by phase; nothing here sends or receives a message.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/timer.h"
#include "plane/data_plane.h"
#include "refit/config.h"
#include "refit/rank.h"
#include "refit/session.h"
#include "runtime/export_cache.h"
#include "runtime/rollback.h"
#include "runtime/slots.h"
#include "runtime/staging.h"
#include "runtime/weight_loader.h"

namespace refit {

// The version the parameters hold: a complete version's label, or none while a refit may be
// writing them, and after one failed once it could have (the weights are then a mix).
class WeightVersion {
 public:
  bool valid() const { return label_.has_value(); }
  // The label, or "" when invalid (Engine::weight_version()).
  std::string label() const { return label_.value_or(""); }
  const std::optional<std::string>& get() const { return label_; }
  void set(std::optional<std::string> label) { label_ = std::move(label); }

 private:
  std::optional<std::string> label_ = std::string("0");  // before the first refit
};

struct EngineHooks {
  std::function<Status()> pause;
  std::function<void()> resume;
  std::function<Status(int step, const std::string& version)> verify;
  // Engine::on_weights_changed: the names of the parameters whose bytes were rewritten (every
  // parameter of the rank, in layout order), after the load_weights hook of a refit and after a
  // rollback restored the kept bytes, so that the engine derives again what it computes from
  // them (MLA's matrices from kv_b_proj, docs/engines.md). An error ends the session, as the
  // load_weights hook's does.
  std::function<Status(const std::vector<std::string>& changed)> weights_changed;
};

class EngineWeights {
 public:
  EngineWeights(const Config& config, RankId self, DataPlane& plane, Registry params);

  const Registry& params() const { return params_; }
  Status register_param(const std::string& name, void* data, DType dtype,
                        const std::vector<std::int64_t>& shape);
  // Engine::allocate_params: exported memory named after `run_id` for every parameter.
  Result<std::vector<void*>> allocate(const std::string& run_id);
  EngineHooks& hooks() { return hooks_; }
  WeightLoader& loader() { return loader_; }
  const WeightVersion& version() const { return version_; }
  // Every version label these weights published, with the refit step that published it: this
  // Engine's committed refits and the labels handed to note_published (Engine::published).
  const std::map<std::string, int>& published() const { return published_; }
  // Labels published before this Engine was created (Engine::note_published); a label already
  // held keeps its step.
  void note_published(const std::map<std::string, int>& published);

  // refit.staged: whether the bytes of a refit land in the staging area (runtime/staging.h) while
  // generation goes on, and the parameters change only in apply_staged().
  bool staged() const { return cfg_.refit.staged; }
  // Where the executor writes a refit's bytes: the staging area's slots with refit.staged, else
  // the parameters. `run_id` names the staging area's exported memory.
  Result<const Registry*> landing(const std::string& run_id);
  // The complete version the memory a refit lands in holds before it (what a delta applies onto):
  // the staging area's with refit.staged, else the parameters'.
  const std::optional<std::string>& base() const {
    return staged() ? staging_.holds() : version_.get();
  }
  // Bytes of a refit may land from now on: with refit.staged, the staging area holds no complete
  // version until the refit publishes, and with refit.keep_previous the copy to roll back to is
  // taken now (not for a bench's raw pass), while the engine generates on parameters the refit
  // does not touch before its pause, so that the pause holds only the apply.
  void landing_begins(bool raw);

  // A refit's steps, in order:
  //  - admit: checks the registration and the version label (one published at another step is
  //    refused before anything changes). With refit.staged, admit() is the whole answer to the
  //    begin: generation goes on while the bytes land.
  Status admit(int step, const std::string& version);
  //  - pause: admit(), then runs the pause hook (an error, or a hook that took
  //    longer than refit.timeout_s, refuses the refit: generation resumes then, the weights keep
  //    their version); keeps a copy (refit.keep_previous); from here the version is invalid.
  Status pause(int step, const std::string& version);
  //  - the feeders aborted it before any byte landed: the version before pause() again, and
  //    generation resumes when this rank had paused.
  void abandon(int step, bool paused, const std::string& why);
  //  - refit.staged, every byte landed in the staging area: pause() (its hook, the kept copy),
  //    then the parameters take the refit: through `changes` (which writes onto the parameters
  //    what the refit changed in the staging area, or returns false when it cannot) when they
  //    held the staging area's version before it, else a copy of the whole staging area. A
  //    pause hook that refuses leaves the parameters and their version as they were: `refused`
  //    gets its error, and the refit fails (the caller reports it as this rank's verdict). Other
  //    errors end the session.
  using StagedChanges = std::function<Result<bool>(const std::vector<void*>& params)>;
  Status apply_staged(int step, const std::string& version, const StagedChanges& changes,
                      Status& refused);
  // refit.staged, a bench's bare pass: the staging area copied into the parameters, no hook run.
  Status copy_staged() { return staging_.apply(plane_, self_.name()); }
  //  - every byte landed: the load_weights hook takes them, then the weights_changed hook hears
  //    which parameters changed.
  Status landed(int step);
  //  - complete (and verified when asked): publish `version` and resume generation.
  void publish(int step, const std::string& version);
  //  - or failed after bytes may have landed, with every rank alive: roll back to the kept copy
  //    and resume, or leave the weights invalid and generation paused. Returns `why`.
  Status fail(int step, const Status& why);
  Status verify(int step, const std::string& version) const;
  // Seconds generation was paused in the last refit, from the pause hook's start until it
  // resumed (or until now while it has not); 0 when the refit did not pause.
  double pause_seconds() const { return paused_ ? pause_timer_.seconds() : pause_s_; }
  // A refit begins: pause_seconds() counts its pause only (or a pause still going on).
  void refit_begins() {
    if (!paused_) pause_s_ = 0;
  }

  // Where the memory a refit lands in can be mapped (ExportCache::get): the staging area with
  // refit.staged, else the parameters; nullptr when they cannot.
  const ExportedParams* exported();
  // Every peer feeder mapped the exported region: its name may go.
  void release_export_name() {
    exports_.release_name();
    staging_.release_export_name();
  }
  // A feeder may still be writing in place: no rollback of this refit.
  void forget_kept(const std::string& why);
  bool has_kept() const { return rollback_.kept().has_value(); }

 private:
  const Config& cfg_;
  const RankId self_;
  DataPlane& plane_;
  Registry params_;
  EngineHooks hooks_;
  WeightLoader loader_;
  WeightVersion version_;
  std::optional<std::string> prior_;      // the version before the refit in flight
  std::map<std::string, int> published_;  // every label published -> the step that published it
  ExportCache exports_;
  Rollback rollback_;
  Staging staging_;       // refit.staged
  bool in_step_ = false;  // refit.staged: the parameters held the staging area's version at landing
  // refit.staged with refit.keep_previous: landing_begins() took the copy to roll back to, with
  // this outcome (pause() refuses the refit when it failed).
  std::optional<Status> kept_at_landing_;
  Timer pause_timer_;  // since the pause hook of the refit in flight started
  bool paused_ = false;
  double pause_s_ = 0;  // of the last refit

  // Runs the resume hook, and ends the pause's measurement.
  void resume();

  // The bytes of every parameter were rewritten: the load_weights hook, then weights_changed.
  Status rewritten(int step, const char* what);
};

}  // namespace refit
