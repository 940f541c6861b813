"""``python -m benchmarks.peers`` (benchmarks/peers/cli.py)."""

import sys

from benchmarks.peers.cli import main

sys.exit(main())
