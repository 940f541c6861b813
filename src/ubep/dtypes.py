"""Payload element types and how each is stored in numpy.

numpy has no bfloat16, so ubep stores every payload in a plain numpy *storage* dtype and reads
its meaning from that dtype alone (the mapping is one-to-one, so no extra tag travels with an
array):

=========  ==============  ========  =====================================================
ubep name  numpy storage   itemsize  meaning
=========  ==============  ========  =====================================================
``bf16``   ``uint16``      2         bfloat16 bit patterns (``torch.bfloat16`` viewed as
                                     ``torch.uint16``); ``ml_dtypes.bfloat16`` is accepted
                                     and viewed as ``uint16``
``fp16``   ``float16``     2         IEEE half
``fp32``   ``float32``     4         IEEE single
``int8``   ``int8``        1         W8A8 integer activations
``uint8``  ``uint8``       1         opaque bytes, e.g. FP8 (E4M3/E5M2) bit patterns
=========  ==============  ========  =====================================================

Wherever ubep takes a dtype it also takes the ``torch.dtype`` of that meaning (checked by
name, torch is never imported here): ``torch.bfloat16``, ``torch.float16``, ``torch.float32``,
``torch.int8``, ``torch.uint8``, and every ``torch.float8_*`` as ``uint8`` bytes.

Dispatch moves any of them bit for bit. Arithmetic (combine) needs a float type: the three
float descriptors convert exactly to float32 and back with round-to-nearest-even
(:meth:`DType.from_float32`); the 1-byte ones have no float view here (FP8 scales are the
caller's business) and raise.

Each float type has an SP sentinel (docs/FORMATS.md): a *signalling* NaN bit pattern, which no
arithmetic produces because every IEEE operation returns a quiet NaN. Sentinels are compared as
bit patterns, never as floats (NaN != NaN, and a float conversion may quiet it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidArgumentError

__all__ = [
    "BF16",
    "CANONICAL_NAN",
    "DTYPES",
    "FP16",
    "FP32",
    "INT8",
    "TORCH_DTYPES",
    "UINT8",
    "DType",
    "as_storage",
    "dtype_of",
]


@dataclass(frozen=True)
class DType:
    """A payload element type.

    Attributes:
        name: ``"bf16"``, ``"fp16"``, ``"fp32"``, ``"int8"`` or ``"uint8"``.
        storage: the numpy dtype arrays of this type are stored in.
        is_float: whether combine can reduce it (converts exactly to float32).
        sentinel: SP sentinel as an unsigned bit pattern of ``itemsize`` bytes, or ``None``
            when the type has no value outside its data domain (1-byte types).
    """

    name: str
    storage: np.dtype
    is_float: bool
    sentinel: int | None

    @property
    def itemsize(self) -> int:
        return int(self.storage.itemsize)

    @property
    def bits_dtype(self) -> np.dtype:
        """Unsigned integer dtype of the same width, for bit-pattern comparisons."""
        return np.dtype(f"u{self.itemsize}")

    def to_float32(self, arr: np.ndarray) -> np.ndarray:
        """Exact float32 values of a storage array (a new array)."""
        self._require_float("to_float32")
        a = np.asarray(arr)
        if a.dtype != self.storage:
            raise InvalidArgumentError("arr", a.dtype, f"must be stored as {self.storage}")
        if self.name == "bf16":
            return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return a.astype(np.float32)

    def from_float32(self, arr: np.ndarray) -> np.ndarray:
        """Round float32 values to this type (round to nearest, ties to even); every NaN becomes
        the type's canonical quiet NaN (:data:`CANONICAL_NAN`): IEEE 754 leaves the payload of
        ``NaN + NaN`` to the implementation, so a reduction's NaN payload is not reproducible
        across scalar and vector code, and combine promises bits."""
        self._require_float("from_float32")
        a = np.asarray(arr)
        if a.dtype != np.float32:
            raise InvalidArgumentError("arr", a.dtype, "must be float32")
        out = _float32_to_bf16_bits(a) if self.name == "bf16" else a.astype(self.storage)
        nan = np.isnan(a)
        if nan.any():
            out = np.array(out, copy=True)
            out.view(self.bits_dtype)[nan] = CANONICAL_NAN[self.name]
        return out

    def contains_sentinel(self, arr: np.ndarray) -> bool:
        """Whether any element of ``arr`` has the sentinel's bit pattern."""
        if self.sentinel is None:
            return False
        bits = np.ascontiguousarray(arr).view(self.bits_dtype)
        return bool((bits == self.sentinel).any())

    def _require_float(self, what: str) -> None:
        if not self.is_float:
            raise InvalidArgumentError(
                "dtype", self.name, f"{what} needs a float type (bf16, fp16, fp32)"
            )


