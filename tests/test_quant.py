"""The quantiser (ubep.quant) against closed forms and brute-force searches (the native kernels
are checked against it in tests/runtime/test_native_quant.py, torch's cast in
tests/torch/test_torch_fp8.py).

benchmarks/quant_exhaustive.py extends the conversion checks to every float32 the quantiser
can produce (too long for the suite).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests._quant_support import F32_NAN, FORMATS
from tests._quant_support import assert_same as _assert_same
from tests._quant_support import bits as _bits
from tests._quant_support import probe_floats as _probe_floats
from ubep import InvalidArgumentError
from ubep.quant import (
    dequantize,
    e4m3_to_float32,
    float32_to_e4m3,
    float32_to_int8,
    quantize,
    ue8m0_ceil,
)

FORMAT_QMAX = {"e4m3": 448.0, "int8": 127.0}


def _f32(bits: np.ndarray | list[int]) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)








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


