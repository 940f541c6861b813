"""``python -m benchmarks.soak`` (benchmarks/soak/cli.py)."""

import sys

from benchmarks.soak.cli import main

sys.exit(main())
