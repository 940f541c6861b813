"""examples/two_batch_overlap.py runs and agrees with ubep.reference (it checks itself: the
received FP8 rows against ubep.quant of the oracle's rows, the combine bit for bit)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from ubep.runtime import launch

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")


def test_two_batch_overlap_example_matches_the_reference() -> None:
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)  # spawned ranks get the parent's sys.path
    example = importlib.import_module("two_batch_overlap")
    assert launch(example.run, example.RANKS, timeout_s=120) == [True] * example.RANKS