def _float32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(a).view(np.uint32)
    # Round to nearest even on the 16 dropped bits; uint32 arithmetic cannot overflow for
    # non-NaN inputs (the largest, 0x7F7FFFFF + 0x8000, stays below 2^32 and rounds to inf).
    # NaN inputs come out wrong here; from_float32 overwrites them with the canonical NaN.
    bias = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    return ((bits + bias) >> np.uint32(16)).astype(np.uint16)


#: The quiet NaN every float conversion of combine's results produces (bit patterns).
CANONICAL_NAN: dict[str, int] = {"bf16": 0x7FC0, "fp16": 0x7E00, "fp32": 0x7FC00000}


BF16 = DType("bf16", np.dtype(np.uint16), True, 0x7FA5)
FP16 = DType("fp16", np.dtype(np.float16), True, 0x7CA5)
FP32 = DType("fp32", np.dtype(np.float32), True, 0x7FA5A5A5)
INT8 = DType("int8", np.dtype(np.int8), False, None)
UINT8 = DType("uint8", np.dtype(np.uint8), False, None)

DTYPES: dict[str, DType] = {d.name: d for d in (BF16, FP16, FP32, INT8, UINT8)}
_BY_STORAGE: dict[np.dtype, DType] = {d.storage: d for d in DTYPES.values()}


#: ``torch.dtype`` names (``str(torch.bfloat16)`` = ``"torch.bfloat16"``) and their ubep type.
#: Every FP8 format travels as opaque bytes (``"uint8"``): ubep moves it, the caller's scales
#: give it meaning.
TORCH_DTYPES: dict[str, DType] = {
    "torch.bfloat16": BF16,
    "torch.float16": FP16,
    "torch.float32": FP32,
    "torch.int8": INT8,
    "torch.uint8": UINT8,
    "torch.float8_e4m3fn": UINT8,
    "torch.float8_e5m2": UINT8,
    "torch.float8_e4m3fnuz": UINT8,
    "torch.float8_e5m2fnuz": UINT8,
}


def _is_torch_dtype(value: object) -> bool:
    # Checked by type name so that ubep never imports torch for it.
    kind = type(value)
    return kind.__name__ == "dtype" and kind.__module__ == "torch"


def _torch_dtype(value: object, argument: str) -> DType:
    found = TORCH_DTYPES.get(str(value))
    if found is None:
        raise InvalidArgumentError(
            argument, value,
            f"unsupported payload dtype; use one of {', '.join(TORCH_DTYPES)}",
        )
    return found


def dtype_of(value: object, *, argument: str = "dtype") -> DType:
    """The :class:`DType` of an array or tensor, a numpy or ``torch`` dtype, a ``DType`` or a
    ubep name like ``"bf16"`` (``torch.float8_e4m3fn`` and the other FP8 types: ``"uint8"``)."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    if _is_torch_dtype(value):
        return _torch_dtype(value, argument)
    raw: Any = getattr(value, "dtype", None)
    if _is_torch_dtype(raw):  # a torch tensor
        return _torch_dtype(raw, argument)
    if not isinstance(raw, np.dtype):  # a class like np.float32 has a non-dtype .dtype
        raw = value
    try:
        np_dtype = np.dtype(raw)
    except TypeError:
        raise InvalidArgumentError(argument, value, "is not a dtype or array") from None
    if np_dtype.name == "bfloat16" and np_dtype.itemsize == 2:
        return BF16
    found = _BY_STORAGE.get(np_dtype)
    if found is None:
        raise InvalidArgumentError(
            argument, np_dtype,
            "unsupported payload dtype; use uint16 (bf16 bits), float16, float32, int8 or uint8",
        )
    return found


def as_storage(arr: object, *, argument: str = "x") -> tuple[np.ndarray, DType]:
    """``arr`` as a numpy array in its storage dtype, with its :class:`DType`.

    ``ml_dtypes.bfloat16`` arrays are viewed (not copied) as ``uint16``.
    """
    a = np.asarray(arr)
    dt = dtype_of(a.dtype, argument=argument)
    if a.dtype != dt.storage:
        a = a.view(dt.storage)
    return a, dt
