"""Combine's rows to another host, two-sided: ``MPI_Isend`` / ``MPI_Irecv`` on the Buffer's own
communicator (:class:`TwoSidedRows`, held by the RMA engine as ``e.two``).

Over TCP, Open MPI's one-sided component emulates a put with active messages that the target
receives inside its one-sided progress (``MPI_Win_sync``), and the pushed combine's source then
checks a DC checksum over what landed. Two-sided messages take the point-to-point path instead:
the source pre-posts, at the start of its combine, one receive per expert rank on another host
straight into that rank's slot of its combine landing window (it knows how many rows come back
from each rank: the ones it sent there), and a receive of the rank's control record
``[rows][dispatch index][epoch]``; each expert rank sends the record, then the rows as they lie
in the expert outputs (one run per local expert, one message described by an ``hindexed``
datatype, so nothing is gathered first). A completed receive is the data whole: no checksum.
Same-host peers keep their stores and DC records (ubep.mpi.combine).

Matching: the tag is the call's epoch (mod the communicator's tag bound), on a communicator of
this Buffer alone, so a message of an abandoned call never matches a later call's receive (its
epoch differs: ``Buffer.resync`` moves to epochs above every one used). Nothing waits without a
deadline: receives are polled (``MPI_Test``) inside the engine's waits; a call that ends in an
error cancels its receives still posted (one already matched completes when its data arrives)
and the engine counts them, with its sends, among what ``resync`` waits for. A message no
receive will ever match (its call was abandoned, its receiver cancelled) would keep its sender's
request open for ever (a rendezvous send completes only once matched): each rank drains, from
every peer on another host, the messages of calls older than its current one into a scratch
buffer whenever it reaps (the start and end of each call, ``resync``). A peer's messages arrive
in the order it sent them and its epochs only grow, so those come before any of the current
call's.

Ordering against the done records: a peer's done record of this call is an ``MPI_Put`` it
issues only after its sends completed, on the same TCP stream per pair as its messages
(``btl/tcp``), so a peer seen done has delivered what it sent (the engine's ``peer_past`` rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..plane.records import E_BAD_INPUT, E_INTERNAL
from .protocol import _Op, _OpError

__all__ = ["TwoSidedRows"]

_RECORD_WORDS = 3  # [rows][dispatch index][epoch], u64 each


@dataclass
class _Posted:
    """The receives of one peer's rows and record in the current call."""

    record: np.ndarray
    rec_req: Any
    rows_req: Any  # None: no rows expected
    rows: int
    got_record: bool = False


