"""ubep.deep_ep: DeepEP's normal and low-latency flows, checked against dense computations.

Ranks are threads (``LocalWorld``); the real 2-process runs are in test_torch_runtime.py.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from ubep.deep_ep import Buffer  # noqa: E402
from ubep.errors import InvalidArgumentError  # noqa: E402
from ubep.torch import LocalWorld, run_threads  # noqa: E402

R, E, H, K = 2, 8, 256, 3
NUM_TOKENS = [5, 3]


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    n = NUM_TOKENS[rank]
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).to(torch.int64)
    idx[0, 2] = -1  # masked slot
    w = torch.rand(n, K, generator=g)
    return x, idx, w


def _scale(e: torch.Tensor) -> torch.Tensor:
    return (e.to(torch.float32) + 1.0) / 4.0  # expert e multiplies its rows by (e+1)/4


def _dense(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(idx.shape[1]):
        ok = idx[:, k] >= 0
        y += torch.where(
            ok[:, None], w[:, k, None] * _scale(idx[:, k].clamp(min=0))[:, None] * x.float(), 0.0
        )
    return y


def test_get_dispatch_layout_matches_brute_force() -> None:
    world = LocalWorld(R, E)
    buf = Buffer(world.backend(0))
    _, idx, _ = _inputs(0)
    per_rank, rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    assert rdma is None and per_rank.dtype == torch.int32
    for r in range(R):
        owns = [(idx[t] >= 0) & (idx[t] // (E // R) == r) for t in range(idx.shape[0])]
        assert in_rank[:, r].tolist() == [bool(o.any()) for o in owns]
        assert int(per_rank[r]) == sum(bool(o.any()) for o in owns)
    for e in range(E):
        assert int(per_expert[e]) == int((idx == e).sum())


def normal_flow(group: Any, rank: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """DeepEP's normal-mode round trip on ``group``; returns (y, combined_w, cached_ok)."""
    buf = Buffer(group, max_tokens_per_rank=max(NUM_TOKENS))
    x, idx, w = _inputs(rank)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x,
        topk_idx=idx,
        topk_weights=w,
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
    )
    assert counts == [int((recv_idx == e).sum()) for e in range(E // R)]
    # DeepEP normal mode: the caller applies its local experts and weights, sums per row.
    first = rank * (E // R)
    out = torch.zeros(recv_x.shape, dtype=torch.float32)
    for k in range(K):
        ok = recv_idx[:, k] >= 0
        s = _scale(first + recv_idx[:, k].clamp(min=0))
        out += torch.where(ok[:, None], recv_w[:, k, None] * s[:, None] * recv_x.float(), 0.0)
    y, combined_w, _ = buf.combine(out.to(torch.bfloat16), handle, topk_weights=recv_w)
    cached, *rest, _ = buf.dispatch(x, handle=handle)  # the backward of combine
    return y, combined_w, torch.equal(cached, recv_x) and rest == [None] * 4


def check_normal(rank: int, y: torch.Tensor, combined_w: torch.Tensor, cached_ok: bool) -> None:
    x, idx, w = _inputs(rank)
    torch.testing.assert_close(y.float(), _dense(x, idx, w), rtol=2e-2, atol=2e-2)  # BF16 rows
    assert cached_ok
    torch.testing.assert_close(combined_w, torch.where(idx >= 0, w, 0.0), rtol=0, atol=0)


def test_normal_mode_round_trip_matches_dense() -> None:
    world = LocalWorld(R, E)
    for rank, got in enumerate(run_threads(lambda r: normal_flow(world.backend(r), r), R)):
        check_normal(rank, *got)


def test_normal_mode_alignment_and_worst_tokens() -> None:
    world = LocalWorld(R, E)

    def body(rank: int) -> tuple[list[int], int, int, bool]:
        buf = Buffer(world.backend(rank))
        x, idx, w = _inputs(rank)
        _, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        recv_x, _, _, counts, _, _ = buf.dispatch(
            x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert, expert_alignment=4
        )
        worst, worst_idx, _, _, h2, _ = buf.dispatch(
            x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert, num_worst_tokens=16
        )
        pad_ok = bool((worst_idx[recv_x.shape[0] :] == -1).all())
        # Identity experts: each token comes back once per rank it visited (padding ignored).
        y, _, _ = buf.combine(worst, h2)
        ref = (in_rank.sum(dim=1, keepdim=True).float() * x.float()).to(torch.bfloat16)
        return counts, int(worst.shape[0]), int(recv_x.shape[0]), pad_ok and torch.equal(y, ref)

    for counts, worst_rows, rows, ok in run_threads(body, R):
        assert all(c % 4 == 0 for c in counts)
        assert worst_rows == 16 and rows <= 16 and ok


LL_MAX_TOKENS = 8


def low_latency_flow(group: Any, rank: int, use_fp8: bool) -> torch.Tensor:
    """DeepEP's low-latency round trip on ``group``; returns the combined output."""
    buf = Buffer(group, low_latency_mode=True)
    x, idx, w = _inputs(rank)
    recv, count, handle, _, hook = buf.low_latency_dispatch(
        x, idx, LL_MAX_TOKENS, E, use_fp8=use_fp8
    )
    hook()
    if use_fp8:
        q, s = recv
        assert q.dtype == torch.float8_e4m3fn and s.shape[-1] == H // 128
        rows = (q.float().reshape(*q.shape[:2], -1, 128) * s[..., None]).reshape(q.shape)
    else:
        rows = recv.float()
    assert rows.shape == (E // R, LL_MAX_TOKENS * R, H)
    first = rank * (E // R)
    out = torch.zeros(rows.shape, dtype=torch.bfloat16)
    for e in range(E // R):
        n = int(count[e])
        out[e, :n] = (rows[e, :n] * _scale(torch.tensor(first + e))).to(torch.bfloat16)
    y, _, _ = buf.low_latency_combine(out, idx, w, handle)
    return y


def check_low_latency(rank: int, y: torch.Tensor, use_fp8: bool) -> None:
    x, idx, w = _inputs(rank)
    tol = 1.5e-1 if use_fp8 else 2e-2  # e4m3 keeps 3 mantissa bits
    torch.testing.assert_close(y.float(), _dense(x, idx, w), rtol=tol, atol=tol)


@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_round_trip_matches_dense(use_fp8: bool) -> None:
    world = LocalWorld(R, E)
    ys = run_threads(lambda r: low_latency_flow(world.backend(r), r, use_fp8), R)
    for rank, y in enumerate(ys):
        check_low_latency(rank, y, use_fp8)


def test_dispatch_rejects_a_layout_that_does_not_match_topk_idx() -> None:
    buf = Buffer(LocalWorld(1, E).backend(0))
    x, idx, w = _inputs(0)
    _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, E)
    with pytest.raises(InvalidArgumentError, match="num_tokens_per_expert"):
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert + 1)
    with pytest.raises(InvalidArgumentError, match="num_max_dispatch_tokens_per_rank"):
        buf.low_latency_dispatch(x, idx, 2, E)


def test_fp8_packing_round_trip_is_within_e4m3_precision() -> None:
    from ubep.deep_ep import _quantize_fp8

    x = torch.randn(4, 256) * torch.tensor([1e-3, 1.0, 30.0, 1e3])[:, None]
    q, s = _quantize_fp8(x, round_scale=False)
    back = (q.float().reshape(4, 2, 128) * s[..., None]).reshape(4, 256)
    # e4m3: relative error <= 2^-4 for normal values; tiny ones are covered by atol per block.
    amax = x.abs().reshape(4, 2, 128).amax(-1).repeat_interleave(128, dim=1)
    assert ((back - x).abs() <= x.abs() * 2**-4 + amax * 2**-9).all()
    _q2, s2 = _quantize_fp8(x, round_scale=True)
    assert torch.equal(torch.exp2(torch.log2(s2).round()), s2)  # powers of two


def test_normal_mode_fp8_tuple_arrives_bit_for_bit() -> None:
    """(values, scales) rows land where the BF16 rows of the same routing land, unchanged."""
    from ubep.deep_ep import _quantize_fp8

    world = LocalWorld(R, E)

    def body(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        buf = Buffer(world.backend(rank))
        x, idx, w = _inputs(rank)
        _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, E)
        q, s = _quantize_fp8(x, round_scale=False)
        (rq, rs), *_ = buf.dispatch(
            (q, s), topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert
        )
        rx, *_ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
        return (
            rq,
            rs,
            rx,
            torch.stack([_quantize_fp8(r[None], False)[1][0] for r in rx]) if len(rx) else rs,
        )

    for rq, rs, rx, expected_s in run_threads(body, R):
        assert rq.dtype == torch.float8_e4m3fn and rq.shape == rx.shape
        # Quantising the received BF16 rows again gives exactly the received FP8 rows.
        q_again = torch.stack([_quantize_fp8(r[None], False)[0][0] for r in rx])
        assert torch.equal(rq.view(torch.uint8), q_again.view(torch.uint8))
        assert torch.equal(rs, expected_s)
