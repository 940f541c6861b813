"""schedule(): the units it plans (against brute-force oracles) and each policy's guarantees."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ubep.errors import InvalidArgumentError
from ubep.modes import LAYOUTS
from ubep.routing import get_dispatch_layout, hot_experts_topk, uniform_topk
from ubep.sched import (
    POLICIES,
    Plan,
    hierarchical_slices,
    hop_quotas,
    partition,
    remapped_expert_order,
    schedule,
    send_units,
)
from ubep.topology import Topology, cm384


def _topology(num_ranks: int, ranks_per_node: int, cores: int) -> Topology:
    return Topology(
        num_ranks=num_ranks, ranks_per_node=ranks_per_node, cores_per_rank=cores,
        latency_ns=(218.0, 929.0, 2500.0), bandwidth_gbps=(392.0,) * 3,
    )


@st.composite
def instances(draw: st.DrawFn) -> tuple[np.ndarray, Topology, int, int, int]:
    """(topk_idx, topology, rank, num_experts, num_send_cores) with masks and skew."""
    num_ranks = draw(st.sampled_from([1, 2, 4, 6, 8]))
    ranks_per_node = draw(st.sampled_from([2, 4]))
    per_rank = draw(st.integers(1, 3))
    num_experts = num_ranks * per_rank
    num_topk = draw(st.integers(1, min(4, num_experts)))
    num_tokens = draw(st.integers(0, 40))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    idx = uniform_topk(num_tokens, num_experts, num_topk, seed=seed)
    if num_experts > 1 and draw(st.booleans()):  # skew: most picks on one expert
        idx = hot_experts_topk(num_tokens, num_experts, num_topk, hot_experts=1, hot_share=0.9,
                               seed=seed)
    idx = np.where(rng.random(idx.shape) < draw(st.sampled_from([0.0, 0.3])), -1, idx)
    cores = draw(st.integers(1, 12))
    topo = _topology(num_ranks, ranks_per_node, cores)
    rank = draw(st.integers(0, num_ranks - 1))
    n_send = draw(st.integers(1, cores))
    return idx, topo, rank, num_experts, n_send


def _oracle_units(idx: np.ndarray, topo: Topology, rank: int, num_experts: int,
                  layout: str) -> dict[tuple[int, int], tuple[int, int, int, int, int]]:
    """Brute force: unit key -> (k, expert, dst_rank, hop, slot)."""
    per_rank = num_experts // topo.num_ranks
    out = {}
    if layout == "expert":
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e < 0:
                    continue
                slot = sum(1 for u in range(t) if e in idx[u])
                dst = e // per_rank
                out[(t, k)] = (k, e, dst, topo.hop(rank, dst), slot)
        return out
    in_rank = get_dispatch_layout(idx, num_experts, topo.num_ranks).is_token_in_rank
    for t in range(idx.shape[0]):
        for r in range(topo.num_ranks):
            if not in_rank[t, r]:
                continue
            k = min(k for k in range(idx.shape[1]) if idx[t, k] >= 0 and idx[t, k] // per_rank == r)
            slot = int(in_rank[:t, r].sum())
            out[(t, r)] = (k, int(idx[t, k]), r, topo.hop(rank, r), slot)
    return out


def _check_plan_units(plan: Plan, idx: np.ndarray, topo: Topology, num_experts: int) -> None:
    want = _oracle_units(idx, topo, plan.rank, num_experts, plan.layout)
    second = plan.send_k if plan.layout == "expert" else plan.send_dst_rank
    keys = list(zip(plan.send_token.tolist(), second.tolist(), strict=True))
    assert len(keys) == len(set(keys)) == len(want)
    for i, key in enumerate(keys):
        got = (int(plan.send_k[i]), int(plan.send_expert[i]), int(plan.send_dst_rank[i]),
               int(plan.send_hop[i]), int(plan.send_slot[i]))
        assert got == want[key], (key, got, want[key])
    # Grouped by core, CSR consistent.
    assert np.all(np.diff(plan.send_core) >= 0)
    np.testing.assert_array_equal(np.bincount(plan.send_core, minlength=plan.num_send_cores),
                                  plan.core_loads())
    ptr = plan.count_expert_ptr
    assert ptr[0] == 0 and ptr[-1] == num_experts and np.all(np.diff(ptr) >= 0)
    assert np.diff(ptr).max() - np.diff(ptr).min() <= 1


@pytest.mark.parametrize("layout", LAYOUTS)
@given(inst=instances())
@settings(max_examples=40, deadline=None)
def test_units_match_brute_force(layout: str, inst: tuple) -> None:
    idx, topo, rank, num_experts, n_send = inst
    for policy in POLICIES:
        plan = schedule(idx, topo, rank=rank, num_experts=num_experts, policy=policy,
                        num_send_cores=n_send, layout=layout)
        assert plan.policy == policy and plan.num_send_cores == n_send
        _check_plan_units(plan, idx, topo, num_experts)


def _expert_token_sorted(plan: Plan) -> bool:
    key = plan.send_expert * (int(plan.send_token.max(initial=0)) + 1) + plan.send_token
    return bool(np.all(np.diff(key) > 0))


@pytest.mark.parametrize("layout", LAYOUTS)
@given(inst=instances())
@settings(max_examples=60, deadline=None)
def test_policy_guarantees(layout: str, inst: tuple) -> None:
    idx, topo, rank, num_experts, n = inst
    kw = dict(rank=rank, num_experts=num_experts, num_send_cores=n, layout=layout)

    contiguous = schedule(idx, topo, policy="expert_contiguous", **kw)
    for j in range(n):  # core j owns experts [floor(jE/n), floor((j+1)E/n)), in expert order
        ex = contiguous.send_expert[contiguous.core_units(j)]
        assert np.all((ex >= j * num_experts // n) & (ex < (j + 1) * num_experts // n))
    assert _expert_token_sorted(contiguous)

    balanced = schedule(idx, topo, policy="balanced", **kw)
    total = balanced.num_units
    want_loads = [total // n + (1 if j < total % n else 0) for j in range(n)]
    np.testing.assert_array_equal(balanced.core_loads(), want_loads)
    assert _expert_token_sorted(balanced)

    hier = schedule(idx, topo, policy="hierarchical", **kw)
    np.testing.assert_array_equal(hier.core_loads(), want_loads)
    v = hier.hop_counts(topo.num_hops)
    per_hop = v.sum(axis=0)
    ceil_share = -(-per_hop // n)
    assert np.all(v <= ceil_share[None, :]), (v, per_hop)
    lat = np.asarray(topo.latency_ns)
    for j in range(n):  # farthest hop first inside every core
        assert np.all(np.diff(lat[hier.send_hop[hier.core_units(j)]]) <= 0)


def test_hierarchical_beats_the_literal_example() -> None:
    """CM384 EP256, rank 0: hop-1 experts 1..15 are contiguous in expert id; every core must
    still get at most ceil(V_1/n) of them, where contiguous slicing piles them on few cores."""
    topo = cm384(256)
    idx = uniform_topk(128, 256, 8, seed=7)
    hier = schedule(idx, topo, rank=0, num_experts=256, num_send_cores=48)
    bal = schedule(idx, topo, rank=0, num_experts=256, num_send_cores=48, policy="balanced")
    v_h, v_b = hier.hop_counts(3), bal.hop_counts(3)
    bound = -(-v_h.sum(axis=0) // 48)
    assert np.all(v_h <= bound)
    assert v_b[:, 1].max() > bound[1]  # the topology-agnostic slice does violate it


def test_literal_construction_breaks_bound() -> None:
    """The paper's construction read literally (transposition, then contiguous slices of one
    (remapped expert, token) sequence) does not give the hop bound; ours does on the same input."""
    topo = cm384(256)
    idx = uniform_topk(128, 256, 8, seed=0)
    units = send_units(idx, topo, rank=0, num_experts=256)
    rpos = remapped_expert_order(256, 48)
    order = np.lexsort((units.token, rpos[units.expert]))
    bounds = [j * units.num_units // 48 for j in range(49)]
    literal = np.zeros((48, 3), dtype=np.int64)
    for j in range(48):
        np.add.at(literal[j], units.hop[order[bounds[j]:bounds[j + 1]]], 1)
    cap = -(-literal.sum(axis=0) // 48)
    assert literal[:, 1].max() > 2 * cap[1]
    ours = schedule(idx, topo, rank=0, num_experts=256, num_send_cores=48).hop_counts(3)
    assert np.all(ours <= cap)


@given(
    st.lists(st.integers(0, 200), min_size=1, max_size=5),
    st.integers(1, 60),
)
@settings(max_examples=200, deadline=None)
def test_hop_quotas(units_per_hop: list[int], n: int) -> None:
    v = np.asarray(units_per_hop)
    q = hop_quotas(v, n)
    np.testing.assert_array_equal(q.sum(axis=0), v)
    loads = q.sum(axis=1)
    total = int(v.sum())
    np.testing.assert_array_equal(loads, [total // n + (j < total % n) for j in range(n)])
    assert np.all(q <= -(-v // n)) and np.all(q >= v // n)


def test_remapped_expert_order_is_a_transposition() -> None:
    for num_experts, rows in [(16, 4), (10, 3), (5, 8), (256, 48)]:
        cols = math.ceil(num_experts / rows)
        matrix = [[r * cols + c for c in range(cols)] for r in range(rows)]
        read = [matrix[r][c] for c in range(cols) for r in range(rows)
                if matrix[r][c] < num_experts]
        rpos = remapped_expert_order(num_experts, rows)
        assert [int(e) for e in np.argsort(rpos)] == read


def test_slice_boundaries_match_searchsorted() -> None:
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 5, 3 * 40) * (rng.random(120) < 0.6)
    sl = hierarchical_slices(counts, 3, 7, 40)
    prefix = np.concatenate(([0], np.cumsum(counts)))
    for j in range(7):
        for h in range(3):
            t = sl.start[j, h]
            if t == prefix[-1]:
                assert (sl.start_expert[j, h], sl.start_offset[j, h]) == (120, 0)
                continue
            e = np.searchsorted(prefix, t, side="right") - 1
            assert (sl.start_expert[j, h], sl.start_offset[j, h]) == (e, t - prefix[e])
    assert sl.search_steps <= math.ceil(math.log(120, 4))


def test_default_core_split_follows_partition_model() -> None:
    topo = cm384(64)
    idx = uniform_topk(128, 64, 8, seed=1)
    plan = schedule(idx, topo, rank=5, num_experts=64)
    part = partition(48, 64, 8, 128)
    assert (plan.num_send_cores, plan.num_count_cores) == (part.num_send_cores,
                                                           part.num_count_cores)
    assert plan.num_send_cores >= 1 and plan.num_count_cores >= 1
    one = schedule(idx, cm384(64, cores_per_rank=1), rank=5, num_experts=64)
    assert (one.num_send_cores, one.num_count_cores) == (1, 1)
    two = schedule(idx, cm384(64, cores_per_rank=2), rank=5, num_experts=64)
    assert (two.num_send_cores, two.num_count_cores) == (1, 1)
    given_send = schedule(idx, topo, rank=5, num_experts=64, num_send_cores=40)
    assert given_send.num_count_cores == 8


def test_empty_routing() -> None:
    topo = cm384(16)
    idx = np.full((4, 2), -1, dtype=np.int64)
    for policy in POLICIES:
        plan = schedule(idx, topo, rank=0, num_experts=16, policy=policy, num_send_cores=5)
        assert plan.num_units == 0 and plan.core_loads().sum() == 0


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: remapped_expert_order(0, 4), "num_experts"),
        (lambda: remapped_expert_order(8, 0), "num_rows"),
        (lambda: hop_quotas(np.array([3, -1]), 4), "units_per_hop"),
        (lambda: hop_quotas(np.array([3, 1]), 0), "n"),
        (lambda: hierarchical_slices(np.zeros(5, dtype=np.int64), 2, 3, 3),
         "units_per_virtual_expert"),
        (lambda: schedule(np.array([[0]]), "cm384", rank=0, num_experts=1), "topology"),
    ],
)
def test_bad_input_helpers(call: object, argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        call()  # type: ignore[operator]
    assert err.value.argument == argument


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        (dict(policy="random"), "policy"),
        (dict(layout="token"), "layout"),
        (dict(num_send_cores=0), "num_send_cores"),
        (dict(num_send_cores=49), "num_send_cores"),
        (dict(num_count_cores=2.5), "num_count_cores"),
        (dict(rank=16), "rank"),
        (dict(num_experts=24), "num_experts"),
        (dict(topk_idx=np.array([[0, 99]])), "topk_idx"),
        (dict(topk_idx=np.array([[1, 1]])), "topk_idx"),
        (dict(topk_idx=np.array([0, 1])), "topk_idx"),
    ],
)
def test_bad_input(kwargs: dict, argument: str) -> None:
    args = dict(topk_idx=np.array([[0, 1]]), rank=0, num_experts=16)
    args.update(kwargs)
    idx = args.pop("topk_idx")
    with pytest.raises(InvalidArgumentError) as err:
        schedule(idx, cm384(16), **args)  # type: ignore[arg-type]
    assert err.value.argument == argument
