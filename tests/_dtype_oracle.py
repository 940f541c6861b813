"""An independent oracle of ubep.dtypes' conversions: exact-fraction BF16 rounding (round to
nearest, ties to even) and float32 bit patterns built from Python ints."""

from __future__ import annotations

import struct
from fractions import Fraction

import numpy as np

from ubep import dtypes


def bits(a: np.ndarray) -> np.ndarray:
    """Bit patterns, so -0.0 != +0.0 and the comparison is exact."""
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}")


# --- independent oracle ------------------------------------------------------------------------


def bf16_value(p: int) -> Fraction:
    """Exact value of a non-NaN BF16 pattern; exponent 255 with mantissa 0 reads as 2^128,
    the "next value" round-to-nearest compares against before overflowing to inf."""
    sign = -1 if p & 0x8000 else 1
    exp, mant = (p >> 7) & 0xFF, p & 0x7F
    if exp == 0:
        return sign * Fraction(mant, 128) * Fraction(2) ** -126
    return sign * (1 + Fraction(mant, 128)) * Fraction(2) ** (exp - 127)


def f32_to_bf16_oracle(f: float) -> int:
    b = struct.unpack("<I", struct.pack("<f", f))[0]
    if f != f:
        return (b >> 16) | 0x40
    sign, mag = b & 0x80000000, b & 0x7FFFFFFF
    lo = mag >> 16
    if lo == 0x7F80:  # inf stays inf
        return (sign >> 16) | lo
    exact = Fraction(struct.unpack("<f", struct.pack("<I", mag))[0])
    d_lo, d_hi = exact - bf16_value(lo), bf16_value(lo + 1) - exact
    pick = lo if d_lo < d_hi or (d_lo == d_hi and lo % 2 == 0) else lo + 1
    return (sign >> 16) | pick


def to_f32_oracle(dt: dtypes.DType, a: np.ndarray) -> np.ndarray:
    if dt is dtypes.BF16:
        # Built from Python ints: going through a Python float would quiet signalling NaNs.
        return np.array([int(v) << 16 for v in a.ravel()], dtype=np.uint32).view(
            np.float32
        ).reshape(a.shape)
    return a.astype(np.float32)


def from_f32_oracle(dt: dtypes.DType, a: np.ndarray) -> np.ndarray:
    if dt is dtypes.BF16:
        return np.array(
            [f32_to_bf16_oracle(float(v)) for v in a.ravel()], dtype=np.uint16
        ).reshape(a.shape)
    return a.astype(dt.storage)


