"""benchmarks/bench_step.py: spans, tails and the slowest rank's phases against hand-computed
values, the stand-in experts against a per-row loop, and the quick path's structure (no timing
assertions)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import bench_step as step
from benchmarks.harness import COMBINE_PHASES, DISPATCH_PHASES, trace_range
from ubep.runtime.abi import TRACE


def _trace(op: str, start: int, gaps: list[int]) -> dict[int, int]:
    """Trace slots of ``op``: the native call's entry at ``start``, then its task graph's
    stamps, consecutive ones ``gaps`` apart."""
    first, last = trace_range(op)
    slots = [TRACE["d_native" if op == "dispatch" else "c_native"], *range(first, last + 1)]
    assert len(gaps) == len(slots) - 1
    return {slot: start + sum(gaps[:i]) for i, slot in enumerate(slots)}


def test_spans_tails_and_the_slowest_ranks_phases() -> None:
    # 2 ranks, 1 step: rank 1 enters dispatch later and leaves it last; rank 0 leaves combine
    # last. Stamps are (t0, d0, d1, c0, c1) in ns.
    stamps = [(0, 100, 1_000, 2_000, 2_900), (50, 400, 1_200, 2_100, 2_800)]
    d_gaps = [5, 10, 20, 30, 40, 50, 60, 70]
    c_gaps = [3, 5, 10, 15, 20, 25]
    traces = []
    for r in range(2):
        tr = [0] * 16
        for slot, t in {**_trace("dispatch", stamps[r][1] + 100 + r, d_gaps),
                        **_trace("combine", stamps[r][3] + 50 + r, c_gaps)}.items():
            tr[slot] = t
        traces.append(tr)
    per_rank = [{"stamps": [stamps[r]], "traces": [traces[r]], "cold_copy_ns": [300 + 200 * r],
                 "cold_call_ns": [70 - 20 * r]} for r in range(2)]
    row = step._summarise(step.Case("qwen3-30b", 16, "uniform", "none", "asp"), per_rank, 1)
    assert row.dispatch_span.median_us == pytest.approx((1_200 - 100) / 1e3)
    assert row.dispatch_tail.median_us == pytest.approx((1_200 - 400) / 1e3)
    assert row.combine_span.median_us == pytest.approx((2_900 - 2_000) / 1e3)
    assert row.combine_tail.median_us == pytest.approx((2_900 - 2_100) / 1e3)
    assert row.experts_skew.median_us == pytest.approx((2_100 - 2_000) / 1e3)
    assert row.cold_copy.median_us == pytest.approx(500 / 1e3)  # the slower rank's copy
    assert row.cold_call.median_us == pytest.approx(70 / 1e3)  # the slower rank's call
    assert row.step.median_us == pytest.approx(2_900 / 1e3)
    assert row.comm_share == pytest.approx((1_100 + 900) / 2_900)
    # dispatch phases are rank 1's (it left last): entry gap 101, the trace gaps, then exit
    d_end = 400 + 101 + sum(d_gaps)
    expect_d = [101, *d_gaps, 1_200 - d_end]
    assert list(row.dispatch_phases) == list(DISPATCH_PHASES)
    assert [s.median_us for s in row.dispatch_phases.values()] == pytest.approx(
        [v / 1e3 for v in expect_d])
    # entry and exit: py_in (the gap to the native call), args (its first trace gap), py_out
    assert row.dispatch_entry_exit is not None
    assert row.dispatch_entry_exit.median_us == pytest.approx(
        (101 + d_gaps[0] + expect_d[-1]) / 1e3)
    # combine phases are rank 0's
    c_end = 2_000 + 50 + sum(c_gaps)
    expect_c = [50, *c_gaps, 2_900 - c_end]
    assert list(row.combine_phases) == list(COMBINE_PHASES)
    assert [s.median_us for s in row.combine_phases.values()] == pytest.approx(
        [v / 1e3 for v in expect_c])
    assert row.combine_entry_exit is not None
    assert row.combine_entry_exit.median_us == pytest.approx(
        (50 + c_gaps[0] + expect_c[-1]) / 1e3)


def test_untraced_ops_have_no_phases() -> None:
    per_rank = [{"stamps": [(0, 1, 2, 3, 4)], "traces": [[0] * 16], "cold_copy_ns": [1],
                 "cold_call_ns": [1]} for _ in range(2)]
    row = step._summarise(step.Case("qwen3-30b", 1, "uniform", "none", "bsp"), per_rank, 1)
    assert row.dispatch_phases == {} and row.combine_phases == {}
    assert row.dispatch_entry_exit is None and row.combine_entry_exit is None


def test_experts_are_each_rows_ffn() -> None:
    rng = np.random.default_rng(0)
    hidden, inter = 16, 8
    w_up = rng.standard_normal((hidden, inter), dtype=np.float32)
    w_down = rng.standard_normal((inter, hidden), dtype=np.float32)
    x = (rng.standard_normal((7, hidden), dtype=np.float32).view(np.uint32) >> 16).astype(
        np.uint16)
    got = step._experts(x, [3, 0, 4], w_up, w_down)
    as_f64 = (got.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    for i in range(7):  # row by row in float64: the same FFN; BF16 keeps 8 bits of mantissa
        f = (x[i].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        h = f @ w_up.astype(np.float64)
        want = (h / (1.0 + np.exp(-h))) @ w_down.astype(np.float64)
        assert as_f64[i] == pytest.approx(want, rel=2**-6, abs=1e-4)


def test_quick_path_structure(tmp_path: Path) -> None:
    step.main(["--quick", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "step.json").read_text())
    cases = {(r["case"]["engine"], r["case"]["skew"]) for r in data["rows"]}
    assert cases == {(e, s) for e in ("asp", "bsp") for s in step.SKEWS}
    for r in data["rows"]:
        assert r["bytes_per_rank"] == 16 * 8 * 2048 * 2
        for key in ("step", "dispatch_span", "dispatch_tail", "combine_span", "combine_tail"):
            s = r[key]
            assert 0 < s["min_us"] <= s["median_us"] <= s["p99_us"]
        assert r["dispatch_tail"]["median_us"] <= r["dispatch_span"]["median_us"]
        assert set(r["combine_phases"]) == set(COMBINE_PHASES)
        assert set(r["dispatch_phases"]) == set(DISPATCH_PHASES)  # both engines trace
        assert r["cold_copy"]["min_us"] > 0 and r["cold_call"]["min_us"] > 0
        for key in ("dispatch_entry_exit", "combine_entry_exit"):  # sums of three phases
            phases = r[key.split("_")[0] + "_phases"]
            assert r[key]["min_us"] >= sum(phases[n]["min_us"] for n in step.ENTRY_EXIT) - 1e-6
    text = (tmp_path / "step.txt").read_text()
    assert "phases of the slowest rank" in text and "against the cold call" in text
