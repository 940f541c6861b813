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
    w = torch.rand(n, K, generator=g, dtype=torch.float32)  # float32, as DeepEP asks
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
        x, idx, LL_MAX_TOKENS, E, use_fp8=use_fp8, return_recv_hook=True
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
    from ubep.torch.fp8 import quantize_fp8 as _quantize_fp8

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
    from ubep.torch.fp8 import quantize_fp8 as _quantize_fp8

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


# --------------------------------------------------------------------------- DeepEP drop-in
DEEPEP_INIT = [  # DeepEP head's V1 Buffer (deep_ep/buffers/legacy.py), in its order
    "group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
    "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "explicitly_destroy", "enable_shrink",
    "comm",
]


def test_constructor_takes_deepeps_arguments_in_deepeps_order() -> None:
    import inspect

    params = inspect.signature(Buffer.__init__).parameters
    assert list(params)[1: len(DEEPEP_INIT) + 1] == DEEPEP_INIT
    # DeepEP v1.2's use_fabric (dropped from the head's positions) is still taken by keyword
    assert params["use_fabric"].kind is inspect.Parameter.KEYWORD_ONLY
    world = LocalWorld(R, E)

    def body(rank: int) -> tuple[Any, ...]:
        # Positionally, as DeepEP code passes them; GPU-only options must not break a call.
        buf = Buffer(world.backend(rank), 1 << 30, 1 << 29, True, 12, False, True, True, False,
                     None, use_fabric=True)
        x, idx, w = _inputs(rank)
        _, _, per_expert, _in_rank, _ = buf.get_dispatch_layout(idx, E)
        recv, *_ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
        got = (buf.num_nvl_bytes, buf.num_rdma_bytes, buf.low_latency_mode, buf.num_qps_per_rank,
               buf.allow_nvlink_for_low_latency_mode, buf.allow_mnnvl, buf.explicitly_destroy,
               buf.enable_shrink, buf.use_fabric, recv.shape[0])
        buf.destroy()  # explicitly_destroy (8th) was True
        with pytest.raises(InvalidArgumentError, match="destroyed"):
            buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
        return got

    for got in run_threads(body, R):
        assert got[:-1] == (1 << 30, 1 << 29, True, 12, False, True, True, False, True)
        assert got[-1] > 0


def test_destroy_needs_explicitly_destroy_and_shrink_needs_a_process_group() -> None:
    backend = LocalWorld(1, E).backend(0)
    with pytest.raises(InvalidArgumentError, match="explicitly_destroy"):
        Buffer(backend).destroy()
    # enable_shrink (9th) masks lost processes: threads as ranks have none to lose
    with pytest.raises(InvalidArgumentError, match="enable_shrink"):
        Buffer(backend, 0, 0, True, 24, True, False, False, True)


def test_constructor_rejects_unknown_options_and_bad_values_at_once() -> None:
    backend = LocalWorld(1, E).backend(0)
    with pytest.raises(InvalidArgumentError, match="use_fabrik"):
        Buffer(backend, use_fabrik=True)
    with pytest.raises(InvalidArgumentError, match="engine"):
        Buffer(backend, engine="gpu")
    with pytest.raises(InvalidArgumentError, match="group"):
        Buffer(None)


def test_module_names_deepep_code_touches() -> None:
    from ubep import deep_ep

    assert deep_ep.topk_idx_t == torch.int64
    assert deep_ep.Buffer.is_sm90_compiled()  # FP8 payloads work
    event = deep_ep.Buffer.capture()
    assert isinstance(event.event, deep_ep.EventHandle)
    event.current_stream_wait()
    with event:
        pass
    cfg = deep_ep.Config(24, 8, 256)
    assert (cfg.num_sms, cfg.num_max_nvl_chunked_send_tokens) == (24, 8)
    assert deep_ep.Buffer.get_dispatch_config(2).num_sms == deep_ep.Buffer.num_sms


