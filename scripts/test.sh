#!/usr/bin/env bash
# Installs, builds and runs every test (GoogleTest under CTest, real processes on loopback). CTest
# also runs the Python tests (tests/python, `/usr/bin/python3 -m pytest` on the build's module:
# test `python_tests`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
ctest --preset default -j 2 "$@"
