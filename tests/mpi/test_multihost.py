"""ubep.mpi across namespaced hosts (tests/mpi/netns.py): each host its own network stack,
``/dev/shm`` and hostname, joined by veth links on a bridge; ``mpiexec`` starts the ranks
through a launch agent as it would over ssh.

* every engine x sync x layout (``python -m ubep.tools.mpi_selftest``; SP refused across
  hosts) on 2 hosts x 2 ranks and 3 hosts x 1, bit-exact against ``ubep.reference``;
* the topology ubep derives from where the ranks run (hop 1 inside a host, 2 across), the one
  the hierarchical scheduler is given;
* ``sync="sp"`` refused across hosts, naming ``sync``;
* a trace of a job whose second host's monotonic clock runs 1000 s ahead (a time namespace)
  puts every rank on rank 0's clock: each call overlaps on every rank, and a send starts before
  the receive of its rows on another host ends;
* after every job, nothing in any host's ``/dev/shm`` and no namespace or link of the bed once
  it is torn down.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.mpi.multihost import MakeBed, no_shm_left, run_job

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(("hosts", "per_host"), [(2, 2), (3, 1)])
def test_every_mode_bit_exact_across_namespaced_hosts(
        make_bed: MakeBed, tmp_path: Path, hosts: int,
        per_host: int) -> None:
    bed = make_bed(hosts)
    out = tmp_path / "selftest.json"
    code, output = run_job(bed, per_host, ["-m", "ubep.tools.mpi_selftest", "--faults",
                                           "--json", str(out)], timeout_s=240)
    assert code == 0, output[-4000:]
    every = json.loads(out.read_text())
    assert len(every) == hosts * per_host
    for rank, findings in enumerate(every):
        assert findings["hosts"] == hosts and findings["ranks_per_host"] == per_host, findings
        assert len(findings["modes"]) == 12  # 16 engine x sync x layout less SP's 4
        assert findings["errors"] == [], (rank, findings["errors"])
    assert not any(":sp:" in m for m in every[0]["modes"])
    no_shm_left(bed)


def test_topology_is_two_tiers_from_where_the_ranks_run(
        make_bed: MakeBed, tmp_path: Path) -> None:
    bed = make_bed(2)
    out = tmp_path / "topology.json"
    code, output = run_job(bed, 2, ["-m", "tests.mpi.test_mpi", "_worker_topology", str(out)])
    assert code == 0, output[-4000:]
    host_of = [0, 0, 1, 1]  # mpiexec placed ranks host by host (ppr:2:node)
    hops = [[0 if a == b else (1 if host_of[a] == host_of[b] else 2) for b in range(4)]
            for a in range(4)]
    for rank, got in enumerate(json.loads(out.read_text())):
        assert got["hosts"] == 2
        assert got["host_of"] == host_of
        assert got["hops"] == hops
        assert got["same_host"] == [host_of[q] == host_of[rank] for q in range(4)]
    no_shm_left(bed)


def test_sp_is_refused_across_namespaced_hosts(
        make_bed: MakeBed, tmp_path: Path) -> None:
    bed = make_bed(2)
    out = tmp_path / "sp.json"
    code, output = run_job(bed, 1, ["-m", "tests.mpi.test_mpi", "_worker_sp_refused", str(out)])
    assert code == 0, output[-4000:]
    every = json.loads(out.read_text())
    for got in every:
        assert got["outcome"].startswith("sync: SP cannot run across hosts"), got
    assert [got["rows"] for got in every] == [16, 0]  # the DC Buffer after it works
    no_shm_left(bed)


_CLOCK_AHEAD_S = 1000
_ALIGN_SLACK_NS = 2_000_000  # the measured offsets are good to half a round trip (microseconds)


def test_a_trace_across_hosts_with_their_own_clocks_is_on_one_clock(
        make_bed: MakeBed, tmp_path: Path) -> None:
    from ubep.trace import load

    bed = make_bed(2, monotonic_offsets_s=[0, _CLOCK_AHEAD_S])
    code, output = run_job(bed, 2, ["-m", "tests.mpi._trace_worker", str(tmp_path)])
    assert code == 0, output[-4000:]
    ranks = json.loads((tmp_path / "ranks.json").read_text())
    assert all(not r["errors"] for r in ranks), ranks  # every call bit-exact
    ahead = (ranks[2]["monotonic_ns"] - ranks[0]["monotonic_ns"]) / 1e9
    assert abs(ahead - _CLOCK_AHEAD_S) < 60, ahead  # the hosts' clocks really differ
    (trace,) = load(tmp_path / "step.json")
    assert trace.ranks() == [0, 1, 2, 3]
    assert not list(tmp_path.glob("step.rank*.json"))
    calls: dict[tuple[str, int], list[Any]] = {}
    for r in range(4):
        mine = sorted((c for c in trace.calls if c.rank == r), key=lambda c: c.start_ns)
        for name in ("dispatch", "combine"):
            for k, c in enumerate(c for c in mine if c.name == name):
                calls.setdefault((name, k), []).append(c)
    assert sorted(calls) == [("combine", 0), ("combine", 1), ("dispatch", 0), ("dispatch", 1)]
    for every in calls.values():
        # a call ends on no rank before it started on every rank: each rank takes a count
        # record from every peer's same call
        assert len(every) == 4
        assert max(c.start_ns for c in every) <= min(c.end_ns for c in every) + _ALIGN_SLACK_NS
    # one clock: a dispatch's send to another host starts before the wait that took its rows
    # (the peer's wait for this source in the same call) ends; both ways, so a host ahead or
    # behind fails it
    checked = 0
    for key, every in calls.items():
        if key[0] != "dispatch":
            continue
        inside = {c.rank: c for c in every}
        for s in trace.spans:
            c = inside[s.rank]
            if not (s.task == "send" and s.rows and c.start_ns <= s.start_ns <= c.end_ns):
                continue
            peer = inside[s.peer]
            ends = [q.end_ns for q in trace.spans if q.rank == s.peer and q.task == "wait"
                    and q.peer == s.rank and peer.start_ns <= q.start_ns <= peer.end_ns]
            assert ends and max(ends) + _ALIGN_SLACK_NS >= s.start_ns, (s, ends)
            checked += (s.rank < 2) != (s.peer < 2)
    assert checked >= 8  # each rank's sends to both ranks of the other host, both calls
    no_shm_left(bed)
