"""The quantiser (ubep.quant) against closed forms, the native kernels against ubep.quant bit for
bit, and ubep.quant against torch's own FP8 cast when torch is installed.

benchmarks/quant_exhaustive.py extends the conversion checks to every float32 the quantiser
can produce (too long for the suite).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ubep import InvalidArgumentError
from ubep.quant import (
    dequantize,
    e4m3_to_float32,
    float32_to_e4m3,
    float32_to_int8,
    quantize,
    ue8m0_ceil,
)
from ubep.runtime import abi

FORMATS = ("e4m3", "int8")
FORMAT_QMAX = {"e4m3": 448.0, "int8": 127.0}
F32_NAN = 0x7FC00000


def _f32(bits: np.ndarray | list[int]) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _bf16_patterns() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def _probe_floats() -> np.ndarray:
    """Every BF16 pattern with low halves that sit on, just below and just above each rounding
    boundary the 8 or fewer kept bits can have (the bits below them only act as a sticky bit)."""
    hi = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lows = np.array([0, 1, 0x3FFF, 0x4000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    return (hi[:, None] | lows[None, :]).ravel().view(np.float32)


def _e4m3_brute(a: np.ndarray) -> np.ndarray:
    """Nearest E4M3 by exhaustive comparison with the 127 non-negative finite values (exact in
    float64), ties to the even code; above 448 saturates; NaN -> 0x7F."""
    finite = np.arange(0x7F, dtype=np.uint8)
    table = np.array([_e4m3_value(int(c)) for c in finite])
    with np.errstate(invalid="ignore"):
        x = np.abs(np.asarray(a, dtype=np.float64))
    dist = np.abs(x[:, None] - table[None, :])
    best = dist.min(axis=1, keepdims=True)
    tied = dist == best
    # among the (at most two) nearest codes take the even one
    even = tied & (finite[None, :] % 2 == 0)
    pick = np.where(even.any(axis=1), even.argmax(axis=1), tied.argmax(axis=1))
    pick = np.where(x >= 448.0, 0x7E, pick).astype(np.uint8)
    out = pick | np.where(np.signbit(a), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(a), np.uint8(0x7F), out)


def _e4m3_value(code: int) -> float:
    exp, man = (code >> 3) & 0xF, code & 7
    mag = man * 2.0**-9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
    return -mag if code & 0x80 else mag


@pytest.fixture(scope="module")
def native() -> Any:
    return abi.load_native()


def _native_quantize(
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
    _assert_same(out[0], out[1])
    return out[0]


def _assert_same(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray]) -> None:
    assert got[0].dtype == want[0].dtype
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(_bits(got[1]), _bits(want[1]))


# ------------------------------------------------------------------ conversions (numpy)
def test_e4m3_conversion_is_nearest_even_with_saturation() -> None:
    a = _probe_floats()
    for chunk in np.array_split(a, 16):
        np.testing.assert_array_equal(float32_to_e4m3(chunk), _e4m3_brute(chunk))


def test_int8_conversion_is_nearest_even_clamped() -> None:
    a = _probe_floats()
    finite = np.where(np.isnan(a), 0.0, a).astype(np.float64)
    want = np.clip(np.rint(np.clip(finite, -1e3, 1e3)), -127, 127).astype(np.int8)
    np.testing.assert_array_equal(float32_to_int8(a), want)


def test_conversion_corner_values() -> None:
    cases = [  # float32 -> E4M3 bits
        (0.0, 0x00), (-0.0, 0x80), (2.0**-10, 0x00), (-(2.0**-10), 0x80), (3 * 2.0**-10, 0x02),
        (2.0**-9, 0x01), (2.0**-6, 0x08), (448.0, 0x7E), (464.0, 0x7E), (1e30, 0x7E),
        (np.inf, 0x7E), (-np.inf, 0xFE), (416.0, 0x7D), (432.0, 0x7E), (400.0, 0x7C),
        (1.0625, 0x38), (1.1875, 0x3A), (np.nan, 0x7F),
    ]
    got = float32_to_e4m3(np.array([c[0] for c in cases], dtype=np.float32))
    assert [int(g) for g in got] == [c[1] for c in cases]
    ints = [(0.5, 0), (1.5, 2), (2.5, 2), (-2.5, -2), (126.5, 126), (127.4, 127), (1e9, 127),
            (-np.inf, -127), (np.nan, 0), (-0.0, 0)]
    got8 = float32_to_int8(np.array([c[0] for c in ints], dtype=np.float32))
    assert [int(g) for g in got8] == [c[1] for c in ints]


def test_e4m3_decode_table() -> None:
    codes = np.arange(256, dtype=np.uint8)
    vals = e4m3_to_float32(codes)
    want = np.array([_e4m3_value(c) for c in range(256)], dtype=np.float32)
    nan = (codes & 0x7F) == 0x7F
    assert np.isnan(vals[nan]).all()
    np.testing.assert_array_equal(vals[~nan], want[~nan])
    # every finite code survives decode -> encode
    np.testing.assert_array_equal(float32_to_e4m3(vals[~nan]), codes[~nan])


def test_ue8m0_ceil_is_the_next_power_of_two() -> None:
    s = _f32([0x3F800000, 0x3F800001, 0x3FFFFFFF, 0x00800000, 0x34000001, 0x7F800000])
    np.testing.assert_array_equal(
        _bits(ue8m0_ceil(s)),
        [0x3F800000, 0x40000000, 0x40000000, 0x00800000, 0x34800000, 0x7F800000],
    )
    assert np.isnan(ue8m0_ceil(_f32([F32_NAN])))[0]


# ------------------------------------------------------------------ quantize (numpy)
def _scale_bits(amax: float, qmax: float) -> int:
    scale = np.float32(max(np.float32(amax), np.float32(1e-4))) / np.float32(qmax)
    return int(_bits(np.array([scale]))[0])


def test_zero_and_negative_zero_blocks() -> None:
    x = np.zeros((2, 256), dtype=np.float32)
    x[1, :128] = -0.0
    for fmt, qmax, neg_zero in (("e4m3", 448.0, 0x80), ("int8", 127.0, 0)):
        values, scales = quantize(x, fmt)
        assert (_bits(scales) == _scale_bits(0.0, qmax)).all()
        assert (values.view(np.uint8)[1, :128] == neg_zero).all()
        assert (values[0] == 0).all() and (values[1, 128:] == 0).all()


def test_nan_poisons_its_block_only() -> None:
    x = np.ones((1, 256), dtype=np.float32)
    x[0, 5] = -np.nan
    for fmt in FORMATS:
        values, scales = quantize(x, fmt)
        assert int(_bits(scales)[0, 0]) == F32_NAN
        assert (values[0, :128] == (0x7F if fmt == "e4m3" else 0)).all()
        assert int(_bits(scales)[0, 1]) == _scale_bits(1.0, FORMAT_QMAX[fmt])
        deq = dequantize(values, scales, fmt)
        assert np.isnan(deq[0, :128]).all() and np.isfinite(deq[0, 128:]).all()



def test_inf_block() -> None:
    x = np.zeros((1, 128), dtype=np.float32)
    x[0, :4] = [np.inf, -np.inf, 3.0, -3.0]
    values, scales = quantize(x, "e4m3")
    assert np.isinf(scales[0, 0])
    assert values[0, :4].tolist() == [0x7F, 0x7F, 0x00, 0x80]  # inf / inf is NaN, 3 / inf is 0
    ivalues, _ = quantize(x, "int8")
    assert (ivalues == 0).all()


def test_block_maximum_maps_to_the_format_maximum() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 512)).astype(np.float32)
    for fmt, top in (("e4m3", 0x7E), ("int8", 127)):
        values, _ = quantize(x, fmt)
        mags = values.view(np.uint8) & 0x7F if fmt == "e4m3" else np.abs(values)
        blocks = mags.reshape(64, 4, 128)
        assert (blocks.max(axis=-1) == top).all()  # rounding never passes the maximum


def test_subnormal_e4m3_values() -> None:
    x = np.zeros((1, 128), dtype=np.float32)
    x[0, :6] = [448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, -(2.0**-10) * 1.0001, 7.5 * 2.0**-9]
    values, scales = quantize(x, "e4m3")
    assert float(scales[0, 0]) == 1.0  # so values are the exact x rounded
    assert values[0, :6].tolist() == [0x7E, 0x01, 0x00, 0x02, 0x81, 0x08]


def test_round_scale_gives_powers_of_two_at_least_the_plain_scale() -> None:
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((32, 512)) * np.exp(rng.uniform(-20, 20, (32, 1)))).astype(np.float32)
    for fmt in FORMATS:
        _, plain = quantize(x, fmt)
        values, pow2 = quantize(x, fmt, round_scale=True)
        assert (_bits(pow2) & 0x7FFFFF == 0).all()
        assert (pow2 >= plain).all() and (pow2 < 2 * plain).all()
        mags = values.view(np.uint8) & 0x7F if fmt == "e4m3" else np.abs(values)
        assert mags.max() <= (0x7E if fmt == "e4m3" else 127)
    # a scale one ulp above a power of two goes to the next one (float32 log2 would not)
    x1 = np.zeros((1, 128), dtype=np.float32)
    x1[0, 0] = np.float32(448.0) * _f32([0x3F800001])[0]  # amax / 448 = 1 + 2^-23
    assert float(quantize(x1, "e4m3", round_scale=True)[1][0, 0]) == 2.0


def test_dequantize_error_is_within_half_a_step() -> None:
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((16, 1024)) * np.exp(rng.standard_normal((16, 1024)))).astype(
        np.float32
    )
    for round_scale in (False, True):
        values, scales = quantize(x, "e4m3", round_scale=round_scale)
        s = np.repeat(scales, 128, axis=1).astype(np.float64)
        v = x / s
        # half an E4M3 step: 2^-4 relative above 2^-6, 2^-10 absolute below (in units of s)
        step = np.where(np.abs(v) >= 2.0**-6, np.abs(v) * 2.0**-4, 2.0**-10)
        err = np.abs(dequantize(values, scales, "e4m3") - x) / s
        assert (err <= step * (1 + 1e-6)).all()
        ivalues, iscales = quantize(x, "int8", round_scale=round_scale)
        si = np.repeat(iscales, 128, axis=1).astype(np.float64)
        assert (np.abs(dequantize(ivalues, iscales, "int8") - x) / si <= 0.5 + 1e-5).all()


def test_inputs_of_every_float_type_agree() -> None:
    rng = np.random.default_rng(6)
    x16 = rng.standard_normal((8, 256)).astype(np.float16)
    bf16 = (_bits(x16.astype(np.float32)) >> np.uint32(16)).astype(np.uint16)  # exact: fp16 fits
    for fmt in FORMATS:
        _assert_same(quantize(x16, fmt), quantize(x16.astype(np.float32), fmt))
        x_bf16 = (bf16.astype(np.uint32) << np.uint32(16)).view(np.float32)
        _assert_same(quantize(bf16, fmt), quantize(x_bf16, fmt))


@pytest.mark.parametrize(
    ("args", "argument"),
    [
        ((np.zeros((2, 200), np.float32), "e4m3"), "x"),
        ((np.zeros(256, np.float32), "e4m3"), "x"),
        ((np.zeros((2, 256), np.int8), "int8"), "x"),
        ((np.zeros((2, 256), np.float32), "e5m2"), "fmt"),
    ],
)
def test_bad_input_names_the_argument(args: tuple[np.ndarray, str], argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        quantize(*args)
    assert info.value.argument == argument


def test_dequantize_checks_shapes() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        dequantize(np.zeros((2, 256), np.uint8), np.zeros((2, 3), np.float32), "e4m3")
    assert info.value.argument == "scales"
    with pytest.raises(InvalidArgumentError) as info:
        dequantize(np.zeros((2, 256), np.uint8), np.zeros((2, 2), np.float32), "int8")
    assert info.value.argument == "values"


# ------------------------------------------------------------------ native == numpy
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


# ------------------------------------------------------------------ numpy == torch
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
