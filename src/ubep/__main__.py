"""``python -m ubep``: the same command line as the ``ubep`` console script (:mod:`ubep.cli`)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
