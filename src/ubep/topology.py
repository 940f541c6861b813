"""Fabric topology: ranks, cores and hop classes with their latency and bandwidth.

A rank is one process (one NPU die in the paper). Hop classes order the distance between two
ranks: hop 0 is the same rank, hop 1 the same node (one switch tier), hop 2 across the tier-2
switch, and so on for deeper fabrics. ``domain_sizes[h]`` is the number of consecutive ranks that
share hop class ``h`` or lower: two ranks are at hop ``h`` when ``h`` is the first class whose
domain holds both (the last class holds everything).

Constants of the presets come from docs/CALIBRATION.md; each cites its row.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidArgumentError

__all__ = ["Topology", "cm384", "host", "nvl72", "nvl576"]


@dataclass(frozen=True)
class Topology:
    """A fabric of ``num_ranks`` ranks with ``len(latency_ns)`` hop classes.

    Attributes:
        num_ranks: number of ranks (processes / NPU dies).
        ranks_per_node: ranks under one tier-1 switch (hop class 1 domain).
        cores_per_rank: worker cores per rank (AIVs in the paper, threads in the runtime).
        latency_ns: one-way memory access latency per hop class, ascending hop.
        bandwidth_gbps: per-rank bandwidth per hop class in GB/s (10^9 bytes per second).
        domain_sizes: ranks per domain for hop classes 0..H-2 (class H-1 is "everything else").
            Defaults to ``(1,)`` for one switch tier and ``(1, ranks_per_node)`` for two.
        name: preset name, for tables and plots.
    """

    num_ranks: int
    ranks_per_node: int
    cores_per_rank: int
    latency_ns: tuple[float, ...]
    bandwidth_gbps: tuple[float, ...]
    domain_sizes: tuple[int, ...] = field(default=())
    name: str = "custom"

    def __post_init__(self) -> None:
        _positive("num_ranks", self.num_ranks)
        _positive("ranks_per_node", self.ranks_per_node)
        _positive("cores_per_rank", self.cores_per_rank)
        num_hops = len(self.latency_ns)
        if num_hops < 1:
            raise InvalidArgumentError("latency_ns", self.latency_ns, "needs at least one class")
        if len(self.bandwidth_gbps) != num_hops:
            raise InvalidArgumentError(
                "bandwidth_gbps", self.bandwidth_gbps,
                f"needs one entry per hop class ({num_hops}, like latency_ns)",
            )
        if any(not (lat >= 0) for lat in self.latency_ns):
            raise InvalidArgumentError("latency_ns", self.latency_ns, "must be >= 0")
        if any(not (bw > 0) for bw in self.bandwidth_gbps):
            raise InvalidArgumentError("bandwidth_gbps", self.bandwidth_gbps, "must be > 0")
        if not self.domain_sizes:
            defaults = _default_domains(num_hops, self.ranks_per_node)
            object.__setattr__(self, "domain_sizes", defaults)
        domains = self.domain_sizes
        if len(domains) != num_hops - 1:
            raise InvalidArgumentError(
                "domain_sizes", domains, f"needs {num_hops - 1} entries for {num_hops} hop classes"
            )
        if domains and domains[0] != 1:
            raise InvalidArgumentError("domain_sizes", domains, "class 0 is the rank itself: 1")
        for inner, outer in itertools.pairwise(domains):
            if outer <= inner or outer % inner:
                raise InvalidArgumentError(
                    "domain_sizes", domains, "each domain must be a larger multiple of the last"
                )

    @property
    def num_hops(self) -> int:
        """Number of hop classes H."""
        return len(self.latency_ns)

    @property
    def num_nodes(self) -> int:
        return -(-self.num_ranks // self.ranks_per_node)

    def hop(self, src_rank: int, dst_rank: int) -> int:
        """Hop class between two ranks: 0 same rank, 1 same node, ..., H-1 farthest."""
        for name, r in (("src_rank", src_rank), ("dst_rank", dst_rank)):
            if not 0 <= r < self.num_ranks:
                raise InvalidArgumentError(name, r, f"must be in [0, {self.num_ranks})")
        for h, size in enumerate(self.domain_sizes):
            if src_rank // size == dst_rank // size:
                return h
        return self.num_hops - 1

    def hop_matrix(self) -> np.ndarray:
        """``[num_ranks, num_ranks]`` int8 matrix of hop classes (vectorised ``hop``)."""
        ranks = np.arange(self.num_ranks)
        out = np.full((self.num_ranks, self.num_ranks), self.num_hops - 1, dtype=np.int8)
        # Walk from the widest domain inward so the innermost shared domain wins.
        for h in range(len(self.domain_sizes) - 1, -1, -1):
            block = ranks // self.domain_sizes[h]
            out[block[:, None] == block[None, :]] = h
        return out

    def latency_of_hops(self, hops: np.ndarray) -> np.ndarray:
        """Latency in ns for an array of hop classes."""
        return np.asarray(self.latency_ns, dtype=np.float64)[hops]


def _positive(name: str, value: int) -> None:
    if not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidArgumentError(name, value, "must be a positive integer")


def _default_domains(num_hops: int, ranks_per_node: int) -> tuple[int, ...]:
    if num_hops == 1:
        return ()
    if num_hops == 2:
        return (1,)
    if num_hops == 3:
        return (1, ranks_per_node)
    raise InvalidArgumentError(
        "domain_sizes", (), f"must be given for {num_hops} hop classes (only 1-3 have a default)"
    )


# docs/CALIBRATION.md, "From the UBEP paper": Table 2 latencies (intra-NPU 218 ns, one hop
# 929 ns, two hops 2500 ns), uniform bandwidth across hops, UB about 392 GB/s per NPU, 48 AIVs per
# die, 16-NPU nodes under a tier-2 switch in the evaluation deployment.
CM384_LATENCY_NS = (218.0, 929.0, 2500.0)
CM384_BANDWIDTH_GBPS = 392.0
CM384_CORES = 48

# docs/CALIBRATION.md, "Other public measurements": NVL72 900 GB/s unidirectional per GPU,
# one NVSwitch tier. Latency: NCCL tuner NVLink LL per-step latency 0.6 us (one hop); the local
# class reuses CM384's intra-die figure since both are on-package HBM accesses.
NVL72_LATENCY_NS = (218.0, 600.0)
NVL72_BANDWIDTH_GBPS = 900.0
# An H100/B200-class GPU has 132-148 SMs; a comm kernel typically gets ~24-32 of them. We model
# 48 "cores" so schedules are comparable with CM384 (documented choice, not a measurement).
NVL72_CORES = 48

# docs/CALIBRATION.md, "This host": cross-process flag round trip with spin ~0.4 us (so one
# way ~0.2 us); memcpy ~12.7 GB/s in one process. Hop 0 is a copy inside the rank's own memory.
HOST_LATENCY_NS = (100.0, 200.0)
HOST_BANDWIDTH_GBPS = 12.7
# ASSUMED, not measured (this 2-core VM has one class between ranks): on hosts where /sys shows
# ranks pinned to different last-level caches, packages or NUMA nodes
# (``ubep.runtime.host_topology``), each farther class costs twice the latency of the one before,
# as core-to-core cache-line transfers roughly do on current x86 servers (same L3 < across L3s
# < across sockets). The bandwidth stays 12.7 GB/s in every class: one core's memcpy, not the
# socket interconnect, bounds a rank's copy.
HOST_FARTHER_LATENCY_FACTOR = 2.0


def _preset(family: str, num_ranks: int, ranks_per_node: int, cores_per_rank: int,
            latency_ns: tuple[float, ...], bandwidth_gbps: float) -> Topology:
    """A preset's topology: the same bandwidth in every hop class, named ``family-num_ranks``."""
    return Topology(num_ranks=num_ranks, ranks_per_node=ranks_per_node,
                    cores_per_rank=cores_per_rank, latency_ns=latency_ns,
                    bandwidth_gbps=(bandwidth_gbps,) * len(latency_ns),
                    name=f"{family}-{num_ranks}")


