"""benchmarks/bench_decode_step.py: the bytes a rank sends against a per-token count, the phases
of a traced call against hand-computed stamps, and the report's ratios (no timing assertions)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from benchmarks import bench_decode_step as step
from benchmarks.harness import COMBINE_PHASES, DISPATCH_PHASES
from ubep.runtime.abi import TRACE


@pytest.mark.parametrize("ranks", [2, 4])
def test_bytes_per_rank_counts_each_token_once_per_destination_rank(ranks: int) -> None:
    shape = step.Shape(ranks, 256, 16)
    for rank in range(ranks):
        _, idx, _ = step._inputs(shape, rank)
        per_expert = step.EXPERTS // ranks
        rows = sum(len({int(e) // per_expert for e in token if e >= 0})
                   for token in idx.numpy())
        assert step.bytes_per_rank(shape, rank) == rows * 256 * 2


def _trace(d0: int, c0: int) -> list[int]:
    """A trace whose dispatch stamps start at ``d0`` (the native entry, then 1 us apart) and
    whose combine stamps start at ``c0`` (2 us apart)."""
    tr = [0] * TRACE["slots"]
    tr[TRACE["d_native"]] = d0
    for i in range(TRACE["d_enter"], TRACE["d_data_in"] + 1):
        tr[i] = d0 + 1_000 * (i - TRACE["d_enter"] + 1)
    tr[TRACE["c_native"]] = c0
    for i in range(TRACE["c_enter"], TRACE["c_reduced"] + 1):
        tr[i] = c0 + 2_000 * (i - TRACE["c_enter"] + 1)
    return tr


def test_phases_are_the_gaps_between_the_calls_stamps() -> None:
    # two calls; dispatch entered 500 ns after its start, left 3 us after its last stamp
    rows = []
    for base in (0, 100_000):
        t0, c2 = base, base + 50_000
        tr = _trace(t0 + 500, c2 + 700)
        t1 = tr[TRACE["d_data_in"]] + 3_000
        t3 = tr[TRACE["c_reduced"]] + 400
        rows.append([t0, t1, c2, t3, *tr])
    got = step._phases({"numpy": [], "trace:numpy": rows})["numpy"]
    assert list(got["dispatch"]) == list(DISPATCH_PHASES)
    want_d = [0.5, *([1.0] * (len(DISPATCH_PHASES) - 2)), 3.0]
    assert list(got["dispatch"].values()) == pytest.approx(want_d)
    want_c = [0.7, *([2.0] * (len(COMBINE_PHASES) - 2)), 0.4]
    assert list(got["combine"].values()) == pytest.approx(want_c)
    # the two calls are alike, so each phase's minimum is its median
    assert list(got["dispatch_min"].values()) == pytest.approx(want_d)
    assert list(got["combine_min"].values()) == pytest.approx(want_c)


def test_phase_minima_are_each_phases_own_minimum() -> None:
    # the second call's dispatch enters 2 us later and leaves 1 us sooner than the first's
    rows = []
    for entry, exit_ns in ((500, 3_000), (2_500, 2_000)):
        tr = _trace(entry, 50_000)
        rows.append([0, tr[TRACE["d_data_in"]] + exit_ns, 40_000,
                     tr[TRACE["c_reduced"]] + 100, *tr])
    got = step._phases({"trace:torch": rows})["torch"]["dispatch_min"]
    assert got["py_in"] == pytest.approx(0.5) and got["py_out"] == pytest.approx(2.0)


def test_report_ratios_are_medians_over_the_numpy_buffer_and_the_floor() -> None:
    def stats(med: float) -> dict[str, float]:
        return {"min_us": med / 2, "median_us": med, "max_us": med * 2, "repeats": 3}

    row: dict[str, object] = {"ranks": 2, "hidden": 2048, "tokens": 16, "bytes_per_rank": 1024,
                              "phases": {}}
    for i, name in enumerate(step.PATHS):
        row[name] = {"dispatch": stats(10.0 * (i + 1)), "combine": stats(5.0 * (i + 1))}
    row["floor"] = {"dispatch": stats(2.0), "combine": stats(4.0)}
    row["numpy"] = {"dispatch": stats(10.0), "combine": stats(5.0)}
    row["torch"] = {"dispatch": stats(20.0), "combine": stats(10.0)}
    text = step.report({"rows": [row]})
    line = next(ln for ln in text.splitlines() if ln.split()[3:4] == ["torch"])
    cells = line.split()
    # d/numpy = 20/10, c/numpy = 10/5, d/floor = 20/2, c/floor = 10/4
    assert [float(c) for c in cells[-4:]] == pytest.approx([2.0, 2.0, 10.0, 2.5])
    assert np.isclose(float(cells[5]), 20.0)


def test_low_latency_paths_are_measured_against_the_padded_call_and_its_bytes() -> None:
    def stats(med: float) -> dict[str, float]:
        return {"min_us": med, "median_us": med, "max_us": med, "repeats": 1}

    row: dict[str, object] = {"ranks": 2, "hidden": 2048, "tokens": 16, "phases": {}}
    for name in step.PATHS:
        row[name] = {"dispatch": stats(100.0), "combine": stats(100.0)}
    row["numpy-ll"] = {"dispatch": stats(50.0), "combine": stats(25.0)}
    row["floor-ll"] = {"dispatch": stats(20.0), "combine": stats(10.0)}
    text = step.report({"rows": [row]})
    cells = next(ln for ln in text.splitlines() if ln.split()[3:4] == ["v1-ll"]).split()
    assert [float(c) for c in cells[-4:]] == pytest.approx([2.0, 4.0, 5.0, 10.0])
    cells = next(ln for ln in text.splitlines() if ln.split()[3:4] == ["v1"]).split()
    assert [float(c) for c in cells[-4:]] == pytest.approx([1.0, 1.0, 1.0, 1.0])


@pytest.mark.parametrize("ranks", [2, 4])
def test_low_latency_bytes_count_each_valid_pick(ranks: int) -> None:
    shape = step.Shape(ranks, 128, 16)
    for rank in range(ranks):
        _, idx, _ = step._inputs(shape, rank)
        picks = sum(1 for token in idx.numpy() for e in token if e >= 0)
        assert step.ll_bytes_per_rank(shape, rank) == picks * 128 * 2
