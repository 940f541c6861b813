"""Redundant experts in the simulator: logical routing -> the physical routing a Buffer sends.

A deployment with an :class:`~ubep.expert_map.ExpertMap` routes each logical pick to one live
replica (``ubep.expert_map``'s rule: the nearest hop class from the sender, then round-robin by
token). The simulator applies that rule with the module's own :func:`replica_table` and
:func:`route_topk` -- the code a Buffer and the oracle run -- and then plans and times the
physical routing as any other: a replica on a nearer tier turns the pick into a shorter hop.

A masked rank (a lost peer) sends nothing (its ``topk_idx`` is emptied, as the oracle empties
it) and no pick goes to its slots; it stays in the modelled fabric, idle apart from its count
words, so its (early) end never sets the call's latency.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import InvalidArgumentError
from ..expert_map import ExpertMap, replica_table, route_topk
from ..topology import Topology

__all__ = ["check_masked", "physical_topk"]


def check_masked(masked: Sequence[int], num_ranks: int) -> tuple[int, ...]:
    """The masked ranks as a sorted tuple, each in ``[0, num_ranks)`` (errors name
    ``masked_ranks``)."""
    out = set()
    for r in masked:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) \
                or not 0 <= int(r) < num_ranks:
            raise InvalidArgumentError("masked_ranks", r, f"must be ranks in [0, {num_ranks})")
        out.add(int(r))
    if len(out) >= num_ranks:
        raise InvalidArgumentError("masked_ranks", sorted(out), "must leave one rank serving")
    return tuple(sorted(out))


def physical_topk(
    topk_per_rank: Sequence[np.ndarray],
    topology: Topology,
    *,
    num_experts: int,
    expert_map: ExpertMap | None,
    masked_ranks: Sequence[int] = (),
) -> list[np.ndarray]:
    """Every rank's physical ``topk_idx`` (``num_experts`` physical slots, ``num_experts //
    num_ranks`` per rank) for its logical one under ``expert_map`` (``None``: the identity)
    with ``masked_ranks`` out of service."""
    R = topology.num_ranks
    masked = check_masked(masked_ranks, R)
    if expert_map is None:
        if not masked:
            return [np.asarray(t) for t in topk_per_rank]
        expert_map = ExpertMap.identity(num_experts)
    if not isinstance(expert_map, ExpertMap):
        raise InvalidArgumentError("expert_map", type(expert_map).__name__,
                                   "must be a ubep.ExpertMap")
    if num_experts % R:
        raise InvalidArgumentError("num_experts", num_experts, f"must be a multiple of {R}")
    num_topk = int(np.asarray(topk_per_rank[0]).shape[1]) if len(topk_per_rank) else 0
    expert_map.check_shape(num_experts, num_topk)
    hops = topology.hop_matrix()
    out = []
    for r, idx in enumerate(topk_per_rank):
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (int(idx.min()) < -1 or int(idx.max()) >= expert_map.num_logical):
            raise InvalidArgumentError("topk_per_rank", r, "logical expert id out of range "
                                       f"[-1, {expert_map.num_logical}) (expert_map)")
        if r in masked:
            out.append(idx[:0])
            continue
        table = replica_table(expert_map, hops[r], masked, num_experts // R)
        out.append(route_topk(idx, table))
    return out
