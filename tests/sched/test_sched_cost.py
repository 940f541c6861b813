"""Objective (1), the ordered completion model, and the MILP optimum against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ubep.errors import InvalidArgumentError
from ubep.routing import uniform_topk, zipf_topk
from ubep.sched import (
    Plan,
    core_times_ns,
    objective_ns,
    optimal,
    optimal_classes,
    optimal_units,
    schedule,
)
from ubep.topology import Topology, cm384

TOKEN_BYTES = 7168


def _loop_core_times(plan: Plan, topo: Topology, token_bytes: float, issue_ns: float,
                     ordered: bool, exposure: float = 0.0) -> list[float]:
    out = []
    for j in range(plan.num_send_cores):
        t = far = 0.0
        for h in plan.send_hop[plan.core_units(j)]:
            t += token_bytes / topo.bandwidth_gbps[h] + issue_ns + exposure * topo.latency_ns[h]
            rtt = 2 * topo.latency_ns[h]
            far = max(far, t + rtt) if ordered else max(far, rtt)
        out.append(far if ordered else t + far)
    return out


@pytest.mark.parametrize("policy", ["expert_contiguous", "balanced", "hierarchical"])
@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("exposure", [0.0, 0.25])
def test_core_times_match_loop(policy: str, ordered: bool, exposure: float) -> None:
    topo = Topology(num_ranks=8, ranks_per_node=4, cores_per_rank=6,
                    latency_ns=(100.0, 400.0, 900.0), bandwidth_gbps=(50.0, 20.0, 10.0))
    idx = zipf_topk(30, 16, 3, seed=2, mask_prob=0.1)
    plan = schedule(idx, topo, rank=1, num_experts=16, policy=policy, num_send_cores=5)
    got = core_times_ns(plan, topo, token_bytes=1000, issue_ns=3.0, ordered=ordered,
                        latency_exposure=exposure)
    np.testing.assert_allclose(got, _loop_core_times(plan, topo, 1000, 3.0, ordered, exposure))
    assert objective_ns(plan, topo, token_bytes=1000, issue_ns=3.0, ordered=ordered,
                        latency_exposure=exposure) == pytest.approx(max(got))


def test_farthest_first_minimises_the_ordered_completion() -> None:
    """Jackson's rule: no permutation of a core's units finishes earlier than RTT-descending."""
    topo = cm384(64)
    l_h = TOKEN_BYTES / np.asarray(topo.bandwidth_gbps)
    rtt_h = 2 * np.asarray(topo.latency_ns)
    idx = uniform_topk(6, 64, 8, seed=5)
    plan = schedule(idx, topo, rank=0, num_experts=64, num_send_cores=8)
    times = core_times_ns(plan, topo, token_bytes=TOKEN_BYTES, ordered=True)
    for j in range(plan.num_send_cores):
        hops = plan.send_hop[plan.core_units(j)]
        best = min(
            max(np.cumsum(l_h[list(p)]) + rtt_h[list(p)]) for p in itertools.permutations(hops)
        ) if hops.size else 0.0
        assert times[j] == pytest.approx(best)
    unordered = core_times_ns(plan, topo, token_bytes=TOKEN_BYTES)
    assert np.all(times <= unordered + 1e-9)


def _brute_force(l_ns: np.ndarray, rtt_ns: np.ndarray, n: int) -> float:
    """Minimum of (1) over every assignment of units to n cores with loads <= ceil(m/n)."""
    m = l_ns.size
    cap = -(-m // n)
    assign = np.array(list(itertools.product(range(n), repeat=m)))
    onehot = assign[:, :, None] == np.arange(n)[None, None, :]  # [A, m, n]
    loads = onehot.sum(axis=1)
    ok = np.all(loads <= cap, axis=1)
    busy = (onehot * l_ns[None, :, None]).sum(axis=1)
    far = (onehot * rtt_ns[None, :, None]).max(axis=1)
    return float((busy + far).max(axis=1)[ok].min())


@given(st.integers(0, 8), st.integers(1, 3), st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_unit_milp_matches_brute_force(m: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    l_ns = np.round(rng.uniform(0, 100, m), 1)
    rtt_ns = np.round(rng.uniform(0, 300, m), 1) * (rng.random(m) < 0.8)
    res = optimal_units(l_ns, rtt_ns, n)
    assert res.status == "optimal"
    want = _brute_force(l_ns, rtt_ns, n) if m else 0.0
    assert res.objective_ns == pytest.approx(want, abs=1e-6)
    if m:
        assert np.all(res.y.sum(axis=0) == 1) and res.y.sum(axis=1).max() <= -(-m // n)


@pytest.mark.parametrize("method", ["configurations", "cores"])
@given(st.lists(st.integers(0, 4), min_size=1, max_size=3), st.integers(1, 3),
       st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_class_milp_matches_brute_force(method: str, counts: list[int], n: int,
                                        seed: int) -> None:
    v = np.asarray(counts)
    if v.sum() > 8:
        v = np.minimum(v, 2)
    rng = np.random.default_rng(seed)
    l_c = np.round(rng.uniform(0, 100, v.size), 1)
    rtt_c = np.round(rng.uniform(0, 300, v.size), 1)  # any order: the MILP sorts by RTT
    res = optimal_classes(v, l_c, rtt_c, n, method=method)
    units = np.repeat(np.arange(v.size), v)
    want = _brute_force(l_c[units], rtt_c[units], n) if units.size else 0.0
    assert res.status == "optimal"
    assert res.objective_ns == pytest.approx(want, abs=1e-6)
    np.testing.assert_array_equal(res.y.sum(axis=0), v)


@pytest.mark.parametrize("num_ranks", [16, 64, 256])
def test_optimum_bounds_the_balanced_policies(num_ranks: int) -> None:
    topo = cm384(num_ranks)
    idx = zipf_topk(128, num_ranks, 8, seed=num_ranks)
    plans = [schedule(idx, topo, rank=num_ranks - 1, num_experts=num_ranks, policy=p,
                      num_send_cores=48) for p in ("balanced", "hierarchical")]
    res = optimal(plans[0], topo, token_bytes=TOKEN_BYTES, time_limit_s=30)
    assert res.status == "optimal"
    np.testing.assert_array_equal(res.y.sum(axis=0), plans[0].hop_counts(3).sum(axis=0))
    assert res.y.sum(axis=1).max() <= -(-plans[0].num_units // 48)
    for plan in plans:
        assert res.objective_ns <= objective_ns(plan, topo, token_bytes=TOKEN_BYTES) + 1e-6


@pytest.mark.parametrize("counts", [[2, 25, 37], [0, 19, 45], [7, 112, 137], [5, 56, 963]])
def test_methods_agree_on_cm384_shapes(counts: list[int]) -> None:
    """Both programs on the per-hop counts of real CM384 instances (48 cores), incl. the small
    ones where many cores hold one or two units."""
    topo = cm384(256)
    l_ns = np.full(3, TOKEN_BYTES / 392.0)
    rtt_ns = 2 * np.asarray(topo.latency_ns)
    a = optimal_classes(counts, l_ns, rtt_ns, 48, method="configurations", time_limit_s=60)
    b = optimal_classes(counts, l_ns, rtt_ns, 48, method="cores", time_limit_s=2)
    assert a.status == "optimal"
    if b.status == "optimal":
        assert a.objective_ns == pytest.approx(b.objective_ns)
    else:  # the per-core program may stop at its limit: its bound must still hold
        assert b.bound_ns <= a.objective_ns + 1e-6 <= b.objective_ns + 2e-6
    np.testing.assert_array_equal(a.y.sum(axis=0), counts)
    assert a.y.sum(axis=1).max() <= -(-sum(counts) // 48)


def test_per_core_program_stopped_before_its_first_incumbent_still_answers() -> None:
    """A time limit too short for the solver's first solution gives a feasible assignment
    (every unit placed, within the per-core cap) whose objective and bound bracket the
    optimum of the configurations program, never an error."""
    topo = cm384(256)
    counts = [7, 112, 137]
    l_ns = np.full(3, TOKEN_BYTES / 392.0)
    rtt_ns = 2 * np.asarray(topo.latency_ns)
    best = optimal_classes(counts, l_ns, rtt_ns, 48, method="configurations", time_limit_s=60)
    cut = optimal_classes(counts, l_ns, rtt_ns, 48, method="cores", time_limit_s=1e-6)
    assert best.status == "optimal"
    if cut.status == "time_limit":
        np.testing.assert_array_equal(cut.y.sum(axis=0), counts)
        assert cut.y.sum(axis=1).max() <= -(-sum(counts) // 48)
    assert cut.bound_ns <= best.objective_ns + 1e-6 <= cut.objective_ns + 2e-6


def test_optimal_accepts_hop_arrays() -> None:
    topo = cm384(32)
    hops = np.array([0, 1, 1, 2, 2, 2, 2])
    res = optimal(hops, topo, 3, token_bytes=TOKEN_BYTES)
    want = _brute_force(np.full(7, TOKEN_BYTES / 392.0), 2 * np.asarray(topo.latency_ns)[hops], 3)
    assert res.objective_ns == pytest.approx(want)


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: optimal(np.array([0, 3]), cm384(32), 2, token_bytes=1), "units"),
        (lambda: optimal(np.array([0, 1]), cm384(32), token_bytes=1), "num_send_cores"),
        (lambda: optimal(np.array([0, 1]), cm384(32), 2, token_bytes=0), "token_bytes"),
        (lambda: optimal(np.array([0, 1]), cm384(32), 2, token_bytes=1, time_limit_s=0),
         "time_limit_s"),
        (lambda: optimal_classes([1, -1], [1, 1], [1, 1], 2), "units_per_class"),
        (lambda: optimal_classes([1, 1], [1, 1], [1, 1], 2, method="lp"), "method"),
        (lambda: optimal_classes([1, 1], [1], [1, 1], 2), "l_ns"),
        (lambda: optimal_units([1.0, 2.0], [1.0, np.nan], 2), "rtt_ns"),
        (lambda: optimal_units([1.0], [1.0], 0), "num_send_cores"),
        (lambda: core_times_ns("plan", cm384(32), token_bytes=1), "plan"),  # type: ignore
        (lambda: objective_ns(schedule(np.array([[0]]), cm384(32), rank=0, num_experts=32),
                              cm384(16), token_bytes=1), "topology"),
        (lambda: objective_ns(schedule(np.array([[0]]), cm384(32), rank=0, num_experts=32),
                              cm384(32), token_bytes=1, issue_ns=-1), "issue_ns"),
    ],
)
def test_bad_input(call: object, argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        call()  # type: ignore[operator]
    assert err.value.argument == argument
