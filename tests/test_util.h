// Helpers shared by the tests: temporary directories and running the refit CLI as a process.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace refit::testing {

// A fresh directory under $TMPDIR, removed with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  // Writes `text` to path()/name and returns the full path.
  std::string write(const std::string& name, const std::string& text) const;

 private:
  std::string path_;
};

struct CliResult {
  int exit_code = -1;  // exit status, or 128+signal
  std::string output;  // stdout and stderr together
};

// Runs the refit CLI with `args`, waits at most `timeout_s` (then kills it: exit_code 124).
CliResult run_cli(const std::vector<std::string>& args, double timeout_s = 300);

// Runs this test binary with `--gtest_filter=filter` and the extra environment `env_extra`
// ("NAME=value"); returns its exit status (124 after `timeout`, then it is killed; 128+signal).
int run_test_child(const std::string& filter, const std::vector<std::string>& env_extra,
                   std::chrono::seconds timeout);

}  // namespace refit::testing
