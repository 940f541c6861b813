"""A Buffer with redundant experts (``BufferConfig(expert_map=...)``, or the same map's routing
handed in as ``Buffer(..., routing=...)``) against the oracle given the same map: callers route
in logical ids, every rank's picks reach one replica by the stated rule, results are bit-exact;
bad logical ids are a clean reject on every rank."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from tests._runtime_support import Case, make_inputs
from ubep import testing
from ubep.buffer import Buffer
from ubep.buffer.replicas import LogicalRouting
from ubep.errors import InvalidArgumentError, RemoteError
from ubep.expert_map import ExpertMap
from ubep.runtime import launch

RANKS = 3
SLOTS_PER_RANK = 8  # Case.config: 8 experts per rank with uniform routing


def replicated_map(num_ranks: int, replicated: int) -> ExpertMap:
    """Six logical experts per rank on its first six slots (rank-major); the two spare slots of
    every other rank hold replicas of rank ``replicated``'s experts, in order, as far as they
    go (all six with four ranks); that rank's own spares hold replicas of the first two
    experts of the next rank."""
    L, primary = SLOTS_PER_RANK, 6
    replicas = [[r * L + j] for r in range(num_ranks) for j in range(primary)]
    spares = [r * L + primary + j for r in range(num_ranks) if r != replicated for j in range(2)]
    for j, slot in enumerate(spares[:primary]):
        replicas[replicated * primary + j].append(slot)
    nxt = (replicated + 1) % num_ranks
    for j in range(2):
        replicas[nxt * primary + j].append(replicated * L + primary + j)
    return ExpertMap(replicas)


def _serve_with_map(group: Any, cases: list[Case], steps: int) -> list[str]:
    errors: list[str] = []
    emap = replicated_map(group.num_ranks, 1)
    for case in cases:
        cfg = case.config(32, expert_map=emap, timeout_s=30.0)
        with Buffer(group, cfg) as buf:
            for i in range(steps):
                tokens = [32, 0, 17]  # a rank with no tokens too
                xs, idxs, ws = make_inputs(case, emap.num_logical, tokens, i, "uniform")
                errors += [f"{case} step {i}: {e}"
                           for e in testing.check_call(buf, xs, idxs, ws, i)]
    return errors


CASES = [
    Case("asp", "sw", "expert", "bf16", RANKS, 256, "uniform"),
    Case("bsp", "tff", "rank", "bf16", RANKS, 256, "uniform"),
    Case("asp", "dc", "rank", "fp16", RANKS, 128, "uniform"),
    Case("bsp", "sp", "expert", "fp32", RANKS, 64, "uniform"),
]


def test_a_buffer_with_an_expert_map_is_bit_exact_against_the_oracle_with_the_map() -> None:
    results = launch(_serve_with_map, RANKS, CASES, 3, timeout_s=180)
    assert results == [[]] * RANKS


def _handed_routing(group: Any) -> list[Any]:
    """A Buffer without a map in its config, handed the map's routing (what the masking Buffer
    hands its members' Buffer), checked against the oracle given the map; then a routing that
    is none and one handed to a masking config, each refused naming the argument."""
    case = CASES[1]
    emap = replicated_map(group.num_ranks, 1)
    mapped = case.config(16, expert_map=emap, timeout_s=30.0)
    plain = dataclasses.replace(mapped, expert_map=None)
    route = LogicalRouting(emap, plain.num_experts, group.num_ranks,
                           group.topology.hop_matrix()[group.rank], plain.num_topk)
    out: list[Any] = []
    with Buffer(group, plain, routing=route) as buf:
        # what check_call's oracle reads: the config with the map the routing applies
        seen = SimpleNamespace(config=mapped, rank=buf.rank, group=buf.group,
                               dispatch=buf.dispatch, combine=buf.combine)
        for i in range(2):
            xs, idxs, ws = make_inputs(case, emap.num_logical, [16, 0, 9], i, "uniform")
            out += testing.check_call(seen, xs, idxs, ws, i)
        res = buf.dispatch(xs[buf.rank], idxs[buf.rank], ws[buf.rank])
        out.append(res.handle.buffer_uid == buf.uid and len(set(group.allgather(buf.uid))) == 1)
    for config, routing in ((plain, object()),
                            (dataclasses.replace(plain, on_peer_loss="mask"), route)):
        try:
            Buffer(group, config, routing=routing)  # type: ignore[arg-type]
            out.append("built")
        except InvalidArgumentError as exc:
            out.append(exc.argument)
    return out


def test_a_buffer_handed_a_routing_is_bit_exact_against_the_oracle_with_its_map() -> None:
    assert launch(_handed_routing, RANKS, timeout_s=180) == [[True, "routing", "routing"]] * RANKS


def _bad_logical_id(group: Any) -> list[str]:
    case = CASES[0]
    emap = replicated_map(group.num_ranks, 1)
    cfg = case.config(8, expert_map=emap, timeout_s=30.0)
    seen = []
    with Buffer(group, cfg) as buf:
        xs, idxs, ws = make_inputs(case, emap.num_logical, [8] * RANKS, 1, "uniform")
        idx = idxs[buf.rank].copy()
        if buf.rank == 1:
            idx[0, 0] = emap.num_logical  # a physical slot id, but no logical expert
        try:
            buf.dispatch(xs[buf.rank], idx, ws[buf.rank])
            seen.append("ok")
        except InvalidArgumentError as exc:
            seen.append(f"invalid {exc.argument}")
        except RemoteError as exc:
            seen.append(f"remote clean={exc.clean}")
        seen += testing.check_call(buf, xs, idxs, ws, 2)  # the next call works
    return seen


def test_a_bad_logical_id_is_a_clean_reject_on_every_rank() -> None:
    assert launch(_bad_logical_id, RANKS, timeout_s=120) == [
        ["remote clean=True"], ["invalid topk_idx"], ["remote clean=True"]]


def test_the_test_map_replicates_the_experts_of_a_rank_on_the_others() -> None:
    emap = replicated_map(4, 3)
    assert emap.num_logical == 24 and emap.num_slots_used == 32
    for e in range(18, 24):  # rank 3's experts: a replica on another rank each
        assert emap.replicas[e][0] // SLOTS_PER_RANK == 3
        assert len({s // SLOTS_PER_RANK for s in emap.replicas[e]}) == 2
