"""What-ifs beyond the paper's figures: redundant experts, EP 1024 and M2N (predictions).

``replicas``: Figure 9's set-up (EP64, 256 experts, 8 hot, batch 64) with EPLB-style replicas of
the hot experts, one on every node, routed by ``ubep.expert_map``'s rule. ``ep1024``: Table 4's
workload at 1024 ranks on a CM384-like and an NVL576-like fabric, with the wall time of each
configuration. ``m2n``: attention dies dispatching to disjoint expert dies, against co-located
EP on the same dies (``ubep.sim.m2n``). Every number is a prediction of the model
(docs/SIMULATOR.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import numpy as np

from ..errors import InvalidArgumentError
from ..expert_map import ExpertMap
from ..topology import Topology
from .calib import load_fabric, topology_for
from .experiments import INTERVAL_NOTE, ExperimentResult, _band, _latency, _us, provenance
from .fabric import FabricModel
from .m2n import m2n  # its own module: M2N deployments
from .workload import (
    CANN_EP,
    UBEP,
    Workload,
    aux_cores,
    hot_ids_for,
    plans_for,
    routing_for,
    run_case,
)

__all__ = ["WHATIFS", "ep1024", "hot_replica_map", "replicas"]


def hot_replica_map(topology: Topology, experts_per_rank: int, hot: np.ndarray) -> ExpertMap:
    """Logical expert ``e`` on slot ``(e // epr) * (epr + 1) + e % epr`` (its home rank keeps
    it), and each hot expert replicated once on every other node, in the spare slot (the last of
    each rank) of a rank of that node: the rank at the home rank's position in its node, or
    the next free one."""
    epr, R, per_node = experts_per_rank, topology.num_ranks, topology.ranks_per_node
    slots: list[list[int]] = [[(e // epr) * (epr + 1) + e % epr] for e in range(R * epr)]
    used: set[int] = set()
    for h in (int(x) for x in hot):
        home = h // epr
        for node in range(topology.num_nodes):
            if node == home // per_node:
                continue
            for step in range(per_node):
                rank = node * per_node + (home % per_node + step) % per_node
                if rank < R and rank not in used:
                    used.add(rank)
                    slots[h].append(rank * (epr + 1) + epr)
                    break
    return ExpertMap(tuple(tuple(s) for s in slots))


def replicas(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """Redundant experts: Figure 9's set-up with the 8 hot experts replicated on every node."""
    fab = fabric or load_fabric(family)
    ranks, epr = 64, 4
    topo = topology_for(family, ranks)
    base = Workload(tokens_per_rank=64, experts_per_rank=epr, routing="hot", hot_experts=8)
    hot = hot_ids_for(base, ranks)
    spare = base.with_(experts_per_rank=epr + 1)
    primaries = ExpertMap(tuple((s,) for s in
                                ((e // epr) * (epr + 1) + e % epr for e in range(ranks * epr))))
    cases = (("figure 9 (4 slots per rank)", base),
             ("no replicas (5 slots, spare idle)", spare.with_(expert_map=primaries)),
             ("hot experts on every node", spare.with_(
                 expert_map=hot_replica_map(topo, epr, hot))))
    rows, data = [], []
    for label, w in cases:
        for s in (CANN_EP, UBEP):
            res = run_case(w, s, topo, fab)
            lat = res.send_latency_ns(until="sent")
            hops = np.concatenate([p.send_hop for p in plans_for(w, s, topo, fab)])
            recv = np.bincount(np.concatenate([p.send_dst_rank for p in
                                               plans_for(w, s, topo, fab)]), minlength=ranks)
            nominal, lo, hi = (_band(partial(_latency, w, s, topo), family, fabric)
                               if s is UBEP else (res.latency_ns,) * 3)
            rows.append((label, s.name, _us(lat.max()), _us(nominal), _us(lo), _us(hi),
                         round(float(np.mean(hops == 2)), 3), int(recv.max())))
            data.append({"case": label, "system": s.name, "max_core_us": _us(lat.max()),
                         "dispatch_us": _us(nominal), "dispatch_interval_us": [_us(lo), _us(hi)],
                         "hop2_row_share": round(float(np.mean(hops == 2)), 4),
                         "max_rows_per_rank": int(recv.max())})
    return ExperimentResult(
        "replicas", f"Redundant experts: Figure 9's set-up, 8 hot experts replicated on every "
        f"node, EP{ranks} ({family})",
        ("case", "system", "max_core_us", "dispatch_us", "lo_us", "hi_us", "hop2_share",
         "max_rows_per_rank"),
        tuple(rows),
        ("PREDICTION of the model: 64 ranks (4 nodes x 16), 256 logical experts, top-8, batch "
         f"64, the 8 hot experts take {fab.hot_share:.1%} of the picks (fitted to Figure 9, "
         "calib.json hot_share); one hot-expert draw (the first of Figure 9's 8, where two "
         "hot experts share a CANN EP core), not Figure 9's median",
         "replicas: each hot expert keeps its home slot and gets one replica on each other "
         "node, in a fifth (spare) slot per rank; a pick goes to the replica on the sender's "
         "nearest tier, round-robin by token (ubep.expert_map's rule)",
         "max_core_us: Figure 9's per-AIV token-send latency (program (1) of the core's rows "
         "+ their mean wait at the receivers' ports), the maximum over every send core of "
         "every rank; hop2_share: rows "
         "that cross the tier-2 switch; max_rows_per_rank: rows received by the busiest rank",
         "no replicas (5 slots): the same slot count as with replicas, so the count phase "
         "costs the same; CANN EP has no interval (calibrated)", INTERVAL_NOTE),
        {"rows": data, "hot_experts": [int(h) for h in hot], "provenance": provenance(
            family, (f"hot_share {fab.hot_share:.3g} (fitted; range 0.1-0.75)",))},
    )


EP1024_FABRICS = {
    "cm384": "CM384-like: 64 nodes of 16 dies under one tier-2 switch (CM384 has 24 such "
             "nodes), Table 2 latencies and 392 GB/s per die unchanged",
    "nvl576": "NVL576-like: 72-GPU NVL72 domains under a second NVSwitch tier (14 full "
              "domains + one of 16), NVL72 constants, the second hop 2.7x the first",
}


def ep1024(family: str = "cm384", fabric: FabricModel | None = None) -> ExperimentResult:
    """EP 1024 extrapolation: Table 4's workload at 1024 ranks, CM384- and NVL576-like."""
    del family  # both fabrics, always
    if fabric is not None:
        raise InvalidArgumentError("fabric", fabric.name, "ep1024 runs the calibrated fabrics")
    w, ranks = Workload(), 1024
    rows, data = [], []
    for fam, what in EP1024_FABRICS.items():
        fab = load_fabric(fam)
        topo = topology_for(fam, ranks)
        t = time.perf_counter()
        routing_for(w, ranks)  # the seeded draw, shared by every configuration
        routing_s = time.perf_counter() - t
        run: dict[str, float] = {}
        wall: dict[str, float] = {}
        for s in (CANN_EP, UBEP):
            t = time.perf_counter()
            run[s.name] = run_case(w, s, topo, fab).latency_ns
            wall[s.name] = time.perf_counter() - t
        t = time.perf_counter()
        ubep_of: Callable[[FabricModel], float] = partial(_latency, w, UBEP, topo)
        # Only CM384 has fitted constants with a spread; elsewhere the band is the point.
        lo = hi = run[UBEP.name]
        if fam == "cm384":
            _, lo, hi = _band(ubep_of, fam, None)
        band_s = time.perf_counter() - t
        cann, ubep = run[CANN_EP.name], run[UBEP.name]
        rows.append((fam, ranks, _us(cann), _us(ubep), _us(lo), _us(hi), round(cann / ubep, 2),
                     f"{cann / hi:.2f}-{cann / lo:.2f}", round(wall[CANN_EP.name], 2),
                     round(wall[UBEP.name], 2), round(band_s, 2)))
        data.append({"family": fam, "fabric": what, "ep": ranks, "cann_latency_us": _us(cann),
                     "ubep_latency_us": _us(ubep), "ubep_latency_interval_us": [_us(lo), _us(hi)],
                     "aux_cores": aux_cores(ranks, fab, topo.cores_per_rank),
                     "wall_s": {"routing": routing_s, "cann": wall[CANN_EP.name],
                                "ubep": wall[UBEP.name],
                                "ubep_interval": band_s}})
    return ExperimentResult(
        "ep1024", "EP 1024 EXTRAPOLATION: Table 4's workload on CM384- and NVL576-like fabrics",
        ("fabric", "ep", "cann_us", "ubep_us", "ubep_lo_us", "ubep_hi_us", "speedup",
         "speedup_interval", "cann_wall_s", "ubep_wall_s", "interval_wall_s"),
        tuple(rows),
        ("EXTRAPOLATION: no 1024-rank measurement exists; the fitted constants of each family "
         "are used as they are at 1024 ranks",
         *(f"{fam}: {what}" for fam, what in EP1024_FABRICS.items()),
         "128 tokens per rank, hidden 7168, 1 B (W8A8), top-8, one expert per rank (1024 "
         "experts), uniform routing, 48 cores per rank",
         "ASP routing/checksum cores: 12 at 256 ranks scaled with the ranks would take all 48 "
         "cores at 1024; capped at 36 (a quarter of the cores left to count and send)",
         "nvl576 has no interval: only CM384's assumed constants are fitted, with a spread",
         "wall_s: the simulator's wall time per configuration (plans + executor; the seeded "
         "routing is drawn once and shared), interval_wall_s: the two corner fabrics of the "
         "interval", INTERVAL_NOTE),
        {"rows": data, "provenance": provenance("cm384")},
    )


WHATIFS: dict[str, Callable[..., ExperimentResult]] = {"replicas": replicas, "ep1024": ep1024,
                                                       "m2n": m2n}
