#!/usr/bin/env bash
# Copies the header-only / source dependencies of the standalone GPU build (bench/gpu/CMakeLists.txt)
# from this machine's Debian packages into .carry/deps (git-ignored), so that a `run` on the
# device machine can carry them: fmt (used header-only), nlohmann-json, googletest's sources.
#   bench/gpu/prepare_deps.sh [DEST]      (default: <repo>/.carry/deps)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dest=${1:-$root/.carry/deps}
mkdir -p "$dest"
cp -r /usr/include/fmt /usr/include/nlohmann "$dest/"
rm -rf "$dest/googletest"
cp -r /usr/src/googletest "$dest/googletest"
du -sh "$dest"
