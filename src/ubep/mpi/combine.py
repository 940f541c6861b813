"""Combine over MPI RMA (:class:`ubep.mpi.engine.RmaEngine`'s reduce side): publish where this
rank's expert outputs lie, fetch the rows each token needs from their owners with gets, and
reduce them in float32 into ``y``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..plane.records import E_BAD_INPUT, E_INTERNAL
from ..plane.records import HEADER_BYTES as _HEADER_BYTES
from .protocol import _Op, _OpError, _u8

__all__ = ["RmaCombine"]


class RmaCombine:
    """The combine of the RMA engine ``e`` (held as ``e.combiner``), on the windows and
    layout the engine sets up."""

    __slots__ = ("e",)

    def __init__(self, e: Any) -> None:
        self.e = e

    # --- combine ------------------------------------------------------------------------

    def combine(self, op: _Op, eo: np.ndarray, rows: int, h_idx: np.ndarray, h_w: np.ndarray,
                h_dst: np.ndarray, ntok: int, creg: int, y: np.ndarray,
                dispatch_index: int) -> bool:
        e = self.e
        lay, cl = e.lay, e.cl
        local = e.data.local_array
        base = int(local.ctypes.data)
        at = int(eo.ctypes.data) if eo.size else 0
        nbytes = rows * e.crow_bytes
        zero_copy = base + _HEADER_BYTES <= at and at + nbytes <= base + e.seg_size
        e.proto.wait_peers_done(op, op.epoch - 2)
        if zero_copy:
            eo_off = at - base
        else:
            e.proto.wait_peers_done(op, e.comb_last[creg])
            e.comb_last[creg] = op.epoch
            eo_off = lay.off_comb + creg * lay.comb_bytes
            local[eo_off: eo_off + nbytes] = _u8(eo)[:nbytes]
        for c in range(2):
            lo = lay.off_comb + c * lay.comb_bytes
            if lo <= eo_off < lo + lay.comb_bytes:
                e.comb_last[c] = op.epoch
        e.data.sync()  # the expert outputs are in memory before peers are told
        info = np.array([eo_off, rows, e.crow_bytes, dispatch_index], "<u8")
        for q in range(e.R):
            e.proto.put_record(e.ctrl, q, cl.slot(cl.comb_info, op.par, e.rank), info,
                               op.epoch)
        if e.bsp:
            # descriptors complete before the barrier
            e.proto.complete(op, e.ctrl, None, "the expert-output descriptors to complete")
            e._barrier(op, 3)
        self.check_same_dispatch(op, dispatch_index)
        needed = self.needed_rows(h_idx, h_dst, ntok)
        fetched: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        order = sorted(needed, key=lambda q: (q - e.rank) % e.R)
        for q in order:  # every get in flight at once, then complete them
            fetched[q] = self.fetch(op, q, needed[q])
        e.proto.wait(op, lambda: all(e.data.done(q) for q in order), -1,
                     "the expert outputs of every rank to arrive", needs=tuple)
        self.reduce(h_idx[:ntok], h_w[:ntok], h_dst[:ntok], fetched, y)
        return zero_copy

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

    def descriptor(self, op: _Op, q: int) -> np.ndarray:
        """``[offset, rows, stride, dispatch index]`` of ``q``'s expert outputs for this call."""
        e = self.e
        slot = e.cl.slot(e.cl.comb_info, op.par, q)
        box: list[np.ndarray] = []

        def ready() -> bool:
            got = e.proto.read_record(slot, 32, op.epoch)
            if got is not None:
                box.append(got[1].view("<u8"))
            return got is not None

        if e.bsp:
            e.ctrl.sync()
            if not ready():
                raise _OpError(E_INTERNAL, q, f"rank {q}'s expert outputs missing after the "
                                              "barrier")
        else:
            e.proto.wait(op, ready, q, f"the expert outputs of rank {q}")
        return box[0]

    def check_same_dispatch(self, op: _Op, index: int) -> None:
        """Every rank combines the outputs of the same dispatch (else bad input everywhere)."""
        e = self.e
        for q in range(e.R):
            theirs = int(self.descriptor(op, q)[3])
            if theirs != index:
                raise _OpError(
                    E_BAD_INPUT, e.rank,
                    f"ranks combine different dispatches (rank {q} passed the handle of "
                    f"dispatch {theirs}): every rank must pass the handle of the same dispatch",
                    arg="handle", msg=f"dispatch {index}")

    def fetch(self, op: _Op, q: int, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Start fetching rows ``pos`` of ``q``'s expert outputs (``MPI_Get``) into a new array
        (complete once ``self.e.data.done(q)``)."""
        e = self.e
        off, nrows, stride, _index = (int(v) for v in self.descriptor(op, q))
        if (stride != e.crow_bytes or nrows > e.cap_rows or off < _HEADER_BYTES
                or off + nrows * stride > e.seg_size):
            raise _OpError(E_INTERNAL, q, f"rank {q} published expert outputs outside its "
                                          "segment")
        if pos[0] < 0 or pos[-1] >= nrows:
            bad = int(pos[-1] if pos[-1] >= nrows else pos[0])
            raise _OpError(E_INTERNAL, q, f"handle row {bad} outside rank {q}'s {nrows} expert "
                                          "outputs")
        rows = np.empty((len(pos), e.crow_bytes), np.uint8)
        runs = [(off + p0 * stride, m * stride) for p0, m in e._runs(pos)]
        e.data.get_runs(q, runs, rows)
        return pos, rows

    def reduce(self, idx: np.ndarray, w: np.ndarray, dst_row: np.ndarray,
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
