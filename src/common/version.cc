// The linked library's versions (include/refit/version.h).
#include "refit/version.h"

namespace refit {

const char* version() { return REFIT_VERSION_STRING; }
int wire_version() { return REFIT_WIRE_VERSION; }

}  // namespace refit
