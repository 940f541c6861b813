"""``benchmarks/gpu_check.py`` imports and says plainly, on a machine without a CUDA GPU, that
it ran nothing; its table computes the ratios it states."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from benchmarks import gpu_check


def test_says_no_gpu_and_runs_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the script runs for real there")
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU" in out or "not installed" in out


def test_table_ratios_are_medians_over_the_floor() -> None:
    res = {"times": {"dispatch": [30.0, 10.0, 20.0], "combine": [8.0, 8.0, 9.0]},
           "floor": {"dispatch": [4.0, 5.0, 6.0], "combine": [2.0, 2.0, 3.0]},
           "bytes": {"dispatch": 1024, "combine": 512}}
    args = argparse.Namespace(ranks=2, sync="tff", tokens=4, hidden=8, repeats=3)
    lines = gpu_check._table(res, args, "test device").splitlines()
    row = {ln.split()[0]: ln.split() for ln in lines if ln.split()[0] in ("dispatch", "combine")}
    assert float(row["dispatch"][-1]) == pytest.approx(np.median([30, 10, 20]) / 5.0, abs=0.01)
    assert float(row["combine"][-1]) == pytest.approx(8.0 / 2.0, abs=0.01)
    assert row["dispatch"][1] == "1024" and float(row["dispatch"][2]) == 10.0
