"""The registry row ``"triton"`` sizes the memory a Buffer maps for the engine and refuses, by
the field and before anything is mapped, what the engine does not serve (no triton needed:
the sizes and the checks are plain Python)."""

from __future__ import annotations

import pytest

from ubep import Buffer, BufferConfig
from ubep.errors import InvalidArgumentError
from ubep.plane import memory_bytes
from ubep.triton.config import from_buffer_config
from ubep.triton.layout import arena_bytes


def _config(**extra: object) -> BufferConfig:
    return BufferConfig(**({"max_tokens_per_rank": 16, "hidden": 256, "num_topk": 2,
                            "num_experts": 8, "dtype": "bf16", "num_cores": 2} | extra))


def test_a_buffer_maps_the_engines_own_layout() -> None:
    cfg = _config(transport="triton", layout="rank")
    want = arena_bytes(from_buffer_config(cfg, num_send_programs=2), 4)
    assert Buffer.size_hint(cfg, 4, 2) == memory_bytes(cfg, 4, 2) == want
    # the built-in rows and a config that names no transport: the segment layout's size
    assert memory_bytes(_config(), 4, 2) is None
    assert memory_bytes(_config(transport="shm"), 4, 2) is None
    assert Buffer.size_hint(_config(transport="shm"), 4, 2) == Buffer.size_hint(_config(), 4, 2)


@pytest.mark.parametrize(("field", "value"), [
    ("quant", "e4m3"), ("engine", "bsp"), ("integrity", "checksum"), ("tff_block_bytes", 1024),
])
def test_what_the_engine_does_not_serve_is_refused_by_the_field(field: str,
                                                                 value: object) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        Buffer.size_hint(_config(transport="triton", **{field: value}), 2, 2)
    assert err.value.argument == field


def test_an_unknown_transport_is_refused_before_anything_is_mapped() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        Buffer.size_hint(_config(transport="nvshmem"), 2, 2)
    assert err.value.argument == "transport"
