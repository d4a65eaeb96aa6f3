// `refit run`, `bench`, `trainer`, `engine`, `shard` (placeholder until the runtime lands).
#include <CLI/CLI.hpp>

#include "cli/commands.h"

namespace refit::cli {
void add_run_commands(CLI::App& app) {}
}  // namespace refit::cli
