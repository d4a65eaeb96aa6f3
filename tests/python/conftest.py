"""pytest setup for tests/python: `refit` must be importable — installed (CTest's python_tests
installs the wheel into a fresh venv: tests/python/run_installed.sh), or from a build tree next to
this checkout (build/python, build-cpu/python) when none is installed.

With REFIT_EXPECT_INSTALLED=1 the tests refuse to run unless `refit` and its CLI come from the
interpreter's own environment (sys.prefix), so a build tree cannot stand in for the package."""

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

if os.environ.get("REFIT_EXPECT_INSTALLED") == "1":
    _prefix = os.path.realpath(sys.prefix)
    _where = os.path.realpath(refit.__file__)
    if not _where.startswith(_prefix + os.sep):
        raise RuntimeError(f"REFIT_EXPECT_INSTALLED: refit was imported from {_where}, not from the "
                           f"environment {_prefix}")
    _cli = refit.cli_path()
    if _cli is None or not os.path.realpath(_cli).startswith(_prefix + os.sep):
        raise RuntimeError(f"REFIT_EXPECT_INSTALLED: the installed package has no CLI ({_cli})")
