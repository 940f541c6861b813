"""TFF: token-flag fusion (docs/FORMATS.md, "TFF").

A row is cut into blocks of ``P = block_bytes - flag_bytes`` payload bytes; each block is stored
as its payload (zero padded to ``P``) followed by a ``flag_bytes`` flag field whose first 8 bytes
are the epoch (little-endian uint64) and the rest zero. The writer stores a block's payload, then
its epoch word with a separate release store; the reader takes a block as complete iff its epoch
word equals the expected epoch, and a row iff all its blocks are.

On a CPU a block is not written atomically (docs/MEMORY-MODEL.md), so the guarantee rests
entirely on that order: a writer that stores the flag with (or before) the payload exposes torn
blocks, and no reader-side check can tell. The epoch, not a clear-to-zero, rejects a stale
block left by the previous call, so buffers are reused without clearing.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError
from ._common import NotReadyError, check_epoch, check_rows_u8

__all__ = ["TffCodec"]

_WORD = np.dtype("<u8")


class TffCodec:
    """Encoder/decoder of TFF slots.

    Args:
        block_bytes: bytes per block, flag included; a multiple of 64 so every slot and flag
            word stays aligned (default 512, UB's atomic write size).
        flag_bytes: flag field per block, >= 8 and a multiple of 8 (default 32, the paper's).
    """

    def __init__(self, block_bytes: int = 512, flag_bytes: int = 32) -> None:
        if not isinstance(flag_bytes, int) or flag_bytes < 8 or flag_bytes % 8:
            raise InvalidArgumentError("flag_bytes", flag_bytes, "must be >= 8, a multiple of 8")
        if not isinstance(block_bytes, int) or block_bytes % 64 or block_bytes <= flag_bytes:
            raise InvalidArgumentError(
                "block_bytes", block_bytes,
                f"must be a multiple of 64 larger than flag_bytes={flag_bytes}",
            )
        self.block_bytes = block_bytes
        self.flag_bytes = flag_bytes

    def __repr__(self) -> str:
        return f"TffCodec(block_bytes={self.block_bytes}, flag_bytes={self.flag_bytes})"

    @property
    def payload_per_block(self) -> int:
        """``P``: payload bytes per block (480 by default)."""
        return self.block_bytes - self.flag_bytes

    @property
    def efficiency(self) -> float:
        """Effective bandwidth fraction ``P / block_bytes``."""
        return self.payload_per_block / self.block_bytes

    def num_blocks(self, row_bytes: int) -> int:
        if row_bytes < 1:
            raise InvalidArgumentError("row_bytes", row_bytes, "must be >= 1")
        return -(-row_bytes // self.payload_per_block)

    def slot_bytes(self, row_bytes: int) -> int:
        """Encoded size (and slot stride) of a row: ``num_blocks * block_bytes``."""
        return self.num_blocks(row_bytes) * self.block_bytes

    def flag_offsets(self, row_bytes: int) -> np.ndarray:
        """Byte offset inside a slot of each block's epoch word."""
        nblocks = self.num_blocks(row_bytes)
        return np.arange(nblocks, dtype=np.int64) * self.block_bytes + self.payload_per_block

    def encode(self, rows_u8: np.ndarray, epoch: int) -> np.ndarray:
        """``[n, row_bytes]`` uint8 rows -> ``[n, slot_bytes]`` uint8 slots for ``epoch``."""
        epoch = check_epoch(epoch)
        slots = self.unflagged(rows_u8)
        blocks = slots.reshape(slots.shape[0], slots.shape[1] // self.block_bytes,
                               self.block_bytes)
        P = self.payload_per_block
        blocks[:, :, P : P + 8] = np.frombuffer(np.array([epoch], _WORD).tobytes(), np.uint8)
        return slots

    def unflagged(self, rows_u8: np.ndarray) -> np.ndarray:
        """The slots of ``[n, row_bytes]`` rows with every flag field zero: what a writer that
        stores the flags later (a separate put, after a flush: the RMA engine) sends first."""
        rows = check_rows_u8(rows_u8, "rows_u8")
        n, row_bytes = rows.shape
        nblocks, P = self.num_blocks(row_bytes), self.payload_per_block
        blocks = np.zeros((n, nblocks, self.block_bytes), dtype=np.uint8)
        padded = np.zeros((n, nblocks * P), dtype=np.uint8)
        padded[:, :row_bytes] = rows
        blocks[:, :, :P] = padded.reshape(n, nblocks, P)
        return blocks.reshape(n, nblocks * self.block_bytes)

    def _blocks(self, slots: np.ndarray, row_bytes: int | None) -> np.ndarray:
        a = np.asarray(slots)
        if row_bytes is None:  # any whole number of blocks
            ok = a.ndim == 2 and a.shape[1] > 0 and a.shape[1] % self.block_bytes == 0
            want = a.shape[1] if ok else -1
            expect = f"uint8 [n, multiple of {self.block_bytes}]"
        else:
            want = self.slot_bytes(row_bytes)
            expect = f"uint8 [n, {want}] for row_bytes={row_bytes}"
        if a.dtype != np.uint8 or a.ndim != 2 or a.shape[1] != want:
            raise InvalidArgumentError("slots", (a.dtype, a.shape), f"must be {expect}")
        return np.ascontiguousarray(a).reshape(
            a.shape[0], want // self.block_bytes, self.block_bytes
        )

    def block_ready(
        self, slots: np.ndarray, epoch: int, row_bytes: int | None = None
    ) -> np.ndarray:
        """``[n, num_blocks]`` bool: the block's epoch word equals ``epoch``.

        ``row_bytes`` only checks the slot width; the blocks are found from the width alone.
        """
        epoch = check_epoch(epoch)
        blocks = self._blocks(slots, row_bytes)
        P = self.payload_per_block
        words = np.ascontiguousarray(blocks[:, :, P : P + 8]).view(_WORD)[..., 0]
        return np.asarray(words == np.uint64(epoch), dtype=bool)

    def row_ready(self, slots: np.ndarray, epoch: int, row_bytes: int | None = None) -> np.ndarray:
        """``[n]`` bool: every block of the row carries ``epoch``."""
        return np.all(self.block_ready(slots, epoch, row_bytes), axis=1, keepdims=False)

    def decode(self, slots: np.ndarray, epoch: int, row_bytes: int) -> np.ndarray:
        """``[n, row_bytes]`` payload; :class:`NotReadyError` if any block lacks ``epoch``."""
        ready = self.row_ready(slots, epoch, row_bytes)
        if not ready.all():
            missing = np.nonzero(~ready)[0]
            raise NotReadyError(
                f"TFF: {len(missing)} of {len(ready)} rows not complete for epoch {epoch} "
                f"(first: row {int(missing[0])})"
            )
        return self.payload(slots, row_bytes).copy()

    def payload(self, slots: np.ndarray, row_bytes: int) -> np.ndarray:
        """``[n, row_bytes]`` payload of the slots, flags unchecked (for a reader that has
        checked them already: :meth:`row_ready`); a view where ``slots`` is contiguous."""
        blocks = self._blocks(slots, row_bytes)
        n, nblocks, _ = blocks.shape
        P = self.payload_per_block
        return blocks[:, :, :P].reshape(n, nblocks * P)[:, :row_bytes]
