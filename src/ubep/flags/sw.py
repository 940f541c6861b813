"""SW: stop-and-wait, the baseline (docs/FORMATS.md, "SW").

Slots hold the raw rows. After all of a source's rows to one destination are written, the source
release-stores one 8-byte flag word equal to the epoch; the reader acquire-loads it until it
equals the epoch and only then reads the rows.
"""

from __future__ import annotations

import numpy as np

from ._common import NotReadyError, align_up, check_epoch, check_rows_u8

__all__ = ["SwFlag"]

_WORD = np.dtype("<u8")


class SwFlag:
    """Encoder/decoder of the SW flag word (stateless)."""

    @staticmethod
    def slot_bytes(row_bytes: int) -> int:
        """Slot stride of a raw row: ``row_bytes`` rounded up to 64 bytes."""
        return align_up(row_bytes)

    @staticmethod
    def encode(epoch: int) -> np.ndarray:
        """The flag word as ``[1]`` little-endian uint64 (its 8 bytes are what is stored)."""
        return np.array([check_epoch(epoch)], dtype=_WORD)

    @staticmethod
    def ready(flag: np.ndarray, epoch: int) -> bool:
        """Whether the flag word announces ``epoch`` (an older epoch is not ready)."""
        word = np.asarray(flag).view(_WORD).reshape(-1)
        return bool(word.size == 1 and int(word[0]) == check_epoch(epoch))

    @classmethod
    def decode(cls, rows: np.ndarray, flag: np.ndarray, epoch: int) -> np.ndarray:
        """The rows, once the flag says they are all written; else :class:`NotReadyError`."""
        rows = check_rows_u8(rows)
        if not cls.ready(flag, epoch):
            raise NotReadyError(f"SW flag does not announce epoch {epoch}")
        return rows.copy()
