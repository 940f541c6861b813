"""DC: data checksum (docs/FORMATS.md, "DC").

Slots hold the raw rows. Per batch of rows (by default all rows of one (source, destination)
pair in one call) the writer publishes ``[count, checksum, epoch]`` after the payload, the epoch
word last with a release store. The reader waits for the epoch word, recomputes the checksum over
the rows it sees and accepts iff it matches, else retries until its deadline.

The checksum covers, from every ``block_bytes`` block of every row, the first ``check_bytes``
bytes (``None``: the whole block), mixed with the epoch so that last call's rows do not validate
this call. ``check_bytes=32`` is the paper's setting: sound only where a block lands atomically
(UB's 512-byte writes). A CPU store of a block tears, so bytes past the checked prefix can still
be stale when the check passes; the runtime therefore checks the whole block (the default).
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError
from ._common import NotReadyError, align_up, check_epoch, check_rows_u8

__all__ = ["DcCodec", "words_checksum"]

_WORD = np.dtype("<u8")
_MASK64 = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _rotl64(v: int, r: int) -> int:
    return ((v << r) | (v >> (64 - r))) & _MASK64


def words_checksum(words: np.ndarray, epoch: int) -> int:
    """The DC formula over uint64 words ``w_0 .. w_{n-1}`` (docs/FORMATS.md): ``s1 = sum w_i``,
    ``s2 = sum (i + 1) * w_i`` (mod 2^64), ``s1 ^ rotl(s2, 29) ^ epoch * golden``; never 0 (a 0
    becomes 1). :meth:`DcCodec.checksum` applies it to a batch's checked words; the RMA engine
    (``ubep.mpi.engine.record_check``) to a control record's words."""
    w = np.asarray(words, dtype=np.uint64).reshape(-1)
    # numpy uint64 arithmetic wraps, which is exactly "mod 2^64".
    s1 = int(w.sum(dtype=np.uint64)) if w.size else 0
    weights = np.arange(1, w.size + 1, dtype=np.uint64)
    s2 = int((w * weights).sum(dtype=np.uint64)) if w.size else 0
    value = s1 ^ _rotl64(s2, 29) ^ ((epoch * _GOLDEN) & _MASK64)
    return value or 1


class DcCodec:
    """Checksum and control block of DC.

    Args:
        block_bytes: block size the rows are cut into, a multiple of 8 (default 512).
        check_bytes: bytes checked at the start of each block, a multiple of 8 no larger than
            ``block_bytes``; ``None`` (default) checks the whole block.
    """

    def __init__(self, block_bytes: int = 512, check_bytes: int | None = None) -> None:
        if not isinstance(block_bytes, int) or block_bytes < 8 or block_bytes % 8:
            raise InvalidArgumentError(
                "block_bytes", block_bytes, "must be a positive multiple of 8"
            )
        if check_bytes is not None and (
            not isinstance(check_bytes, int)
            or check_bytes < 8
            or check_bytes % 8
            or check_bytes > block_bytes
        ):
            raise InvalidArgumentError(
                "check_bytes", check_bytes,
                f"must be None or a multiple of 8 in [8, block_bytes={block_bytes}]",
            )
        self.block_bytes = block_bytes
        self.check_bytes = check_bytes
        self._maps: dict[int, np.ndarray] = {}

    def __repr__(self) -> str:
        return f"DcCodec(block_bytes={self.block_bytes}, check_bytes={self.check_bytes})"

    @staticmethod
    def slot_bytes(row_bytes: int) -> int:
        """Slot stride of a raw row: ``row_bytes`` rounded up to 64 bytes."""
        return align_up(row_bytes)

    def checked_byte_offsets(self, row_bytes: int) -> np.ndarray:
        """Byte offsets of one row, in checksum order, each checked block's prefix zero-padded
        to whole words (-1 marks a pad byte). Its length is 8x the row's word count."""
        cached = self._maps.get(row_bytes)
        if cached is not None:
            return cached
        check = self.block_bytes if self.check_bytes is None else self.check_bytes
        parts = []
        for start in range(0, row_bytes, self.block_bytes):
            take = min(check, row_bytes - start)
            padded = -(-take // 8) * 8
            part = np.full(padded, -1, dtype=np.int64)
            part[:take] = np.arange(start, start + take)
            parts.append(part)
        offsets = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        self._maps[row_bytes] = offsets
        return offsets

    def words(self, rows_u8: np.ndarray) -> np.ndarray:
        """The words ``w_0 .. w_{n-1}`` the checksum sums (rows in slot order), uint64."""
        rows = check_rows_u8(rows_u8, "rows_u8")
        offsets = self.checked_byte_offsets(rows.shape[1])
        # Column row_bytes of the widened rows is the zero pad byte (offset -1 wraps to it).
        widened = np.zeros((rows.shape[0], rows.shape[1] + 1), dtype=np.uint8)
        widened[:, :-1] = rows
        picked = np.ascontiguousarray(widened[:, offsets])
        return picked.view(_WORD).reshape(-1).astype(np.uint64)

    def checksum(self, rows_u8: np.ndarray, epoch: int) -> int:
        """The batch checksum (uint64, never 0)."""
        return words_checksum(self.words(rows_u8), check_epoch(epoch))

    def control(self, rows_u8: np.ndarray, epoch: int) -> np.ndarray:
        """The published control block ``[count, checksum, epoch]``, little-endian uint64."""
        rows = check_rows_u8(rows_u8, "rows_u8")
        return np.array([rows.shape[0], self.checksum(rows, epoch), epoch], dtype=_WORD)

    def verify(self, rows_u8: np.ndarray, control: np.ndarray, epoch: int) -> bool:
        """Whether ``control`` announces ``epoch`` and the rows match its count and checksum."""
        epoch = check_epoch(epoch)
        rows = check_rows_u8(rows_u8, "rows_u8")
        ctl = np.asarray(control).view(_WORD).reshape(-1)
        if ctl.size != 3:
            raise InvalidArgumentError("control", ctl.shape, "must be 3 uint64 words")
        count, check, ctl_epoch = (int(v) for v in ctl)
        if ctl_epoch != epoch or count != rows.shape[0]:
            return False
        return check == self.checksum(rows, epoch)

    def decode(self, rows_u8: np.ndarray, control: np.ndarray, epoch: int) -> np.ndarray:
        """A copy of the rows if :meth:`verify` passes, else :class:`NotReadyError`."""
        if not self.verify(rows_u8, control, epoch):
            raise NotReadyError(f"DC: checksum or epoch mismatch for epoch {epoch}")
        return np.array(rows_u8, dtype=np.uint8, copy=True)
