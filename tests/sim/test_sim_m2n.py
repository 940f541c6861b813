"""M2N in the simulator (``ubep.sim.m2n``): the placement's physical routing, the plans that
follow from it, and one row timed against the closed form of docs/SIMULATOR.md."""

from __future__ import annotations

import numpy as np
import pytest

from tests.sim.test_sim_model import fabric
from tests.sim.test_sim_replicas import LAT, ROW, closed_form
from ubep.errors import InvalidArgumentError
from ubep.sim.m2n import M2NCase, m2n_plans, m2n_topology, time_m2n
from ubep.sim.workload import UBEP, System
from ubep.topology import Topology

ONE_CORE = System("one core", "asp", "balanced", "sp", num_send_cores=1, num_count_cores=1)


def tiers(num_ranks: int) -> Topology:
    # two ranks per node: ranks 2i and 2i + 1 are one hop apart, the others two
    return Topology(num_ranks=num_ranks, ranks_per_node=2, cores_per_rank=2, latency_ns=LAT,
                    bandwidth_gbps=(20.0, 20.0, 20.0))


def one_row(seed: int) -> tuple[M2NCase, int, int]:
    """1 attention die, 3 expert dies (one expert each), top-1: the token's one row goes to
    die ``1 + e``, one hop away for die 1 (rank 0's node), two for dies 2 and 3."""
    case = M2NCase(1, 3, tokens_per_attention_die=1, hidden=ROW, itemsize=1, num_topk=1,
                   num_experts=3, seed=seed)
    die = 1 + int(case.routing()[0][0, 0])
    return case, die, 1 if die == 1 else 2


@pytest.mark.parametrize("mode", ["analytic", "events"])
@pytest.mark.parametrize("hop", [1, 2])
def test_one_token_to_its_expert_die_is_timed_as_the_closed_form(mode: str, hop: int) -> None:
    case, die, _ = next(c for c in map(one_row, range(100)) if c[2] == hop)
    plans = m2n_plans(case, ONE_CORE, tiers(4), fabric())
    assert plans[0].send_dst_rank.tolist() == [die] and plans[0].send_hop.tolist() == [hop]
    assert [p.num_units for p in plans[1:]] == [0, 0, 0]
    dispatch, combine = time_m2n(case, ONE_CORE, tiers(4), fabric(), mode=mode)
    assert dispatch == pytest.approx(closed_form(hop), abs=1e-2)
    assert combine > 0


def test_the_placement_sends_every_pick_to_the_expert_dies_in_order() -> None:
    # 3 attention dies, 2 expert dies, 8 experts: expert e on die 3 + e // 4, local e % 4
    case = M2NCase(3, 2, tokens_per_attention_die=5, hidden=64, num_topk=2, num_experts=8)
    assert case.expert_ranks == (3, 4) and case.tokens() == [5, 5, 5, 0, 0]
    assert case.expert_map().replicas == tuple(((3 + e // 4) * 4 + e % 4,) for e in range(8))
    picks = case.routing()
    plans = m2n_plans(case, UBEP.with_(num_send_cores=1, num_count_cores=1), tiers(5),
                      fabric())
    for r, p in enumerate(plans):
        assert p.num_units == (10 if r < 3 else 0)  # 5 tokens x top-2, senders only
        # closed form: a pick of expert e lands on die 3 + e // 4
        want = sorted(3 + int(e) // 4 for e in picks[r].ravel())
        assert sorted(p.send_dst_rank.tolist()) == want


def test_co_located_runs_the_same_picks_over_every_die() -> None:
    m2n = M2NCase(3, 2, tokens_per_attention_die=5, hidden=64, num_topk=2, num_experts=8)
    co = M2NCase(3, 2, tokens_per_attention_die=5, hidden=64, num_topk=2, num_experts=8,
                 placement="colocated")
    assert co.tokens() == [3, 3, 3, 3, 3] and co.expert_ranks == (0, 1, 2, 3, 4)
    assert np.array_equal(np.concatenate(m2n.routing()), np.concatenate(co.routing()))
    # 8 experts over 5 dies: 2 slots each, expert e on die e % 5, slot e // 5
    assert co.expert_map().replicas == tuple(((e % 5) * 2 + e // 5,) for e in range(8))
    plans = m2n_plans(co, ONE_CORE, tiers(5), fabric())
    assert sum(p.num_units for p in plans) == 15 * 2


def test_mixed_spreads_the_expert_dies_evenly_and_keeps_the_picks() -> None:
    # 6 attention dies, 2 expert dies: every 4th die holds experts, the last of each stride
    pooled = M2NCase(6, 2, tokens_per_attention_die=3, hidden=64, num_topk=2, num_experts=4)
    mixed = M2NCase(6, 2, tokens_per_attention_die=3, hidden=64, num_topk=2, num_experts=4,
                    placement="mixed")
    assert mixed.expert_ranks == (3, 7)
    assert mixed.tokens() == [3, 3, 3, 0, 3, 3, 3, 0]
    assert np.array_equal(np.concatenate(pooled.routing()), np.concatenate(mixed.routing()))
    # expert e on die (3, 7)[e // 2]; two dies per node: die 2 sends to die 3 one hop away
    topo = Topology(num_ranks=8, ranks_per_node=2, cores_per_rank=2, latency_ns=LAT,
                    bandwidth_gbps=(20.0, 20.0, 20.0))
    plans = m2n_plans(mixed, ONE_CORE, topo, fabric())
    picks = mixed.routing()
    for r, p in enumerate(plans):
        want = sorted((3, 7)[int(e) // 2] for e in picks[r].ravel())
        assert sorted(p.send_dst_rank.tolist()) == want
        assert np.all(p.send_hop == np.where(p.send_dst_rank // 2 == r // 2, 1, 2))


def test_bad_cases_are_refused_naming_the_argument() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        M2NCase(64, 48)  # 256 experts over 48 dies
    assert info.value.argument == "expert_dies"
    with pytest.raises(InvalidArgumentError) as info:
        M2NCase(0, 16)
    assert info.value.argument == "attention_dies"
    with pytest.raises(InvalidArgumentError) as info:
        M2NCase(64, 16, placement="spread")
    assert info.value.argument == "placement"
    with pytest.raises(InvalidArgumentError) as info:
        m2n_plans(M2NCase(2, 2, num_experts=4, num_topk=2), ONE_CORE, tiers(5), fabric())
    assert info.value.argument == "topology"


def test_nvl72_beyond_one_domain_is_the_two_tier_model() -> None:
    topo, family = m2n_topology("nvl72", 80)
    assert family == "nvl576" and topo.num_ranks == 80 and topo.num_nodes == 2
    topo, family = m2n_topology("nvl72", 72)
    assert family == "nvl72" and topo.num_nodes == 1
