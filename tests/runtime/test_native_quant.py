"""The native quantiser (runtime/native/kernels.c, AVX2 and generic builds) against ubep.quant,
bit for bit, on every BF16 pattern and on random rows of every float type."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests._quant_support import FORMATS
from tests._quant_support import assert_same as _assert_same
from tests._quant_support import bf16_patterns as _bf16_patterns
from tests._quant_support import bits as _bits
from tests._quant_support import native_quantize as _native_quantize
from tests._quant_support import probe_floats as _probe_floats
from ubep.quant import float32_to_e4m3, quantize
from ubep.runtime import abi


@pytest.fixture(scope="module")
def native() -> Any:
    return abi.load_native()


def _anchored_blocks(patterns: np.ndarray, anchor: float) -> np.ndarray:
    """BF16 rows whose every block starts with ``anchor`` followed by the finite patterns of
    magnitude <= anchor, so that ``anchor`` sets each block's scale."""
    x = (patterns.astype(np.uint32) << np.uint32(16)).view(np.float32)
    keep = patterns[np.isfinite(x) & (np.abs(x) <= anchor)]
    pad = (-len(keep)) % 127
    keep = np.concatenate([keep, np.zeros(pad, np.uint16)]).reshape(-1, 127)
    head_bits = int(_bits(np.array([anchor], np.float32))[0]) >> 16
    head = np.full((len(keep), 1), head_bits, np.uint16)
    rows = np.concatenate([head, keep], axis=1)  # [blocks, 128]
    return rows.reshape(-1, 8 * 128) if len(rows) % 8 == 0 else rows


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("round_scale", [False, True])
def test_native_equals_numpy_on_every_bf16_pattern(
    native: Any, fmt: str, round_scale: bool
) -> None:
    patterns = _bf16_patterns()
    rng = np.random.default_rng(7)
    mixed = rng.permutation(patterns).reshape(64, 1024)  # NaN, inf, subnormals: everything
    _assert_same(_native_quantize(native, mixed, fmt, round_scale),
                 quantize(mixed, fmt, round_scale=round_scale))
    # the same patterns under a few fixed scales (bf16 anchors exact)
    for anchor in (2.0**-120, 1.0, 448.0, 1.5 * 2.0**127):
        x = _anchored_blocks(patterns, anchor)
        _assert_same(_native_quantize(native, x, fmt, round_scale),
                     quantize(x, fmt, round_scale=round_scale))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint16])
def test_native_equals_numpy_on_random_rows(native: Any, dtype: type) -> None:
    rng = np.random.default_rng(8)
    x32 = (rng.standard_normal((16, 2048)) * np.exp(rng.uniform(-12, 12, (16, 2048))))
    x32 = x32.astype(np.float32)
    x32[3, 100:228] = 0.0
    x32[4, 7] = np.nan
    x32[5, 9] = -np.inf
    if dtype is np.uint16:
        x = (_bits(x32) >> np.uint32(16)).astype(np.uint16)
    else:
        with np.errstate(over="ignore"):  # float16 overflows to inf: part of the test
            x = x32.astype(dtype)
    for fmt in FORMATS:
        for round_scale in (False, True):
            _assert_same(_native_quantize(native, x, fmt, round_scale),
                         quantize(x, fmt, round_scale=round_scale))


def test_native_float32_conversion_through_unit_scales(native: Any) -> None:
    """With round_scale and a block maximum in (224, 448] the scale is exactly 1, so the native
    values are the conversion of the float32 inputs themselves: every probe value <= 448."""
    a = _probe_floats()
    a = a[np.isfinite(a) & (np.abs(a) <= 256.0)]
    a = a[: len(a) // 127 * 127].reshape(-1, 127)
    x = np.concatenate([np.full((len(a), 1), 256.0, np.float32), a], axis=1)
    values, scales = _native_quantize(native, x, "e4m3", True)
    assert (scales == 1.0).all()
    np.testing.assert_array_equal(values[:, 1:], float32_to_e4m3(a))


def test_native_refuses_bad_rows(native: Any) -> None:
    out = np.zeros(1024, np.uint8)
    sc = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="x:"):
        native.quantize_rows(np.zeros((2, 200), np.float32), "e4m3", False, out, sc)
    with pytest.raises(ValueError, match="fmt"):
        native.quantize_rows(np.zeros((2, 128), np.float32), "e5m2", False, out, sc)
    with pytest.raises(ValueError, match="scales_out"):
        native.quantize_rows(np.zeros((2, 512), np.float32), "int8", False, out, sc[:1])


