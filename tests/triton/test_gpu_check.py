"""``benchmarks/gpu_check.py`` imports and says plainly, on a machine without a CUDA GPU, that
it skipped the device parts; its table computes the ratios it states; its door checks
(``ubep.Buffer`` and ``deep_ep.Buffer`` with ``transport="triton"``) pass on CPU tensors under
Triton's interpreter."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

import ubep
from benchmarks import gpu_check
from tests.triton.conftest import needs_triton


def test_says_no_gpu_and_runs_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the script runs for real there")
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU" in out or "not installed" in out


def test_table_ratios_are_medians_over_the_floor() -> None:
    res = {"times": {"ubep.Buffer": {"dispatch": [30.0, 10.0, 20.0], "combine": [8.0, 8.0, 9.0]},
                     "deep_ep.Buffer": {"dispatch": [12.0, 11.0, 40.0],
                                        "combine": [6.0, 7.0, 5.0]}},
           "floor": {"dispatch": [4.0, 5.0, 6.0], "combine": [2.0, 2.0, 3.0]},
           "bytes": {"dispatch": 1024, "combine": 512}}
    args = argparse.Namespace(ranks=2, sync="tff", tokens=4, hidden=8, repeats=3)
    lines = gpu_check._table(res, args, "test device").splitlines()
    rows: dict[str, dict[str, list[str]]] = {}
    door = ""
    for ln in lines:
        if ln.endswith(":") and ln[:-1] in res["times"]:
            door = ln[:-1]
        elif ln.split()[0] in ("dispatch", "combine"):
            rows.setdefault(door, {})[ln.split()[0]] = ln.split()
    own, facade = rows["ubep.Buffer"], rows["deep_ep.Buffer"]
    assert float(own["dispatch"][-1]) == pytest.approx(np.median([30, 10, 20]) / 5.0, abs=0.01)
    assert float(own["combine"][-1]) == pytest.approx(8.0 / 2.0, abs=0.01)
    assert float(facade["dispatch"][-1]) == pytest.approx(12.0 / 5.0, abs=0.01)
    assert own["dispatch"][1] == "1024" and float(own["dispatch"][2]) == 10.0


@needs_triton
def test_door_checks_pass_on_cpu_tensors() -> None:
    results = ubep.launch(gpu_check.door_checks, 2, "cpu", "tff", 64, timeout_s=600)
    errors = [e for rank in results for e in rank]
    assert not errors, "\n".join(errors)
