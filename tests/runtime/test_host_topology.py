"""Host hop classes from /sys (ubep.runtime.host_topology) on fake /sys trees in tmp_path: every
expected hop matrix is a closed form of the rank numbers, written out independently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ubep import topology as topo
from ubep.runtime.host_topology import (
    cpu_domains,
    host_levels,
    host_topology,
    last_level_cache_bytes,
    own_cpus,
    parse_cpulist,
)


def _cpulist(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus) + "\n"


def fake_sys(root: Path, *, llc: list[list[int]], package: list[list[int]],
             numa: list[list[int]]) -> str:
    """A /sys tree: ``llc``/``package``/``numa`` list each domain's CPUs (domain id = index).
    Each CPU also gets a private L1d, L1i and L2, as real machines have."""
    cpu_root = root / "devices" / "system" / "cpu"
    for pkg_id, cpus in enumerate(package):
        for cpu in cpus:
            topo_dir = cpu_root / f"cpu{cpu}" / "topology"
            topo_dir.mkdir(parents=True)
            (topo_dir / "physical_package_id").write_text(f"{pkg_id}\n")
    for shared in llc:
        for cpu in shared:
            caches = [(1, "Data", [cpu]), (1, "Instruction", [cpu]), (2, "Unified", [cpu]),
                      (3, "Unified", shared)]
            for i, (level, kind, members) in enumerate(caches):
                index = cpu_root / f"cpu{cpu}" / "cache" / f"index{i}"
                index.mkdir(parents=True)
                (index / "level").write_text(f"{level}\n")
                (index / "type").write_text(f"{kind}\n")
                (index / "shared_cpu_list").write_text(_cpulist(members))
    for node_id, cpus in enumerate(numa):
        node = root / "devices" / "system" / "node" / f"node{node_id}"
        node.mkdir(parents=True)
        (node / "cpulist").write_text(_cpulist(cpus))
    return str(root)


def two_sockets_two_llcs(root: Path) -> str:
    """8 CPUs: 2 sockets (one NUMA node each) x 2 LLCs x 2 cores."""
    return fake_sys(root, llc=[[0, 1], [2, 3], [4, 5], [6, 7]],
                    package=[[0, 1, 2, 3], [4, 5, 6, 7]], numa=[[0, 1, 2, 3], [4, 5, 6, 7]])


def _closed_form(num_ranks: int, blocks: list[int]) -> np.ndarray:
    """hop(i, j) = 0 for i == j, else 1 + the number of ``blocks`` sizes that split i from j."""
    out = np.zeros((num_ranks, num_ranks), dtype=np.int8)
    for i in range(num_ranks):
        for j in range(num_ranks):
            if i != j:
                out[i, j] = 1 + sum(i // b != j // b for b in blocks)
    return out


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == set()
    for bad in ("3-1", "a", "1-", "-2"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


def test_cpu_domains_read_every_level(tmp_path: Path) -> None:
    got = cpu_domains(two_sockets_two_llcs(tmp_path))
    assert got["llc"] == {c: 2 * (c // 2) for c in range(8)}  # id: the LLC's first CPU
    assert got["package"] == {c: c // 4 for c in range(8)}
    assert got["numa"] == {c: c // 4 for c in range(8)}


def test_one_rank_per_core_gives_llc_then_socket_classes(tmp_path: Path) -> None:
    root = two_sockets_two_llcs(tmp_path)
    t = host_topology([{c} for c in range(8)], cores_per_rank=1, sysfs_root=root)
    assert host_levels([{c} for c in range(8)], root) == (("llc", 2), ("package+numa", 4))
    assert t.domain_sizes == (1, 2, 4)
    assert np.array_equal(t.hop_matrix(), _closed_form(8, [2, 4]))
    near, factor = topo.HOST_LATENCY_NS[1], topo.HOST_FARTHER_LATENCY_FACTOR
    assert t.latency_ns == (topo.HOST_LATENCY_NS[0], near, near * factor, near * factor**2)
    assert t.bandwidth_gbps == (topo.HOST_BANDWIDTH_GBPS,) * 4
    assert t.name == "host-8-llc2-package+numa4"


def test_one_rank_per_llc_drops_the_llc_class(tmp_path: Path) -> None:
    """No two ranks share an LLC: the nearest class between ranks is the socket."""
    root = two_sockets_two_llcs(tmp_path)
    t = host_topology([{0, 1}, {2, 3}, {4, 5}, {6, 7}], cores_per_rank=2, sysfs_root=root)
    assert t.domain_sizes == (1, 2)
    assert np.array_equal(t.hop_matrix(), _closed_form(4, [2]))
    far = topo.HOST_LATENCY_NS[1] * topo.HOST_FARTHER_LATENCY_FACTOR
    assert t.latency_ns == (*topo.HOST_LATENCY_NS, far)


def test_sub_numa_clusters_order_the_node_before_the_package(tmp_path: Path) -> None:
    """One socket split in two NUMA nodes, one LLC each: LLC and node partition alike, and the
    package holds every rank (no class of its own)."""
    root = fake_sys(tmp_path, llc=[[0, 1], [2, 3]], package=[[0, 1, 2, 3]],
                    numa=[[0, 1], [2, 3]])
    assert host_levels([{c} for c in range(4)], root) == (("llc+numa", 2),)
    t = host_topology([{c} for c in range(4)], cores_per_rank=1, sysfs_root=root)
    assert np.array_equal(t.hop_matrix(), _closed_form(4, [2]))


def test_unpinned_ranks_get_the_host_preset(tmp_path: Path) -> None:
    root = two_sockets_two_llcs(tmp_path)
    everything = set(range(8))
    assert host_topology([everything] * 4, sysfs_root=root) == topo.host(4)
    # A rank that spans sockets makes the level unusable for every rank.
    pinned_but_one = [{0}, {1}, {2}, {3}, {4}, {5}, {6}, {0, 7}]
    assert host_topology(pinned_but_one, cores_per_rank=1, sysfs_root=root) == topo.host(8, 1)


def test_round_robin_placement_falls_back_to_one_class(tmp_path: Path) -> None:
    """Ranks alternate sockets (0, 4, 1, 5, ...): no level is consecutive blocks, so every pair
    gets the coarsest class that holds for all of them."""
    root = two_sockets_two_llcs(tmp_path)
    cpus = [{0}, {4}, {1}, {5}, {2}, {6}, {3}, {7}]
    assert host_levels(cpus, root) == ()
    assert host_topology(cpus, cores_per_rank=1, sysfs_root=root) == topo.host(8, 1)


def test_unequal_blocks_drop_the_level(tmp_path: Path) -> None:
    """3 ranks on socket 0 and 1 on socket 1: the package partition has blocks of 3 and 1."""
    root = two_sockets_two_llcs(tmp_path)
    assert host_levels([{0}, {2}, {3}, {4}], root) == ()


def test_missing_or_garbled_sys_gives_one_class(tmp_path: Path) -> None:
    cpus = [{0}, {1}, {2}, {3}]
    assert host_topology(cpus, cores_per_rank=1, sysfs_root=str(tmp_path / "absent")) \
        == topo.host(4, 1)
    assert host_topology([None, None], cores_per_rank=1) == topo.host(2, 1)
    root = two_sockets_two_llcs(tmp_path)
    for cpu in range(8):  # garble every package id and every L3: only NUMA is left
        (tmp_path / f"devices/system/cpu/cpu{cpu}/topology/physical_package_id").write_text("x")
        (tmp_path / f"devices/system/cpu/cpu{cpu}/cache/index3/shared_cpu_list").write_text("9-")
    assert cpu_domains(root)["package"] == {}
    # the L2 (private) is now the highest readable level: one rank per core shares none
    assert host_levels([{c} for c in range(8)], root) == (("numa", 4),)
    (tmp_path / "devices/system/node/node1/cpulist").unlink()
    assert host_levels([{c} for c in range(8)], root) == ()  # CPUs 4-7 in no known node


def test_last_level_cache_size_is_the_highest_level_that_reads(tmp_path: Path) -> None:
    root = two_sockets_two_llcs(tmp_path)
    first = min(own_cpus() or [0])
    cache = tmp_path / f"devices/system/cpu/cpu{first}/cache"
    if not cache.exists():  # this process may run on CPUs the fake tree has not
        pytest.skip(f"the fake /sys has no cpu{first}")
    assert last_level_cache_bytes(root) is None  # no size files
    for i, size in enumerate(["48K", "32K", "2048K", "32768K"]):
        (cache / f"index{i}" / "size").write_text(size + "\n")
    assert last_level_cache_bytes(root) == 32 << 20
    (cache / "index3" / "size").write_text("a lot\n")  # unreadable: the L2 is the last that reads
    assert last_level_cache_bytes(root) == 2 << 20
    (cache / "index2" / "size").write_text("1M")
    assert last_level_cache_bytes(root) == 1 << 20
    assert last_level_cache_bytes(str(tmp_path / "absent")) is None


def test_this_host_has_one_class_between_ranks() -> None:
    """Whatever this machine is, a pair of ranks on one CPU each gets a valid topology; on the
    2-core VM the project runs on (one package, one node, one shared L3) it is the preset."""
    cpus = sorted(os.sched_getaffinity(0))
    pair = [{cpus[0]}, {cpus[-1]}]
    t = host_topology(pair, cores_per_rank=1)
    assert t.num_ranks == 2 and t.hop(0, 0) == 0 and t.hop(0, 1) >= 1
    if len(set(cpu_domains()["llc"].values())) <= 1:
        assert t == topo.host(2, 1)


_ENV_CHILD = """
import json, os, sys
import ubep.runtime.group as G
from ubep.runtime.host_topology import host_topology
rank = int(os.environ["UBEP_RANK"])
seen = []
G.own_cpus = lambda: [3 - rank]  # as if rank r were pinned to CPU 3 - r
def recording(cpu_sets):
    seen.append([list(s) for s in cpu_sets])
    return host_topology(cpu_sets, cores_per_rank=1, sysfs_root=sys.argv[1])
G.host_topology = recording
g = G.group_from_env()
print(json.dumps({"seen": seen, "hops": g.topology.hop_matrix().tolist()}))
g.close()
"""


def test_the_group_builds_its_topology_from_every_ranks_affinity(tmp_path: Path) -> None:
    """Two env-launched ranks publish their (faked) affinities at rendezvous; each builds the
    topology from both, in rank order."""
    root = two_sockets_two_llcs(tmp_path / "sys")
    rdv = tmp_path / "rdv"
    rdv.mkdir(mode=0o700)
    procs = [subprocess.Popen(
        [sys.executable, "-c", _ENV_CHILD, root], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=dict(os.environ, UBEP_RANK=str(r), UBEP_WORLD_SIZE="2",
                            UBEP_RENDEZVOUS=str(rdv)),
    ) for r in range(2)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    for out in outs:
        assert out["seen"] == [[[3], [2]]]  # one call, both ranks in rank order
        assert out["hops"] == [[0, 1], [1, 0]]  # CPUs 3 and 2 share an LLC: one class
