"""SP: sentinel polling (docs/FORMATS.md, "SP").

The receiver pre-fills its slots with a sentinel element and resets them after consuming them;
a row is complete iff none of its elements still has the sentinel's bit pattern. Every element is
checked because stores land in any order. The sentinel is a signalling NaN of the payload type
(``ubep.dtypes``), which arithmetic never produces (IEEE operations return quiet NaNs); a payload
that contains it anyway is refused before anything is sent. 1-byte types have no free pattern,
so SP refuses them and the caller uses TFF or DC.

SP has no epoch word: the reset to the sentinel after consumption is what keeps last call's rows
from validating this call, so it is mandatory, not an optimisation. Writers must store each
element whole (aligned stores at least the element width): a byte-wise store can leave an
element that is neither the sentinel nor the value, which the reader would accept.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import DType, dtype_of
from ..errors import InvalidArgumentError
from ._common import NotReadyError, align_up

__all__ = ["SpCodec"]

# (exponent mask, quiet bit) per type: a signalling NaN has all exponent bits set, a nonzero
# mantissa and the quiet bit clear.
_NAN_BITS = {"bf16": (0x7F80, 0x0040), "fp16": (0x7C00, 0x0200), "fp32": (0x7F800000, 0x00400000)}


class SpCodec:
    """Sentinel fill / check for one payload type.

    Args:
        dtype: a ``ubep.dtypes`` float type (``"bf16"``, ``"fp16"``, ``"fp32"``, a numpy dtype or
            array); 1-byte types raise ``InvalidArgumentError`` naming ``sync``.
    """

    def __init__(self, dtype: object) -> None:
        dt = dtype_of(dtype)
        if dt.sentinel is None:
            raise InvalidArgumentError(
                "sync", "sp",
                f"{dt.name} ({dt.itemsize} byte) has no value outside its data domain to use as "
                "a sentinel; use sync='tff' or sync='dc'",
            )
        _check_signalling_nan(dt)
        self.dtype = dt

    def __repr__(self) -> str:
        return f"SpCodec({self.dtype.name!r})"

    @staticmethod
    def slot_bytes(row_bytes: int) -> int:
        """Slot stride of a raw row: ``row_bytes`` rounded up to 64 bytes."""
        return align_up(row_bytes)

    @property
    def sentinel_bits(self) -> int:
        """The sentinel's bit pattern (an unsigned int of the element width)."""
        assert self.dtype.sentinel is not None
        return self.dtype.sentinel

    @property
    def sentinel(self) -> np.ndarray:
        """The sentinel as a 0-d array in the storage dtype."""
        return np.array(self.sentinel_bits, dtype=self.dtype.bits_dtype).view(self.dtype.storage)

    def _bits(self, rows: np.ndarray, argument: str) -> np.ndarray:
        a = np.asarray(rows)
        if a.dtype not in (self.dtype.storage, self.dtype.bits_dtype, np.dtype(np.uint8)):
            raise InvalidArgumentError(
                argument, a.dtype,
                f"must be {self.dtype.storage} (or its bytes) for {self.dtype.name}",
            )
        if a.ndim < 1 or (a.shape[-1] * a.dtype.itemsize) % self.dtype.itemsize:
            raise InvalidArgumentError(
                argument, a.shape, f"last axis must hold whole {self.dtype.itemsize}-byte elements"
            )
        return a.view(self.dtype.bits_dtype)

    def fill(self, buf: np.ndarray) -> None:
        """Write the sentinel into every element of ``buf`` (in place; also the reset)."""
        if not buf.flags.writeable:
            raise InvalidArgumentError("buf", "read-only", "must be writable")
        self._bits(buf, "buf")[...] = self.sentinel_bits

    reset = fill

    def element_ready(self, rows: np.ndarray) -> np.ndarray:
        """Per element: written (not the sentinel)."""
        return np.asarray(self._bits(rows, "rows") != self.sentinel_bits, dtype=bool)

    def row_ready(self, rows: np.ndarray) -> np.ndarray:
        """``[n]`` bool for ``[n, hidden]`` rows: no element is the sentinel."""
        ready = self.element_ready(rows)
        if ready.ndim != 2:
            raise InvalidArgumentError("rows", ready.shape, "must be 2-D [n, hidden]")
        return np.asarray(ready.all(axis=1), dtype=bool)

    def check_payload(self, x: np.ndarray) -> None:
        """Raise ``InvalidArgumentError`` (naming ``x``) if ``x`` holds the sentinel."""
        bits = self._bits(np.ascontiguousarray(x), "x")
        hits = np.nonzero(bits.reshape(-1) == self.sentinel_bits)[0]
        if hits.size:
            raise InvalidArgumentError(
                "x", f"element {int(hits[0])} = 0x{self.sentinel_bits:X}",
                f"holds the SP sentinel of {self.dtype.name} (a signalling NaN); "
                "clean the input or use sync='tff' or sync='dc'",
            )

    def decode(self, rows: np.ndarray) -> np.ndarray:
        """A copy of the rows if all are complete, else :class:`NotReadyError`."""
        ready = self.row_ready(rows)
        if not ready.all():
            pending = int((~ready).sum())
            raise NotReadyError(f"SP: {pending} of {len(ready)} rows still hold sentinels")
        return np.array(rows, copy=True)


def _check_signalling_nan(dt: DType) -> None:
    # Guards the constants in ubep.dtypes: a sentinel that arithmetic can produce would let a
    # legitimate NaN result be taken for "not written yet" forever.
    exp_mask, quiet = _NAN_BITS[dt.name]
    s = dt.sentinel
    assert s is not None
    if (s & exp_mask) != exp_mask or s & quiet or not s & (quiet - 1):
        raise InvalidArgumentError("dtype", dt.name, f"sentinel 0x{s:X} is not a signalling NaN")
