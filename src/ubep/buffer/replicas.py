"""A Buffer's routing of a caller's logical ``topk_idx`` to the physical slots it sends to.

With ``BufferConfig(expert_map=...)`` (``ubep.expert_map``) every dispatch routes each pick to
one live replica before anything else sees it, so the native engine, the scheduler and the
handle work on physical slots as without a map. A masking Buffer serving over its members
routes the same way with the masked ranks out, then renumbers slots for the members' Buffer.
The call runs inside the Buffer's dispatch, before the data plane: bad ids are a clean reject
on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import InvalidArgumentError
from ..expert_map import ExpertMap, ReplicaTable, replica_table, route_topk
from .checks import to_array

__all__ = ["LogicalRouting"]


class LogicalRouting:
    """``topk_idx`` (logical) -> the physical ids a Buffer sends (callable).

    Args:
        expert_map: the map (a masking Buffer without one passes the identity).
        num_slots: physical slots (``config.num_experts``).
        num_ranks: ranks the slots are spread over (original numbers).
        hop_row: hop class from this rank to each rank (the group topology's).
        num_topk: picks per token.
        masked: ranks out of service (their replicas are never chosen).
        to_inner: ``[num_slots + 1]`` table, original slot + 1 -> the id the Buffer under this
            routing knows (a members' Buffer); ``None``: the physical slot itself.
    """

    def __init__(self, expert_map: ExpertMap, num_slots: int, num_ranks: int,
                 hop_row: np.ndarray, num_topk: int, masked: Sequence[int] = (),
                 to_inner: np.ndarray | None = None) -> None:
        self.expert_map = expert_map
        self.num_topk = num_topk
        self.table: ReplicaTable = replica_table(expert_map, hop_row, masked,
                                                 num_slots // num_ranks)
        self.to_inner = to_inner
        self.last_physical: np.ndarray | None = None  # the last call's, in original slots
        self._pinned: np.ndarray | None = None

    def pin(self, physical: np.ndarray) -> None:
        """Route the next call with these physical ids (original slots; ``to_inner`` drops
        those on a rank now masked) instead of its own: the completion of a call that saw a
        loss keeps the routing it was issued with."""
        self._pinned = physical

    def __call__(self, topk_idx: object) -> np.ndarray:
        idx = to_array(topk_idx, "topk_idx")
        if idx.ndim != 2 or idx.shape[1] != self.num_topk:
            raise InvalidArgumentError("topk_idx", idx.shape,
                                       f"must be [num_tokens, num_topk={self.num_topk}]")
        if idx.dtype.kind not in "iu":
            raise InvalidArgumentError("topk_idx", idx.dtype, "must be an integer array")
        idx = np.ascontiguousarray(idx, dtype=np.int64)
        # logical ids in [-1, num_logical); one expert twice in a row needs no check here: both
        # picks meet on one slot, which the engine refuses as it refuses any repeated id
        if idx.size:
            lo, hi = int(idx.min()), int(idx.max())
            if lo < -1 or hi >= self.expert_map.num_logical:
                raise InvalidArgumentError(
                    "topk_idx", lo if lo < -1 else hi, "logical expert id out of range [-1, "
                    f"{self.expert_map.num_logical}) (expert_map.num_logical)")
        pinned, self._pinned = self._pinned, None
        if pinned is not None and pinned.shape == idx.shape:
            phys = pinned  # to_inner drops the slots of the masked ranks
        else:
            phys = route_topk(idx, self.table)
        self.last_physical = phys
        if self.to_inner is None:
            return phys
        return np.ascontiguousarray(self.to_inner[phys + 1])
