"""Runtime vs reference, bit for bit: engine x sync x layout x dtype x ranks x hidden x routing.

The axes are covered pairwise (every pair of values of any two axes appears in some case), and
every case runs several calls on one Buffer: full batches, 0 tokens on rank 0, all tokens to one
expert, both combine paths (copy-in and zero-copy via ``get_combine_buffer``). Multi-core runs
(the ``ubep.sched`` Plan driving several send cores, as threads or all on one thread) are checked
separately.
"""

from __future__ import annotations

import itertools

import pytest

from tests._runtime_support import AXES, Case, pairwise_cases, run_case
from ubep.modes import LAYOUTS, POLICIES
from ubep.runtime import launch

CASES = pairwise_cases()


def _steps(case: Case, max_tokens: int) -> list[tuple[list[int], str]]:
    R = case.ranks
    return [
        ([max_tokens] * R, case.routing),
        ([0] + [max_tokens // 2] * (R - 1), case.routing),
        ([max_tokens // 3] * R, "one"),
        ([max_tokens - 1] * R, case.routing),
    ]


def _worker_matrix(group: object, cases: list[Case]) -> list[str]:
    errors: list[str] = []
    for i, case in enumerate(cases):
        max_tokens = 24 if case.hidden > 4096 else 40
        errors += run_case(group, case, max_tokens=max_tokens, steps=_steps(case, max_tokens),
                           seed=i, zero_copy=bool(i % 2))
    return errors


def test_pairwise_cover_is_complete() -> None:
    names = list(AXES)
    for a, b in itertools.combinations(names, 2):
        for va, vb in itertools.product(AXES[a], AXES[b]):
            if {a, b} == {"sync", "dtype"} and "sp" in (va, vb) and {va, vb} & {"int8", "uint8"}:
                continue  # SP refuses 1-byte payloads
            assert any(getattr(c, a) == va and getattr(c, b) == vb for c in CASES), (a, va, b, vb)


@pytest.mark.parametrize("ranks", [2, 4])
def test_matrix_bit_exact(ranks: int) -> None:
    cases = [c for c in CASES if c.ranks == ranks]
    results = launch(_worker_matrix, ranks, cases, timeout_s=600)
    errors = [e for r in results for e in r]
    assert not errors, "\n".join(errors[:20])


def _worker_cores(group: object, variants: list[tuple[Case, dict[str, object]]]) -> list[str]:
    errors: list[str] = []
    for i, (case, extra) in enumerate(variants):
        steps = [([32, 32], case.routing), ([0, 17], case.routing), ([20, 20], "one")]
        errors += [f"{extra}: {e}" for e in run_case(
            group, case, max_tokens=32, steps=steps, seed=100 + i, zero_copy=bool(i % 2),
            **extra)]
    return errors


def test_multicore_plans_bit_exact() -> None:
    """Several cores per rank: ASP send cores follow the ubep.sched Plan of every policy;
    BSP splits each phase over the cores and its barrier counts every core."""
    variants = []
    for policy, threads, layout in itertools.product(
        POLICIES, (True, False), LAYOUTS
    ):
        case = Case("asp", "dc" if threads else "sp", layout, "bf16", 2, 2048, "hot")
        variants.append((case, {"num_cores": 3, "policy": policy, "threads": threads}))
    variants.append((Case("bsp", "tff", "expert", "fp16", 2, 2048, "uniform"),
                     {"num_cores": 2, "threads": True}))
    variants.append((Case("bsp", "sw", "rank", "fp32", 2, 2048, "uniform"),
                     {"num_cores": 3, "threads": False}))
    results = launch(_worker_cores, 2, variants, timeout_s=600)
    errors = [e for r in results for e in r]
    assert not errors, "\n".join(errors[:20])
