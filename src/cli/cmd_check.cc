// `refit check CONFIG` and `refit matrix` (placeholder until the config module lands).
#include <CLI/CLI.hpp>

#include "cli/commands.h"

namespace refit::cli {
void add_check_commands(CLI::App& app) {}
}  // namespace refit::cli
