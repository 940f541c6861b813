"""The DeepEP facade's low-latency pair on a real Buffer (2 processes): ``recv_x``, its FP8
scales and ``get_next_low_latency_combine_buffer`` are views of the padded Buffer's receive and
combine regions (the same memory every second call, nothing of the padded shape allocated per
call), bit for bit against ``ubep.reference``'s padded layout, FP8 and UE8M0 exact under a BF16
default dtype (DeepEP's test pattern), with hooks, events and masked slots."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from ubep import reference, testing  # noqa: E402
from ubep.quant import quantize  # noqa: E402
from ubep.runtime import launch  # noqa: E402
from ubep.torch.deep_ep import Buffer  # noqa: E402

R, E, K, H, MAX_TOKENS = 2, 8, 3, 512, 12
TOKENS = [12, 7]
SLOTS = MAX_TOKENS * R
L = E // R


def _inputs(seed: int) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    xs, idxs, ws = testing.inputs("bf16", E, K, H, TOKENS, seed, "uniform")
    idxs[0][2, 1] = -1  # a masked slot
    return xs, idxs, ws


def _bf16(a: np.ndarray) -> Any:
    return torch.from_numpy(a.copy()).view(torch.bfloat16)


def _pattern(rank: int) -> Any:
    """DeepEP's test rows: ``rank - 128`` everywhere but the last 128 channels, the token."""
    x = torch.full((TOKENS[rank], H), rank - 128.0, dtype=torch.bfloat16)
    x[:, -128:] = torch.arange(TOKENS[rank], dtype=torch.float32).to(torch.bfloat16)[:, None]
    return x


def _bf16_flow(buf: Any, rank: int) -> dict[str, Any]:
    """Three dispatches (the third with a hook) and their combines, and the addresses of
    every tensor they handed out."""
    out: dict[str, Any] = {name: [] for name in (
        "ptr", "comb_ptr", "recv", "count", "src_info", "layout_range", "y", "y_zero_copy",
        "y_dropped", "y_own")}
    for call, seed in enumerate((1, 2, 3)):
        xs, idxs, ws = _inputs(seed)
        x, idx, w = _bf16(xs[rank]), torch.from_numpy(idxs[rank]), torch.from_numpy(ws[rank])
        hook_it = call == 2
        recv, count, handle, _, hook = buf.low_latency_dispatch(
            x, idx, MAX_TOKENS, E, use_fp8=False, return_recv_hook=hook_it)
        if hook_it:
            hook()
        out["ptr"].append(recv.data_ptr())
        for name, t in (("recv", recv), ("count", count), ("src_info", handle[0]),
                        ("layout_range", handle[1])):
            out[name].append(t.clone())
        out["y"].append(buf.low_latency_combine(recv, idx, w, handle)[0].clone())
        # a decode step's expert outputs (a contiguous tensor of its own) and the dispatch's
        # topk_idx with a slot dropped in place: what the facade recognises from metadata
        expert_out = recv.clone()
        kept = idx[:, 0].clone()
        idx[:, 0] = -1
        out["y_dropped"].append(buf.low_latency_combine(expert_out, idx, w, handle)[0].clone())
        idx[:, 0] = kept
        out["y_own"].append(buf.low_latency_combine(expert_out, idx, w, handle)[0].clone())
        staged = buf.get_next_low_latency_combine_buffer(handle)
        out["comb_ptr"].append(staged.data_ptr())
        staged.copy_(recv)
        y, event, _ = buf.low_latency_combine(torch.full_like(recv, float("nan")), idx, w,
                                              handle, zero_copy=True, async_finish=True)
        event.current_stream_wait()
        out["y_zero_copy"].append(y.clone())
    return out


_FP8_CALLS = (False, False, True, True)  # use_ue8m0 of each FP8 call


