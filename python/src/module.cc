// The refit extension module (refit._refit). The Python package refit/ re-exports it.
#include "binding.h"
#include "refit/version.h"

PYBIND11_MODULE(_refit, m) {
  m.doc() =
      "refit: push a sharded trainer's weights into inference engines after every RL step "
      "(the C++ library behind refit/session.h; use the `refit` package).";
  m.attr("__version__") = refit::version();
  m.attr("__wire_version__") = refit::wire_version();
  // Exceptions live in pure Python (refit._common) so they carry .code and pickle cleanly.
  pybind11::module_::import("refit._common");
  refit::python::bind_config(m);
  refit::python::bind_session(m);
}
