"""``deep_ep_layouts.dispatch_layout`` (the native one-pass layout) against
``ubep.routing.get_dispatch_layout``, errors included; ``deep_ep_layouts.LayoutMemo``: a
dispatch given ``get_dispatch_layout``'s own outputs for the same routing skips the second
layout computation; anything changed since (the routing through any alias, a layout tensor in
place, another tensor) is checked the long way, so a stale layout is still refused by name on
the rank that passed it and the peers' call fails with it."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ubep  # noqa: E402
from ubep import deep_ep, routing  # noqa: E402
from ubep.torch.deep_ep_layouts import LayoutMemo, dispatch_layout  # noqa: E402
from ubep.torch.deep_ep_types import NormalHandle  # noqa: E402

_EXPERTS, _HIDDEN = 8, 64


def _memo(idx: np.ndarray) -> tuple[LayoutMemo, tuple[Any, ...], Any]:
    lay = routing.get_dispatch_layout(idx, _EXPERTS, 2)
    outputs = (torch.from_numpy(lay.num_tokens_per_rank.astype(np.int32)), None,
               torch.from_numpy(lay.num_tokens_per_expert.astype(np.int32)),
               torch.from_numpy(lay.is_token_in_rank.copy()))
    memo = LayoutMemo()
    memo.remember(idx, lay, outputs)
    return memo, outputs, lay


@pytest.mark.parametrize("tokens,topk,experts,ranks", [
    (16, 8, 64, 2), (0, 4, 16, 4), (7, 1, 4, 4), (257, 8, 256, 8), (33, 6, 12, 3)])
def test_the_one_pass_layout_is_the_routing_modules(tokens: int, topk: int, experts: int,
                                                    ranks: int) -> None:
    rng = np.random.default_rng(tokens + experts)
    idx = np.array([rng.choice(experts, topk, replace=False) for _ in range(tokens)],
                   dtype=np.int64).reshape(tokens, topk)
    idx[rng.random(idx.shape) < 0.25] = -1  # masked picks count nowhere
    got, want = dispatch_layout(idx, experts, ranks), routing.get_dispatch_layout(
        idx, experts, ranks)
    assert got.num_tokens_per_rank.dtype == got.num_tokens_per_expert.dtype == np.int32
    for name in ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    # a strided view takes numpy's path, with the same answer
    wide = np.repeat(idx, 2, axis=1)[:, ::2]
    np.testing.assert_array_equal(dispatch_layout(wide, experts, ranks).is_token_in_rank,
                                  want.is_token_in_rank)


@pytest.mark.parametrize("row,match", [([3, 3], "same expert twice"), ([1, 8], "out of range"),
                                       ([-2, 1], "out of range"), ([-1, -1], None)])
def test_the_one_pass_layout_refuses_what_the_routing_check_refuses(row: list[int],
                                                                    match: str | None) -> None:
    idx = np.array([[0, 5], row], dtype=np.int64)
    if match is None:
        assert dispatch_layout(idx, _EXPERTS, 2).num_tokens_per_expert.sum() == 2
        return
    with pytest.raises(ubep.InvalidArgumentError, match=match) as mine:
        dispatch_layout(idx, _EXPERTS, 2)
    with pytest.raises(ubep.InvalidArgumentError) as oracle:
        routing.get_dispatch_layout(idx, _EXPERTS, 2)
    assert str(mine.value) == str(oracle.value)


def test_the_same_routing_and_the_layouts_own_tensors_are_recalled() -> None:
    idx = routing.uniform_topk(6, _EXPERTS, 2, seed=3)
    memo, outputs, lay = _memo(idx)
    assert memo.recall(idx.copy(), outputs) is lay
    assert memo.recall(idx, (None, None, outputs[2], None)) is lay  # some not given


def test_anything_changed_since_is_not_recalled() -> None:
    idx = routing.uniform_topk(6, _EXPERTS, 2, seed=3)
    memo, outputs, _ = _memo(idx)
    idx[0, 0] = (idx[0, 0] + 1) % _EXPERTS  # the caller's array, changed in place
    assert memo.recall(idx, outputs) is None
    idx = routing.uniform_topk(6, _EXPERTS, 2, seed=3)
    assert memo.recall(idx[:5], outputs) is None  # another shape
    equal = tuple(None if t is None else t.clone() for t in outputs)
    assert memo.recall(idx, equal) is None  # equal values, other tensors: the long check
    outputs[3][0, 0] = ~outputs[3][0, 0]  # the layout's own tensor changed (its version moves)
    assert memo.recall(idx, outputs) is None
    assert LayoutMemo().recall(idx, outputs) is None  # nothing remembered


def test_a_decode_steps_tensors_are_recalled_and_anything_else_goes_the_long_way() -> None:
    idx_np = routing.uniform_topk(6, _EXPERTS, 2, seed=3)
    memo, outputs, lay = _memo(idx_np)
    idx, w = torch.from_numpy(idx_np.copy()), torch.rand(6, 2, dtype=torch.float32)
    x = torch.zeros(6, _HIDDEN, dtype=torch.bfloat16)
    got = memo.recall_step(x, idx, w, outputs, 16)
    assert got is not None and got[3] is lay
    assert np.shares_memory(got[0], x.view(torch.uint16).numpy())
    assert np.shares_memory(got[1], idx.numpy()) and np.shares_memory(got[2], w.numpy())
    for bad_x, bad_idx, bad_w, cap in (
        (x, idx.to(torch.int32), w, 16),  # another ids dtype
        (x, idx, w.double(), 16),  # other weights
        (x[:5], idx, w, 16),  # another token count
        (x, idx, w, 5),  # over the capacity
        (x.t(), idx, w, 16),  # not [tokens, hidden]
        (x, idx.t().contiguous().t(), w, 16),  # not contiguous
        (x, idx, w.clone().requires_grad_(True), 16),  # autograd
        (x.to("meta"), idx, w, 16),  # another device
    ):
        assert memo.recall_step(bad_x, bad_idx, bad_w, outputs, cap) is None
    assert memo.recall_step(x, idx, w, outputs, 16) is not None  # none of them changed it
    idx[0, 0] = (idx[0, 0] + 1) % _EXPERTS  # changed since
    assert memo.recall_step(x, idx, w, outputs, 16) is None


def test_a_handle_built_for_a_decode_step_is_the_dataclasss() -> None:
    fields = {f.name: object() for f in dataclasses.fields(NormalHandle) if f.name != "combines"}
    built, made = NormalHandle.built(**fields), NormalHandle(**fields)
    assert vars(built) == {**vars(made), "combines": [0]} and made.combines == [0]
    assert built.combines is not NormalHandle.built(**fields).combines  # each its own count


def _worker(group: Any) -> dict[str, Any]:
    buf = deep_ep.Buffer(group, num_nvl_bytes=1 << 26, max_tokens_per_rank=16)
    g = torch.Generator().manual_seed(group.rank)
    idx = torch.stack([torch.randperm(_EXPERTS, generator=g)[:2] for _ in range(6)])
    x = torch.randn(6, _HIDDEN, generator=g).to(torch.bfloat16)
    w = torch.rand(6, 2, generator=g, dtype=torch.float32)
    out: dict[str, Any] = {}
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, _EXPERTS)
    if group.rank == 0:  # rank 0 moves a pick to the other rank's experts through numpy
        row = idx.numpy()[0]
        row[0] = (int(row[0]) + _EXPERTS // 2) % _EXPERTS
        if row[0] == row[1]:
            row[0] = (int(row[0]) + 1) % _EXPERTS
    try:
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                     is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        out["stale"] = None
    except ubep.UbepError as exc:
        out["stale"] = f"{type(exc).__name__}: {exc}"
    # the next call, its layout fresh: rows summed once per rank they went to
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, _EXPERTS)
    recv_x, _, _, _, handle, _ = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert)
    y, _, _ = buf.combine(recv_x, handle)
    times = in_rank.sum(dim=1, dtype=torch.float32)[:, None]
    out["next_exact"] = torch.equal(y, (x.float() * times).to(torch.bfloat16))
    return out


def test_a_stale_layout_is_refused_on_every_rank_and_the_next_call_is_exact() -> None:
    first, second = ubep.launch(_worker, 2)
    assert first["stale"].startswith("InvalidArgumentError: ")
    assert "does not match the routing" in first["stale"]
    assert second["stale"].startswith("RemoteError") and "rank 0" in second["stale"]
    assert first["next_exact"] and second["next_exact"]
