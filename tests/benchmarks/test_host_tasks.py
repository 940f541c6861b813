"""benchmarks/host_tasks.py: the host model's task-by-task timeline of a call, computed by hand
on a two-rank exchange of one row each (no timing measured)."""

from __future__ import annotations

import numpy as np
import pytest

# benchmarks/ is a top-level folder, not an installed package (see test_peers.py)
from benchmarks.host_tasks import predicted_tasks
from ubep.sim.host import HostCase

WRITE_NS, READ_NS, FLAG_NS, FIXED_NS = 700.0, 300.0, 2_000.0, 10_000.0


def _timer(writer: str, reader: str, terms: int) -> tuple[float, float]:
    return (0.0 if writer == "tail" else WRITE_NS), READ_NS


@pytest.mark.parametrize("sync", ["sp", "tff"])
def test_predicted_wait_is_the_flight_of_the_peer_row(sync: str) -> None:
    # Each rank sends its one token (top-1) to the other rank's expert: one peer row each, one
    # core a rank. The core's init is the call's fixed cost, it writes the row (WRITE_NS),
    # then waits for the peer's row to land one flag latency after the peer wrote it, then
    # reads it (READ_NS). So per rank: send 700 ns, wait 2000 ns, reorder 300 ns.
    case = HostCase(ranks=2, tokens=1, hidden=64, itemsize=2, layout="expert", engine="asp",
                    sync=sync, op="dispatch", num_experts=2, num_topk=1)
    idxs = [np.array([[1]]), np.array([[0]])]
    got = predicted_tasks(case, idxs, fixed_ns=FIXED_NS, flag_oneway_ns=FLAG_NS, timer=_timer)
    assert got["init"] == pytest.approx(FIXED_NS)
    assert got["send"] == pytest.approx(WRITE_NS)
    assert got["wait"] == pytest.approx(FLAG_NS, abs=1e-3)
    assert got["reorder"] == pytest.approx(READ_NS, abs=1e-3)
