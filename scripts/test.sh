#!/usr/bin/env bash
# Installs, builds and runs every test (GoogleTest under CTest, real processes on loopback and in
# network namespaces), in two builds:
#   1. ./build (preset default: CUDA parts when /usr/local/cuda is present, -Werror): every test,
#      including `python_tests` (tests/python against the wheel installed into a fresh venv) and
#      `cpp_package` (an outside project against `cmake --install`);
#   2. ./build-asan (preset asan: CPU-only, AddressSanitizer + UndefinedBehaviorSanitizer): the
#      C++ suite again under the sanitizers. REFIT_SKIP_SANITIZERS=1 skips this part.
# Extra arguments go to both ctest runs (e.g. -R Runtime).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
ctest --preset default -j 2 "$@"
if [ "${REFIT_SKIP_SANITIZERS:-0}" != 1 ]; then
  export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}" CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
  export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
  cmake --preset asan >/dev/null
  cmake --build --preset asan -j "$(nproc)"
  ctest --preset asan -j 2 "$@"
fi
