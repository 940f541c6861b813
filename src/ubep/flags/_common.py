"""Shared pieces of the Data-as-Flag codecs: epochs, row byte views, the not-ready error."""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError, UbepError

__all__ = ["EPOCH_MAX", "NotReadyError", "as_row_bytes", "check_epoch", "check_rows_u8"]

EPOCH_MAX = 2**64 - 1
SLOT_ALIGN_BYTES = 64


class NotReadyError(UbepError):
    """A decode found data that is not (completely) written for the expected epoch.

    Not an input error: the reader retries until its deadline (the runtime turns the last
    failure into ``ubep.TimeoutError``).
    """


def check_epoch(epoch: object) -> int:
    """An epoch is a uint64 >= 1 (0 never names a live call, docs/FORMATS.md)."""
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)):
        raise InvalidArgumentError("epoch", epoch, "must be an integer")
    if not 1 <= int(epoch) <= EPOCH_MAX:
        raise InvalidArgumentError("epoch", epoch, "must be in [1, 2^64)")
    return int(epoch)


def check_rows_u8(rows: object, argument: str = "rows") -> np.ndarray:
    """``rows`` as a C-contiguous ``[n, row_bytes]`` uint8 array (``row_bytes >= 1``)."""
    a = np.asarray(rows)
    if a.dtype != np.uint8 or a.ndim != 2:
        raise InvalidArgumentError(
            argument, (a.dtype, a.shape), "must be uint8 [n, row_bytes] (see as_row_bytes)"
        )
    if a.shape[1] < 1:
        raise InvalidArgumentError(argument, a.shape, "rows must hold at least one byte")
    return np.ascontiguousarray(a)


def as_row_bytes(x: object) -> np.ndarray:
    """``[n, hidden]`` array of any dtype as its ``[n, hidden * itemsize]`` uint8 bytes (a view
    when ``x`` is C-contiguous)."""
    a = np.ascontiguousarray(np.asarray(x))
    if a.ndim != 2:
        raise InvalidArgumentError("x", a.shape, "must be 2-D [n, hidden]")
    return a.view(np.uint8).reshape(a.shape[0], a.shape[1] * a.dtype.itemsize)


def align_up(n: int, align: int = SLOT_ALIGN_BYTES) -> int:
    return -(-n // align) * align
