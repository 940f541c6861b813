"""Combine plans: every expert rank sends its received rows back to the tokens' home ranks.

The dispatch plans say which rows each rank receives; combine reverses them. A combine unit at
rank ``r`` is one row ``(src rank s, token t, k)`` that ``r`` received, now sent back to ``s``
(``send_dst_rank = s``, ``send_token = t``). Core assignment follows the dispatch policy:

* ``expert_contiguous`` and ``balanced``: contiguous equal slices of the receive buffer
  (``(expert, src, slot)`` order in the expert layout, ``(src, slot)`` in the rank layout)
  (CANN EP splits its combine by rows; a one-expert rank would otherwise put every row on one
  core);
* ``hierarchical``: rows in hop-class order dealt round robin over the send cores, so every core
  has the same number of rows (within one) and the same mix of hop classes; farthest hop first
  inside a core.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import InvalidArgumentError
from ..topology import Topology
from .plan import POLICIES, Plan

__all__ = ["combine_plans"]


def combine_plans(dispatch_plans: Sequence[Plan], topology: Topology, *,
                  policy: str) -> tuple[Plan, ...]:
    """The combine plan of every rank for the rows its dispatch plans delivered."""
    if policy not in POLICIES:
        raise InvalidArgumentError("policy", policy, f"must be one of {POLICIES}")
    R = topology.num_ranks
    if len(dispatch_plans) != R:
        raise InvalidArgumentError("dispatch_plans", len(dispatch_plans), f"needs {R} plans")
    src = np.concatenate([np.full(p.num_units, p.rank, dtype=np.int64) for p in dispatch_plans])
    dst = np.concatenate([p.send_dst_rank for p in dispatch_plans]).astype(np.int64)
    token = np.concatenate([p.send_token for p in dispatch_plans]).astype(np.int64)
    k = np.concatenate([p.send_k for p in dispatch_plans]).astype(np.int64)
    expert = np.concatenate([p.send_expert for p in dispatch_plans]).astype(np.int64)
    slot = np.concatenate([p.send_slot for p in dispatch_plans]).astype(np.int64)
    # Each rank's receive buffer order: regions per (src, expert), expert-major, in the expert
    # layout; per src in the rank layout (FORMATS / ubep.sched.plan).
    if dispatch_plans[0].layout == "rank":
        order = np.lexsort((slot, src, dst))
    else:
        order = np.lexsort((slot, src, expert, dst))
    bounds = np.searchsorted(dst[order], np.arange(R + 1))
    hops = topology.hop_matrix().astype(np.int64)
    first = dispatch_plans[0]
    n = first.num_send_cores
    out = []
    for r in range(R):
        rows = order[bounds[r]:bounds[r + 1]]
        hop = hops[r, src[rows]]
        m = rows.size
        if policy == "hierarchical":
            seq = np.lexsort((np.arange(m), hop))  # hop-major, buffer order inside a class
            core = np.empty(m, dtype=np.int64)
            core[seq] = np.arange(m) % n
            issue = np.lexsort((np.arange(m), -hop, core))
        else:
            j = np.arange(n + 1, dtype=np.int64)
            q, rem = divmod(m, n)
            cut = j * q + np.minimum(j, rem)
            core = np.searchsorted(cut[1:], np.arange(m), side="right")
            issue = np.arange(m)
        rows, hop, core = rows[issue], hop[issue], core[issue]
        core_ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(core, minlength=n), out=core_ptr[1:])
        out.append(Plan(
            rank=r, num_ranks=R, num_experts=first.num_experts, layout=first.layout,
            policy=policy, num_send_cores=n, num_count_cores=first.num_count_cores,
            send_token=token[rows], send_k=k[rows], send_expert=expert[rows],
            send_dst_rank=src[rows], send_hop=hop, send_slot=token[rows],
            send_core=core.astype(np.int32), core_ptr=core_ptr,
            count_expert_ptr=first.count_expert_ptr,
        ))
    return tuple(out)
