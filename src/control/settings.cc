// The mailboxes' settings from the environment, read at the edge (control/mailbox.h).
#include "common/env.h"
#include "control/mailbox.h"

namespace refit {

Result<ControlSettings> control_settings_from_environment() {
  ControlSettings s;
  REFIT_ASSIGN_OR_RETURN(s.lanes, env::control_lanes());
  REFIT_ASSIGN_OR_RETURN(const int spin, env::control_spin_us());
  s.spin = std::chrono::microseconds(spin);
  s.host_identity = env::host_identity();
  return s;
}

}  // namespace refit
