"""The host's hop classes from ``/sys``: which ranks share a last-level cache, a package (socket),
a NUMA node.

Each rank runs on the CPUs of its affinity mask (``os.sched_getaffinity(0)``, exchanged by the
group at rendezvous). A rank is *in* a domain of a level when all its CPUs are: a rank pinned to
one core is in that core's LLC, package and NUMA node; an unpinned rank spans them all and is in
no domain below the whole host. Two ranks are one class apart per level they do not share, and
the classes, finest first, are::

    0  the same rank
    1  the same last-level cache        (cache/index*/ of the highest level: shared_cpu_list)
    2  the same package                 (cpu*/topology/physical_package_id)
    3  the same NUMA node               (node/node*/cpulist)
    4  the same host, nothing shared

Only the levels the placement actually distinguishes are kept. A level is dropped when

* no two ranks share a domain of it (every rank alone: it adds nothing to class 0), or every
  rank shares one (it adds nothing to the last class);
* it partitions the same ranks as a neighbouring level (LLC = package on a one-die socket; the
  kept class is named ``llc+package``);
* its domains are not consecutive ranks in blocks of one size, a multiple of the finer kept
  level's: :class:`ubep.topology.Topology` models classes as nested blocks of consecutive ranks
  (``domain_sizes``). Ranks placed round-robin over two sockets, say, give no package class: such
  pairs fall to the next coarser class that does hold, so a distance is overestimated, never
  underestimated;
* some rank is not inside one of its domains, or ``/sys`` does not say (a file missing,
  unreadable or malformed). ``/sys`` missing altogether gives one class, never an exception.

Levels are ordered by how many ranks their domains hold, so a NUMA node smaller than its
package (sub-NUMA clustering) comes before the package. With no level kept the result is
:func:`ubep.topology.host`, which is what this 2-core VM gives: one package, one NUMA node, one L3
shared by both cores, so every pair of ranks is one class (hop 1) apart, pinned or not.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable, Sequence

from .. import topology as topo

__all__ = [
    "LEVELS", "cpu_domains", "host_levels", "host_topology", "last_level_cache_bytes", "own_cpus",
    "parse_cpulist",
]

# Finest first, in the nominal order of the classes; the kept ones are re-sorted by domain size.
LEVELS = ("llc", "package", "numa")

_CPU_DIR = re.compile(r"cpu(\d+)$")
_NODE_DIR = re.compile(r"node(\d+)$")


def own_cpus() -> list[int] | None:
    """The CPUs this process may run on (its affinity mask), or ``None`` where the OS does not
    say; each rank publishes it at rendezvous for :func:`host_topology`."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    return None if getaffinity is None else sorted(getaffinity(0))


