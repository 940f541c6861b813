"""Redundant experts in the simulator: the logical picks routed by ``ubep.expert_map``'s rule,
then planned and timed as physical rows (a replica on a nearer tier is a shorter hop)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.sim.test_sim_model import fabric, speed
from ubep.errors import InvalidArgumentError
from ubep.expert_map import ExpertMap, replica_table, route_topk
from ubep.sim import build_spec, make_plans, simulate
from ubep.sim.whatif import hot_replica_map
from ubep.sim.workload import UBEP, Workload, hot_ids_for, plans_for, routing_for, run_case
from ubep.topology import Topology, cm384

ROW = 100_000  # large rows: the data, not the count words, sets the latency
LAT = (50.0, 400.0, 1200.0)


def two_tiers() -> Topology:
    # 4 ranks, 2 per node, 2 slots per rank: rank 0's node holds ranks 0 and 1.
    return Topology(num_ranks=4, ranks_per_node=2, cores_per_rank=2, latency_ns=LAT,
                    bandwidth_gbps=(20.0, 20.0, 20.0))


def one_row(expert_map: ExpertMap | None, mode: str) -> tuple[object, object]:
    topo = two_tiers()
    idx = [np.array([[0]]), *(np.zeros((0, 1), dtype=np.int64) for _ in range(3))]
    plans = make_plans(idx, topo, num_experts=8, policy="balanced", num_send_cores=1,
                       num_count_cores=1, expert_map=expert_map)
    spec = build_spec(plans, topo, fabric(), engine="asp", sync="sp", row_bytes=ROW)
    return spec, simulate(plans, topo, fabric(), engine="asp", sync="sp", row_bytes=ROW,
                          mode=mode)


def closed_form(hop: int) -> float:
    # One row on one core (docs/SIMULATOR.md; test_sim_model's closed form): work, the port,
    # the flight, then the receiver's local copy and sentinel reset.
    f = fabric()
    end = f.init_ns + (100 + ROW / 10 + 0.5 * LAT[hop]) / speed(f, 1)
    land = end + ROW / 20 + LAT[hop]
    return land + 100 + ROW / 10 + 0.5 * LAT[0] + ROW / 10


@pytest.mark.parametrize("mode", ["analytic", "events"])
def test_a_replica_on_the_senders_node_is_a_hop_1_row(mode: str) -> None:
    # Logical expert 0 lives on slot 4 (rank 2, hop 2 from rank 0); the replica on slot 3
    # (rank 1, rank 0's node) takes the pick: the row goes one tier less far.
    primary_only = ExpertMap(((4,), (0,), (1,), (2,)))
    replicated = ExpertMap(((4, 3), (0,), (1,), (2,)))
    spec_far, far = one_row(primary_only, mode)
    spec_near, near = one_row(replicated, mode)
    assert spec_far.unit_hop.tolist() == [2] and spec_far.unit_dst.tolist() == [2]
    assert spec_near.unit_hop.tolist() == [1] and spec_near.unit_dst.tolist() == [1]
    assert far.latency_ns == pytest.approx(closed_form(2), abs=1e-2)
    assert near.latency_ns == pytest.approx(closed_form(1), abs=1e-2)
    # The saving: the exposed share of the latency difference in the core's work, plus the
    # difference in flight.
    saving = 0.5 * (LAT[2] - LAT[1]) / speed(fabric(), 1) + (LAT[2] - LAT[1])
    assert far.latency_ns - near.latency_ns == pytest.approx(saving, abs=1e-2)


def test_masked_rank_s_rows_go_to_the_replicas() -> None:
    topo = cm384(32, cores_per_rank=8)  # 2 nodes of 16
    # 2 slots per rank: slot 2r holds expert r; slot 2r + 1 a replica of expert (r + 16) % 32
    # (a copy on the other node).
    emap = ExpertMap(tuple((2 * e, 2 * ((e - 16) % 32) + 1) for e in range(32)))
    w = Workload(tokens_per_rank=64, num_topk=4, experts_per_rank=2, expert_map=emap,
                 masked_ranks=(5,), hidden=256)
    plans = plans_for(w, UBEP.with_(num_send_cores=4, num_count_cores=2), topo)
    spec = build_spec(plans, topo, fabric(), engine="asp", sync="sp", row_bytes=w.row_bytes)
    got = np.bincount(spec.unit_dst, minlength=32)
    hops = topo.hop_matrix()
    want = np.zeros(32, dtype=np.int64)
    for r, idx in enumerate(routing_for(w, 32)):
        if r == 5:
            continue
        phys = route_topk(idx, replica_table(emap, hops[r], [5], 2))
        assert (phys >= 0).all()  # every expert keeps a replica: nothing dropped
        want += np.bincount(phys.ravel() // 2, minlength=32)
    np.testing.assert_array_equal(got, want)
    assert got[5] == 0 and not (spec.unit_src == 5).any()
    # Expert 5's picks now land on rank 21 (its replica's rank): more rows than unmasked.
    unmasked = build_spec(plans_for(w.with_(masked_ranks=()), UBEP.with_(
        num_send_cores=4, num_count_cores=2), topo), topo, fabric(), engine="asp", sync="sp",
        row_bytes=w.row_bytes)
    assert got[21] > np.bincount(unmasked.unit_dst, minlength=32)[21]
    assert run_case(w, UBEP.with_(num_send_cores=4, num_count_cores=2), topo,
                    fabric()).latency_ns > 0


def test_bad_map_or_mask_names_the_argument() -> None:
    topo = two_tiers()
    idx = [np.array([[0]]), *(np.zeros((0, 1), dtype=np.int64) for _ in range(3))]
    with pytest.raises(InvalidArgumentError) as exc:
        make_plans(idx, topo, num_experts=8, policy="balanced", masked_ranks=(4,))
    assert exc.value.argument == "masked_ranks"
    with pytest.raises(InvalidArgumentError) as exc:
        make_plans(idx, topo, num_experts=8, policy="balanced",
                   expert_map=ExpertMap(((9,), (0,))))
    assert exc.value.argument == "expert_map"
    with pytest.raises(InvalidArgumentError) as exc:
        make_plans([np.array([[3]]), *idx[1:]], topo, num_experts=8, policy="balanced",
                   expert_map=ExpertMap(((4,), (0,))))
    assert exc.value.argument == "topk_per_rank"


def test_hot_replicas_on_every_node_take_the_hot_picks_off_tier_2() -> None:
    # Figure 9's set-up (`ubep sim replicas`): a hot pick whose home is on another node goes
    # to the replica on the sender's node; every other pick keeps its hop.
    topo = cm384(64)
    base = Workload(tokens_per_rank=64, experts_per_rank=4, routing="hot", hot_experts=8)
    hot = hot_ids_for(base, 64)
    emap = hot_replica_map(topo, 4, hot)
    nodes = [{(s // 5) // 16 for s in emap.replicas[int(h)]} for h in hot]
    assert all(n == {0, 1, 2, 3} for n in nodes)  # one slot per node
    primaries = ExpertMap(tuple((emap.replicas[e][0],) for e in range(256)))
    spare = base.with_(experts_per_rank=5)
    system = UBEP.with_(num_send_cores=24, num_count_cores=12)
    hop = {}
    for name, m in (("none", primaries), ("every node", emap)):
        plans = plans_for(spare.with_(expert_map=m), system, topo)
        hop[name] = np.concatenate([p.send_hop for p in plans])
    far_hot = 0
    for r, idx in enumerate(routing_for(base, 64)):
        far_hot += int((np.isin(idx, hot) & ((idx // 4) // 16 != r // 16)).sum())
    assert far_hot > 0
    assert int((hop["none"] == 2).sum()) - int((hop["every node"] == 2).sum()) == far_hot
    assert hop["none"].size == hop["every node"].size  # nothing dropped
