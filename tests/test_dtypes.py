"""ubep.dtypes: BF16 rounding against the exact-fraction oracle, sentinels, dtype lookup and
its errors."""

from __future__ import annotations

import numpy as np
import pytest

from tests._dtype_oracle import bits, from_f32_oracle, to_f32_oracle
from ubep import dtypes
from ubep.errors import InvalidArgumentError


def test_bf16_round_trip_against_exact_rounding():
    rng = np.random.default_rng(0)
    special = np.array(
        [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 3.3895314e38, 3.4028235e38, 1e-45, -1e-40,
         1.00390625, 1.01171875, 1.0078125 + 2**-23],  # ties to even down / up, and just above
        dtype=np.float32,
    )
    random_bits = rng.integers(0, 2**32, size=3000, dtype=np.uint64).astype(np.uint32)
    vals = np.concatenate([special, random_bits.view(np.float32)])
    vals = vals[~np.isnan(vals)]
    got = dtypes.BF16.from_float32(vals)
    want = from_f32_oracle(dtypes.BF16, vals)
    np.testing.assert_array_equal(got, want)
    # Every BF16 pattern converts to float32 exactly and back to itself (NaNs stay NaN).
    all_bf16 = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    f = dtypes.BF16.to_float32(all_bf16)
    np.testing.assert_array_equal(bits(f), bits(to_f32_oracle(dtypes.BF16, all_bf16)))
    back = dtypes.BF16.from_float32(f)
    nan = np.isnan(f)
    np.testing.assert_array_equal(back[~nan], all_bf16[~nan])
    assert np.isnan(dtypes.BF16.to_float32(back[nan])).all()


def test_bf16_to_float32_is_the_top_half():
    patterns = np.array([0x0000, 0x8000, 0x3F80, 0xC2F7, 0x7F80, 0x0001], dtype=np.uint16)
    got = dtypes.BF16.to_float32(patterns)
    np.testing.assert_array_equal(got, to_f32_oracle(dtypes.BF16, patterns))
    assert got.tolist()[:4] == [0.0, -0.0, 1.0, -123.5]


def test_sentinels_are_signalling_nans():
    for dt, exp_mask, quiet_bit in [
        (dtypes.BF16, 0x7F80, 0x0040),
        (dtypes.FP16, 0x7C00, 0x0200),
        (dtypes.FP32, 0x7F800000, 0x00400000),
    ]:
        s = dt.sentinel
        assert s is not None
        assert s & exp_mask == exp_mask and s & (quiet_bit - 1) != 0 and not s & quiet_bit
        sentinel_value = np.array([s], dtype=dt.bits_dtype).view(dt.storage)
        # Arithmetic on it yields a quiet NaN, never the sentinel again.
        f = dt.to_float32(sentinel_value)
        with np.errstate(invalid="ignore"):
            produced = dt.from_float32((f * np.float32(1)) + np.float32(0))
        assert not dt.contains_sentinel(produced)
        assert dt.contains_sentinel(np.concatenate([np.zeros(3, dt.storage), sentinel_value]))
    assert dtypes.INT8.sentinel is None and dtypes.UINT8.sentinel is None


def test_dtype_of_and_errors():
    assert dtypes.dtype_of(np.zeros(2, np.uint16)) is dtypes.BF16
    assert dtypes.dtype_of("fp16") is dtypes.FP16
    assert dtypes.dtype_of(np.float32) is dtypes.FP32
    for bad in (np.float64, np.int32, "bf8"):
        with pytest.raises(InvalidArgumentError):
            dtypes.dtype_of(bad)
    with pytest.raises(InvalidArgumentError) as err:
        dtypes.INT8.to_float32(np.zeros(2, np.int8))
    assert err.value.argument == "dtype"
    with pytest.raises(InvalidArgumentError):
        dtypes.FP16.to_float32(np.zeros(2, np.float32))

