"""The native kernels one by one, every kernel set this CPU has (generic, AVX2, AVX-512): DC's
checksum against ``ubep.flags``' codec, float32 -> bf16/fp16 rounding against ``ubep.dtypes``,
and combine's reduction against float32 sums in the reference's order."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ubep import dtypes
from ubep.flags import DcCodec
from ubep.runtime import _native  # type: ignore[attr-defined]


@pytest.mark.parametrize("row_bytes", [6, 8, 37, 512, 1000, 4096])
def test_native_dc_checksum_equals_codec(row_bytes: int) -> None:
    rng = np.random.default_rng(row_bytes)
    for n in (1, 3, 17):
        rows = rng.integers(0, 256, size=(n, row_bytes), dtype=np.uint8)
        for epoch in (1, 2**63 + 5):
            assert _native.dc_checksum(rows, row_bytes, epoch) == DcCodec().checksum(rows, epoch)


@pytest.fixture(params=[0, 1, 2], ids=["generic", "avx2", "avx512"])
def kernel_set(request: pytest.FixtureRequest) -> Any:
    """Every kernel set this CPU has (a level it lacks runs the best one below it)."""
    name = _native.use_kernels(request.param)
    yield name
    _native.use_kernels(2)


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp32"])
def test_native_rounding_equals_dtypes(name: str, kernel_set: str) -> None:
    rng = np.random.default_rng(0)
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, 65504.0, 65520.0, 65519.99, 6.0e-8, 2.98e-8, 1e-45,
         3.4e38, -1.0000001, 1.00390625, 1.01171875, 2**-24, 2**-25, 3 * 2**-26],
        dtype=np.float32,
    )
    values = np.concatenate([
        special,
        rng.standard_normal(5000).astype(np.float32) * 1e3,
        rng.integers(0, 2**32, 5000, dtype=np.uint64).astype(np.uint32).view(np.float32),
    ])
    dt = dtypes.dtype_of(name)
    with np.errstate(over="ignore"):  # float32 -> fp16 overflows to inf, on purpose
        want = dt.from_float32(values)
    got = np.empty_like(want)
    _native.convert(values, got, {"bf16": 0, "fp16": 1, "fp32": 2}[name])
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    # every NaN, whatever its sign and payload, comes out as the canonical quiet NaN
    nan = np.isnan(values)
    assert nan.sum() > 10
    assert (want.view(dt.bits_dtype)[nan] == dtypes.CANONICAL_NAN[name]).all()


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("weighted", [False, True])
def test_native_reduce_equals_float32_sums(name: str, weighted: bool, kernel_set: str) -> None:
    """Combine's reduction, every kernel set: float32 terms summed in order from +0.0, the
    product rounded before the add, then rounded to the dtype (ubep.reference's arithmetic,
    here in numpy float32). Lengths off the vector widths exercise the tails."""
    dt = dtypes.dtype_of(name)
    rng = np.random.default_rng(7)
    for nt in (1, 2, 5, -2):
        n = 2 * 64 * 16 + 37
        with np.errstate(over="ignore"):
            values = (rng.standard_normal((abs(nt), n)) * 50).astype(np.float32)
            values.flat[rng.choice(abs(nt) * n, 40, replace=False)] = rng.choice(
                np.array([np.inf, -np.inf, np.nan, -0.0, 1e-39, -3e-41, 65504.0], np.float32), 40)
            rows = dt.from_float32(values)
        w = rng.standard_normal(abs(nt)).astype(np.float32)
        if nt == -2:  # w x - w x: 0 when the product is rounded first, its rounding error when
            nt = 2  # fused (an FMA), which survives any output rounding
            rows[1], w[1] = rows[0], -w[0]
        acc = np.zeros(n, np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            for j in range(nt):
                term = dt.to_float32(rows[j])
                acc = acc + (w[j] * term if weighted else term)
            want = dt.from_float32(acc)
        got = np.empty_like(want)
        _native.reduce_rows(np.ascontiguousarray(rows), nt, w, got, _native.DTYPES[name],
                            weighted)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (nt, kernel_set)
