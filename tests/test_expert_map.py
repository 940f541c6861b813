"""Redundant experts (``ubep.expert_map``): the map's checks, and the routing rule against a
brute-force loop over every pick that states the rule from scratch."""

from __future__ import annotations

import numpy as np
import pytest

from ubep import expert_map, reference
from ubep.buffer import BufferConfig
from ubep.errors import InvalidArgumentError
from ubep.expert_map import ExpertMap, replica_table, route_topk
from ubep.routing import uniform_topk
from ubep.sched import objective_ns, schedule, send_units
from ubep.topology import Topology, cm384, host


def brute_force(idx: np.ndarray, emap: ExpertMap, src: int, hops: np.ndarray,
                masked: set[int], slots_per_rank: int) -> np.ndarray:
    """The rule, one pick at a time: live replicas, the nearest hop class, round-robin by
    token index in the map's order; none live: -1."""
    out = np.full(idx.shape, -1, dtype=np.int64)
    for t in range(idx.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e < 0:
                continue
            live = [s for s in emap.replicas[e] if s // slots_per_rank not in masked]
            if not live:
                continue
            best = min(hops[src, s // slots_per_rank] for s in live)
            near = [s for s in live if hops[src, s // slots_per_rank] == best]
            out[t, k] = near[t % len(near)]
    return out


def random_map(rng: np.random.Generator, num_slots: int, num_logical: int) -> ExpertMap:
    """Every logical expert on one slot, the spare slots given to random experts."""
    slots = rng.permutation(num_slots)
    replicas: list[list[int]] = [[int(s)] for s in slots[:num_logical]]
    for s in slots[num_logical:]:
        if rng.random() < 0.8:  # some spare slots stay idle
            replicas[int(rng.integers(num_logical))].append(int(s))
    return ExpertMap(replicas)


TWO_TIERS = Topology(num_ranks=8, ranks_per_node=4, cores_per_rank=1,
                     latency_ns=(0.0, 1.0, 5.0), bandwidth_gbps=(1.0, 1.0, 1.0))


@pytest.mark.parametrize("lookup", [True, False], ids=["lookup", "per-pick"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("topology", [host(8), TWO_TIERS], ids=["one-tier", "two-tiers"])
def test_routing_matches_the_rule_pick_by_pick(seed: int, topology: Topology, lookup: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    if not lookup:  # the path of maps whose lookup table would be too large
        monkeypatch.setattr(expert_map, "_LOOKUP_MAX", 0)
    rng = np.random.default_rng(seed)
    R, per_rank, logical = 8, 6, 30
    emap = random_map(rng, R * per_rank, logical)
    hops = topology.hop_matrix()
    idx = uniform_topk(40, logical, 5, seed=seed, mask_prob=0.1)
    for masked in (set(), {int(rng.integers(R))}, {1, 2, 5}):
        for src in range(R):
            table = replica_table(emap, hops[src], sorted(masked), per_rank)
            assert (table.by_token is not None) == lookup
            got = route_topk(idx, table)
            assert np.array_equal(got, brute_force(idx, emap, src, hops, masked, per_rank))


def test_a_replica_nearer_than_the_primary_wins_and_ties_alternate_by_token() -> None:
    # two tiers, two slots per rank; expert 0: primary slot 10 on rank 5 (the other node from
    # rank 0), replicas on slots 2 and 5 (ranks 1 and 2, rank 0's node)
    emap = ExpertMap([[10, 2, 5], [0], [7]])
    hops = TWO_TIERS.hop_matrix()
    idx = np.array([[0], [0], [0], [1]], dtype=np.int64)
    got = route_topk(idx, replica_table(emap, hops[0], [], 2))
    assert got[:, 0].tolist() == [2, 5, 2, 0]  # slots 2 (rank 1), 5 (rank 2) alternate
    got = route_topk(idx, replica_table(emap, hops[0], [1, 2], 2))
    assert got[:, 0].tolist() == [10, 10, 10, 0]  # only the far replica is live
    got = route_topk(idx, replica_table(emap, hops[0], [0, 1, 2, 5], 2))
    assert got[:, 0].tolist() == [-1, -1, -1, -1]  # no live replica: dropped


@pytest.mark.parametrize("bad, what", [
    ([[0, 1], [1]], "used twice"),
    ([[0], []], "has no slot"),
    ([[0], [-2]], ">= 0"),
    ([[0, 0]], "twice"),
    ([], "non-empty"),
    ([[0], ["a"]], "integers"),
])
def test_bad_maps_are_refused_naming_expert_map(bad: object, what: str) -> None:
    with pytest.raises(InvalidArgumentError, match=what) as err:
        ExpertMap(bad)  # type: ignore[arg-type]
    assert err.value.argument == "expert_map"


def test_a_map_that_does_not_fit_the_buffer_is_refused_by_the_config() -> None:
    base = dict(max_tokens_per_rank=4, hidden=8, num_topk=2, num_experts=8, dtype="bf16")
    cfg = BufferConfig(**base, expert_map=[[0, 4], [1], [2, 7]])  # type: ignore[arg-type]
    assert isinstance(cfg.expert_map, ExpertMap) and cfg.expert_map.num_logical == 3
    for bad in ([[0], [8]], [[0]], [[0, 0]]):  # slot out of range, fewer experts than topk
        with pytest.raises(InvalidArgumentError) as err:
            BufferConfig(**base, expert_map=bad)  # type: ignore[arg-type]
        assert err.value.argument == "expert_map"
    eplb = np.array([[0, 4], [1, -1], [2, 7]])  # an EPLB-style padded array
    assert BufferConfig(**base, expert_map=eplb).expert_map == cfg.expert_map  # type: ignore


def test_the_oracle_with_a_map_is_the_oracle_of_the_physical_routing() -> None:
    R, per_rank, logical, T = 4, 4, 12, 10
    rng = np.random.default_rng(3)
    emap = random_map(rng, R * per_rank, logical)
    xs = [rng.integers(0, 1 << 15, (T, 8)).astype(np.uint16) for _ in range(R)]
    idxs = [uniform_topk(T, logical, 3, seed=r) for r in range(R)]
    ws = [rng.random((T, 3), dtype=np.float32) for _ in range(R)]
    mask = np.array([0, 0, 1, 0])
    got = reference.dispatch(xs, idxs, ws, R * per_rank, expert_map=emap, mask=mask)
    hops = host(R).hop_matrix()
    phys = [brute_force(idxs[r], emap, r, hops, {2}, per_rank) for r in range(R)]
    want = reference.dispatch([x if r != 2 else x[:0] for r, x in enumerate(xs)],
                              [p if r != 2 else p[:0] for r, p in enumerate(phys)],
                              [w if r != 2 else w[:0] for r, w in enumerate(ws)], R * per_rank)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g.recv_x, w.recv_x)
        assert np.array_equal(g.recv_topk_idx, w.recv_topk_idx)
        assert np.array_equal(g.recv_src_rank, w.recv_src_rank)
    assert not any(len(g.recv_x) and (g.recv_topk_idx // per_rank == 2).any() for g in got)


def test_the_scheduler_sees_a_nearer_replica_as_a_shorter_hop() -> None:
    """Two nodes of 16 ranks (cm384); the experts of rank 20 (the other node from rank 0) have
    a replica on rank 5 (rank 0's node): routed from rank 0, their picks become hop-1 units,
    and the plan's objective (1) with latencies exposed drops."""
    topo = cm384(32)
    per_rank = 4
    replicas = [[r * 2 * per_rank + j] for r in range(32) for j in range(per_rank)]
    slots = 2 * 32 * per_rank  # 2 * per_rank slots per rank: the second half are spares
    for j in range(per_rank):  # rank 5's spares hold the replicas
        replicas[20 * per_rank + j].append(5 * 2 * per_rank + per_rank + j)
    emap = ExpertMap(replicas)
    idx = uniform_topk(256, emap.num_logical, 8, seed=1)
    hops = topo.hop_matrix()
    near = route_topk(idx, replica_table(emap, hops[0], [], slots // 32))
    primary = route_topk(idx, replica_table(ExpertMap([[r[0]] for r in replicas]), hops[0],
                                            [], slots // 32))
    units = {name: send_units(i, topo, rank=0, num_experts=slots)
             for name, i in (("near", near), ("primary", primary))}
    moved = int(np.isin(idx, np.arange(20 * per_rank, 21 * per_rank)).sum())
    assert moved > 0
    far = {name: int((u.hop == 2).sum()) for name, u in units.items()}
    assert far["primary"] - far["near"] == moved  # every pick of rank 20 now stays in the node
    # with the hop latencies exposed (cm384: hop 2 costs more than hop 1), the plan is faster
    cost = {name: objective_ns(schedule(i, topo, rank=0, num_experts=slots), topo,
                               token_bytes=7168 * 2, latency_exposure=1.0)
            for name, i in (("near", near), ("primary", primary))}
    assert cost["near"] < cost["primary"]