class TwoSidedRows:
    """The two-sided row transport of RMA engine ``e`` on ``comm`` (the Buffer's own
    duplicate of the group's communicator, freed with the group)."""

    def __init__(self, e: Any, comm: Any) -> None:
        self.e = e
        self.comm = comm
        self.mpi = e.data.mpi
        ub = comm.Get_attr(self.mpi.TAG_UB)
        self.tag_mod = min(int(ub) + 1 if ub else 32768, 1 << 30)
        self.remote = [q for q in range(e.R) if q != e.rank and e.cland.remote(q)]
        self.floor = 0  # messages of calls before this epoch are stale (drained)
        self.sends: list[tuple[Any, Any, Any]] = []  # (request, buffer, datatype) in flight
        self.loose: list[tuple[Any, Any]] = []  # cancelled or stale receives not yet complete
        self.posted: dict[int, _Posted] = {}

    def tag(self, epoch: int) -> int:
        return epoch % self.tag_mod

    # --- the source: receives posted before anything is sent ------------------------------

    def post(self, op: _Op, rows_of: dict[int, int], land: Any) -> None:
        """Post, for every peer on another host, the receive of its record and of its
        ``rows_of[q]`` rows into ``land(q, rows)`` (that peer's landing slot)."""
        self.floor = max(self.floor, op.epoch)
        self._drain_stale()
        tag, byte = self.tag(op.epoch), self.mpi.BYTE
        self.posted = {}
        for q in self.remote:
            rec = np.zeros(_RECORD_WORDS, "<u8")
            rec_req = self.comm.Irecv([rec, byte], source=q, tag=tag)
            n = rows_of.get(q, 0)
            rows_req = self.comm.Irecv([land(q, n), byte], source=q, tag=tag) if n else None
            self.posted[q] = _Posted(rec, rec_req, rows_req, n)

    def take(self, op: _Op, q: int, dispatch_index: int) -> bool:
        """Whether peer ``q``'s record and rows have arrived (``MPI_Test``, never blocks);
        a record that disagrees with this rank's call is an error."""
        p = self.posted[q]
        if not p.got_record:
            if not p.rec_req.Test():
                return False
            p.got_record = True
            n, theirs, epoch = (int(v) for v in p.record)
            if theirs != dispatch_index:
                raise _OpError(
                    E_BAD_INPUT, self.e.rank,
                    f"ranks combine different dispatches (rank {q} passed the handle of "
                    f"dispatch {theirs}): every rank must pass the handle of the same dispatch",
                    arg="handle", msg=f"dispatch {dispatch_index}")
            if n != p.rows or epoch != op.epoch:
                raise _OpError(E_INTERNAL, q, f"rank {q} returned {n} expert outputs (epoch "
                                              f"{epoch}), this rank sent it {p.rows} rows "
                                              f"(epoch {op.epoch})")
        if p.rows_req is not None and not p.rows_req.Test():
            return False
        del self.posted[q]
        return True

    def abandon(self) -> None:
        """The call ends in an error: cancel every receive still posted (one already matched
        completes when its data arrives: :meth:`done` waits for it)."""
        for p in self.posted.values():
            for req, buf in ((p.rec_req, p.record), (p.rows_req, None)):
                if req is not None and not (req is p.rec_req and p.got_record):
                    req.Cancel()
                    self.loose.append((req, buf))
        self.posted = {}

    # --- the expert rank ----------------------------------------------------------------

    def send(self, op: _Op, q: int, eo_rows: np.ndarray, runs: list[tuple[int, int]],
             dispatch_index: int) -> None:
        """Peer ``q``'s record, then its rows: ``runs`` ``(first row, rows)`` of ``eo_rows``
        in order, one message (an ``hindexed`` datatype over the runs when there are several)."""
        tag, byte = self.tag(op.epoch), self.mpi.BYTE
        n = sum(m for _, m in runs)
        rec = np.array([n, dispatch_index, op.epoch], "<u8")
        self.sends.append((self.comm.Isend([rec, byte], dest=q, tag=tag), rec, None))
        if not n:
            return
        rb = eo_rows.shape[1]
        if len(runs) == 1:
            p0, m = runs[0]
            block = eo_rows[p0: p0 + m]
            self.sends.append((self.comm.Isend([block, byte], dest=q, tag=tag), block, None))
            return
        dtype = byte.Create_hindexed([m * rb for _, m in runs], [p0 * rb for p0, _ in runs])
        dtype.Commit()
        req = self.comm.Isend([eo_rows, 1, dtype], dest=q, tag=tag)
        self.sends.append((req, eo_rows, dtype))

    # --- completion (the engine's windows' interface) -------------------------------------

    def done(self, dst: int | None = None) -> bool:
        """Whether every send and every abandoned receive has completed (``MPI_Test``); drains
        the messages of older calls first."""
        del dst
        self._drain_stale()
        left = []
        for req, buf, dtype in self.sends:
            if req.Test():
                if dtype is not None:
                    dtype.Free()
            else:
                left.append((req, buf, dtype))
        self.sends = left
        self.loose = [(req, buf) for req, buf in self.loose if not req.Test()]
        return not self.sends and not self.loose

    def forget(self, base_epoch: int) -> None:
        """``resync``: every call before ``base_epoch`` is over: cancel its receives, drain
        its messages."""
        self.abandon()
        self.floor = max(self.floor, base_epoch)

    def flush_all(self) -> None:
        """Nothing to flush: a completed send or receive is complete at both ends."""

    def close(self) -> None:
        """Local; the communicator is freed with the group."""

    def _drain_stale(self) -> None:
        """Receive into scratch every message of a call before ``floor`` that has arrived
        (per peer, in arrival order, up to its first message of a later call)."""
        if not self.remote:
            return
        mpi = self.mpi
        status = mpi.Status()
        floor = self.tag(self.floor)
        half = self.tag_mod // 2
        for q in self.remote:
            while self.comm.Iprobe(source=q, tag=mpi.ANY_TAG, status=status):
                tag = status.Get_tag()
                if not 0 < (floor - tag) % self.tag_mod < half:
                    break  # the current call's or a later one's: its receive will match it
                msg = self.comm.Mprobe(source=q, tag=tag)
                scratch = np.empty(max(status.Get_count(mpi.BYTE), 1), np.uint8)
                self.loose.append((msg.Irecv([scratch, mpi.BYTE]), scratch))
