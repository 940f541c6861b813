"""The Triton engine's failures, ranks as processes under the interpreter: bad input refused
on every rank before it reaches a peer, a lost peer, a timeout and the resync after it, and a
clear refusal when Triton is missing."""

from __future__ import annotations

import pytest

import ubep
from ubep.errors import InvalidArgumentError, UbepError
from ubep.runtime.launch import LostRank
from ubep.triton import TritonConfig, _require, open_engine

from ._ranks import Case, bad_inputs, lost_peer, over_callers_memory, resync
from .conftest import needs_triton


@needs_triton
def test_bad_input_fails_everywhere_and_the_next_call_works() -> None:
    """TFF with the expert layout; SP with the rank layout, a sentinel in ``x`` too."""
    cases = [Case("tff", "expert", "bf16"), Case("sp", "rank", "fp32")]
    results = ubep.launch(bad_inputs, 2, cases, timeout_s=600)
    errors = [e for rank in results for e in rank]
    assert not errors, "\n".join(errors)


@needs_triton
def test_lost_peer() -> None:
    results = ubep.launch(lost_peer, 2, Case("sw", "expert", "fp32"), timeout_s=300,
                          keep_survivors=True)
    assert isinstance(results[1], LostRank)
    assert results[0].startswith("ok: PeerLostError"), results[0]
    assert "[1] died" in results[0], results[0]


@needs_triton
def test_timeout_then_resync() -> None:
    results = ubep.launch(resync, 2, Case("dc", "expert", "bf16"), timeout_s=300)
    errors = [e for rank in results for e in rank]
    assert not errors, "\n".join(errors)


def test_refuses_clearly_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before it touches the group (None here) or imports anything of Triton."""
    monkeypatch.setattr(_require, "triton_available", lambda: False)
    cfg = TritonConfig(max_tokens_per_rank=4, hidden=64, num_topk=2, num_experts=4)
    with pytest.raises(UbepError, match=r"needs triton and torch.*pip install 'ubep\[triton\]'"):
        open_engine(None, cfg)


@pytest.mark.parametrize(("field", "value"), [("sync", "xx"), ("layout", "row"), ("hidden", 0),
                                              ("dtype", "fp64"), ("device", "tpu")])
def test_bad_config_names_the_field(field: str, value: object) -> None:
    base = {"max_tokens_per_rank": 4, "hidden": 64, "num_topk": 2, "num_experts": 4}
    with pytest.raises(InvalidArgumentError) as info:
        TritonConfig(**(base | {field: value}))  # type: ignore[arg-type]
    assert info.value.argument in (field, "name", "value")


def test_sp_refuses_one_byte_payloads() -> None:
    with pytest.raises(InvalidArgumentError, match="sync"):
        TritonConfig(max_tokens_per_rank=4, hidden=64, num_topk=2, num_experts=4,
                     dtype="uint8", sync="sp")


def test_from_buffer_config() -> None:
    """A BufferConfig's fields carried over; what the engine does not serve refused by name."""
    from ubep.buffer import BufferConfig
    from ubep.triton import from_buffer_config

    base = {"max_tokens_per_rank": 8, "hidden": 128, "num_topk": 4, "num_experts": 8,
            "dtype": "bf16", "layout": "rank", "sync": "dc", "timeout_s": 9.0, "num_cores": 3}
    cfg = from_buffer_config(BufferConfig(**base))
    assert (cfg.max_tokens_per_rank, cfg.hidden, cfg.num_topk, cfg.num_experts, cfg.dtype,
            cfg.layout, cfg.sync, cfg.timeout_s, cfg.num_send_programs) == (
        8, 128, 4, 8, "bf16", "rank", "dc", 9.0, 3)
    for field, value in (("quant", "e4m3"), ("integrity", "checksum"), ("engine", "bsp"),
                         ("on_peer_loss", "mask")):
        with pytest.raises(InvalidArgumentError) as info:
            from_buffer_config(BufferConfig(**(base | {field: value})))
        assert info.value.argument == field


@needs_triton
def test_engine_over_a_callers_memory() -> None:
    results = ubep.launch(over_callers_memory, 2, Case("sp", "expert", "bf16"), timeout_s=300)
    errors = [e for rank in results for e in rank]
    assert not errors, "\n".join(errors)
