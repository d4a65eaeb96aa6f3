// Pieces shared by the translation units of the refit extension module.
#pragma once

#include <pybind11/pybind11.h>

#include <sstream>
#include <string>
#include <utility>

#include "refit/config.h"

namespace refit::python {

// A resolved refit Config, and where it came from (a file path, or "" for text and dicts), so
// setup errors can name the file as `refit check` does.
struct PyConfig {
  Config config;
  std::string source;
};

// Concatenates its arguments with operator<< (the binding uses no formatting library).
template <typename... Args>
std::string cat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

void bind_config(pybind11::module_& m);
void bind_session(pybind11::module_& m);

}  // namespace refit::python
