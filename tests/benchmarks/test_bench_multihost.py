"""bench_multihost's wire bytes (what its table states per system) against a brute force over
every token of every rank, and its report's columns."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest


def _brute(inp: Any, per_host: int, system: str) -> float:
    """Dispatch rows a rank sends to other hosts, mean over ranks, token by token."""
    from benchmarks.peers.workload import NUM_EXPERTS

    idxs = inp.topk_idxs
    local = NUM_EXPERTS // len(idxs)
    total = 0
    for r, idx in enumerate(idxs):
        for row in idx.tolist():
            ranks = [e // local for e in row if e >= 0]
            away = [q for q in ranks if q // per_host != r // per_host]
            if system == "mpi":
                total += len(away)
            elif system == "expert":
                total += len({q // per_host for q in away})
            else:
                total += len(set(away))
    return total / len(idxs)


@pytest.mark.parametrize(("ranks", "per_host", "routing"), [(4, 2, "uniform"), (4, 1, "hot"),
                                                             (8, 4, "hot")])
def test_wire_bytes_match_a_token_by_token_count(ranks: int, per_host: int,
                                                  routing: str) -> None:
    from benchmarks.bench_multihost import wire_bytes
    from benchmarks.peers.workload import Shape, make_inputs

    inp = make_inputs(Shape(ranks, 32, 256, "bf16", routing))
    for system in ("mpi", "expert", "rank"):
        rows = _brute(inp, per_host, system)
        assert wire_bytes(inp, per_host, system, "dispatch") == pytest.approx(rows * 256 * 2)
    # combine sends back what crossed: per pick (expert layout, Alltoallv), per (token, rank)
    assert wire_bytes(inp, per_host, "expert", "combine") == pytest.approx(
        _brute(inp, per_host, "mpi") * 256 * 2)
    assert wire_bytes(inp, per_host, "rank", "combine") == pytest.approx(
        _brute(inp, per_host, "rank") * 256 * 2)
    # one host: nothing crosses
    assert wire_bytes(inp, ranks, "mpi", "dispatch") == 0


def test_report_states_each_systems_wire_bytes() -> None:
    from benchmarks.bench_multihost import report

    times = {k: [1.0, 2.0, 3.0] for k in ("ubep_dispatch_ms", "ubep_combine_ms",
                                          "mpi_dispatch_ms", "mpi_combine_ms", "memcpy_ms")}
    row = {"hosts": 2, "ranks_per_host": 2, "shape": "4r 32t", "dispatch_bytes": 4096,
           "combine_bytes": 4096, "mpi_wire_dispatch_bytes": 2048,
           "mpi_wire_combine_bytes": 2048, "expert_wire_dispatch_bytes": 1024,
           "expert_wire_combine_bytes": 2048} | times
    text = report([row], "head")
    line = [ln for ln in text.splitlines() if ln.startswith("2x2 4r 32t")]
    assert len(line) == 1
    assert line[0].split()[5:7] == ["1/2", "2/2"]  # ubep's wire KiB d/c, then Alltoallv's
    assert np.isclose(float(line[0].split()[-4]), 1.0)  # ratio d: equal medians