def _fp8_flow(buf: Any, rank: int) -> list[Any]:
    """DeepEP's pattern with FP8 and with UE8M0 scales, under a BF16 default dtype."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        got = []
        idx = torch.from_numpy(_inputs(4)[1][rank])
        for ue8m0 in _FP8_CALLS:  # each twice: the Buffer's first call, then a decode step's
            (q, s), count, handle, _, _ = buf.low_latency_dispatch(
                _pattern(rank), idx, MAX_TOKENS, E, round_scale=ue8m0, use_ue8m0=ue8m0)
            got.append((q.view(torch.uint8).clone(), s.clone(), count.clone(), handle[0].clone()))
        return got
    finally:
        torch.set_default_dtype(before)


def _host(value: Any) -> Any:
    """Tensors as numpy arrays (BF16 as its uint16 bits): what crosses back from a rank."""
    if isinstance(value, torch.Tensor):
        return (value.view(torch.uint16) if value.dtype == torch.bfloat16 else value).numpy()
    if isinstance(value, dict):
        return {k: _host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host(v) for v in value)
    return value


def _worker(group: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    buf = Buffer(group, low_latency_mode=True)
    return _host({"bf16": _bf16_flow(buf, group.rank), "fp8": _fp8_flow(buf, group.rank)})


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch(_worker, R, timeout_s=240)


def test_tensors_are_views_of_the_two_regions(results: list[dict[str, Any]]) -> None:
    for got in results:
        a, b, c = got["bf16"]["ptr"]
        assert a == c != b  # the two receive regions, alternating
        a, b, c = got["bf16"]["comb_ptr"]
        assert a == c != b  # the two combine regions, alternating


def test_rows_and_handles_match_the_padded_reference(results: list[dict[str, Any]]) -> None:
    for call, seed in enumerate((1, 2, 3)):
        xs, idxs, ws = _inputs(seed)
        ones = [np.ones(w.shape, np.float32) for w in ws]  # the pair sends unit weights
        refs = reference.dispatch(xs, idxs, ones, E, layout="expert_padded",
                                  max_tokens=MAX_TOKENS)
        ys = reference.combine([ref.recv_x for ref in refs], refs, topk_weights=ws)
        for r, got in enumerate(results):
            ref, bf16 = refs[r], got["bf16"]
            counts = ref.num_recv_tokens_per_expert
            assert bf16["count"][call].tolist() == counts.tolist()
            rows = testing.defined(ref)
            recv = bf16["recv"][call].reshape(L * SLOTS, H)
            assert np.array_equal(recv[rows], ref.recv_x[rows])
            src_info = bf16["src_info"][call].reshape(-1)
            assert np.array_equal(src_info[rows], ref.recv_src_token[rows])
            # layout_range: (begin << 32) | count of each source's rows in each expert
            src = ref.recv_src_rank.reshape(L, SLOTS)
            for e in range(L):
                begin = 0
                for j in range(R):
                    n = int((src[e] == j).sum())
                    assert int(bf16["layout_range"][call][e, j]) == (begin << 32) | n
                    begin += n
            for y in (bf16["y"][call], bf16["y_zero_copy"][call], bf16["y_own"][call]):
                assert np.array_equal(y, ys[r])
            # a dropped slot adds nothing: the reference with its weight 0 (finite rows)
            zeroed = [w.copy() for w in ws]
            for w in zeroed:
                w[:, 0] = 0
            dropped = reference.combine([ref.recv_x for ref in refs], refs, topk_weights=zeroed)
            assert np.array_equal(bf16["y_dropped"][call], dropped[r])


def test_fp8_and_ue8m0_are_exact_under_a_bf16_default_dtype(
        results: list[dict[str, Any]]) -> None:
    idxs = _inputs(4)[1]
    xs = [_pattern(r).view(torch.uint16).numpy() for r in range(R)]
    refs = reference.dispatch(xs, idxs, [np.ones(i.shape, np.float32) for i in idxs], E,
                              layout="expert_padded", max_tokens=MAX_TOKENS)
    for r, got in enumerate(results):
        rows = testing.defined(refs[r])
        for ue8m0, (q, s, count, src_info) in zip(_FP8_CALLS, got["fp8"], strict=True):
            assert count.tolist() == refs[r].num_recv_tokens_per_expert.tolist()
            values, scales = quantize(refs[r].recv_x[rows], "e4m3", round_scale=ue8m0)
            assert np.array_equal(q.reshape(L * SLOTS, H)[rows], values)
            if ue8m0:  # DeepEP's reading: each byte a float exponent, four to an int32
                assert s.dtype == np.int32 and s.shape == (L, SLOTS, H // 512)
                s = (s.view(np.int8).astype(np.int32) << 23).view(np.float32)
            assert s.dtype == np.float32 and s.shape == (L, SLOTS, H // 128)
            flat = s.reshape(L * SLOTS, -1)[rows]
            assert np.array_equal(flat.view(np.uint32), scales.view(np.uint32))
            if not ue8m0:  # per_token_cast_back: the token index back exactly in BF16
                back = (torch.from_numpy(values[:, -128:].copy()).view(torch.float8_e4m3fn)
                        .float() * torch.from_numpy(flat[:, -1:])).to(torch.bfloat16)
                tokens = src_info.reshape(-1)[rows]
                assert torch.equal(back, torch.from_numpy(tokens).float().to(torch.bfloat16)
                                   [:, None].expand(-1, 128))


def test_a_dropped_slot_is_found_wherever_it_is() -> None:
    from ubep.torch.deep_ep_lowlatency import _any_dropped

    rng = np.random.default_rng(11)
    for tokens, topk in ((0, 4), (1, 1), (16, 8), (33, 7)):
        idx = rng.integers(0, 64, (tokens, topk), dtype=np.int64)
        assert not _any_dropped(idx)
        for flat in range(idx.size):  # a -1 (or another negative id) in every place
            marked = idx.copy()
            marked.reshape(-1)[flat] = -1 if flat % 2 else np.iinfo(np.int64).min
            assert _any_dropped(marked) == bool((marked < 0).any())
            assert _any_dropped(np.asfortranarray(marked))  # numpy's way: another layout
