// refit — push a sharded trainer's weights into inference engines (see README.md).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <new>
#include <string>

#include "refit/config.h"
#include "refit/version.h"

#include "cli/commands.h"

namespace refit::cli {

void exit_if_error(const Status& status, int exit_code) {
  if (!status.ok()) throw CliExit(exit_code, status.to_string());
}

}  // namespace refit::cli

int main(int argc, char** argv) {
  CLI::App app{"refit: move a sharded trainer's weights into inference engines"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("refit ") + refit::version() + " (wire protocol " +
                                        std::to_string(refit::wire_version()) + ", " +
                                        (refit::build_has_cuda() ? "CUDA" : "CPU-only") +
                                        " build)");
  refit::cli::add_spec_commands(app);
  refit::cli::add_check_commands(app);
  refit::cli::add_run_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : refit::cli::kExitSetup;
  } catch (const refit::cli::CliExit& e) {
    std::fprintf(stderr, "refit: error: %s\n", e.what());
    return e.code;
  } catch (const std::bad_alloc&) {
    // A model or buffer larger than this machine's memory: an error, not std::terminate.
    std::fprintf(stderr,
                 "refit: error: out of memory: an allocation for the model, its plan or a buffer "
                 "failed; the model (or refit.buffer_size_bytes x refit.num_buffers) is too large "
                 "for this machine\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "refit: error: internal error: %s\n", e.what());
    return 1;
  }
  return 0;
}
