"""``python -m benchmarks.peers`` (benchmarks/peers/run.py)."""

import sys

from benchmarks.peers.run import main

sys.exit(main())
