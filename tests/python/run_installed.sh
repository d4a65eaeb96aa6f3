#!/usr/bin/env bash
# CTest `python_tests`: the Python tests against the *installed* package, not the build tree.
#   1. `pip wheel .` with refit's own build backend (pyproject.toml), reusing BUILD_DIR (already
#      built for PYTHON by CTest's build) so nothing compiles twice;
#   2. a fresh `PYTHON -m venv --system-site-packages` (NumPy, pytest, jsonschema from Debian);
#   3. `pip install --no-index` of that wheel into it, then tests/python with the venv's python,
#      from outside the source tree, with REFIT_EXPECT_INSTALLED=1 (conftest.py checks that
#      `refit` and its CLI come from the venv).
# Usage: run_installed.sh PYTHON BUILD_DIR [pytest args...]
set -euo pipefail
python=$1 build=$(cd "$2" && pwd); shift 2
root=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d /tmp/refit-wheel.XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$work"  # no refit/ folder of a build tree on sys.path (python -m puts the cwd first)

"$python" -m venv --system-site-packages "$work/venv"
venv_py="$work/venv/bin/python"
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
REFIT_WHEEL_BUILD_DIR="$build" "$venv_py" -m pip wheel --no-deps -q -w "$work/dist" "$root"
wheel=$(ls "$work"/dist/refit-*.whl)
echo "python_tests: built $(basename "$wheel")"
"$venv_py" -m pip install -q "$wheel"
"$work/venv/bin/refit" --version
env -u PYTHONPATH "$venv_py" -m refit --version

env -u PYTHONPATH REFIT_EXPECT_INSTALLED=1 PYTHONDONTWRITEBYTECODE=1 \
  "$venv_py" -m pytest -q -p no:cacheprovider --rootdir "$root/tests/python" "$@" "$root/tests/python"
