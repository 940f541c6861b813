"""Combine over MPI RMA (:class:`ubep.mpi.engine.RmaEngine`'s reduce side): publish where this
rank's expert outputs lie, fetch the rows each token needs from their owners with gets, and
reduce them in float32 into ``y``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..plane.records import E_BAD_INPUT, E_INTERNAL
from ..plane.records import HEADER_BYTES as _HEADER_BYTES
from .protocol import RmaProtocol, _Op, _OpError, _u8

__all__ = ["RmaCombine"]


class RmaCombine(RmaProtocol):
    """The combine of an RMA engine, on the attributes the engine sets up."""

    E: int
    L: int
    bsp: bool
    expert: bool
    hidden: int
    cap_rows: int
    crow_bytes: int
    seg_size: int
    lay: Any
    cdtype: Any
    comb_last: list[int]

    def _barrier(self, op: _Op, phase: int) -> None:
        raise NotImplementedError  # the engine's global barrier (BSP)

    def _runs(self, pos: np.ndarray) -> list[tuple[int, int]]:
        raise NotImplementedError  # the engine's contiguous runs of positions

    # --- combine ------------------------------------------------------------------------

    def _combine(self, op: _Op, eo: np.ndarray, rows: int, h_idx: np.ndarray, h_w: np.ndarray,
                 h_dst: np.ndarray, ntok: int, creg: int, y: np.ndarray,
                 dispatch_index: int) -> bool:
        lay, cl = self.lay, self.cl
        local = self.data.local_array
        base = int(local.ctypes.data)
        at = int(eo.ctypes.data) if eo.size else 0
        nbytes = rows * self.crow_bytes
        zero_copy = base + _HEADER_BYTES <= at and at + nbytes <= base + self.seg_size
        self._wait_peers_done(op, op.epoch - 2)
        if zero_copy:
            eo_off = at - base
        else:
            self._wait_peers_done(op, self.comb_last[creg])
            self.comb_last[creg] = op.epoch
            eo_off = lay.off_comb + creg * lay.comb_bytes
            local[eo_off: eo_off + nbytes] = _u8(eo)[:nbytes]
        for c in range(2):
            lo = lay.off_comb + c * lay.comb_bytes
            if lo <= eo_off < lo + lay.comb_bytes:
                self.comb_last[c] = op.epoch
        self.data.sync()  # the expert outputs are in memory before peers are told
        info = np.array([eo_off, rows, self.crow_bytes, dispatch_index], "<u8")
        for q in range(self.R):
            self._put_record(self.ctrl, q, cl.slot(cl.comb_info, op.par, self.rank), info,
                             op.epoch)
        if self.bsp:
            # descriptors complete before the barrier
            self._complete(op, self.ctrl, None, "the expert-output descriptors to complete")
            self._barrier(op, 3)
        self._check_same_dispatch(op, dispatch_index)
        needed = self._needed_rows(h_idx, h_dst, ntok)
        fetched: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        order = sorted(needed, key=lambda q: (q - self.rank) % self.R)
        for q in order:  # every get in flight at once, then complete them
            fetched[q] = self._fetch(op, q, needed[q])
        self._wait(op, lambda: all(self.data.done(q) for q in order), -1,
                   "the expert outputs of every rank to arrive", needs=tuple)
        self._reduce(h_idx[:ntok], h_w[:ntok], h_dst[:ntok], fetched, y)
        return zero_copy

    def _needed_rows(self, h_idx: np.ndarray, h_dst: np.ndarray, ntok: int) -> dict[int,
                                                                                     np.ndarray]:
        """Per destination, the sorted unique rows this rank sent there."""
        out: dict[int, np.ndarray] = {}
        if self.expert:
            idx = h_idx[:ntok]
            if ((idx < -1) | (idx >= self.E)).any():
                raise _OpError(E_INTERNAL, -1, "handle names an expert out of range")
            dst = np.where(idx >= 0, idx // self.L, -1)
            for q in range(self.R):
                pos = h_dst[:ntok][dst == q]
                if len(pos):
                    out[q] = np.unique(pos)
        else:
            for q in range(self.R):
                pos = h_dst[:ntok, q]
                pos = pos[pos >= 0]
                if len(pos):
                    out[q] = np.unique(pos)
        return out

    def _descriptor(self, op: _Op, q: int) -> np.ndarray:
        """``[offset, rows, stride, dispatch index]`` of ``q``'s expert outputs for this call."""
        slot = self.cl.slot(self.cl.comb_info, op.par, q)
        box: list[np.ndarray] = []

        def ready() -> bool:
            got = self._read_record(slot, 32, op.epoch)
            if got is not None:
                box.append(got[1].view("<u8"))
            return got is not None

        if self.bsp:
            self.ctrl.sync()
            if not ready():
                raise _OpError(E_INTERNAL, q, f"rank {q}'s expert outputs missing after the "
                                              "barrier")
        else:
            self._wait(op, ready, q, f"the expert outputs of rank {q}")
        return box[0]

    def _check_same_dispatch(self, op: _Op, index: int) -> None:
        """Every rank combines the outputs of the same dispatch (else bad input everywhere)."""
        for q in range(self.R):
            theirs = int(self._descriptor(op, q)[3])
            if theirs != index:
                raise _OpError(
                    E_BAD_INPUT, self.rank,
                    f"ranks combine different dispatches (rank {q} passed the handle of "
                    f"dispatch {theirs}): every rank must pass the handle of the same dispatch",
                    arg="handle", msg=f"dispatch {index}")

    def _fetch(self, op: _Op, q: int, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Start fetching rows ``pos`` of ``q``'s expert outputs (``MPI_Get``) into a new array
        (complete once ``self.data.done(q)``)."""
        off, nrows, stride, _index = (int(v) for v in self._descriptor(op, q))
        if (stride != self.crow_bytes or nrows > self.cap_rows or off < _HEADER_BYTES
                or off + nrows * stride > self.seg_size):
            raise _OpError(E_INTERNAL, q, f"rank {q} published expert outputs outside its "
                                          "segment")
        if pos[0] < 0 or pos[-1] >= nrows:
            bad = int(pos[-1] if pos[-1] >= nrows else pos[0])
            raise _OpError(E_INTERNAL, q, f"handle row {bad} outside rank {q}'s {nrows} expert "
                                          "outputs")
        rows = np.empty((len(pos), self.crow_bytes), np.uint8)
        runs = [(off + p0 * stride, m * stride) for p0, m in self._runs(pos)]
        self.data.get_runs(q, runs, rows)
        return pos, rows

    def _reduce(self, idx: np.ndarray, w: np.ndarray, dst_row: np.ndarray,
                fetched: dict[int, tuple[np.ndarray, np.ndarray]], y: np.ndarray) -> None:
        """The reference's arithmetic (ubep.reference: float32, product rounded, masked slots
        skipped, ascending k or destination), one gather and two in-place ufuncs per term."""
        cd, H = self.cdtype, self.hidden
        ntok = idx.shape[0]
        acc = np.zeros((ntok, H), np.float32)
        qs = sorted(fetched)
        base = dict(zip(qs, np.cumsum([0] + [len(fetched[q][0]) for q in qs])[:-1], strict=True))
        rows = (np.concatenate([cd.to_float32(fetched[q][1].view(cd.storage).reshape(-1, H))
                                for q in qs]) if qs else np.zeros((0, H), np.float32))
        if self.expert:
            valid = idx >= 0
            owner = np.where(valid, idx // self.L, -1)
            coeff = w
        else:
            valid = dst_row >= 0
            owner = np.where(valid, np.arange(self.R)[None, :], -1)
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
