"""ubep.modes: the one vocabulary of engines, syncs, layouts, policies and payload types."""

from __future__ import annotations

import itertools

import pytest

from ubep import dtypes, modes
from ubep.errors import InvalidArgumentError
from ubep.runtime import abi


def test_enumerate_modes_is_the_product_without_sp_on_one_byte_types() -> None:
    got = [str(m) for m in modes.enumerate_modes()]
    want = [f"{e}:{s}:{lay}:{d}" for e, s, lay, d in itertools.product(
        ("asp", "bsp"), ("sw", "tff", "dc", "sp"), ("expert", "rank"),
        ("bf16", "fp16", "fp32", "int8", "uint8"))
        if not (s == "sp" and d in ("int8", "uint8"))]
    assert got == want
    assert len(got) == 2 * 4 * 2 * 5 - 2 * 2 * 2


def test_rotated_dtypes_give_one_mode_per_engine_sync_layout() -> None:
    got = modes.enumerate_modes(dtypes=("uint8", "fp16"), rotate_dtypes=True)
    assert [(m.engine, m.sync, m.layout) for m in got] == list(
        itertools.product(("asp", "bsp"), ("sw", "tff", "dc", "sp"), ("expert", "rank")))
    # turns alternate; SP's 1-byte turns take the first float type instead
    assert [m.dtype for m in got] == ["uint8", "fp16"] * 3 + ["fp16", "fp16"] + (
        ["uint8", "fp16"] * 3 + ["fp16", "fp16"])


def test_names_agree_with_the_dtypes_registry_and_the_abi() -> None:
    assert tuple(dtypes.DTYPES) == modes.DTYPE_NAMES
    assert tuple(d for d, t in dtypes.DTYPES.items() if t.is_float) == modes.FLOAT_DTYPE_NAMES
    assert tuple(abi.SYNCS) == modes.SYNCS and tuple(abi.ENGINES) == modes.ENGINES
    assert tuple(abi.LAYOUTS) == modes.BUFFER_LAYOUTS and tuple(abi.DTYPES) == modes.DTYPE_NAMES
    assert modes.BUFFER_LAYOUTS[: len(modes.LAYOUTS)] == modes.LAYOUTS  # the matrix's first
    assert [modes.supports("sp", d) for d in modes.DTYPE_NAMES] == [
        dtypes.DTYPES[d].sentinel is not None for d in modes.DTYPE_NAMES]


def test_mode_parse_round_trips_and_rejects_other_shapes() -> None:
    m = modes.Mode.parse("bsp:tff:rank:uint8")
    assert (m.engine, m.sync, m.layout, m.dtype) == ("bsp", "tff", "rank", "uint8")
    assert str(m) == "bsp:tff:rank:uint8"
    with pytest.raises(InvalidArgumentError) as err:
        modes.Mode.parse("asp:dc:expert")
    assert err.value.argument == "modes"
