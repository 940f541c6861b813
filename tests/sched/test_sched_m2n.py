"""The scheduler on an M2N placement's physical routing (what a Buffer with ``expert_ranks``
hands it): a sender's cores get all the send units, an expert rank without tokens none (it only
receives, and sends its received rows back in combine), and the hierarchical mapping balances
each core's units and its mix of hops between the two pools, on a two-tier fabric."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ubep import routing
from ubep.expert_map import replica_table, route_topk
from ubep.m2n import m2n_expert_map
from ubep.sched import combine_plans, schedule
from ubep.topology import Topology

# two nodes of four ranks; attention ranks 0, 1 (node 0) and 4, 5 (node 1), expert ranks 2, 3
# (node 0) and 6, 7 (node 1): from every sender, half the expert ranks are one hop away (same
# node), half two (the other node)
TOPO = Topology(num_ranks=8, ranks_per_node=4, cores_per_rank=6, latency_ns=(0.0, 300.0, 900.0),
                bandwidth_gbps=(100.0, 50.0, 25.0), domain_sizes=(1, 4))
SENDERS = (0, 1, 4, 5)
EXPERT_RANKS = (2, 3, 6, 7)
LOGICAL = 32  # 8 per expert rank
SLOTS = LOGICAL // len(EXPERT_RANKS) * TOPO.num_ranks
SEND_CORES = 4


def _physical(tokens: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Logical routing of ``rank`` (0 tokens on an expert rank) and its physical one."""
    t = tokens if rank in SENDERS else 0
    idx = routing.uniform_topk(t, LOGICAL, 8, seed=rank)
    emap = m2n_expert_map(LOGICAL, EXPERT_RANKS, TOPO.num_ranks)
    table = replica_table(emap, TOPO.hop_matrix()[rank], (), SLOTS // TOPO.num_ranks)
    return idx, route_topk(idx, table)


@pytest.mark.parametrize("layout", ["expert", "rank"])
def test_senders_send_expert_ranks_receive_and_each_core_gets_an_equal_hop_mix(
        layout: str) -> None:
    plans = []
    for r in range(TOPO.num_ranks):
        logical, phys = _physical(96, r)
        plan = schedule(phys, TOPO, rank=r, num_experts=SLOTS, policy="hierarchical",
                        layout=layout, num_send_cores=SEND_CORES, num_count_cores=2)
        plans.append(plan)
        if r not in SENDERS:
            assert plan.num_units == 0  # an expert rank's cores send nothing in dispatch
            continue
        # every unit goes to an expert rank; unit count and hop mix by closed form from the
        # logical routing: logical expert e lives on EXPERT_RANKS[e // 8]
        assert set(plan.send_dst_rank.tolist()) <= set(EXPERT_RANKS)
        owner = np.asarray(EXPERT_RANKS)[logical // 8]
        valid = logical >= 0
        if layout == "expert":
            dests = [(int(owner[t, k]),) for t, k in zip(*np.nonzero(valid), strict=True)]
        else:
            dests = [(int(d),) for t in range(logical.shape[0])
                     for d in sorted(set(owner[t][valid[t]].tolist()))]
        want = np.bincount([TOPO.hop(r, d) for (d,) in dests], minlength=TOPO.num_hops)
        v = plan.hop_counts(TOPO.num_hops)
        assert v.sum(axis=0).tolist() == want.tolist()
        assert want[0] == 0 and want[1] > 0 and want[2] > 0  # both pools' hop classes occur
        loads = plan.core_loads()
        assert loads.max() - loads.min() <= 1
        for h in range(TOPO.num_hops):  # the hierarchical bound v[j, h] <= ceil(V_h / n)
            assert v[:, h].max() <= math.ceil(want[h] / SEND_CORES)
    # combine: the expert ranks send the received rows back, senders send nothing
    back = combine_plans(plans, TOPO, policy="hierarchical")
    received = {r: sum(int((p.send_dst_rank == r).sum()) for p in plans) for r in EXPERT_RANKS}
    for r, plan in enumerate(back):
        if r in SENDERS:
            assert plan.num_units == 0
            continue
        assert plan.num_units == received[r] > 0
        assert set(plan.send_dst_rank.tolist()) <= set(SENDERS)
        v = plan.hop_counts(TOPO.num_hops)
        total = v.sum(axis=0)
        assert np.diff(plan.core_loads()).size == SEND_CORES - 1
        for h in range(TOPO.num_hops):
            assert v[:, h].max() <= math.ceil(total[h] / SEND_CORES)
