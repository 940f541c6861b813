"""The native core's ABI: the module exports what ``ubep.runtime.abi`` holds, a stale build is
refused at load, and the error record becomes the exception its code names."""

from __future__ import annotations

import types

import numpy as np
import pytest

from ubep.buffer import BufferConfig
from ubep.errors import (
    InvalidArgumentError,
    OutOfStepError,
    PeerLostError,
    RemoteError,
    TimeoutError,
    UbepError,
)
from ubep.plane import records
from ubep.plane.layout import compute_layout
from ubep.runtime import _native, abi  # type: ignore[attr-defined]


def test_native_exports_equal_abi() -> None:
    native = abi.load_native()
    assert native.ABI == abi.ABI_VERSION
    assert native.OFFSETS == abi.OFFSETS
    assert native.PARAMS == abi.PARAMS
    assert (native.ERRORS, native.DTYPES, native.SYNCS, native.ENGINES, native.LAYOUTS,
            native.QUANTS, native.TRACE, native.POLICIES) == (
        abi.ERRORS, abi.DTYPES, abi.SYNCS, abi.ENGINES, abi.LAYOUTS, abi.QUANTS, abi.TRACE,
        abi.POLICIES)


@pytest.mark.parametrize("name", ["ABI", "SYNCS", "QUANTS", "OFFSETS", "PARAMS", "TRACE",
                                  "POLICIES", "FIELDS"])
def test_a_stale_build_is_refused_by_name(name: str) -> None:
    native = abi.load_native()
    fake = types.SimpleNamespace(**{k: getattr(native, k) for k in (
        "ABI", "ERRORS", "DTYPES", "SYNCS", "ENGINES", "LAYOUTS", "QUANTS", "OFFSETS",
        "PARAMS", "TRACE", "POLICIES", "FIELDS")})
    abi.check_native(fake)  # a faithful copy passes
    value = getattr(fake, name)
    if isinstance(value, dict):
        value = dict(value, **{next(iter(value)): 99})
    elif isinstance(value, tuple):
        value = value[:-1]
    else:
        value += 1
    setattr(fake, name, value)
    with pytest.raises(ImportError, match=f"stale build: it exports {name}="):
        abi.check_native(fake)


def test_engine_params_have_exactly_the_native_keys() -> None:
    cfg = BufferConfig(max_tokens_per_rank=8, hidden=64, num_topk=2, num_experts=4, dtype="bf16",
                       sync="tff")
    lay = compute_layout(num_ranks=2, num_cores=1, num_experts=4, num_topk=2, max_tokens=8,
                         hidden=64, itemsize=2, combine_itemsize=2, layout="expert",
                         engine="asp", sync="tff", tff_block_bytes=512, tff_flag_bytes=32)
    params = abi.engine_params(cfg, lay, rank=1, num_ranks=2, num_cores=1, threaded=False)
    assert set(params) == set(abi.load_native().PARAMS)
    assert params["seg_size"] == lay.size_bytes and params["num_local_experts"] == 2
    assert (params["sync"], params["dtype"], params["rank"]) == (1, 0, 1)


@pytest.mark.parametrize(
    ("code", "cls"),
    [(records.E_BAD_INPUT, InvalidArgumentError), (records.E_TIMEOUT, TimeoutError),
     (records.E_PEER_LOST, PeerLostError), (records.E_REMOTE, RemoteError),
     (records.E_INTERNAL, UbepError), (records.E_LOST, OutOfStepError)],
)
def test_error_record_becomes_its_exception(code: int, cls: type[UbepError]) -> None:
    rec = records.ErrorRecord(code, 1, records.E_BAD_INPUT, "x", "what", "17")
    exc = rec.to_exception(0)
    assert type(exc) is cls
    assert rec.clean == (code in (records.E_BAD_INPUT, records.E_REMOTE))
    # an engine that raises hands back the record of its exception: the same exception again
    # (an internal error's record leaves the ranks out of step)
    again = records.ErrorRecord.of(exc)
    want = records.E_LOST if code == records.E_INTERNAL else code
    assert again.code == want and again.clean == (rec.clean and code != records.E_INTERNAL)
    back = again.to_exception(0)
    assert type(back) is (OutOfStepError if code == records.E_INTERNAL else cls)
    if code != records.E_LOST and code != records.E_INTERNAL:
        assert str(back) == str(exc)


# --- control-record checksums (abi.h), against their sequential definition -----------------

_M64 = (1 << 64) - 1


def _mix64(h: int, v: int) -> int:
    h ^= (v + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2)) & _M64
    return (h * 0xBF58476D1CE4E5B9) & _M64


def _fletcher(h: int, *parts: np.ndarray) -> int:
    """Word by word, as the record format defines it: a += p, b += a (mod 2^64)."""
    a, b, n = 1, 0, 0
    for part in parts:
        for p in part.astype(np.uint64).tolist():
            a = (a + p) & _M64
            b = (b + a) & _M64
            n += 1
    return _mix64(_mix64(h, a), (b + n) & _M64)


def test_record_checksums_equal_their_definition() -> None:
    rng = np.random.default_rng(3)
    for n in (0, 1, 7, 2048):
        idx = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
        w = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
        epoch, ntok = int(rng.integers(1, 2**62)), n // 8
        want = _fletcher(_mix64(_mix64(0x726F757465, epoch), ntok), idx, w)
        assert _native.route_sum(epoch, ntok, idx, w) == want
        cnt = idx[: min(n, 64)]
        want = _fletcher(_mix64(_mix64(0x636F756E7473, epoch), n), cnt)
        assert _native.counts_sum(epoch, n, cnt) == want
        assert _native.ranks_sum(epoch, cnt) == _fletcher(_mix64(0x72616E6B73, epoch), cnt)
