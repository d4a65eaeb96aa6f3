// Points of a refit where a test may act (fault injection: the harness's `refit run --fault`).
// The executors call the round points during real refits (never in raw bench passes); the
// runtime calls the setup, hello and commit points. The default does nothing, and no fault logic
// lives in the library: a probe is handed in with the rank's services (runtime/rank_core.h).
#pragma once

#include <vector>

#include "control/messages.h"
#include "plane/data_plane.h"
#include "refit/status.h"

namespace refit {

class RefitProbe {
 public:
  // The round number of a step that moves every round at once (peer access).
  static constexpr int kEveryRound = -1;
  virtual ~RefitProbe() = default;
  // Before this rank moves round `round` (a bucket, for gather) of refit `step`.
  virtual void before_round(int /*step*/, int /*round*/) {}
  // Once this rank joined the control plane, before it forms any group (setup).
  virtual void at_setup() {}
  // An engine rank's hello, before it goes out (setup).
  virtual void before_hello(HelloMessage& /*hello*/) {}
  // Every byte of refit `step` moved (engine: landed), before the commit (engine: its answer).
  virtual void before_commit(int /*step*/) {}
  // refit.delta, before refit `step` decides on its deltas: whether this rank forgets the base it
  // holds of its pair with `peer` (the engine rank a trainer rank feeds, or the trainer rank that
  // feeds an engine rank), as a restarted rank would.
  virtual bool forget_delta_base(int /*step*/, int /*peer*/) { return false; }
  // Round `round`'s bytes were written by `written` (elements of `dtype`) and have not reached
  // their engine yet (or, with peer access, the engine has not been told): may alter them.
  virtual Status after_write(int /*step*/, int /*round*/, DataPlane& /*plane*/,
                             const std::vector<CopyRun>& /*written*/, DType /*dtype*/) {
    return Status::Ok();
  }
  // The probe that does nothing.
  static RefitProbe& none();
};

}  // namespace refit