def parse_cpulist(text: str) -> set[int]:
    """The CPUs of a kernel cpulist (``"0-3,8,10-11"``); ``ValueError`` if it is malformed."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad cpulist range {part!r}")
        cpus.update(range(first, last + 1))
    return cpus


def cpu_domains(sysfs_root: str = "/sys") -> dict[str, dict[int, int]]:
    """For each of :data:`LEVELS`, the domain id of every CPU ``/sys`` describes (a CPU absent
    from a level's map is unknown there). Never raises for missing or malformed files."""
    cpu_root = os.path.join(sysfs_root, "devices", "system", "cpu")
    cpus = sorted(int(m.group(1)) for d in _listdir(cpu_root) if (m := _CPU_DIR.match(d)))
    llc: dict[int, int] = {}
    package: dict[int, int] = {}
    for cpu in cpus:
        here = os.path.join(cpu_root, f"cpu{cpu}")
        pkg = _read_int(os.path.join(here, "topology", "physical_package_id"))
        if pkg is not None:
            package[cpu] = pkg
        shared = _last_level_cache(os.path.join(here, "cache"))
        if shared is not None and cpu in shared:
            llc[cpu] = min(shared)  # the domain's id: its first CPU
    numa: dict[int, int] = {}
    node_root = os.path.join(sysfs_root, "devices", "system", "node")
    for d in _listdir(node_root):
        m = _NODE_DIR.match(d)
        text = _read(os.path.join(node_root, d, "cpulist")) if m else None
        if m is None or text is None:
            continue
        try:
            members = parse_cpulist(text)
        except ValueError:
            continue
        for cpu in members:
            numa[cpu] = int(m.group(1))
    return {"llc": llc, "package": package, "numa": numa}


def host_levels(
    cpu_sets: Sequence[Iterable[int] | None], sysfs_root: str = "/sys"
) -> tuple[tuple[str, int], ...]:
    """The levels kept for ranks running on ``cpu_sets`` (rank order; ``None``: unknown), finest
    first: ``(name, ranks per domain)`` each, names of levels that partition the ranks alike
    joined by ``+``. Empty when the host gives one class (see the module docstring)."""
    num_ranks = len(cpu_sets)
    sets = [None if s is None else frozenset(s) for s in cpu_sets]
    domains = cpu_domains(sysfs_root)
    sizes: dict[int, list[str]] = {}
    for level in LEVELS:
        size = _block_size([_rank_domain(s, domains[level]) for s in sets])
        if size is not None and 1 < size < num_ranks:
            sizes.setdefault(size, []).append(level)
    kept: list[tuple[str, int]] = []
    for size in sorted(sizes):
        if not kept or size % kept[-1][1] == 0:
            kept.append(("+".join(sizes[size]), size))
    return tuple(kept)


def host_topology(
    cpu_sets: Sequence[Iterable[int] | None],
    *,
    cores_per_rank: int | None = None,
    sysfs_root: str = "/sys",
) -> topo.Topology:
    """The :class:`ubep.topology.Topology` of ranks on this host running on ``cpu_sets``.

    Class 0 and the nearest class between ranks cost what :func:`ubep.topology.host` says
    (measured here); each farther class costs ``HOST_FARTHER_LATENCY_FACTOR`` times the one
    before (assumed, see ``ubep.topology``). With one class between ranks it *is*
    ``topology.host(len(cpu_sets), cores_per_rank)``.
    """
    num_ranks = len(cpu_sets)
    base = topo.host(num_ranks, cores_per_rank)
    levels = host_levels(cpu_sets, sysfs_root)
    if not levels:
        return base
    near = topo.HOST_LATENCY_NS[1]
    farther = tuple(near * topo.HOST_FARTHER_LATENCY_FACTOR ** (i + 1) for i in range(len(levels)))
    return topo.Topology(
        num_ranks=num_ranks,
        ranks_per_node=num_ranks,
        cores_per_rank=base.cores_per_rank,
        latency_ns=(topo.HOST_LATENCY_NS[0], near, *farther),
        bandwidth_gbps=(topo.HOST_BANDWIDTH_GBPS,) * (len(levels) + 2),
        domain_sizes=(1, *(size for _, size in levels)),
        name=f"host-{num_ranks}-" + "-".join(f"{name}{size}" for name, size in levels),
    )


def _rank_domain(cpus: frozenset[int] | None, domain_of: dict[int, int]) -> int | None:
    """The one domain all of a rank's CPUs are in, else ``None`` (spans several, or unknown)."""
    if not cpus or any(c not in domain_of for c in cpus):
        return None
    found = {domain_of[c] for c in cpus}
    return found.pop() if len(found) == 1 else None


def _block_size(domains: list[int | None]) -> int | None:
    """``s`` when ranks ``[k*s, (k+1)*s)`` share one domain for every ``k`` and no two blocks
    share one; ``None`` when the domains are not such blocks (or one is unknown)."""
    if not domains or any(d is None for d in domains):
        return None
    runs: list[tuple[int | None, int]] = []  # (domain, length) of maximal runs
    for d in domains:
        if runs and runs[-1][0] == d:
            runs[-1] = (d, runs[-1][1] + 1)
        else:
            runs.append((d, 1))
    lengths = {length for _, length in runs}
    distinct = len({d for d, _ in runs}) == len(runs)
    return lengths.pop() if len(lengths) == 1 and distinct else None


def _data_caches(cache_dir: str) -> list[str]:
    """This CPU's data and unified cache ``index*`` directories, highest level first."""
    found = []
    for index in glob.glob(os.path.join(glob.escape(cache_dir), "index*")):
        level = _read_int(os.path.join(index, "level"))
        kind = _read(os.path.join(index, "type"))
        if level is not None and kind is not None and kind.strip() != "Instruction":
            found.append((-level, index))
    return [index for _, index in sorted(found)]


def _last_level_cache(cache_dir: str) -> set[int] | None:
    """CPUs sharing this CPU's highest-level data or unified cache whose CPU list reads, or
    ``None`` if none does."""
    for index in _data_caches(cache_dir):
        text = _read(os.path.join(index, "shared_cpu_list"))
        try:
            if text is not None:
                return parse_cpulist(text)
        except ValueError:
            pass
    return None


_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)\s*$")


def last_level_cache_bytes(sysfs_root: str = "/sys") -> int | None:
    """Size of the highest-level cache (whose size reads) of the first CPU this process may run
    on: ``/sys``'s ``cache/index*/size``, e.g. ``32768K``; ``None`` if unknown. (glibc's
    ``sysconf(_SC_LEVEL3_CACHE_SIZE)`` reads CPUID, which on this VM reports 384 MiB: the whole
    package's L3, not the 32 MiB one this CPU shares.)"""
    cpus = own_cpus()
    cache_dir = os.path.join(sysfs_root, "devices", "system", "cpu",
                             f"cpu{min(cpus) if cpus else 0}", "cache")
    for index in _data_caches(cache_dir):
        m = _SIZE.match(_read(os.path.join(index, "size")) or "")
        if m:
            return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]
    return None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(path: str) -> int | None:
    text = _read(path)
    try:
        return None if text is None else int(text.strip())
    except ValueError:
        return None
