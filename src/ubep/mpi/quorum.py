"""The quorum of a masking Buffer over MPI: the survivors of a loss serve on only when they are
more than half of the group (or ``BufferConfig.min_live_ranks``).

Why. Over a network a lost peer is an *uncertain* loss: a rank that stops answering may be
dead, stopped, or merely on the other side of a partition, serving its own side. ULFM's
``MPI_Comm_shrink`` agrees within each side of a partition, so with Open MPI's heartbeat
detector on, each side masks the other and would serve on: two groups, each bit-exact for its
own mask (split brain). A rule that only one side can meet ends that: two disjoint sides
cannot both hold more than half of the same ranks. The side without the quorum raises
``NoQuorumError`` (a ``RankMaskedError``, so a ``PeerLostError``) naming it, in the call that
saw the loss and in every later call on that Buffer.

Certain losses. Over MPI no loss is certain: ULFM reports a process it cannot reach the same way
as one that died (``MPI_ERR_PROC_FAILED``), and the detector's "failed" is a missed heartbeat.
So over MPI the quorum applies to every loss. On one host (``ubep.runtime.membership``) a lost
rank is a dead pid or a silent one, and the survivors' decision is one file created once
(``link(2)``): two sides cannot form, so no quorum is asked there (a rank that must not serve
alone there can still be given one with ``min_live_ranks``, which the one-host plane leaves to
the caller).

The count is of the group the Buffer was built on, not of the members left after earlier
losses: a chain of losses cannot walk a minority into serving.
"""

from __future__ import annotations

from ..errors import NoQuorumError

__all__ = ["check_quorum", "quorum_of"]


def quorum_of(num_ranks: int, min_live_ranks: int | None) -> int:
    """The ranks a side must hold to serve on: ``min_live_ranks``, or more than half."""
    if min_live_ranks is None:
        return num_ranks // 2 + 1
    return int(min_live_ranks)


def check_quorum(rank: int, survivors: tuple[int, ...], num_ranks: int,
                 min_live_ranks: int | None) -> None:
    """Raise ``NoQuorumError`` (a ``PeerLostError``) on ``rank`` when ``survivors`` (original
    ranks agreed on by this side) fall short of the quorum of a group of ``num_ranks``."""
    need = quorum_of(num_ranks, min_live_ranks)
    if len(survivors) >= need:
        return
    rule = ("more than half of the group" if min_live_ranks is None
            else f"BufferConfig.min_live_ranks={min_live_ranks}")
    raise NoQuorumError(
        f"rank {rank}: no quorum: this side holds {len(survivors)} of {num_ranks} ranks "
        f"({list(survivors)}), the quorum is {need} ({rule}); it does not serve, so that at "
        "most one side of a partition does (docs/ELASTIC.md, \"The quorum\")")
