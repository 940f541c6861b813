"""The Triton engine under Triton's interpreter, ranks as processes: every sync mode and
layout, bit for bit against ``ubep.reference`` (dispatch results, combine), and a launch's
programs run in any order."""

from __future__ import annotations

import itertools

import pytest

import ubep
from ubep.modes import LAYOUTS, SYNCS, dtypes_for

from ._ranks import Case, run_cases
from .conftest import needs_triton

pytestmark = needs_triton

_ROTATION = ("bf16", "fp32", "uint8", "fp16", "int8")


def _rotated() -> list[Case]:
    """Every sync x layout, the payload type taken in turn (SP: float types only)."""
    out, turn = [], itertools.cycle(_ROTATION)
    for sync, layout in itertools.product(SYNCS, LAYOUTS):
        dtype = next(turn)
        while dtype not in dtypes_for(sync):
            dtype = next(turn)
        out.append(Case(sync, layout, dtype))
    return out


def _assert_clean(results: list[list[str]]) -> None:
    errors = [e for rank in results for e in rank]
    assert not errors, "\n".join(errors)


def test_every_sync_and_layout_two_ranks() -> None:
    _assert_clean(ubep.launch(run_cases, 2, _rotated(), 1, timeout_s=600))


def test_four_ranks() -> None:
    """One case at 4 ranks (the matrix runs every mode at 4)."""
    _assert_clean(ubep.launch(run_cases, 4, [Case("tff", "expert", "bf16")], 2, None, 2,
                              timeout_s=600))


def test_programs_progress_in_any_order() -> None:
    """Every launch's programs run in reversed (first case) or shuffled (second) order; the
    interpreter runs them one after another, so a program that waited on a later one of its
    launch would time out: no program does, and the calls are exact."""
    cases = [Case("sw", "expert", "fp32"), Case("sp", "rank", "bf16")]
    _assert_clean(ubep.launch(run_cases, 2, cases, 3, "mixed", 2, timeout_s=600))


def _matrix() -> list[tuple[int, Case]]:
    return [(ranks, Case(s, lay, d)) for ranks in (2, 4) for s in SYNCS for lay in LAYOUTS
            for d in dtypes_for(s)]


@pytest.mark.matrix
@pytest.mark.parametrize(("ranks", "case"), _matrix(), ids=lambda v: str(v))
def test_matrix(ranks: int, case: Case) -> None:
    _assert_clean(ubep.launch(run_cases, ranks, [case], 4, timeout_s=600))
