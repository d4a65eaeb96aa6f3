// The refit extension module (refit._refit). The Python package refit/ re-exports it.
#include "binding.h"

#ifndef REFIT_VERSION
#define REFIT_VERSION "0.0.0"
#endif

PYBIND11_MODULE(_refit, m) {
  m.doc() =
      "refit: push a sharded trainer's weights into inference engines after every RL step "
      "(the C++ library behind refit/session.h; use the `refit` package).";
  m.attr("__version__") = REFIT_VERSION;
  // Exceptions live in pure Python (refit._common) so they carry .code and pickle cleanly.
  pybind11::module_::import("refit._common");
  refit::python::bind_config(m);
  refit::python::bind_session(m);
}
