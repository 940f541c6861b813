"""The RMA engine's sync modes, one row each: how a writer marks the rows it put at a
destination, and how the destination knows they all arrived (docs/FORMATS.md).

:data:`SYNC_ROWS` maps a sync name to its row; :class:`~ubep.mpi.engine.RmaEngine` picks its
row once, at construction, and never asks which mode it runs. Each row holds the writer's and
the reader's side for both engine kinds:

* ASP: ``send_flags`` after a destination's rows are put, ``source_complete`` polled by the
  receiver per source;
* BSP (staged rows, a barrier between sending and reading): ``flags_before_barrier`` /
  ``flags_after_barrier`` (a mode's flags go out once, on one side of the barrier),
  ``staged_verified`` and ``decode_staged``.

SP has no row: ``MPI_Put`` gives no element atomicity against the receiver's loads, so a
sentinel test could accept a torn element (the engine refuses it by name).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from ..flags import DcCodec
from ..runtime.abi import native_or_none
from .rows import runs_of

if TYPE_CHECKING:
    from .protocol import _Op

__all__ = ["SYNC_ROWS", "SyncRow"]

_DC = DcCodec()  # the batch checksum of DC (whole rows)
_MASK64 = 2**64 - 1

Runs = list[tuple[int, int]]


def dc_sum(e: Any, slots: np.ndarray, epoch: int) -> int:
    """DC checksum of rows (raw or in slots: the first ``row_bytes`` of each): the format's
    codec (``ubep.flags.DcCodec``), the same bytes as the native data plane's."""
    return rows_checksum(np.ascontiguousarray(slots[:, :e.row_bytes]), e.row_bytes, epoch)


def runs_sum(e: Any, blocks: list[np.ndarray], epoch: int) -> int:
    """DC checksum of a batch that lands as contiguous runs ``blocks`` (rows or slots): the sum
    of each run's :func:`dc_sum` (mod 2^64). One run: that run's checksum. The receiver checks
    each run in place, so a batch spread over many runs is never gathered to be checked."""
    return sum(dc_sum(e, b, epoch) for b in blocks) & _MASK64


def rows_checksum(rows: np.ndarray, row_bytes: int, epoch: int) -> int:
    """DC checksum of C-contiguous rows of ``row_bytes``: the native data plane's
    ``dc_checksum`` (one pass, no temporaries) where it is built, else the codec's numpy one
    (the same value: tests/mpi/test_mpi_unit.py)."""
    if not len(rows):
        return 1
    native = native_or_none()
    if native is not None and row_bytes % 8 == 0:
        return int(native.dc_checksum(rows, row_bytes, epoch))
    return _DC.checksum(rows.reshape(-1, row_bytes), epoch)


class SyncRow:
    """A sync mode of the RMA engine ``e`` (its methods take the engine: the row holds no
    state). The base is SW's: rows raw in their slots, then, once they completed, an empty
    flag record for the epoch."""

    name = "sw"
    flag_bytes = 0  # payload bytes of the flag record (DC: [count][checksum])
    in_place = False  # ASP lands rows in recv_x, epoch words beside them (TFF)

    def encode(self, e: Any, rows: np.ndarray, in_place: bool) -> np.ndarray:
        """Rows as their slots: raw, padded to the slot (``in_place``: to recv_x's stride)."""
        width = e.out_stride if in_place else e.slot_bytes
        if width == e.row_bytes:
            return rows
        out = np.zeros((rows.shape[0], width), np.uint8)
        out[:, :e.row_bytes] = rows
        return out

    def send_flags(self, e: Any, op: _Op, d: int, rows: np.ndarray, runs: Runs,
                   reg: int, blocks: list[np.ndarray] | None = None) -> None:
        """ASP: what ``d`` polls, once the rows to it are put (``blocks``: the runs as they
        lie where they were stored, instead of ``rows`` cut at the runs' lengths)."""
        e.proto.complete(op, e.data, d, f"the rows to rank {d} to complete")
        e.proto.put_record(e.ctrl, d, e.cl.slot(e.cl.flag, op.par, e.rank), self._flag(e, rows, op),
                           op.epoch)

    def _flag(self, e: Any, rows: np.ndarray, op: _Op) -> np.ndarray:
        return np.zeros(0, np.uint8)

    def source_complete(self, e: Any, op: _Op, s: int, pos: np.ndarray, reg: int) -> bool:
        """ASP: whether source ``s``'s rows (at ``pos``) have all landed."""
        return e.proto.read_record(e.cl.slot(e.cl.flag, op.par, s), 0, op.epoch) is not None

    def flags_before_barrier(self, e: Any, op: _Op, sent: dict[int, Any], reg: int) -> None:
        """BSP: flags that must be complete before the first barrier (none here)."""

    def flags_after_barrier(self, e: Any, op: _Op, sent: dict[int, Any]) -> None:
        """BSP: the flag records, after the barrier (the rows are complete by then)."""
        for d, (payload, _runs) in sent.items():
            e.proto.put_record(e.ctrl, d, e.cl.slot(e.cl.flag, op.par, e.rank),
                               self._flag(e, payload, op), op.epoch)

    def staged_verified(self, e: Any, op: _Op, s: int, stage: np.ndarray,
                        pos: np.ndarray) -> bool:
        """BSP: wait for source ``s``'s flag record, then whether its staged rows check out."""
        flag = functools.partial(e.proto.has_record, e.cl.slot(e.cl.flag, op.par, s),
                                 self.flag_bytes, op.epoch)
        e.proto.wait(op, flag, s, f"the flag and counts of rank {s}")
        return self._staged_ok(e, op, s, stage[pos])

    def _staged_ok(self, e: Any, op: _Op, s: int, slots: np.ndarray) -> bool:
        return True

    def decode_staged(self, e: Any, part: np.ndarray) -> np.ndarray:
        """BSP: the raw rows of staged slots."""
        return part[:, :e.row_bytes]


