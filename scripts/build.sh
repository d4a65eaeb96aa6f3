#!/usr/bin/env bash
# Installs the Debian dependencies, configures (CUDA parts when /usr/local/cuda is present) and
# builds refit into ./build. Re-running is cheap (ccache, ninja).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"  # cache hits across checkouts
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)"

# `import refit` for each python3 here: the Python module is assembled in build/python (built for
# Debian's /usr/bin/python3); a refit.pth in an interpreter's site-packages puts that directory on
# its sys.path. Interpreters of another Python version are skipped (nothing was built for them).
if [ -d build/python/refit ]; then
  for py in /usr/bin/python3 "$(command -v python3 || true)"; do
    [ -n "$py" ] && [ -x "$py" ] || continue
    "$py" - "$PWD/build/python" <<'PY' || echo "build: could not install refit.pth for $py" >&2
import glob, os, site, sys, sysconfig
path = sys.argv[1]
suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
if not glob.glob(os.path.join(path, "refit", "_refit" + suffix)):
    print(f"build: refit module not built for {sys.executable} (Python {sys.version.split()[0]}); skipped")
    sys.exit(0)
dirs = [sysconfig.get_paths()["purelib"]] + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
for d in dirs:
    try:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "refit.pth"), "w") as f:
            f.write(path + "\n")
    except OSError:
        continue
    print(f"build: `import refit` for {sys.executable} via {os.path.join(d, 'refit.pth')}")
    break
else:
    sys.exit(f"build: no writable site-packages for {sys.executable} (tried {', '.join(dirs)})")
PY
  done
fi