def _brute_force_rows(in_ranks: list[torch.Tensor], me: int) -> list[tuple[int, int]]:
    """(source rank, token) of every row ``me`` receives, in DeepEP's order: by source rank,
    then token."""
    return [(s, t) for s, m in enumerate(in_ranks) for t in range(m.shape[0]) if m[t, me]]


@pytest.mark.parametrize("with_topk", [True, False])
def test_normal_handle_holds_deepeps_values(with_topk: bool) -> None:
    world = LocalWorld(R, E)
    in_ranks = [Buffer(world.backend(0)).get_dispatch_layout(_inputs(r)[1], E)[3] for r in range(R)]

    def body(rank: int) -> Any:
        buf = Buffer(world.backend(rank))
        x, idx, w = _inputs(rank)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        topk = {"topk_idx": idx, "topk_weights": w} if with_topk else {}
        recv, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, **topk,
        )
        y, _, _ = buf.combine(recv, handle)  # identity experts
        cached, *rest, _event = buf.dispatch(x, handle=handle)
        return recv, recv_idx, recv_w, counts, handle, y, cached, rest

    xs = [_inputs(r)[0] for r in range(R)]
    for me, (recv, recv_idx, recv_w, counts, handle, y, cached, rest) in enumerate(
        run_threads(body, R)
    ):
        rows = _brute_force_rows(in_ranks, me)
        assert torch.equal(recv, torch.stack([xs[s][t] for s, t in rows]))
        assert (recv_idx is None) == (recv_w is None) == (not with_topk)
        # counts: every source's tokens per expert, summed over sources (DeepEP's list)
        local = range(me * (E // R), (me + 1) * (E // R))
        all_idx = [_inputs(r)[1] for r in range(R)]
        assert counts == [sum(int((i == e).sum()) for i in all_idx) for e in local]
        # the tuple view
        assert len(handle) == 6 and handle[0] is handle.rank_prefix_matrix
        rpm, cpm, rcpm, src_idx, in_rank, send_head = handle
        sent = torch.tensor([[int(m[:, d].sum()) for d in range(R)] for m in in_ranks])
        assert rpm.dtype == torch.int32 and torch.equal(rpm, sent.cumsum(0).to(torch.int32))
        assert torch.equal(cpm, sent[me][:, None].to(torch.int32))
        assert torch.equal(rcpm, torch.zeros((R, 1), dtype=torch.int32))
        assert src_idx.tolist() == [t for _, t in rows]
        assert torch.equal(in_rank, in_ranks[me])
        for d in range(R):  # send_head: the token's row in this rank's block at d, or -1
            mine = [t for t in range(in_ranks[me].shape[0]) if in_ranks[me][t, d]]
            expect = [mine.index(t) if t in mine else -1 for t in range(in_ranks[me].shape[0])]
            assert send_head[:, d].tolist() == expect
        # identity experts: each token comes back once per rank it went to; cached = same rows
        ref = (in_ranks[me].sum(dim=1, keepdim=True).float() * xs[me].float()).to(torch.bfloat16)
        assert torch.equal(y, ref)
        assert torch.equal(cached, recv) and rest == [None] * 4
        with pytest.raises(AttributeError):
            handle.send_head = send_head  # type: ignore[misc]  # frozen


def test_num_worst_tokens_pads_and_empties_the_list() -> None:
    world = LocalWorld(R, E)
    worst = 16

    def body(rank: int) -> Any:
        buf = Buffer(world.backend(rank))
        x, idx, w = _inputs(rank)
        _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, E)
        args = {"topk_idx": idx, "topk_weights": w, "num_tokens_per_expert": per_expert}
        plain = buf.dispatch(x, **args)
        padded = buf.dispatch(x, num_worst_tokens=worst, **args)
        y_plain, w_plain, _ = buf.combine(plain[0], plain[4], topk_weights=plain[2])
        y_pad, w_pad, _ = buf.combine(padded[0], padded[4], topk_weights=padded[2])
        return plain, padded, (y_plain, w_plain), (y_pad, w_pad)

    for plain, padded, combined_plain, combined_pad in run_threads(body, R):
        n = plain[0].shape[0]
        assert padded[3] == [] and len(plain[3]) == E // R
        for got, ref in zip(padded[:3], plain[:3], strict=True):
            assert got.shape[0] == worst and torch.equal(got[:n], ref)
        assert bool((padded[1][n:] == -1).all())
        assert padded[4].recv_src_idx[n:].tolist() == [-1] * (worst - n)
        for a, b in zip(combined_pad, combined_plain, strict=True):
            assert torch.equal(a, b)


def test_bad_input_on_one_rank_fails_the_call_on_every_rank() -> None:
    world = LocalWorld(R, E, timeout_s=10.0)

    def body(rank: int) -> str:
        buf = Buffer(world.backend(rank))
        x, idx, w = _inputs(rank)
        _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, E)
        if rank == 1:
            per_expert = per_expert + 1  # disagrees with topk_idx
        try:
            buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
        except Exception as exc:  # the kind of error is what is checked
            return type(exc).__name__
        return "no error"

    assert run_threads(body, R) == ["RemoteError", "InvalidArgumentError"]


