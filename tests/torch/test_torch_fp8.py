"""ubep.quant against torch's own FP8 cast and ubep.torch.fp8 (DeepEP's per-128-channel casts)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests._quant_support import F32_NAN
from tests._quant_support import bits as _bits
from tests._quant_support import probe_floats as _probe_floats
from ubep.quant import float32_to_e4m3, quantize, ue8m0_ceil

pytest.importorskip("torch")


def _torch_reference(x: Any, round_scale: bool) -> tuple[np.ndarray, np.ndarray]:
    """The quantiser written with torch's own ops and its own float8 cast."""
    import torch

    t, h = x.shape
    blocks = x.to(torch.float32).reshape(t, h // 128, 128)
    scale = blocks.abs().amax(dim=-1).clamp(min=1e-4) / 448.0
    if round_scale:  # exact: frexp gives mantissa in [0.5, 1); 0.5 means a power of two
        mant, exp = torch.frexp(scale)
        keep = (mant == 0.5) | ~torch.isfinite(scale)
        scale = torch.where(keep, scale, torch.ldexp(torch.ones_like(scale), exp))
    q = (blocks / scale[..., None]).to(torch.float8_e4m3fn).reshape(t, h)
    return q.view(torch.uint8).numpy(), scale.numpy()


@pytest.mark.parametrize("round_scale", [False, True])
def test_numpy_equals_torch(round_scale: bool) -> None:
    torch = pytest.importorskip("torch")
    from ubep.torch.fp8 import quantize_fp8

    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, 1024, generator=g) * torch.exp(torch.randn(64, 1024, generator=g) * 4)
    x = x.to(torch.bfloat16)
    x[1, :128] = 0.0
    x[2, 3] = float("inf")
    x[3, 5] = float("nan")
    values, scales = quantize(x.view(torch.uint16).numpy(), "e4m3", round_scale=round_scale)
    want_v, want_s = _torch_reference(x, round_scale)
    nan = (want_v & 0x7F) == 0x7F  # torch keeps a NaN's sign (0xFF), ubep writes 0x7F
    assert nan.any() and (values[nan] == 0x7F).all()
    np.testing.assert_array_equal(values[~nan], want_v[~nan])
    s_nan = np.isnan(want_s)
    np.testing.assert_array_equal(_bits(scales[~s_nan]), _bits(want_s[~s_nan]))
    assert (_bits(scales[s_nan]) == F32_NAN).all()
    q, s = quantize_fp8(x, round_scale)  # the facade's entry point is ubep.quant itself
    assert q.dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), values)
    np.testing.assert_array_equal(_bits(s.numpy()), _bits(scales))


def test_torch_float8_cast_agrees_with_the_conversion() -> None:
    torch = pytest.importorskip("torch")
    a = _probe_floats()
    got = torch.from_numpy(a.copy()).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    mine = float32_to_e4m3(a)
    nan = np.isnan(a)
    np.testing.assert_array_equal(mine[~nan], got[~nan])  # saturation included
    assert ((got[nan] & 0x7F) == 0x7F).all() and (mine[nan] == 0x7F).all()


def test_torch_log2_rounding_is_exact_for_bf16_block_maxima() -> None:
    """The old torch formula ``exp2(ceil(log2(scale)))`` equals ue8m0_ceil whenever amax is a
    BF16 value (every positive finite one is checked), so BF16 callers saw no change."""
    torch = pytest.importorskip("torch")
    pos = np.arange(1, 0x7F80, dtype=np.uint32) << np.uint32(16)
    amax = np.maximum(pos.view(np.float32), np.float32(1e-4))
    scale = amax / np.float32(448.0)
    old = torch.exp2(torch.ceil(torch.log2(torch.from_numpy(scale)))).numpy()
    np.testing.assert_array_equal(_bits(old), _bits(ue8m0_ceil(scale)))
