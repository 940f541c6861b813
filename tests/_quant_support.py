"""Helpers shared by the quantiser's tests: its formats, bit views and the native entry point."""

from __future__ import annotations

from typing import Any

import numpy as np

FORMATS = ("e4m3", "int8")
F32_NAN = 0x7FC00000  # the canonical quiet NaN


def bits(a: np.ndarray) -> np.ndarray:
    """float32 values as their uint32 patterns (NaNs compare by bits)."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def bf16_patterns() -> np.ndarray:
    """Every one of the 65,536 BF16 bit patterns."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def native_quantize(
    native: Any, x: np.ndarray, fmt: str, round_scale: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The selected build (AVX2 on x86) and the generic one; they must agree to be returned."""
    rows, hidden = x.shape
    out = []
    for generic in (False, True):
        values = np.full((rows, hidden), 0x55, dtype=np.uint8 if fmt == "e4m3" else np.int8)
        scales = np.full((rows, hidden // 128), -1.0, dtype=np.float32)
        native.quantize_rows(np.ascontiguousarray(x), fmt, round_scale, values, scales, generic)
        out.append((values, scales))
    assert_same(out[0], out[1])
    return out[0]


def assert_same(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray]) -> None:
    assert got[0].dtype == want[0].dtype
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(bits(got[1]), bits(want[1]))


def probe_floats() -> np.ndarray:
    """Every BF16 pattern with low halves that sit on, just below and just above each rounding
    boundary the 8 or fewer kept bits can have (the bits below them only act as a sticky bit)."""
    hi = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lows = np.array([0, 1, 0x3FFF, 0x4000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    return (hi[:, None] | lows[None, :]).ravel().view(np.float32)
