"""Redundant experts: logical experts served by physical expert slots, some on several ranks.

An EPLB-style deployment places hot or critical experts on two ranks. :class:`ExpertMap` says
where: ``replicas[e]`` are the physical slots of logical expert ``e``. Physical slots are the
Buffer's ``num_experts``, ``num_experts // num_ranks`` per rank as without a map (slot ``s``
lives on rank ``s // slots_per_rank``). Callers route in logical ids (``topk_idx``); the Buffer,
the oracle (``ubep.reference``) and the scheduler see the physical routing this module makes.

**The rule** (:func:`route_topk`): the pick ``(t, k)`` of logical expert ``e`` sent by rank
``src`` goes to one live replica of ``e``: of its slots on ranks not masked, those on the
nearest hop class from ``src`` (``Topology.hop_matrix()[src]``: hop 0 is ``src`` itself), in
the map's order; of those, the ``t mod n``-th (round-robin by token index). A pick with no live
replica becomes -1: dropped, as a slot on a masked rank is without a map. The same routing,
map, mask and topology give the same physical routing on every rank and in the oracle. Two
picks of one token never meet on one slot: the slots of distinct logical experts are distinct.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import InvalidArgumentError

__all__ = ["ExpertMap", "ReplicaTable", "replica_table", "route_topk"]

# entries of ReplicaTable.by_token at most (8 MiB): beyond, the rule is computed per pick
_LOOKUP_MAX = 1 << 20


@dataclass(frozen=True)
class ExpertMap:
    """Logical expert -> its physical slots (``replicas[e]``, the first is its primary).

    Every logical expert has at least one slot and no slot serves two experts (or one twice);
    slots no expert names stay idle. Built from any sequence of sequences of slot ids, or from
    an EPLB-style ``[num_logical, max_replicas]`` integer array padded with -1; checked against
    a Buffer's shape by :meth:`check_shape`. Errors name ``expert_map``.
    """

    replicas: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        raw: object = self.replicas
        if isinstance(raw, np.ndarray) and raw.ndim == 2 and raw.dtype.kind in "iu":
            raw = [[int(s) for s in row if s != -1] for row in raw]
        if isinstance(raw, (str, bytes, np.ndarray)) or not isinstance(raw, Sequence) or not raw:
            raise InvalidArgumentError("expert_map", type(raw).__name__, "must be a non-empty "
                                       "sequence: logical expert -> sequence of physical slots")
        replicas = tuple(_slots_of(e, slots) for e, slots in enumerate(raw))
        seen: dict[int, int] = {}
        for e, slots in enumerate(replicas):
            for s in slots:
                if s in seen:
                    raise InvalidArgumentError(
                        "expert_map", s, f"physical slot {s} is used twice (logical experts "
                        f"{seen[s]} and {e})")
                seen[s] = e
        object.__setattr__(self, "replicas", replicas)

    @property
    def num_logical(self) -> int:
        """Logical experts (the range of a caller's ``topk_idx``)."""
        return len(self.replicas)

    @property
    def num_slots_used(self) -> int:
        return sum(len(s) for s in self.replicas)

    @staticmethod
    def identity(num_experts: int) -> ExpertMap:
        """Logical expert ``e`` on slot ``e`` alone (what a Buffer without a map does)."""
        return ExpertMap(tuple((e,) for e in range(num_experts)))

    def check_shape(self, num_slots: int, num_topk: int) -> None:
        """Refuse a map that does not fit a Buffer of ``num_slots`` physical slots and
        ``num_topk`` picks per token (naming ``expert_map``)."""
        top = max(max(s) for s in self.replicas)
        if top >= num_slots:
            raise InvalidArgumentError("expert_map", top, f"physical slot out of range [0, "
                                       f"{num_slots}) (num_experts: the Buffer's slots)")
        if num_topk > self.num_logical:
            raise InvalidArgumentError("expert_map", self.num_logical, f"has fewer logical "
                                       f"experts than num_topk={num_topk}")


def _slots_of(expert: int, slots: object) -> tuple[int, ...]:
    if isinstance(slots, (int, np.integer)) and not isinstance(slots, bool):
        slots = (slots,)
    if isinstance(slots, (str, bytes)) or not isinstance(slots, (Sequence, np.ndarray)):
        raise InvalidArgumentError("expert_map", slots, f"logical expert {expert}: must be a "
                                   "sequence of physical slot ids")
    out = []
    for s in slots:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise InvalidArgumentError("expert_map", s, f"logical expert {expert}: slot ids "
                                       "must be integers >= 0")
        out.append(int(s))
    if not out:
        raise InvalidArgumentError("expert_map", [], f"logical expert {expert} has no slot")
    if len(set(out)) != len(out):
        raise InvalidArgumentError("expert_map", out, f"logical expert {expert} names a "
                                   "slot twice")
    return tuple(out)


@dataclass(frozen=True)
class ReplicaTable:
    """One sender's candidates per logical expert under one mask (:func:`replica_table`).

    Attributes:
        slots: ``[num_logical, max_replicas]`` int64, the candidates in the map's order, then -1.
        count: ``[num_logical]`` int64, candidates per expert (0: no live replica).
        by_token: ``[num_logical + 1, period]`` int64: row ``e + 1`` is the slot the pick of
            expert ``e`` goes to for each token index mod ``period`` (the least common multiple
            of the counts); row 0 (a -1 pick) and experts with no candidate are -1. The rule
            in one lookup; ``None`` when the period would be large (then computed per pick).
        period: its number of columns.
    """

    slots: np.ndarray
    count: np.ndarray
    by_token: np.ndarray | None
    period: int


def replica_table(expert_map: ExpertMap, hop_row: np.ndarray, masked: Sequence[int],
                  slots_per_rank: int) -> ReplicaTable:
    """The candidates of every logical expert for a sender whose hop class to each rank is
    ``hop_row``, with the ranks ``masked`` out: its live replicas on the nearest hop class."""
    hops = np.asarray(hop_row)
    dead = set(int(r) for r in masked)
    width = max(len(s) for s in expert_map.replicas)
    slots = np.full((expert_map.num_logical, width), -1, dtype=np.int64)
    count = np.zeros(expert_map.num_logical, dtype=np.int64)
    for e, replicas in enumerate(expert_map.replicas):
        live = [s for s in replicas if s // slots_per_rank not in dead]
        if not live:
            continue
        nearest = min(int(hops[s // slots_per_rank]) for s in live)
        near = [s for s in live if int(hops[s // slots_per_rank]) == nearest]
        slots[e, :len(near)] = near
        count[e] = len(near)
    period = math.lcm(*(int(n) for n in count if n > 0)) if count.any() else 1
    if period * (expert_map.num_logical + 1) > _LOOKUP_MAX:
        return ReplicaTable(slots, count, None, period)
    by_token = np.full((expert_map.num_logical + 1, period), -1, dtype=np.int64)
    served = count > 0
    col = np.arange(period, dtype=np.int64)
    by_token[1:][served] = slots[served][np.arange(int(served.sum()))[:, None],
                                         col[None, :] % count[served][:, None]]
    return ReplicaTable(slots, count, by_token, period)


def route_topk(topk_idx: np.ndarray, table: ReplicaTable) -> np.ndarray:
    """Physical ``topk_idx`` (int64, -1 = dropped) of a logical one (ids in ``[-1,
    num_logical)``, checked by the caller) by the module's rule."""
    idx = np.asarray(topk_idx, dtype=np.int64)
    if table.by_token is not None:  # one lookup by (expert, token index mod period)
        col = np.arange(idx.shape[0], dtype=np.int64) % table.period
        out: np.ndarray = table.by_token[idx + 1, col[:, None]]
        return out
    valid = idx >= 0
    e = np.where(valid, idx, 0)
    n = table.count[e]
    token = np.arange(idx.shape[0], dtype=np.int64)[:, None]
    out = table.slots[e, token % np.maximum(n, 1)]
    out[~valid | (n == 0)] = -1
    return out