def test_low_latency_handle_holds_deepeps_values() -> None:
    world = LocalWorld(R, E)

    def body(rank: int) -> Any:
        buf = Buffer(world.backend(rank), low_latency_mode=True)
        x, idx, _ = _inputs(rank)
        recv, count, handle, _, hook = buf.low_latency_dispatch(x, idx, LL_MAX_TOKENS, E,
                                                                use_fp8=False)
        assert hook is None  # as DeepEP without return_recv_hook
        return recv, count, handle

    xs, idxs = zip(*[_inputs(r)[:2] for r in range(R)], strict=True)
    for me, (recv, count, handle) in enumerate(run_threads(body, R)):
        src_info, layout_range, max_tokens, hidden, num_experts = handle
        assert (max_tokens, hidden, num_experts) == (LL_MAX_TOKENS, H, E)
        for e in range(E // R):
            expert = me * (E // R) + e
            rows = [(s, t) for s in range(R) for t in range(idxs[s].shape[0])
                    if bool((idxs[s][t] == expert).any())]
            assert int(count[e]) == len(rows)
            assert src_info[e, : len(rows)].tolist() == [t for _, t in rows]
            assert bool((src_info[e, len(rows):] == -1).all())
            begin = 0
            for s in range(R):
                n = sum(1 for src, _ in rows if src == s)
                assert int(layout_range[e, s]) == (begin << 32) | n
                assert torch.equal(recv[e, begin : begin + n],
                                   torch.stack([xs[s][t] for src, t in rows if src == s])
                                   if n else recv[e, :0])
                begin += n


def test_low_latency_ue8m0_scales_decode_to_the_rounded_scales() -> None:
    world = LocalWorld(R, E)
    hidden = 512
    xs = [torch.randn(NUM_TOKENS[r], hidden, generator=torch.Generator().manual_seed(r)) * 3
          for r in range(R)]

    def body(rank: int) -> Any:
        buf = Buffer(world.backend(rank), low_latency_mode=True)
        idx = _inputs(rank)[1]
        got = []
        for ue8m0 in (False, True):
            (q, s), count, *_ = buf.low_latency_dispatch(
                xs[rank].to(torch.bfloat16), idx, LL_MAX_TOKENS, E, round_scale=True,
                use_ue8m0=ue8m0,
            )
            got.append((q, s, count))
        return got

    for (q, s, count), (q8, s8, count8) in run_threads(body, R):
        assert torch.equal(count, count8) and torch.equal(q.view(torch.uint8), q8.view(torch.uint8))
        assert s8.dtype == torch.int32 and s8.shape == (*s.shape[:2], hidden // 512)
        # DeepEP's reading (tests/utils.py per_token_cast_back): each byte is a float exponent
        decoded = (s8.contiguous().view(torch.int8).to(torch.int32) << 23).view(torch.float32)
        for e, n in enumerate(count.tolist()):
            assert torch.equal(decoded[e, :n], s[e, :n])

    def refused(rank: int) -> str:  # on every rank (the refusal is collective, as the call)
        try:
            Buffer(world.backend(rank)).low_latency_dispatch(
                xs[rank].to(torch.bfloat16), _inputs(rank)[1], LL_MAX_TOKENS, E,
                use_ue8m0=True)
        except InvalidArgumentError as exc:
            return str(exc)
        return "no error"

    assert all("use_ue8m0" in got for got in run_threads(refused, R))


@pytest.fixture
def bf16_default_dtype() -> Any:
    """torch's default dtype BF16 for one test, as DeepEP's test helpers set it."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    yield
    torch.set_default_dtype(before)


@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_low_latency_fp8_is_exact_under_a_bf16_default_dtype(
        bf16_default_dtype: Any, use_ue8m0: bool) -> None:
    """DeepEP's test pattern: every channel of a row holds ``rank - 128`` but the last 128,
    which hold the token's index; dequantised to BF16, each row gives them back exactly
    (token 123 included: a scale rounded to BF16 makes it 124), and each scale is float32
    ``amax / 448`` (rounded up to a power of two with UE8M0)."""
    num_tokens, hidden = 128, 512
    world = LocalWorld(R, E)
    idxs = [torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t + 99 * r))
                         [:K] for t in range(num_tokens)]) for r in range(R)]

    def x_of(rank: int) -> torch.Tensor:
        x = torch.full((num_tokens, hidden), rank - 128.0, dtype=torch.bfloat16)
        x[:, -128:] = torch.arange(num_tokens, dtype=torch.float32).to(torch.bfloat16)[:, None]
        return x

    def body(rank: int) -> Any:
        buf = Buffer(world.backend(rank), low_latency_mode=True)
        (q, s), count, handle, _, _ = buf.low_latency_dispatch(
            x_of(rank), idxs[rank], num_tokens, E, use_fp8=True, round_scale=use_ue8m0,
            use_ue8m0=use_ue8m0)
        return q, s, count, handle

    blocks = hidden // 128
    seen: set[tuple[int, int]] = set()
    for me, (q, s, count, handle) in enumerate(run_threads(body, R)):
        if use_ue8m0:
            assert s.dtype == torch.int32 and s.shape[-1] == blocks // 4
            s = (s.contiguous().view(torch.int8).to(torch.int32) << 23).view(torch.float32)
        assert s.dtype == torch.float32 and s.shape[-1] == blocks
        src_info, layout_range = handle[0], handle[1]
        for e in range(E // R):
            assert int(count[e]) == int((layout_range[e] & 0xFFFFFFFF).sum())
            for src in range(R):
                begin, m = int(layout_range[e, src]) >> 32, int(layout_range[e, src]) & 0xFFFFFFFF
                tokens = src_info[e, begin:begin + m].to(torch.int64)
                assert bool((idxs[src][tokens] == me * (E // R) + e).any(dim=1).all())
                seen.update((src, int(t)) for t in tokens)
                # the closed form: each block's amax over 448 in float32 (a power of two up
                # with UE8M0), the values torch's own e4m3 cast of x over it
                want_s = x_of(src)[tokens].float().reshape(m, blocks, 128).abs().amax(-1)
                want_s = want_s.clamp(min=1e-4) / 448.0
                if use_ue8m0:
                    want_s = torch.exp2(torch.ceil(torch.log2(want_s)))
                assert torch.equal(s[e, begin:begin + m], want_s)
                x = x_of(src)[tokens].float().reshape(m, blocks, 128)
                want_q = (x / want_s[..., None]).to(torch.float8_e4m3fn)
                got_q = q[e, begin:begin + m].reshape(m, blocks, 128)
                assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
                if not use_ue8m0:  # DeepEP's check (per_token_cast_back): exact in BF16
                    rows = (got_q.float() * s[e, begin:begin + m, :, None]).to(torch.bfloat16)
                    assert torch.equal(rows.reshape(m, hidden), x_of(src)[tokens])
    assert {(0, 123), (1, 123)} <= seen


def test_zero_copy_combine_reads_the_next_combine_buffer_and_masked_slots_drop() -> None:
    world = LocalWorld(R, E)

    def body(rank: int) -> Any:
        buf = Buffer(world.backend(rank), low_latency_mode=True)
        x, idx, w = _inputs(rank)
        recv, _count, handle, _, _ = buf.low_latency_dispatch(x, idx, LL_MAX_TOKENS, E,
                                                             use_fp8=False)
        out = recv * 2
        y, _, _ = buf.low_latency_combine(out, idx, w, handle)
        buf.get_next_low_latency_combine_buffer(handle)[:, :, :] = out
        y_zero_copy, _, _ = buf.low_latency_combine(torch.full_like(out, float("nan")), idx, w,
                                                    handle, zero_copy=True)
        dropped = idx.clone()
        dropped[:, 0] = -1
        y_dropped, _, _ = buf.low_latency_combine(out, dropped, w, handle)
        y_zero_w, _, _ = buf.low_latency_combine(out, idx, w.index_fill(1, torch.tensor(0), 0.0),
                                                 handle)
        return y, y_zero_copy, y_dropped, y_zero_w

    for y, y_zero_copy, y_dropped, y_zero_w in run_threads(body, R):
        assert torch.equal(y, y_zero_copy)  # x ignored, the buffer's rows used
        assert torch.equal(y_dropped, y_zero_w)  # a -1 slot contributes nothing


def test_mask_buffer_needs_enable_shrink_as_deepep() -> None:
    buf = Buffer(LocalWorld(1, E).backend(0))
    status = torch.ones(1, dtype=torch.int32)
    for call in (lambda: buf.low_latency_query_mask_buffer(status),
                 lambda: buf.low_latency_update_mask_buffer(0, True),
                 lambda: buf.low_latency_update_mask_buffer(0, False),
                 buf.low_latency_clean_mask_buffer):
        with pytest.raises(InvalidArgumentError, match="enable_shrink"):
            call()
    assert status.tolist() == [1]


def test_local_buffer_tensor_views_deepeps_byte_ranges() -> None:
    buf = Buffer(LocalWorld(1, E).backend(0), 64, 32)
    nvl = buf.get_local_buffer_tensor(torch.int32)
    nvl.copy_(torch.arange(16, dtype=torch.int32))
    assert nvl.numel() == 16  # num_nvl_bytes / 4
    # offset in bytes (as DeepEP's), size in elements, shaped
    view = buf.get_local_buffer_tensor(torch.int16, torch.Size([3, 2]), offset=8)
    assert view.shape == (3, 2) and view.view(torch.int32).flatten().tolist() == [2, 3, 4]
    view[0, 0] = 99  # the same memory
    assert int(nvl[2]) == 99
    assert buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True).numel() == 32
    with pytest.raises(InvalidArgumentError, match="size"):
        buf.get_local_buffer_tensor(torch.int32, torch.Size([17]))
    with pytest.raises(InvalidArgumentError, match="dtype"):
        buf.get_local_buffer_tensor("int32")  # type: ignore[arg-type]


def two_batch_flow(group: Any, rank: int) -> dict[str, Any]:
    """DeepEP's two-batch overlap: batch A with ``return_recv_hook``, batch B with
    ``async_finish``, both in flight before either receives; the same batches blocking."""
    buf = Buffer(group, low_latency_mode=True)
    x, idx, w = _inputs(rank)
    xb = (x.float() * 0.5).to(torch.bfloat16)  # batch B: other payload, same routing
    recv_a, count_a, ha, _, hook_a = buf.low_latency_dispatch(
        x, idx, LL_MAX_TOKENS, E, use_fp8=False, return_recv_hook=True)
    recv_b, count_b, hb, event_b, _ = buf.low_latency_dispatch(
        xb, idx, LL_MAX_TOKENS, E, use_fp8=False, async_finish=True)
    # recv_a and count_a are undefined until hook_a ran (as DeepEP's: on a Buffer they view
    # a receive region peers are writing), so nothing is read of them before it
    try:
        buf.low_latency_combine(recv_a, idx, w, ha)
        refused = False
    except InvalidArgumentError:
        refused = True
    hook_a()
    event_b.current_stream_wait()
    first = rank * (E // R)

    def expert(recv: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(recv.shape, dtype=torch.bfloat16)
        for e in range(E // R):
            n = int(count[e])
            out[e, :n] = (recv[e, :n].float() * _scale(torch.tensor(first + e))).to(torch.bfloat16)
        return out

    ya, _, hook_ya = buf.low_latency_combine(expert(recv_a, count_a), idx, w, ha,
                                             return_recv_hook=True)
    yb, event_yb, _ = buf.low_latency_combine(expert(recv_b, count_b), idx, w, hb,
                                              async_finish=True)
    event_yb.current_stream_wait()  # B's combine first: A's completes in issue order
    hook_ya()
    blocking = []
    for xx in (x, xb):
        recv, count, h, _, _ = buf.low_latency_dispatch(xx, idx, LL_MAX_TOKENS, E,
                                                           use_fp8=False)
        blocking.append(buf.low_latency_combine(expert(recv, count), idx, w, h)[0])
    return {"refused": refused, "ys": (ya, yb), "blocking": tuple(blocking)}


def check_two_batches(rank: int, got: dict[str, Any]) -> None:
    assert got["refused"], "combine took a handle whose dispatch had not received"
    x, idx, w = _inputs(rank)
    for y, y_blocking, scale in zip(got["ys"], got["blocking"], (1.0, 0.5), strict=True):
        assert torch.equal(torch.as_tensor(y), torch.as_tensor(y_blocking))
        torch.testing.assert_close(torch.as_tensor(y).float(), scale * _dense(x, idx, w),
                                   rtol=2e-2, atol=2e-2)


def test_two_batch_overlap_matches_blocking_calls() -> None:
    world = LocalWorld(R, E)
    for r, got in enumerate(run_threads(lambda r: two_batch_flow(world.backend(r), r), R)):
        check_two_batches(r, got)


def normal_fp8_flow(group: Any, rank: int) -> tuple[Any, Any, Any, Any]:
    """Normal-mode dispatch of rows the caller quantised (DeepEP's ``x = (fp8, scales)``), plain
    and cached: the received values and scales, and the BF16 dispatch of the same routing."""
    from ubep.torch.fp8 import quantize_fp8

    buf = Buffer(group, max_tokens_per_rank=max(NUM_TOKENS))
    x, idx, w = _inputs(rank)
    q, s = quantize_fp8(x, False)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    layout = {"num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank,
              "num_tokens_per_expert": per_expert}
    (rq, rs), _, _, _, handle, _ = buf.dispatch((q, s), topk_idx=idx, topk_weights=w, **layout)
    (cq, cs), *_ = buf.dispatch((q, s), handle=handle)
    plain, *_ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
    return rq.view(torch.uint8), rs, plain, torch.equal(cq.view(torch.uint8), rq.view(
        torch.uint8)) and torch.equal(cs, rs)


def check_normal_fp8(got: tuple[Any, Any, Any, Any]) -> None:
    """The rows arrive as sent: quantising the BF16 rows received gives the same bytes."""
    from ubep.torch.fp8 import quantize_fp8

    rq, rs, plain, cached_ok = (torch.as_tensor(g) if not isinstance(g, bool) else g
                                for g in got)
    q, s = quantize_fp8(plain.to(torch.bfloat16), False)
    assert torch.equal(rq.to(torch.uint8), q.view(torch.uint8))
    assert torch.equal(rs.float(), s)
    assert cached_ok


def test_normal_mode_fp8_rows_arrive_as_sent() -> None:
    world = LocalWorld(R, E)
    for got in run_threads(lambda r: normal_fp8_flow(world.backend(r), r), R):
        check_normal_fp8(got)
