// Reading the user's input files (config YAML, a model's config.json, a checkpoint's index and
// safetensors files) without ever blocking on one: a FIFO, a directory, a device or a socket in
// place of a file is refused at once, naming it, and sizes are bounded.
#pragma once

#include <cstddef>
#include <string>

#include "refit/status.h"

namespace refit {

// Opens `path` for reading without blocking (O_NONBLOCK: a FIFO with no writer would otherwise
// hang open()) and checks that it is a regular file (symlinks are followed). Returns the open
// descriptor (the caller closes it; O_NONBLOCK is cleared) or: NotFound when absent,
// InvalidArgument naming `what` and the file type when it is not a regular file, IOError else.
Result<int> open_regular_file(const std::string& path, const char* what);

// The whole of a regular file, at most `max_bytes` (InvalidArgument naming `what` beyond).
Result<std::string> read_regular_file(const std::string& path, const char* what,
                                      std::size_t max_bytes);

}  // namespace refit
