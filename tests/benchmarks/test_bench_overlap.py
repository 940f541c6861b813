"""benchmarks/bench_overlap.py and ``python -m benchmarks.torch_decode --overlap``: the
two-batch overlap schedule gives the serial schedule's outputs bit for bit, and both equal the
step run on ``ubep.reference`` (no timing assertions). The decode benchmark's ``--overlap`` rows
run in test_torch_runtime.py's decode test (one launch of the model for all its rows)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# benchmarks/ is a top-level folder, not an installed package (see test_peers.py)
from benchmarks import bench_overlap as bench
from benchmarks.torch_decode import TwoBatch

WIDTH = 16  # the smallest attention width: no calibration


def test_model_arithmetic_is_exact() -> None:
    lw = bench.make_weights(1, WIDTH)[0]
    h = bench.initial_state(16, 0, 0)
    assert set(np.unique(h)) <= set(range(-4, 5))
    a = bench.attention(h, lw)
    # the closed form in float64 (exact for these integers): (h + (h@Wq mod 4)@Wo) mod 8 - 4
    q = h.astype(np.float64) @ lw.wq
    want = np.mod(h + np.mod(q, 4) @ lw.wo, 8) - 4
    assert np.array_equal(a, want) and a.dtype == np.float32
    assert np.array_equal(bench.attention(h, lw, repeats=3), a)  # skew: more time, same values
    x, idx, w = bench.route(a, lw)
    assert np.array_equal(bench.from_bf16(x), a)  # small integers are exact in BF16
    logits = a.astype(np.float64) @ lw.wg
    for t in range(len(a)):  # top-8 by brute force: ties go to the lower expert id
        order = sorted(range(bench.NUM_EXPERTS), key=lambda e, t=t: (-logits[t, e], e))
        assert idx[t].tolist() == order[:bench.NUM_TOPK]
    assert np.allclose(w.sum(axis=1), 1.0, atol=1e-6) and (np.diff(w, axis=1) <= 0).all()
    rows = bench.experts(x[:4], np.array([0, 1, 2, 3]))
    assert np.array_equal(bench.from_bf16(rows), a[:4] * np.array([[1], [-1], [1], [-1]]))


def _worker(group: Any, skew: str, layers: int) -> dict[str, list[np.ndarray]]:
    from ubep.buffer import Buffer

    with Buffer(group, bench._config(16, "asp", "sp")) as buf:
        step = bench._Step(buf, group.rank, bench.Case(16, skew, layers),
                           bench.make_weights(layers, WIDTH))
        return {"recorded": step.expected, "serial": step.serial(), "overlap": step.overlap(),
                "overlap_x": step.overlap_x(), "compute": step.compute()}


@pytest.mark.parametrize("skew", ["experts"])
def test_overlap_equals_serial_and_reference(skew: str) -> None:
    from ubep.runtime import launch

    layers = 2  # the cross-layer hand-over (combine hooks before the next attention) runs once
    got = launch(_worker, bench.NUM_RANKS, skew, layers, timeout_s=120)
    want = bench.reference_step(16, bench.make_weights(layers, WIDTH))
    for rank, out in enumerate(got):
        for name, hs in out.items():
            assert len(hs) == 2
            for micro, (h, ref) in enumerate(zip(hs, want[rank], strict=True)):
                assert np.array_equal(h, ref), f"rank {rank} {name} micro-batch {micro}"
        # the micro-batches and ranks really differ: equality above is not vacuous
        assert not np.array_equal(out["overlap"][0], out["overlap"][1])
    assert not np.array_equal(got[0]["overlap"][0], got[1]["overlap"][0])


def test_quick_path_structure(tmp_path: Path) -> None:
    argv = ["--tokens", "16", "--layers", "1", "--width", str(WIDTH), "--skews", "none",
            "--repeats", "2", "--rounds", "1", "--warmup", "0", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    data = json.loads((tmp_path / "overlap.json").read_text())
    assert data["oracle_ok"] and (tmp_path / "overlap.png").stat().st_size > 0
    (row,) = data["rows"]
    assert row["exact_vs_reference"] and row["mismatches"] == {s: 0 for s in bench.SCHEDULES}
    assert row["width"] == WIDTH and data["calibration"] == []
    for s in bench.SCHEDULES:
        assert row[s]["repeats"] == 2 and 0 < row[s]["min_us"] <= row[s]["median_us"]
    for stat in bench.STATS:
        d = row[stat]
        assert d["floor_us"] == max(row["compute"][f"{stat}_us"], row["comm"][f"{stat}_us"])
        assert d["hidden_us"] == pytest.approx(
            row["serial"][f"{stat}_us"] - row["overlap"][f"{stat}_us"])
    assert "ovl/floor" in (tmp_path / "overlap.txt").read_text()


def test_two_batch_hands_over_at_switch_points_only() -> None:
    two = TwoBatch(timeout_s=10.0)
    log: list[str] = []

    def micro(name: str, parts: int) -> str:
        for i in range(parts):
            log.append(f"{name}{i}")
            two.switch()
        return name

    # B has one more part than A: once A is done, B's switches return at once
    assert two.run(lambda: micro("a", 2), lambda: micro("b", 3)) == ["a", "b"]
    assert log == ["a0", "b0", "a1", "b1", "b2"]

    def fails() -> None:
        two.switch()
        raise KeyError("from B")

    with pytest.raises(KeyError, match="from B"):
        two.run(lambda: micro("a", 2), fails)
    with pytest.raises(RuntimeError, match="outside"):
        two.switch()


def test_decode_overlap_refuses_an_odd_batch() -> None:
    from benchmarks.torch_decode import DecodeConfig, run_decode

    with pytest.raises(ValueError, match="even batch"):
        run_decode(DecodeConfig(batch=3), ("ubep-tbo",))
