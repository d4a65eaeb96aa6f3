#!/usr/bin/env bash
# Installs, builds and runs every test (GoogleTest under CTest, real processes on loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
ctest --preset default -j 2 "$@"
