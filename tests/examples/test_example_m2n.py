"""examples/m2n_pingpong.py runs and agrees with ubep.reference given the same roles (it checks
itself: every micro-batch's received rows and combined output, bit for bit)."""

from __future__ import annotations

from examples import m2n_pingpong as example
from ubep.runtime import launch


def test_m2n_pingpong_example_matches_the_reference() -> None:
    assert launch(example.run, example.RANKS, timeout_s=120) == [True] * example.RANKS
