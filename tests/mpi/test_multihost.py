"""ubep.mpi across namespaced hosts (tests/mpi/netns.py): each host its own network stack,
``/dev/shm`` and hostname, joined by veth links on a bridge; ``mpiexec`` starts the ranks
through a launch agent as it would over ssh.

* every engine x sync x layout (``python -m ubep.mpi.selftest``; SP refused across hosts) on
  2 hosts x 2 ranks and 3 hosts x 1, bit-exact against ``ubep.reference``;
* the topology ubep derives from where the ranks run (hop 1 inside a host, 2 across), the one
  the hierarchical scheduler is given;
* ``sync="sp"`` refused across hosts, naming ``sync``;
* after every job, nothing in any host's ``/dev/shm`` and no namespace or link of the bed once
  it is torn down.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.mpi.multihost import MakeBed, no_shm_left, run_job

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(("hosts", "per_host"), [(2, 2), (3, 1)])
def test_every_mode_bit_exact_across_namespaced_hosts(
        make_bed: MakeBed, tmp_path: Path, hosts: int,
        per_host: int) -> None:
    bed = make_bed(hosts)
    out = tmp_path / "selftest.json"
    code, output = run_job(bed, per_host, ["-m", "ubep.mpi.selftest", "--faults", "--json",
                                           str(out)], timeout_s=240)
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