class DcRow(SyncRow):
    """DC: the flag record carries the rows' count and checksum; no wait for completion."""

    name = "dc"
    flag_bytes = 16

    def send_flags(self, e: Any, op: _Op, d: int, rows: np.ndarray, runs: Runs,
                   reg: int, blocks: list[np.ndarray] | None = None) -> None:
        # ASP: the checksum of each run the rows land in, summed (runs_sum)
        if blocks is None:
            ends = np.cumsum([m for _, m in runs]).tolist()
            blocks = [rows[end - m: end] for (_, m), end in zip(runs, ends, strict=True)]
        flag = np.array([sum(m for _, m in runs), runs_sum(e, blocks, op.epoch)], "<u8")
        e.proto.put_record(e.ctrl, d, e.cl.slot(e.cl.flag, op.par, e.rank), flag, op.epoch)

    def _flag(self, e: Any, rows: np.ndarray, op: _Op) -> np.ndarray:
        return np.array([len(rows), dc_sum(e, rows, op.epoch)], "<u8")

    def source_complete(self, e: Any, op: _Op, s: int, pos: np.ndarray, reg: int) -> bool:
        # the record first: the rows are gathered (a copy of all of them) only once it is in
        flag = self._flag_of(e, op, s)
        if flag is None or flag[0] != len(pos):
            return False
        land = e._land_slots(reg)  # each run checked where it landed: no gather
        return runs_sum(e, [land[p0: p0 + m] for p0, m in runs_of(pos)], op.epoch) == flag[1]

    def _staged_ok(self, e: Any, op: _Op, s: int, slots: np.ndarray) -> bool:
        flag = self._flag_of(e, op, s)
        return flag is not None and flag[0] == len(slots) and dc_sum(e, slots, op.epoch) == flag[1]

    def _flag_of(self, e: Any, op: _Op, s: int) -> tuple[int, int] | None:
        """``(count, checksum)`` of source ``s``'s flag record of this call, if it is in."""
        got = e.proto.read_record(e.cl.slot(e.cl.flag, op.par, s), self.flag_bytes, op.epoch)
        if got is None:
            return None
        count, total = (int(v) for v in got[1].view("<u8"))
        return count, total


class TffRow(SyncRow):
    """TFF: an epoch word per block of every row. ASP lands the rows in recv_x and the words in
    the land region beside them; BSP stages whole blocks (payload + flag) and sends the words
    before the barrier."""

    name = "tff"
    in_place = True

    def encode(self, e: Any, rows: np.ndarray, in_place: bool) -> np.ndarray:
        if in_place:
            return super().encode(e, rows, in_place)
        return e.tff.unflagged(rows)  # the flags go out after a flush (send_flags)

    def send_flags(self, e: Any, op: _Op, d: int, rows: np.ndarray, runs: Runs,
                   reg: int, blocks: list[np.ndarray] | None = None) -> None:
        e.proto.complete(op, e.data, d, f"the rows to rank {d} to complete")
        for p0, m in runs:
            words = np.full(m * e.tff_nblocks, op.epoch, np.uint64)
            off = e._land(reg) + p0 * e.slot_bytes
            if e.tff_in_place:
                e.data.put(d, off, words)
            else:
                e.data.put_words(d, off + e.tff.payload_per_block, words, e.tff.block_bytes)

    def source_complete(self, e: Any, op: _Op, s: int, pos: np.ndarray, reg: int) -> bool:
        words = e._land_slots(reg)[pos].view("<u8")  # in place: the rows are in recv_x
        if not (words == op.epoch).all():
            return False
        e.data.sync()  # acquire: recv_x read after the words
        return True

    def flags_before_barrier(self, e: Any, op: _Op, sent: dict[int, Any], reg: int) -> None:
        for d, (payload, runs) in sent.items():
            self.send_flags(e, op, d, payload, runs, reg)
        e.proto.complete(op, e.data, None, "the flags to every rank to complete")

    def flags_after_barrier(self, e: Any, op: _Op, sent: dict[int, Any]) -> None:
        pass  # the words went out with the rows

    def staged_verified(self, e: Any, op: _Op, s: int, stage: np.ndarray,
                        pos: np.ndarray) -> bool:
        return bool(e.tff.row_ready(stage[pos], op.epoch).all())

    def decode_staged(self, e: Any, part: np.ndarray) -> np.ndarray:
        return e.tff.payload(part, e.row_bytes)


# sync name -> its row (SP: none, module docstring)
SYNC_ROWS: dict[str, SyncRow] = {row.name: row for row in (SyncRow(), DcRow(), TffRow())}
