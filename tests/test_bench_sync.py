"""benchmarks/bench_sync.py: the rotated order and the paired ratio against brute force, and the
quick path's output structure (no timing assertions)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

# benchmarks/ is a top-level folder, not an installed package (see test_peers.py)
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_sync  # noqa: E402


def test_rotation_puts_every_mode_first_equally_often() -> None:
    modes = bench_sync.MODES
    orders = [bench_sync.rotation(i, modes) for i in range(4 * len(modes))]
    for order in orders:  # each iteration calls every mode once
        assert sorted(order) == sorted(modes)
    for position in range(len(modes)):  # and each mode sits in each position equally often
        counts = {m: sum(o[position] == m for o in orders) for m in modes}
        assert set(counts.values()) == {4}


def test_paired_ratio_is_the_median_of_per_iteration_ratios() -> None:
    rng = np.random.default_rng(3)
    sw = rng.uniform(10, 20, 101)
    drift = np.linspace(1.0, 3.0, 101)  # the host slows down: both modes alike
    times = {"sw": sw * drift, "sp": 1.07 * sw * drift}
    assert bench_sync.paired_ratio(times, "sp") == pytest.approx(1.07, rel=1e-12)
    # brute force: the middle of the sorted ratios
    ratios = sorted(times["sp"][i] / times["sw"][i] for i in range(101))
    assert bench_sync.paired_ratio(times, "sp") == pytest.approx(ratios[50], rel=1e-12)


def test_quick_run_rows() -> None:
    rows = bench_sync.run([2], [16384], warmup=1, iterations=3)
    assert {r["mode"] for r in rows} == {f"asp+{m}" for m in bench_sync.MODES}
    assert {r["layout"] for r in rows} == {"rank", "expert"}
    for r in rows:
        assert r["min_us"] <= r["median_us"] <= r["max_us"]
        if r["mode"] == "asp+sw":
            assert r["x_sw"] == 1.0
    assert "worst x_sw" in bench_sync.table(rows)
