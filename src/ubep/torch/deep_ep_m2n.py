"""The DeepEP facade's M2N mode (``Buffer(..., expert_ranks=(...))``, docs/M2N.md).

The listed ranks hold the ``num_experts`` experts, ``num_experts // len(expert_ranks)`` each in
the order given (``ubep.m2n``'s placement); the others only send and combine. The low-latency
pair keeps DeepEP's call shapes: its per-expert tensors have an expert rank's local experts, and
0 on a sender (``recv_x [0, slots, hidden]``), the shapes DeepEP gives a rank without experts.
Each call's ubep Buffer gets the roles (``BufferConfig(expert_ranks=)``), which also checks that
``num_experts`` divides over them. Normal mode and the internode pair (their layout counts
tokens per co-located rank), shrink mode (masking Buffers serve no M2N) and the in-process world
(no ubep Buffer under it) refuse the roles, naming ``expert_ranks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError
from ..m2n import check_expert_ranks

__all__ = ["M2NRoles", "check_facade_expert_ranks"]


def check_facade_expert_ranks(expert_ranks: Any, num_ranks: int, shrink: bool,
                              local: bool) -> tuple[int, ...] | None:
    """The facade's ``expert_ranks`` checked as far as it can be before ``num_experts`` is
    known, refused (naming it) with ``shrink`` or a ``local`` (in-process) group."""
    if expert_ranks is None:
        return None
    ranks = check_expert_ranks(expert_ranks, 0)  # 0 experts divide over any count
    out = [r for r in ranks if r >= num_ranks]
    if out:
        raise InvalidArgumentError("expert_ranks", list(ranks), f"rank {out[0]} is out of range "
                                   f"[0, {num_ranks}) (the group's ranks)")
    if shrink:
        raise InvalidArgumentError("expert_ranks", list(ranks), "cannot be combined with "
                                   "enable_shrink (a masking Buffer serves no M2N placement)")
    if local:
        raise InvalidArgumentError("expert_ranks", list(ranks), "needs a ubep group (ubep."
                                   "launch, ubep.mpi, torch.distributed), not the in-process "
                                   "world")
    return ranks


@dataclass(frozen=True)
class M2NRoles:
    """The roles as the facade's calls read them (``FacadeCore.roles``): this rank and the
    group's size, ``expert_ranks`` None without M2N."""

    rank: int
    group_size: int
    expert_ranks: tuple[int, ...] | None

    def check_no_m2n(self) -> None:
        if self.expert_ranks is not None:
            raise InvalidArgumentError(
                "expert_ranks", list(self.expert_ranks), "M2N runs on the low-latency pair "
                "(low_latency_dispatch / low_latency_combine), not on normal-mode calls")

    def num_local_experts(self, num_experts: int) -> int:
        """How many of ``num_experts`` this rank holds: ``num_experts // num_ranks``, or with
        ``expert_ranks`` ``num_experts // len(expert_ranks)`` on an expert rank and 0 on a
        sender (the first dimension of the low-latency pair's per-expert tensors)."""
        if self.expert_ranks is None:
            return num_experts // self.group_size
        return num_experts // len(self.expert_ranks) if self.rank in self.expert_ranks else 0
