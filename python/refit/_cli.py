"""The `refit` command of an installed package: runs the CLI binary shipped in the wheel
(refit/bin/refit). `refit ...` (console script) and `python -m refit ...` both land here."""

from __future__ import annotations

import os
import sys
from typing import List, Optional


def cli_path() -> Optional[str]:
    """The `refit` CLI binary installed with this package, or None (a build tree's package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "refit")
    return path if os.access(path, os.X_OK) else None


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    path = cli_path()
    if path is None:
        sys.stderr.write("refit: this refit package has no CLI binary (refit/bin/refit); install "
                         "it with `python3 -m pip install .` from a refit checkout, or run "
                         "build/src/refit of a build tree\n")
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(path, [path] + args)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
