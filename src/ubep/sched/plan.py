"""The Plan: which core of a rank sends which unit, in which order.

One plan drives both executors: the runtime moves real bytes by it and the simulator times it.

A *send unit* is one row that crosses to a receiver:
  * ``layout="expert"``: one valid ``(token, k)`` pair, bound for expert ``topk_idx[token, k]``;
  * ``layout="rank"``: one ``(token, dst_rank)`` pair (a token crosses to a rank once however
    many of its experts live there); ``send_k``/``send_expert`` then name the token's first
    (lowest k) expert on that rank.

All ``send_*`` arrays have one entry per unit and are stored in *issue order grouped by core*:
the units of core ``j`` are ``slice(core_ptr[j], core_ptr[j+1])`` and a core issues them in that
order. ``send_slot`` is the unit's row inside its receive region, which the sender computes
locally: regions are partitioned by (source rank, expert) in the expert layout and by source
rank in the rank layout, and rows inside a region are in ascending token order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError
from ..modes import LAYOUTS, POLICIES

# LAYOUTS and POLICIES stay importable from here (ubep.sim imports them); ubep.modes owns them
__all__ = ["LAYOUTS", "POLICIES", "CoreSplit", "Plan", "ScheduleSpec", "count_expert_ptr"]


def count_expert_ptr(num_count_cores: int, num_experts: int) -> np.ndarray:
    """``[num_count_cores + 1]`` int64: count core ``c`` owns the contiguous experts
    ``[ptr[c], ptr[c+1])`` (an even split)."""
    return (np.arange(num_count_cores + 1, dtype=np.int64) * num_experts) // num_count_cores


@dataclass(frozen=True)
class CoreSplit:
    """A rank's count/send core split without send units: what the runtime executes when one
    core sends (every policy gives that core every unit, and the engine's per-destination
    buckets, in the order destinations' counts arrive, are that plan's units). Fields as
    :class:`Plan`'s of the same names."""

    num_send_cores: int
    num_count_cores: int
    count_expert_ptr: np.ndarray


@dataclass(frozen=True)
class ScheduleSpec:
    """A rank's count/send split with what the runtime's native scheduler needs to build the
    :class:`Plan` of a call itself, from the routing it validates (no Python per call): the
    policy and its tables for this rank and this number of send cores. The native scheduler
    reproduces :func:`ubep.sched.schedule`'s Plan unit for unit. Fields as :class:`CoreSplit`'s,
    and:

    Attributes:
        policy: the scheduler; ``policy_code`` its index in :data:`POLICIES`.
        num_hops: hop classes of the topology.
        hop_of_rank: ``[num_ranks]`` int64 hop class from this rank to each rank.
        hop_issue_rank: ``[num_hops]`` int64 position of each hop class in a core's issue order
            (hierarchical: farthest first).
        remapped_expert: ``[num_experts]`` int64 each expert's position in the remapped order
            for ``num_send_cores`` rows (the logical matrix transposition).
    """

    num_send_cores: int
    num_count_cores: int
    count_expert_ptr: np.ndarray
    policy: str
    policy_code: int
    num_hops: int
    hop_of_rank: np.ndarray
    hop_issue_rank: np.ndarray
    remapped_expert: np.ndarray


@dataclass(frozen=True)
class Plan:
    """Per-core ordered send lists of one rank, plus its count tasks.

    Attributes:
        rank: the sending rank.
        num_ranks, num_experts: fabric and model size the plan was made for.
        layout: ``"expert"`` or ``"rank"`` (see module docstring).
        policy: the scheduler that produced it.
        num_send_cores: cores that move payload (``send_core`` values lie in ``[0, n)``).
        num_count_cores: cores that count tokens per expert and publish counts / prefix sums.
        send_token, send_k, send_expert, send_dst_rank, send_hop, send_slot: ``[U]`` int64.
        send_core: ``[U]`` int32, non-decreasing (grouped by core).
        core_ptr: ``[num_send_cores + 1]`` int64 CSR offsets into the unit arrays.
        count_expert_ptr: ``[num_count_cores + 1]`` int64; count core ``c`` owns the contiguous
            experts ``[count_expert_ptr[c], count_expert_ptr[c+1])``.
    """

    rank: int
    num_ranks: int
    num_experts: int
    layout: str
    policy: str
    num_send_cores: int
    num_count_cores: int
    send_token: np.ndarray
    send_k: np.ndarray
    send_expert: np.ndarray
    send_dst_rank: np.ndarray
    send_hop: np.ndarray
    send_slot: np.ndarray
    send_core: np.ndarray
    core_ptr: np.ndarray
    count_expert_ptr: np.ndarray

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise InvalidArgumentError("layout", self.layout, f"must be one of {LAYOUTS}")
        n = len(self.send_token)
        for name in ("send_k", "send_expert", "send_dst_rank", "send_hop", "send_slot",
                     "send_core"):
            if len(getattr(self, name)) != n:
                raise InvalidArgumentError(name, len(getattr(self, name)), f"length must be {n}")
        if len(self.core_ptr) != self.num_send_cores + 1 or self.core_ptr[-1] != n:
            raise InvalidArgumentError("core_ptr", self.core_ptr, "must be CSR offsets of units")
        if len(self.count_expert_ptr) != self.num_count_cores + 1:
            raise InvalidArgumentError(
                "count_expert_ptr", self.count_expert_ptr, "needs num_count_cores + 1 entries"
            )
        for arr in (self.send_token, self.send_expert, self.send_core, self.core_ptr):
            arr.flags.writeable = False

    @property
    def num_units(self) -> int:
        return len(self.send_token)

    def core_units(self, core: int) -> slice:
        """Slice of the unit arrays that core ``core`` issues, in issue order."""
        return slice(int(self.core_ptr[core]), int(self.core_ptr[core + 1]))

    def core_loads(self) -> np.ndarray:
        """``[num_send_cores]`` units per core."""
        return np.diff(self.core_ptr)

    def hop_counts(self, num_hops: int) -> np.ndarray:
        """``[num_send_cores, num_hops]`` units per (core, hop class): the paper's ``v[j, h]``."""
        out = np.zeros((self.num_send_cores, num_hops), dtype=np.int64)
        np.add.at(out, (self.send_core.astype(np.int64), self.send_hop), 1)
        return out
