"""Combine over MPI RMA (:class:`ubep.mpi.engine.RmaEngine`'s reduce side), pushed both ways.

Dispatch put each source's rows into the experts' ranks; combine puts them back the same way:
each expert rank puts the output rows of every source, in the order they arrived from it, into
that source's combine landing window (per epoch parity, one slot per expert rank, back to
back in rank order, each as long as what the source sent it: the dispatch's counts say where)
and, after them, a record ``[rows][checksum][dispatch index]`` into the source's control window.
The rows go out as they lie in the expert outputs, one run per local expert: to a rank on
this host a copy into its window, the checksum the sum of the runs' DC checksums, each mixed
with the epoch (the source cuts what landed at the same lengths); to another host one
two-sided message into the landing slot the source pre-posted, with the record in a message
of its own before it (:mod:`ubep.mpi.rows2`: a completed receive is whole, no checksum; over
TCP it costs the source less CPU than receiving emulated puts in ``MPI_Win_sync``). The source
polls its own windows and receives, accepts a same-host peer's rows once the checksum of what
has landed matches (``dc``; ``sw`` and ``tff`` flush the rows before the record, so it matches
at once) and reduces them in the reference's order. No rank reads another rank's memory, so
no call waits for a peer to enter MPI: over TCP (``osc/rdma`` on ``btl/tcp``) a get completes
only when its target runs MPI's progress; a message is received by a peer that is itself
polling for its rows.

Why rows and not weighted partial sums: the reference adds a token's picks in ascending ``k``
in float32; a sum of the picks one expert rank holds is bit-exact only when they are a prefix
of that order, and float32 sums are twice the bytes of BF16 rows.

A landing slot of parity ``p`` is reused two calls later: every rank waits at the start of a
call until every peer finished the call before the last (as dispatch does), so the source has
reduced what landed there before.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..plane.layout import align_up
from ..plane.records import E_BAD_INPUT, E_INTERNAL
from ..plane.records import HEADER_BYTES as _HEADER_BYTES
from ..runtime.abi import DTYPES, native_or_none
from .protocol import _Op, _OpError, _u8
from .rows import runs_of

__all__ = ["RmaCombine", "landing_bytes"]

# the native reduction's dtype codes (runtime/native/abi.h)
_REDUCE_CODE = {name: DTYPES[name] for name in ("bf16", "fp16", "fp32")}

_PAGE = 4096
_RECORD_BYTES = 24  # [rows][checksum][dispatch index], u64 each
_MASK64 = 2**64 - 1


def landing_bytes(cap_sent_rows: int, crow_bytes: int) -> int:
    """Size of a rank's combine landing window: per epoch parity, ``cap_sent_rows`` combine
    rows (the most rows one rank sends in a dispatch), the expert ranks' slots back to back in
    rank order, each as long as what this rank sent that rank."""
    return align_up(max(2 * cap_sent_rows * crow_bytes, 1), _PAGE)


def runs_checksum(e: Any, blocks: list[np.ndarray], epoch: int) -> int:
    """The record's checksum of rows sent as runs ``blocks``: the sum of each run's DC
    checksum (mod 2^64); the receiver cuts what landed at the same lengths."""
    return sum(e.rows_checksum(b, epoch) for b in blocks) & _MASK64


class RmaCombine:
    """The combine of the RMA engine ``e`` (held as ``e.combiner``), on the windows and
    layout the engine sets up; ``sources`` holds, per dispatch region, the dispatch index and
    the positions of each source's rows in this rank's receive region (from the dispatch)."""

    __slots__ = ("e", "sources")

    def __init__(self, e: Any) -> None:
        self.e = e
        self.sources: dict[int, tuple[int, list[np.ndarray], np.ndarray]] = {}

    def remember(self, reg: int, index: int, positions: list[np.ndarray],
                 rows: np.ndarray) -> None:
        """Dispatch ``index`` filled region ``reg``: where each source's rows lie, and
        ``rows[s, d]``, the rows ``s`` sent ``d`` (where this rank's slot starts in each
        source's landing window)."""
        self.sources[reg] = (index, positions, rows)

    # --- combine ------------------------------------------------------------------------

    def combine(self, op: _Op, eo: np.ndarray, rows: int, h_idx: np.ndarray, h_w: np.ndarray,
                h_dst: np.ndarray, ntok: int, y: np.ndarray, dispatch_index: int) -> bool:
        e = self.e
        local = e.data.local_array
        base = int(local.ctypes.data)
        at = int(eo.ctypes.data) if eo.size else 0
        zero_copy = base + _HEADER_BYTES <= at and at + rows * e.crow_bytes <= base + e.seg_size
        positions, slots = self.positions_of(dispatch_index, rows)
        needed = self.needed_rows(h_idx, h_dst, ntok)
        counts = [len(needed.get(q, ())) for q in range(e.R)]
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
        # other hosts' rows come as messages (ubep.mpi.rows2): their receives go up before
        # this rank sends anything, straight into the landing slots (free: this rank reduced
        # what the call before the last left there)
        e.two.post(op, dict(enumerate(counts)),
                   lambda q, n: self.landing_rows(op.par, starts[q], n))
        try:
            e.proto.wait_peers_done(op, op.epoch - 2)  # same-host slots of this parity free
            eo_rows = _u8(eo)[: rows * e.crow_bytes].reshape(rows, e.crow_bytes)
            self.send(op, eo_rows, positions, slots, dispatch_index)
            if e.bsp:  # BSP keeps its barrier: every record complete before anyone reads
                e.proto.complete(op, e.ctrl, None, "the combine records to complete")
                e._barrier(op, 3)
            landed = self.receive(op, needed, starts, dispatch_index)
        except _OpError:
            e.two.abandon()
            raise
        mine = needed.get(e.rank)
        if mine is not None:
            if mine[-1] >= rows:
                raise _OpError(E_INTERNAL, e.rank, f"handle row {int(mine[-1])} outside this "
                                                   f"rank's {rows} expert outputs")
            # own rows into own slot (no peer writes there): every row in one window, one gather
            own = self.landing_rows(op.par, starts[e.rank], len(mine))
            np.take(eo_rows, mine, axis=0, out=own, mode="clip")
            landed[e.rank] = (mine, own)
        self.reduce(h_idx[:ntok], h_w[:ntok], h_dst[:ntok], landed, y,
                    self.landing_rows(op.par, 0, e.cap_sent), starts)
        return zero_copy

    def positions_of(self, index: int, rows: int) -> tuple[list[np.ndarray], list[int]]:
        """Per source, the positions of its rows of dispatch ``index`` (checked: inside
        ``rows``) and where this rank's slot starts in its landing window (checked: the slot
        fits)."""
        e = self.e
        got = self.sources.get(index % e.nreg)
        if got is None or got[0] != index:
            raise _OpError(E_BAD_INPUT, e.rank, f"no rows of dispatch {index} in this Buffer's "
                           "receive regions: combine the handle of one of the last "
                           f"{e.nreg} dispatches", arg="handle", msg=f"dispatch {index}")
        slots = []
        for q, pos in enumerate(got[1]):
            if len(pos) and (pos[0] < 0 or pos[-1] >= rows):
                raise _OpError(E_INTERNAL, q, f"rank {q}'s rows outside the {rows} expert "
                                              "outputs")
            start = int(got[2][q, :e.rank].sum())
            if start + len(pos) > e.cap_sent:
                raise _OpError(E_INTERNAL, q, f"rank {q}'s landing slot for this rank ends "
                                              f"past its {e.cap_sent} rows")
            slots.append(start)
        return got[1], slots

    def landing_offset(self, par: int, start_row: int) -> int:
        """Offset of row ``start_row`` of parity ``par``'s half of a landing window."""
        e = self.e
        return (par * e.cap_sent + start_row) * e.crow_bytes

    def send(self, op: _Op, eo_rows: np.ndarray, positions: list[np.ndarray],
             slots: list[int], dispatch_index: int) -> None:
        """Every source's output rows (in the order they came) into its landing slot, each
        followed by its record; every rank gets a record, with 0 rows if it sent none.

        A source's rows lie in a few runs of ``eo_rows`` (one per local expert): each run goes
        out as it lies, a put (another host) or a copy (this host), and the record's checksum
        is the sum of the runs' (:func:`runs_checksum`), so no row is gathered first."""
        e = self.e
        slot = e.cl.slot(e.cl.comb_info, op.par, e.rank)
        for i in range(e.R - 1):  # own rows are read in place
            q = (e.rank + 1 + i) % e.R
            t0 = e.spans.t0()
            pos = positions[q]
            peer = e.cland.peer_arrays[q]
            if q in e.two.remote:  # another host: a record and one message (ubep.mpi.rows2)
                e.two.send(op, q, eo_rows, runs_of(pos), dispatch_index)
                e.spans.rec(0, "send", t0, peer=q, rows=len(pos),
                            size_bytes=len(pos) * e.crow_bytes, epoch=op.epoch)
                continue
            blocks = [eo_rows[p0: p0 + m] for p0, m in runs_of(pos)]
            at = self.landing_offset(op.par, slots[q])
            assert peer is not None  # this host: every other host is in e.two.remote
            for block in blocks:
                peer[at: at + block.nbytes] = block.reshape(-1)
                at += block.nbytes
            if len(pos) and not e.sync_no_flush:
                e.proto.complete(op, e.cland, q, f"the expert outputs to rank {q} to complete")
            check = runs_checksum(e, blocks, op.epoch)
            e.proto.put_record(e.ctrl, q, slot,
                               np.array([len(pos), check, dispatch_index], "<u8"), op.epoch)
            e.spans.rec(0, "send", t0, peer=q, rows=len(pos), size_bytes=len(pos) * e.crow_bytes,
                        epoch=op.epoch)

    def landing_rows(self, par: int, start_row: int, n: int) -> np.ndarray:
        """Rows ``start_row ..`` (``n`` of them) of parity ``par``'s half of the landing
        window, as ``[n, combine row]`` bytes."""
        e = self.e
        return np.ndarray((n, e.crow_bytes), np.uint8, e.cland.local_array,
                          self.landing_offset(par, start_row))

    def receive(self, op: _Op, needed: dict[int, np.ndarray], starts: list[int],
                dispatch_index: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Wait for every peer's record and its rows (peer ``q``'s slot begins at row
        ``starts[q]``); per peer, the positions this rank's rows had there (sorted) and the
        rows as they landed."""
        e = self.e
        landed: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        pending = {q for q in range(e.R) if q != e.rank}
        since = [e.spans.t0()]

        def poll() -> bool:
            for q in sorted(pending):
                if q in e.two.posted:  # another host: a message
                    if e.two.take(op, q, dispatch_index):
                        pending.discard(q)
                        n = len(needed.get(q, ()))
                        if n:
                            landed[q] = (needed[q], self.landing_rows(op.par, starts[q], n))
                        since[0] = e.spans.rec(0, "wait", since[0], peer=q, rows=n,
                                               size_bytes=n * e.crow_bytes, epoch=op.epoch)
                    continue
                got = e.proto.read_record(e.cl.slot(e.cl.comb_info, op.par, q), _RECORD_BYTES,
                                          op.epoch)
                if got is None:
                    continue
                n, check, theirs = (int(v) for v in got[1].view("<u8"))
                if theirs != dispatch_index:
                    raise _OpError(
                        E_BAD_INPUT, e.rank,
                        f"ranks combine different dispatches (rank {q} passed the handle of "
                        f"dispatch {theirs}): every rank must pass the handle of the same "
                        "dispatch", arg="handle", msg=f"dispatch {dispatch_index}")
                pos = needed.get(q, np.zeros(0, np.int64))
                if n != len(pos):
                    raise _OpError(E_INTERNAL, q, f"rank {q} returned {n} expert outputs, this "
                                                  f"rank sent it {len(pos)} rows")
                rows = self.landing_rows(op.par, starts[q], n)
                ends = np.cumsum([m for _, m in runs_of(pos)]).tolist()
                chunks = [rows[end - m: end] for end, (_, m) in zip(ends, runs_of(pos),
                                                                    strict=True)]
                if runs_checksum(e, chunks, op.epoch) != check:
                    continue  # DC: not all landed yet
                pending.discard(q)
                if n:
                    landed[q] = (pos, rows)
                since[0] = e.spans.rec(0, "wait", since[0], peer=q, rows=n,
                                       size_bytes=rows.nbytes, epoch=op.epoch)
            return not pending

        e.proto.wait(op, poll, -1, "the expert outputs of every rank",
                     needs=lambda: sorted(pending))
        return landed

    def needed_rows(self, h_idx: np.ndarray, h_dst: np.ndarray, ntok: int) -> dict[int,
                                                                                     np.ndarray]:
        """Per destination, the sorted unique rows this rank sent there."""
        e = self.e
        out: dict[int, np.ndarray] = {}
        if e.expert:
            idx = h_idx[:ntok]
            if ((idx < -1) | (idx >= e.E)).any():
                raise _OpError(E_INTERNAL, -1, "handle names an expert out of range")
            dst = np.where(idx >= 0, idx // e.L, -1)
            for q in range(e.R):
                pos = h_dst[:ntok][dst == q]
                if len(pos):
                    out[q] = np.unique(pos)
        else:
            for q in range(e.R):
                pos = h_dst[:ntok, q]
                pos = pos[pos >= 0]
                if len(pos):
                    out[q] = np.unique(pos)
        return out

    def reduce(self, idx: np.ndarray, w: np.ndarray, dst_row: np.ndarray,
               fetched: dict[int, tuple[np.ndarray, np.ndarray]], y: np.ndarray,
               land: np.ndarray, starts: list[int]) -> None:
        """Each token's rows reduced into ``y`` where they landed, in ascending slot order
        (the reference's), by the native data plane's combine reduction through a table of
        row indices (one call, no gather into slot order first, no float32 copy of the rows)
        where it is built, else by :meth:`reduce_numpy`. ``land``: every rank's rows of
        ``fetched``, rank ``q``'s from row ``starts[q]``."""
        e = self.e
        native = native_or_none()
        code = _REDUCE_CODE.get(e.cdtype.name)
        if native is None or code is None:
            self.reduce_numpy(idx, w, dst_row, fetched, y)
            return
        ntok = idx.shape[0]
        if not ntok:
            return
        if e.expert:
            owner = np.where(idx >= 0, idx // e.L, -1)
            coeff = np.ascontiguousarray(w, dtype=np.float32)
        else:
            owner = np.where(dst_row >= 0, np.arange(e.R)[None, :], -1)
            coeff = np.ones(owner.shape, np.float32)
        slots = int(owner.shape[1])
        at = np.full((ntok, slots), -1, np.int64)  # each slot's row in `land` (-1: no row)
        for q, (pos, _rows) in fetched.items():
            sel = owner == q
            at[sel] = starts[q] + np.searchsorted(pos, dst_row[sel])
        out = y.reshape(ntok, -1).view(np.uint8).reshape(ntok, e.crow_bytes)
        # the native call checks every index against `land` (positions checked before)
        native.reduce_at(land, at, coeff, out, slots, code, e.expert)

    def reduce_numpy(self, idx: np.ndarray, w: np.ndarray, dst_row: np.ndarray,
                     fetched: dict[int, tuple[np.ndarray, np.ndarray]], y: np.ndarray) -> None:
        """The reference's arithmetic (ubep.reference: float32, product rounded, masked slots
        skipped, ascending k or destination), one gather and two in-place ufuncs per term."""
        e = self.e
        cd, H = e.cdtype, e.hidden
        ntok = idx.shape[0]
        acc = np.zeros((ntok, H), np.float32)
        qs = sorted(fetched)
        base = dict(zip(qs, np.cumsum([0] + [len(fetched[q][0]) for q in qs])[:-1], strict=True))
        rows = (np.concatenate([cd.to_float32(fetched[q][1].view(cd.storage).reshape(-1, H))
                                for q in qs]) if qs else np.zeros((0, H), np.float32))
        if e.expert:
            valid = idx >= 0
            owner = np.where(valid, idx // e.L, -1)
            coeff = w
        else:
            valid = dst_row >= 0
            owner = np.where(valid, np.arange(e.R)[None, :], -1)
            coeff = None
        where = np.zeros(valid.shape, np.int64)  # row of each term in `rows`
        for q in qs:
            sel = owner == q
            where[sel] = base[q] + np.searchsorted(fetched[q][0], dst_row[sel])
        term = np.empty((ntok, H), np.float32)
        for k in range(valid.shape[1]):
            vk = valid[:, k]
            if vk.all():
                np.take(rows, where[:, k], axis=0, out=term)
                if coeff is not None:
                    np.multiply(coeff[:, k, None], term, out=term)
                np.add(acc, term, out=acc)
            elif vk.any():
                tok = np.nonzero(vk)[0]
                part = rows[where[tok, k]]
                if coeff is not None:
                    part = coeff[tok, k][:, None] * part
                acc[tok] = acc[tok] + part
        out = cd.from_float32(acc)
        y.reshape(-1).view(np.uint8)[:] = out.reshape(-1).view(np.uint8)
