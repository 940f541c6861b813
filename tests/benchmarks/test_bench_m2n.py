"""benchmarks/bench_m2n.py runs end to end with two repeats: the ubep cases and the MPI peer are
checked against ubep.reference inside it before anything is timed (a mismatch raises), and
the saved results hold every case (no timing assertions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_m2n


def test_bench_m2n_runs_checks_and_saves_every_case(tmp_path: Path) -> None:
    pytest.importorskip("mpi4py")
    bench_m2n.main(["--repeats", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "m2n.json").read_text())
    assert "mpi_peer" not in result, result.get("mpi_peer")  # the peer ran
    assert set(result["stats"]) == {
        "m2n dispatch + combine", "co-located dispatch+combine", "mpi alltoallv (same m2n)",
        "2 micro-batches back-to-back", "2 micro-batches pipelined", "memcpy floor"}
    assert result["dispatch_bytes_per_sender"] == 128 * 8 * 2048 * 2
