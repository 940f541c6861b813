"""examples/two_batch_overlap.py runs and agrees with ubep.reference (it checks itself: the
received FP8 rows against ubep.quant of the oracle's rows, the combine bit for bit)."""

from __future__ import annotations

from examples import two_batch_overlap as example
from ubep.runtime import launch


def test_two_batch_overlap_example_matches_the_reference() -> None:
    assert launch(example.run, example.RANKS, timeout_s=120) == [True] * example.RANKS
