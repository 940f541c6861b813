"""``schedule``: which send core issues which unit of one rank, in which order.

``schedule`` builds the send units of one rank (``ubep.sched.units``), splits the rank's cores
into count and send cores (Appendix A's partition model unless given), and hands the units to one
of three policies: the baselines ``expert_contiguous`` (CANN-EP) and ``balanced`` (UBEP without
mapping) in :mod:`ubep.sched.baselines`, and UBEP's ``hierarchical`` remap-and-slice scheduler in
:mod:`ubep.sched.hierarchical`.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..errors import InvalidArgumentError
from ..modes import POLICIES
from ..topology import Topology
from .baselines import balanced, expert_contiguous
from .hierarchical import hierarchical, hop_issue_rank, remapped_expert_order
from .partition import partition
from .plan import CoreSplit, Plan, ScheduleSpec, count_expert_ptr
from .units import SendUnits, hop_row, send_units

__all__ = ["core_split", "schedule", "schedule_spec"]


def schedule(
    topk_idx: object,
    topology: Topology,
    *,
    rank: int,
    num_experts: int,
    policy: str = "hierarchical",
    num_send_cores: int | None = None,
    num_count_cores: int | None = None,
    layout: str = "expert",
) -> Plan:
    """Plan the sends of ``rank`` for ``topk_idx [num_tokens, num_topk]`` (int64, -1 = none).

    Core split: with both counts ``None``, Appendix A's partition model over
    ``topology.cores_per_rank`` (default constants of :func:`ubep.sched.partition`); with one
    given, the other gets the remaining cores (at least 1); with both given they are used as is.
    Each must be ``<= cores_per_rank``. When the two add up to more than ``cores_per_rank`` the
    groups share cores (what a BSP engine does: every core counts, then sends); with one core per
    rank the split is 1 + 1 on that core.
    """
    if policy not in POLICIES:
        raise InvalidArgumentError("policy", policy, f"must be one of {POLICIES}")
    units = send_units(topk_idx, topology, rank=rank, num_experts=num_experts, layout=layout)
    n_send, n_count = _core_split(
        topology.cores_per_rank, num_send_cores, num_count_cores, num_experts, units
    )
    if policy == "expert_contiguous":
        order, core = expert_contiguous(units, n_send, num_experts)
    elif policy == "balanced":
        order, core = balanced(units, n_send)
    else:
        order, core = hierarchical(units, n_send, num_experts, topology)
    core_ptr = np.zeros(n_send + 1, dtype=np.int64)
    np.cumsum(np.bincount(core, minlength=n_send), out=core_ptr[1:])
    count_ptr = count_expert_ptr(n_count, num_experts)
    return Plan(
        rank=int(rank),
        num_ranks=topology.num_ranks,
        num_experts=int(num_experts),
        layout=layout,
        policy=policy,
        num_send_cores=n_send,
        num_count_cores=n_count,
        send_token=units.token[order],
        send_k=units.k[order],
        send_expert=units.expert[order],
        send_dst_rank=units.dst_rank[order],
        send_hop=units.hop[order],
        send_slot=units.slot[order],
        send_core=core.astype(np.int32),
        core_ptr=core_ptr,
        count_expert_ptr=count_ptr,
    )


def _check_cores(name: str, value: int | None, cores: int) -> None:
    if value is None:
        return
    if not isinstance(value, (int, np.integer)) or not 1 <= value <= cores:
        raise InvalidArgumentError(
            name, value, f"must be an integer in [1, cores_per_rank={cores}]"
        )


@lru_cache(maxsize=256)
def core_split(cores: int, num_experts: int, num_topk: int, num_tokens: int) -> CoreSplit:
    """Appendix A's split of ``cores`` for a batch (what :func:`schedule` uses when no split
    is given), with the count cores' experts; cached: the runtime asks once per batch size."""
    if cores == 1:
        n_send, n_count = 1, 1
    else:
        part = partition(cores, num_experts, max(1, num_topk), max(1, num_tokens))
        n_send, n_count = part.num_send_cores, part.num_count_cores
    ptr = count_expert_ptr(n_count, num_experts)
    ptr.flags.writeable = False  # shared by every caller of the cache
    return CoreSplit(num_send_cores=n_send, num_count_cores=n_count, count_expert_ptr=ptr)


def _core_split(
    cores: int,
    num_send_cores: int | None,
    num_count_cores: int | None,
    num_experts: int,
    units: SendUnits,
) -> tuple[int, int]:
    _check_cores("num_send_cores", num_send_cores, cores)
    _check_cores("num_count_cores", num_count_cores, cores)
    if num_send_cores is not None and num_count_cores is not None:
        return int(num_send_cores), int(num_count_cores)
    if num_send_cores is not None:
        return int(num_send_cores), max(1, cores - int(num_send_cores))
    if num_count_cores is not None:
        return max(1, cores - int(num_count_cores)), int(num_count_cores)
    split = core_split(cores, num_experts, units.num_topk, units.num_tokens)
    return split.num_send_cores, split.num_count_cores


def schedule_spec(split: CoreSplit, topology: Topology, *, rank: int, num_experts: int,
                  policy: str = "hierarchical") -> ScheduleSpec:
    """What the runtime's native scheduler needs to build ``rank``'s Plan under ``split``
    (:class:`ScheduleSpec`); a Buffer makes one per batch size and reuses it."""
    if policy not in POLICIES:
        raise InvalidArgumentError("policy", policy, f"must be one of {POLICIES}")
    n = split.num_send_cores
    return ScheduleSpec(
        num_send_cores=n,
        num_count_cores=split.num_count_cores,
        count_expert_ptr=split.count_expert_ptr,
        policy=policy,
        policy_code=POLICIES.index(policy),
        num_hops=topology.num_hops,
        hop_of_rank=hop_row(topology, rank),
        hop_issue_rank=hop_issue_rank(topology),
        remapped_expert=remapped_expert_order(num_experts, n),
    )
