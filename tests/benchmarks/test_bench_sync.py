"""benchmarks/bench_sync.py: the rotated order and the paired ratio against brute force, and the
quick path's output structure (no timing assertions)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

# benchmarks/ is a top-level folder, not an installed package (see test_peers.py)
from benchmarks import bench_sync


def test_call_order_mixes_positions_and_predecessors() -> None:
    modes = bench_sync.MODES
    orders = [bench_sync.call_order(i, modes) for i in range(1200)]
    assert orders[7] == bench_sync.call_order(7, modes)  # every rank computes the same order
    follows: dict[tuple[str, str], int] = {}
    for prev, order in itertools.pairwise(orders):
        assert sorted(order) == sorted(modes)  # each iteration calls every mode once
        chain = [prev[-1], *order]
        for a, b in itertools.pairwise(chain):
            follows[(a, b)] = follows.get((a, b), 0) + 1
    # each mode first about equally often (1200 / 4 = 300 each; binomial sd ~15)
    firsts = {m: sum(o[0] == m for o in orders) for m in modes}
    assert all(240 <= n <= 360 for n in firsts.values()), firsts
    # and each mode follows each other one (a rotation would give one predecessor only)
    for m in modes:
        before = {a: n for (a, b), n in follows.items() if b == m and a != m}
        assert set(before) == set(modes) - {m}, (m, before)
        assert min(before.values()) > 0.5 * max(before.values()), (m, before)


def test_paired_ratio_is_the_median_of_per_iteration_ratios() -> None:
    rng = np.random.default_rng(3)
    sw = rng.uniform(10, 20, 101)
    drift = np.linspace(1.0, 3.0, 101)  # the host slows down: both modes alike
    times = {"sw": sw * drift, "sp": 1.07 * sw * drift}
    assert bench_sync.paired_ratio(times, "sp") == pytest.approx(1.07, rel=1e-12)
    # brute force: the middle of the sorted ratios
    ratios = sorted(times["sp"][i] / times["sw"][i] for i in range(101))
    assert bench_sync.paired_ratio(times, "sp") == pytest.approx(ratios[50], rel=1e-12)


def test_round_ratios_are_each_rounds_paired_median() -> None:
    rng = np.random.default_rng(5)
    rounds = []
    for factor in (1.02, 1.30, 1.05):  # one round on slow pages
        sw = rng.uniform(10, 20, 41)
        rounds.append({"sw": sw, "sp": factor * sw})
    got = bench_sync.round_ratios(rounds, "sp")
    assert got == pytest.approx([1.02, 1.30, 1.05], rel=1e-12)
    assert float(np.median(got)) == pytest.approx(1.05, rel=1e-12)  # the slow round left out


def test_quick_run_rows() -> None:
    rows = bench_sync.run([2], [16384], warmup=1, iterations=4, rounds=2)
    assert {r["mode"] for r in rows} == {f"asp+{m}" for m in bench_sync.MODES}
    assert {r["layout"] for r in rows} == {"rank", "expert"}
    for r in rows:
        assert r["min_us"] <= r["median_us"] <= r["max_us"]
        assert len(r["x_sw_rounds"]) == 2
        assert min(r["x_sw_rounds"]) <= r["x_sw"] <= max(r["x_sw_rounds"])
        if r["mode"] == "asp+sw":
            assert r["x_sw"] == 1.0 and r["x_sw_rounds"] == [1.0, 1.0]
    assert "worst x_sw" in bench_sync.table(rows)
