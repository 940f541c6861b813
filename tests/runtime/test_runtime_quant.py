"""Quantised dispatch (``BufferConfig.quant``): the receivers' ``recv_x`` and ``recv_x_scales``
equal ``ubep.quant.quantize`` of the reference's received rows, bit for bit; everything else
(metadata, combine in BF16) equals the reference as for any dispatch.

Quantisation is per row, so quantising the rows a rank receives (the oracle) and quantising
each token before it is sent (the engine, or the caller with ``x_scales``) must give the same
bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from ubep import quant, reference, testing
from ubep.buffer import Buffer, BufferConfig
from ubep.errors import InvalidArgumentError
from ubep.runtime import launch

HIDDEN, TOPK, EXPERTS = 256, 4, 8


def _config(**kw: Any) -> BufferConfig:
    base: dict[str, Any] = dict(max_tokens_per_rank=16, hidden=HIDDEN, num_topk=TOPK,
                                num_experts=EXPERTS, dtype="bf16", quant="e4m3", sync="sw",
                                timeout_s=30.0)
    return BufferConfig(**(base | kw))


CASES: list[dict[str, Any]] = [
    {"engine": "asp", "sync": "sw", "layout": "expert"},
    {"engine": "asp", "sync": "tff", "layout": "rank", "quant": "int8"},
    {"engine": "asp", "sync": "dc", "layout": "expert", "quant_round_scale": True},
    {"engine": "bsp", "sync": "sw", "layout": "rank"},
    {"engine": "bsp", "sync": "dc", "layout": "expert", "quant": "int8", "dtype": "fp32"},
    {"engine": "asp", "sync": "sw", "layout": "rank", "num_cores": 3, "threads": True},
]


def _one(buf: Buffer, seed: int, hooked: bool, prequant: bool) -> list[str]:
    cfg, r = buf.config, buf.rank
    assert cfg.quant is not None
    xs, idxs, ws = testing.inputs(cfg.dtype, EXPERTS, TOPK, HIDDEN, [13, 9], seed, "uniform")
    xs[0][0, :128] = 0  # a zero block: the floor scale
    if prequant:  # DeepEP's normal-mode FP8 input: quantised by the caller, sent as it is
        vals, sc = quant.quantize(xs[r], cfg.quant, round_scale=cfg.quant_round_scale)
        res = buf.dispatch(vals, idxs[r], ws[r], x_scales=sc, return_recv_hook=hooked)
    else:
        res = buf.dispatch(xs[r], idxs[r], ws[r], return_recv_hook=hooked)
    res = res.hook() if hooked else res
    refs = reference.dispatch(xs, idxs, ws, EXPERTS, layout=cfg.layout)
    values, scales = quant.quantize(refs[r].recv_x, cfg.quant, round_scale=cfg.quant_round_scale)
    errors = testing.compare(res, dataclasses.replace(refs[r], recv_x=values))
    if res.recv_x_scales is None or not np.array_equal(
            testing.bits(res.recv_x_scales), testing.bits(scales)):
        errors.append("recv_x_scales differ")
    outs = [testing.expert_outputs(cfg.combine_dtype, ref.recv_x, seed * 10 + q)
            for q, ref in enumerate(refs)]
    y = buf.combine(outs[r], res.handle)
    if not np.array_equal(testing.bits(y), testing.bits(reference.combine(outs, refs)[r])):
        errors.append("combine differs")
    return errors


def _worker(group: Any, cases: list[dict[str, Any]]) -> list[str]:
    errors: list[str] = []
    for i, case in enumerate(cases):
        with Buffer(group, _config(**case)) as buf:
            for step in range(3):
                errors += [f"{case} step {step}: {e}"
                           for e in _one(buf, 10 * i + step, step == 1, step == 2)]
    return errors


def test_quantised_dispatch_equals_quantised_reference() -> None:
    errors = [e for r in launch(_worker, 2, CASES, timeout_s=300) for e in r]
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize(("kw", "argument"), [
    ({"hidden": 200}, "hidden"),
    ({"sync": "sp"}, "sync"),
    ({"dtype": "int8"}, "dtype"),
    ({"quant": "fp4"}, "quant"),
    ({"quant_round_scale": 1}, "quant_round_scale"),
])
def test_quant_config_errors_name_the_argument(kw: dict[str, Any], argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        _config(**kw)
    assert info.value.argument == argument


def test_prequantised_rows_need_a_quantising_buffer() -> None:
    from ubep.buffer.checks import pack_quantized

    values, scales = quant.quantize(np.ones((2, HIDDEN), np.float32), "e4m3")
    with pytest.raises(InvalidArgumentError) as info:
        pack_quantized(_config(quant=None), values, scales)
    assert info.value.argument == "x_scales"
    with pytest.raises(InvalidArgumentError) as info:
        pack_quantized(_config(), values, scales[:, :1])
    assert info.value.argument == "x_scales"
    rows = pack_quantized(_config(), values, scales)
    assert rows.shape == (2, quant.row_bytes(HIDDEN))
    assert np.array_equal(rows[:, HIDDEN:].copy().view(np.float32), scales)
