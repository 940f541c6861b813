"""Errors through ``ubep.deep_ep`` speak DeepEP: they name DeepEP's arguments (``x``,
``handle``) and the facade's knob that fixes them, reach every rank (RemoteError on the
others), and the next call is exact against the dense oracle."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ubep  # noqa: E402
from ubep import deep_ep  # noqa: E402

_EXPERTS, _HIDDEN = 8, 128


def _inputs(g: Any, n: int, dtype: Any = torch.bfloat16) -> tuple[Any, Any, Any]:
    idx = torch.stack([torch.randperm(_EXPERTS, generator=g)[:2] for _ in range(n)])
    x = torch.randn(n, _HIDDEN, generator=g).to(dtype)
    return x, idx.to(deep_ep.topk_idx_t), torch.rand(n, 2, generator=g, dtype=torch.float32)


def _dispatch(buf: Any, x: Any, idx: Any, w: Any) -> Any:
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, _EXPERTS)
    return buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


def _error(call: Any) -> str | None:
    try:
        call()
    except ubep.UbepError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _worker(group: Any) -> dict[str, Any]:
    r, out = group.rank, {}
    buf = deep_ep.Buffer(group, num_nvl_bytes=1 << 28, max_tokens_per_rank=64)
    other = deep_ep.Buffer(group, num_nvl_bytes=1 << 28, max_tokens_per_rank=64)
    g = torch.Generator().manual_seed(r)
    good = _inputs(g, 4)
    # only rank 0 is at fault: too many tokens, then a float64 x
    out["capacity"] = _error(lambda: _dispatch(buf, *(_inputs(g, 100) if r == 0 else good)))
    out["dtype"] = _error(lambda: _dispatch(
        buf, *(_inputs(g, 4, torch.float64) if r == 0 else good)))
    recv_x, _, _, _, handle, _ = _dispatch(buf, *good)
    out["foreign_handle"] = _error(lambda: other.combine(recv_x, handle))
    out["combine_dtype"] = _error(lambda: buf.combine(recv_x.float(), handle))
    # the next call: combine of the received rows gives x times its distinct ranks' count
    recv_x, _, _, _, handle, _ = _dispatch(buf, *good)
    y, _, _ = buf.combine(recv_x, handle)
    x, idx, _ = good
    ranks = torch.stack([torch.unique(row // (_EXPERTS // group.num_ranks)).numel()
                         * torch.ones(()) for row in idx])
    out["next_exact"] = torch.equal(y.float(), (x.float() * ranks[:, None]).to(x.dtype).float())
    return out


def test_facade_errors_name_deepep_arguments_on_every_rank_and_the_next_call_works() -> None:
    first, second = ubep.launch(_worker, 2)
    assert first["capacity"].startswith("InvalidArgumentError: x=(100, 128)")
    assert "max_tokens_per_rank=100" in first["capacity"]
    assert second["capacity"].startswith("RemoteError") and "rank 0" in second["capacity"]
    assert first["dtype"].startswith("InvalidArgumentError: x=torch.float64")
    assert second["dtype"].startswith("RemoteError")
    for out in (first, second):
        assert "handle=" in out["foreign_handle"] and "another deep_ep.Buffer" in (
            out["foreign_handle"])
        assert out["combine_dtype"].startswith("InvalidArgumentError: x=")
        assert "dispatched x" in out["combine_dtype"]
        assert out["next_exact"]
