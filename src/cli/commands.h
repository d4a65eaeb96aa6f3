// The refit CLI's command families. Each add_*_commands registers its subcommands on `app`;
// a command reports failure by throwing CliExit (main prints the message and exits with code).
#pragma once

#include <stdexcept>
#include <string>

#include "refit/status.h"

namespace CLI {
class App;
}

namespace refit::cli {

// Exit codes: 0 success, 1 runtime failure, 2 setup/usage error (docs/design.md §5.2, §5.4).
inline constexpr int kExitRuntime = 1;
inline constexpr int kExitSetup = 2;

struct CliExit : std::runtime_error {
  CliExit(int code, const std::string& message) : std::runtime_error(message), code(code) {}
  int code;
};

// Throws CliExit(exit_code, status message) when `status` is not ok.
void exit_if_error(const Status& status, int exit_code);

void add_spec_commands(CLI::App& app);   // spec
void add_check_commands(CLI::App& app);  // check, matrix
void add_run_commands(CLI::App& app);    // run, bench, trainer, engine, shard

}  // namespace refit::cli
