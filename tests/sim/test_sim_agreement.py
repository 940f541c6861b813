"""Event-driven vs analytic executor, monotonicity, and one-tier fabrics."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from ubep.sim import simulate
from ubep.sim.calib import load_fabric
from ubep.sim.workload import CANN_EP, UBEP, UBEP_NO_MAPPING, System, Workload, plans_for, run_case
from ubep.topology import Topology, cm384, nvl72

# Stated tolerance of the agreement (docs/SIMULATOR.md): the event mode decides ports and queues
# TIE_NS = 1e-3 ns after an arrival, so its times trail the closed forms by a few TIE_NS at most.
TOL_NS = 0.01

SMALL = Workload(tokens_per_rank=12, hidden=600, num_topk=3, experts_per_rank=2, seed=3)
CASES = [
    (CANN_EP, "dispatch"),
    (CANN_EP, "combine"),
    (UBEP, "dispatch"),
    (UBEP, "combine"),
    (UBEP.with_(sync="tff"), "dispatch"),
    (UBEP.with_(sync="dc"), "dispatch"),
    (UBEP_NO_MAPPING.with_(sync="sw"), "dispatch"),
    (UBEP.with_(sync="dc"), "combine"),
    (UBEP_NO_MAPPING.with_(sync="sw", layout="rank"), "dispatch"),
    (UBEP.with_(sync="sw", layout="rank"), "combine"),
]


def _spans(res):  # type: ignore[no-untyped-def]
    tl = res.timeline
    order = np.lexsort((tl.start_ns.round(2), tl.task, tl.core, tl.rank))
    return (tl.rank[order], tl.core[order], tl.task[order], tl.start_ns[order], tl.end_ns[order])


@pytest.mark.parametrize(("system", "op"), CASES,
                         ids=[f"{s.engine}-{s.sync}-{s.layout}-{o}" for s, o in CASES])
def test_event_and_analytic_modes_agree(system: System, op: str) -> None:
    topo = cm384(4, ranks_per_node=2, cores_per_rank=4)
    fab = load_fabric("cm384")
    a = run_case(SMALL, system, topo, fab, op=op)
    e = run_case(SMALL, system, topo, fab, op=op, mode="events")
    assert a.mode == "analytic" and e.mode == "events"
    for name in ("unit_end_ns", "unit_land_ns", "unit_ready_ns", "item_end_ns", "rank_end_ns",
                 "core_send_end_ns", "core_land_end_ns"):
        np.testing.assert_allclose(getattr(e, name), getattr(a, name), atol=TOL_NS, rtol=0,
                                   err_msg=name)
    sa, se = _spans(a), _spans(e)
    for col_a, col_e in zip(sa[:3], se[:3], strict=True):
        np.testing.assert_array_equal(col_a, col_e)
    for col_a, col_e in zip(sa[3:], se[3:], strict=True):
        np.testing.assert_allclose(col_e, col_a, atol=TOL_NS, rtol=0)
    assert e.latency_ns == pytest.approx(a.latency_ns, abs=TOL_NS)


MONO = [CANN_EP, UBEP, UBEP.with_(sync="tff"), UBEP.with_(sync="dc"), UBEP.with_(sync="sw")]


@pytest.mark.parametrize("system", MONO, ids=[f"{s.engine}-{s.sync}" for s in MONO])
def test_more_bandwidth_never_slower_more_latency_never_faster(system: System) -> None:
    topo = cm384(16, ranks_per_node=4, cores_per_rank=8)
    fab = load_fabric("cm384")
    w = Workload(tokens_per_rank=32, num_topk=4, routing="hot", hot_experts=2, seed=1)
    plans = plans_for(w, system, topo, fab)  # fixed plans: only the fabric changes

    def latency(t: Topology, f=fab) -> float:  # type: ignore[no-untyped-def]
        return simulate(plans, t, f, engine=system.engine, sync=system.sync,
                        row_bytes=w.row_bytes).latency_ns

    bw = [latency(replace(topo, bandwidth_gbps=tuple(b * s for b in topo.bandwidth_gbps)))
          for s in (0.02, 0.1, 0.5, 1.0, 4.0)]
    assert all(x >= y - 1e-6 for x, y in itertools.pairwise(bw)), bw
    assert bw[0] > bw[-1]  # the sweep reaches the regime where ports matter
    lat = [latency(replace(topo, latency_ns=tuple(v * s for v in topo.latency_ns)))
           for s in (0.0, 0.5, 1.0, 2.0, 8.0)]
    assert all(x <= y + 1e-6 for x, y in itertools.pairwise(lat)), lat
    assert lat[0] < lat[-1]
    issue = [latency(topo, fab.with_values(issue_ns=v)) for v in (0.0, 100.0, 1000.0)]
    assert issue[0] <= issue[1] <= issue[2]


def test_one_tier_fabric_makes_hierarchical_equal_balanced() -> None:
    flat = Topology(num_ranks=16, ranks_per_node=16, cores_per_rank=8, latency_ns=(600.0,),
                    bandwidth_gbps=(900.0,))
    fab = load_fabric("nvl72")
    w = Workload(tokens_per_rank=64, experts_per_rank=2, seed=5)
    h = run_case(w, UBEP, flat, fab)
    b = run_case(w, UBEP_NO_MAPPING, flat, fab)
    # Same loads and a single hop class: every core does the same work under both policies.
    np.testing.assert_allclose(np.sort(h.core_send_end_ns, axis=1),
                               np.sort(b.core_send_end_ns, axis=1), rtol=1e-12)
    assert h.latency_ns == pytest.approx(b.latency_ns, rel=0.02)
    # On the NVL72 preset (self + one NVSwitch hop) the two stay close as well.
    topo = nvl72(16, cores_per_rank=8)
    h2, b2 = run_case(w, UBEP, topo, fab), run_case(w, UBEP_NO_MAPPING, topo, fab)
    assert h2.send_latency_ns().max() == pytest.approx(b2.send_latency_ns().max(), rel=0.05)


def test_two_tier_fabric_hierarchical_removes_hop_stragglers() -> None:
    # EP32 on CM384: balanced slices put the tier-2 experts on half of the cores.
    topo = cm384(32)
    fab = load_fabric("cm384")
    w = Workload(tokens_per_rank=128)
    h = run_case(w, UBEP, topo, fab).send_latency_ns()
    b = run_case(w, UBEP_NO_MAPPING, topo, fab).send_latency_ns()
    assert h.max() < b.max()
    spread_h = np.ptp(h[h > 0]) / h.max()
    spread_b = np.ptp(b[b > 0]) / b.max()
    assert spread_h < spread_b
