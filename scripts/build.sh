#!/usr/bin/env bash
# Installs the Debian dependencies, configures (CUDA parts when /usr/local/cuda is present) and
# builds refit into ./build. Re-running is cheap (ccache, ninja).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"  # cache hits across checkouts
# ...also with debug info, whose compile directory would otherwise be part of every hash
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)"
