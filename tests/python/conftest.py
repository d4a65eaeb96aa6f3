"""pytest setup for tests/python: `refit` must be importable (scripts/build.sh installs a refit.pth
pointing at build/python; CTest sets PYTHONPATH to its build tree's python/ folder)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# Helpers (refit_testing) for this process and for the rank processes it spawns.
if HERE not in sys.path:
    sys.path.insert(0, HERE)

try:
    import refit  # noqa: F401
except ImportError:  # a plain checkout: use the build tree next to it
    for build in ("build", "build-cpu"):
        candidate = os.path.join(ROOT, build, "python")
        if os.path.isdir(os.path.join(candidate, "refit")):
            sys.path.insert(0, candidate)
            break
    import refit  # noqa: F401