def cm384(num_ranks: int, ranks_per_node: int = 16, cores_per_rank: int = CM384_CORES) -> Topology:
    """Huawei CloudMatrix384: two switch tiers, Table 2 latencies, 392 GB/s per die."""
    return _preset("cm384", num_ranks, min(ranks_per_node, num_ranks), cores_per_rank,
                   CM384_LATENCY_NS, CM384_BANDWIDTH_GBPS)


def nvl72(num_ranks: int = 72, cores_per_rank: int = NVL72_CORES) -> Topology:
    """NVIDIA GB200 NVL72: one NVSwitch tier, so every peer is one hop away."""
    if num_ranks > 72:
        raise InvalidArgumentError("num_ranks", num_ranks, "NVL72 has at most 72 GPUs")
    return _preset("nvl72", num_ranks, num_ranks, cores_per_rank,
                   NVL72_LATENCY_NS, NVL72_BANDWIDTH_GBPS)


def nvl576(num_ranks: int = 576, cores_per_rank: int = NVL72_CORES) -> Topology:
    """NVL576 (EXTRAPOLATION: no published measurement exists).

    Modelled as 72-GPU NVL72 domains under a second NVSwitch tier, with the second hop costing
    what a second switch traversal costs on CM384 relative to one (2500/929 = 2.7x). Treat every
    number it produces as a what-if, not a prediction backed by data.
    """
    second_hop_ns = NVL72_LATENCY_NS[1] * CM384_LATENCY_NS[2] / CM384_LATENCY_NS[1]
    return _preset("nvl576", num_ranks, min(72, num_ranks), cores_per_rank,
                   (NVL72_LATENCY_NS[0], NVL72_LATENCY_NS[1], second_hop_ns), NVL72_BANDWIDTH_GBPS)


def host(num_ranks: int, cores_per_rank: int | None = None) -> Topology:
    """This machine: ranks are processes on one host, one hop apart (shared memory).

    The groups build their topology with ``ubep.runtime.host_topology.host_topology``, which is
    this preset unless the ranks' CPU affinities and ``/sys`` show more than one class between
    ranks (shared last-level caches, packages, NUMA nodes)."""
    if cores_per_rank is None:
        cores_per_rank = max(1, min(4, (os.cpu_count() or 1) // max(1, num_ranks)))
    return _preset("host", num_ranks, num_ranks, cores_per_rank,
                   HOST_LATENCY_NS, HOST_BANDWIDTH_GBPS)
