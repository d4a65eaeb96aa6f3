"""`python -m refit ...`: the refit CLI (see refit._cli)."""

import sys

from ._cli import main

sys.exit(main())
