"""Every door fails together: a bad input on ONE rank (a device tensor, another dtype, another
expert count or capacity, values valid on each rank but different between them) fails the call
on every rank well within the deadline, naming the argument (and both values where they differ
between ranks), and the next call is exact; no rank returns a result paired with another
rank's different call. One worker per door: ``ubep.Buffer`` with torch tensors, DeepEP's V1
normal mode, V1 low-latency mode and V2 (``EPBuffer``). The deadline of every Buffer is 30 s:
a failure that waited for it would show in the times, which must stay under 10 s."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

import ubep  # noqa: E402
from ubep import deep_ep, reference, testing  # noqa: E402
from ubep.buffer.signature import Signature, mismatch_error  # noqa: E402

_TIMEOUT_S = 30.0  # every Buffer's deadline: a failure must not wait for it
_QUICK_S = 10.0
_E, _H, _K, _T = 8, 128, 2, 6


def _outcome(call: Callable[[], Any]) -> tuple[str | None, float]:
    """(``"Type: message"`` of the UbepError raised, or None; seconds taken)."""
    t0 = time.monotonic()
    try:
        call()
    except ubep.UbepError as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0
    return None, time.monotonic() - t0


def _meta(t: Any) -> Any:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _assert_together(outs: list[dict[str, Any]], case: str, bad_rank: int, *needles: str,
                     remote_ok: bool = True) -> None:
    """Case ``case`` failed on every rank, quickly: ``bad_rank`` with an InvalidArgumentError
    naming ``needles``, the others with an InvalidArgumentError or a clean RemoteError."""
    for r, out in enumerate(outs):
        err, took = out[case]
        assert err is not None, (case, r, "returned a result")
        assert took < _QUICK_S, (case, r, took, err)
        if r == bad_rank:
            assert err.startswith("InvalidArgumentError"), (case, err)
            for needle in needles:
                assert needle in err, (case, needle, err)
        else:
            assert err.startswith("InvalidArgumentError") or (
                remote_ok and err.startswith("RemoteError")), (case, r, err)


# --------------------------------------------------------------------- the signature word
def test_signature_words_name_what_differs_with_both_values() -> None:
    a = Signature("low_latency_dispatch", "bfloat16", 7168, 256, 128, 8,
                  frozenset({"expert_layout", "use_fp8"}))
    fields = Signature.decode(a.word)
    assert fields["dtype"] == "bfloat16" and fields["hidden"] == 7168
    assert fields["num_experts"] == 256 and fields["capacity"] == 128
    assert fields["flags"] == frozenset({"expert_layout", "use_fp8"})
    b = Signature("low_latency_dispatch", "float16", 7168, 288, 128, 8,
                  frozenset({"expert_layout", "use_fp8", "switch"}))
    err = mismatch_error(a.word, b.word, 1, 0)
    assert err.argument == "x" and err.value == "bfloat16"
    msg = str(err)
    assert "dtype bfloat16 on rank 0, float16 on rank 1" in msg
    assert "num_experts 256 on rank 0, 288 on rank 1" in msg
    assert "rank 1 moved to another Buffer" in msg
    same = mismatch_error(a.word, a.word ^ (1 << 63), 1, 0)  # a flag bit past FLAGS
    assert same.argument == "call"


# --------------------------------------------------------------------- ubep.Buffer
def _buffer_worker(group: Any) -> dict[str, Any]:
    r, out = group.rank, {}
    cfg = ubep.BufferConfig(max_tokens_per_rank=_T, hidden=_H, num_topk=_K, num_experts=_E,
                            dtype="bf16", timeout_s=_TIMEOUT_S)
    xs, idxs, ws = testing.inputs("bf16", _E, _K, _H, [_T] * group.num_ranks, 3, "uniform")
    x = torch.from_numpy(xs[r]).view(torch.bfloat16)
    idx, w = torch.from_numpy(idxs[r]), torch.from_numpy(ws[r])
    with ubep.Buffer(group, cfg) as buf:
        # x, topk_idx and expert_out on the meta device, each on rank 1 only
        out["x"] = _outcome(lambda: buf.dispatch(_meta(x) if r == 1 else x, idx, w))
        out["topk_idx"] = _outcome(lambda: buf.dispatch(x, _meta(idx) if r == 1 else idx, w))
        res = buf.dispatch(x, idx, w)
        eo = res.recv_x.clone()
        out["expert_out"] = _outcome(lambda: buf.combine(_meta(eo) if r == 1 else eo,
                                                         res.handle))
        # the next calls: exact against the reference (torch in, and numpy in)
        refs = reference.dispatch(xs, idxs, ws, _E, layout="expert")
        got = buf.dispatch(x, idx, w)
        out["next_torch"] = bool(np.array_equal(got.recv_x.view(torch.uint16).numpy(),
                                                refs[r].recv_x))
        out["next_numpy"] = testing.check_call(buf, xs, idxs, ws, seed=5)
    return out


def test_buffer_torch_door_fails_together_and_the_next_call_is_exact() -> None:
    outs = ubep.launch(_buffer_worker, 2)
    for case in ("x", "topk_idx", "expert_out"):
        _assert_together(outs, case, 1, f"{case}=device(type='meta')", "on device meta")
    assert "RecursionError" not in str(outs)
    for out in outs:
        assert out["next_torch"] and out["next_numpy"] == []


# --------------------------------------------------------------------- V1 normal mode
def _inputs(r: int, n: int = 4, dtype: Any = torch.bfloat16) -> tuple[Any, Any, Any]:
    g = torch.Generator().manual_seed(r)
    idx = torch.stack([torch.randperm(_E, generator=g)[:_K] for _ in range(n)])
    x = torch.randn(n, _H, generator=g).to(dtype)
    return x, idx.to(deep_ep.topk_idx_t), torch.rand(n, _K, generator=g, dtype=torch.float32)


def _normal(buf: Any, x: Any, idx: Any, w: Any, num_experts: int = _E) -> Any:
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    return buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


def _normal_exact(buf: Any, group: Any) -> bool:
    """A dispatch and combine whose combine of the received rows is x times its distinct
    ranks' count (a closed form)."""
    x, idx, w = _inputs(group.rank)
    recv_x, _, _, _, handle, _ = _normal(buf, x, idx, w)
    y, _, _ = buf.combine(recv_x, handle)
    ranks = torch.tensor([float(torch.unique(row // (_E // group.num_ranks)).numel())
                          for row in idx])
    return torch.equal(y.float(), (x.float() * ranks[:, None]).to(x.dtype).float())


def _normal_worker(group: Any) -> dict[str, Any]:
    r, out = group.rank, {}
    buf = deep_ep.Buffer(group, num_nvl_bytes=1 << 20, max_tokens_per_rank=16,
                         timeout_s=_TIMEOUT_S)
    x, idx, w = _inputs(r)
    out["first_exact"] = _normal_exact(buf, group)
    out["x_device"] = _outcome(lambda: _normal(buf, _meta(x) if r == 1 else x, idx, w))
    out["exact_1"] = _normal_exact(buf, group)
    # each dtype valid, but float16 on rank 1 and bfloat16 on rank 0: another Buffer
    out["dtype"] = _outcome(lambda: _normal(buf, x.half() if r == 1 else x, idx, w))
    out["exact_2"] = _normal_exact(buf, group)
    # both dtypes made on both ranks first (both Buffers exist), then they differ again
    for dtype in (torch.float16, torch.bfloat16):
        xd = x.to(dtype)
        recv_x, _, _, _, handle, _ = _normal(buf, xd, idx, w)
        buf.combine(recv_x, handle)
    out["dtype_cached"] = _outcome(lambda: _normal(buf, x.half() if r == 1 else x, idx, w))
    out["exact_3"] = _normal_exact(buf, group)
    # the capacity: too many tokens on rank 1
    big = _inputs(r, 20)
    out["capacity"] = _outcome(lambda: _normal(buf, *(big if r == 1 else (x, idx, w))))
    # the expert count: each valid (a multiple of the ranks), different between ranks
    idx16 = idx * 2
    out["num_experts"] = _outcome(lambda: _normal(
        buf, x, idx16 if r == 1 else idx, w, 2 * _E if r == 1 else _E))
    out["exact_4"] = _normal_exact(buf, group)
    # combine: its x on the meta device on rank 1
    recv_x, _, _, _, handle, _ = _normal(buf, x, idx, w)
    out["combine_x"] = _outcome(lambda: buf.combine(_meta(recv_x) if r == 1 else recv_x,
                                                    handle))
    out["exact_5"] = _normal_exact(buf, group)
    # combine's topk_weights: on one host every rank posts a word about them on the facade's
    # Board before the combine (the received ones come back summed at their sources, no rows
    # move); where there is no Board (the facades below: as across hosts) they travel through
    # the dispatch's Buffer (the carrier), and where the rows back do not fit it (a Buffer
    # holding _T rows a rank) through a float32 Buffer of their own (a switch there, none back)
    out.update({f"board_{k}": v for k, v in _weights_cases(buf, group, x, idx, w).items()})
    from ubep.torch import deep_ep_core

    deep_ep_core.open_board = lambda group: None  # type: ignore[assignment]
    carried = deep_ep.Buffer(group, num_nvl_bytes=1 << 20, max_tokens_per_rank=16,
                             timeout_s=_TIMEOUT_S)
    small = deep_ep.Buffer(group, num_nvl_bytes=1 << 20, max_tokens_per_rank=_T,
                           timeout_s=_TIMEOUT_S)
    for case, b in (("carried", carried), ("own", small)):
        out.update({f"{case}_{k}": v for k, v in _weights_cases(b, group, x, idx, w).items()})
    return out


def _weights_cases(buf: Any, group: Any, x: Any, idx: Any, w: Any) -> dict[str, Any]:
    """A combine's weights summed at their sources (each slot's one weight: its owner's, 0.0
    from the others), then passed on rank 1 only (its weights' call meets rank 0's next
    dispatch), then the next call."""
    r, out = group.rank, {}
    recv_x, _, recv_w, _, handle, _ = _normal(buf, x, idx, w)
    out["own_buffer"] = int(handle.rank_prefix_matrix[-1].max()) > buf.max_tokens_per_rank
    _, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    out["weights_exact"] = torch.equal(combined_w, w)
    recv_x, _, recv_w, _, handle, _ = _normal(buf, x, idx, w)

    def weights_on_one_rank() -> None:
        buf.combine(recv_x, handle, topk_weights=recv_w if r == 1 else None)
        _normal(buf, x, idx, w)

    out["one_rank"] = _outcome(weights_on_one_rank)
    out["next_exact"] = _normal_exact(buf, group)
    return out


def test_v1_normal_mode_fails_together_and_the_next_call_is_exact() -> None:
    outs = ubep.launch(_normal_worker, 2)
    _assert_together(outs, "x_device", 1, "x=device(type='meta')", "on device meta")
    _assert_together(outs, "dtype", 1, "float16", "bfloat16")
    _assert_together(outs, "dtype_cached", 1, "float16", "bfloat16", "rank 0")
    _assert_together(outs, "capacity", 1, "max_tokens_per_rank")
    _assert_together(outs, "num_experts", 1, "num_experts", "16", "8")
    _assert_together(outs, "combine_x", 1, "x=device(type='meta')", "on device meta")
    _assert_together(outs, "board_one_rank", 1, "topk_weights", "given on rank(s) [1]",
                     "not on rank(s) [0]", remote_ok=False)
    _assert_together(outs, "carried_one_rank", 1, "combine_weights", "dispatch")
    _assert_together(outs, "own_one_rank", 1, "another Buffer")
    for out in outs:
        assert all(out[k] for k in ("first_exact", "exact_1", "exact_2", "exact_3",
                                    "exact_4", "exact_5", "board_weights_exact",
                                    "board_next_exact", "carried_weights_exact",
                                    "carried_next_exact", "own_own_buffer", "own_weights_exact",
                                    "own_next_exact")), out
        assert not out["carried_own_buffer"]


# --------------------------------------------------------------------- V1 low-latency mode
def _ll(buf: Any, x: Any, idx: Any, cap: int = 8, num_experts: int = _E,
        use_fp8: bool = False) -> Any:
    return buf.low_latency_dispatch(x, idx, cap, num_experts, use_fp8=use_fp8)


def _ll_exact(buf: Any, group: Any) -> bool:
    """A low-latency dispatch and combine (unit weights): every token comes back as the sum of
    its valid slots' rows, x times its slot count (a closed form)."""
    x, idx, _ = _inputs(group.rank)
    recv_x, _, handle, _, _ = _ll(buf, x, idx)
    y, _, _ = buf.low_latency_combine(recv_x, idx, torch.ones(idx.shape), handle)
    return torch.equal(y.float(), (x.float() * _K).to(x.dtype).float())


def _ll_worker(group: Any) -> dict[str, Any]:
    r, out = group.rank, {"default_dtype": str(torch.get_default_dtype())}
    buf = deep_ep.Buffer(group, num_rdma_bytes=1 << 20, low_latency_mode=True,
                         timeout_s=_TIMEOUT_S)
    x, idx, _ = _inputs(r)
    # the very first call bad on rank 1 (no Buffer made yet)
    out["first_device"] = _outcome(lambda: _ll(buf, _meta(x) if r == 1 else x, idx))
    out["exact_0"] = _ll_exact(buf, group)
    out["x_device"] = _outcome(lambda: _ll(buf, _meta(x) if r == 1 else x, idx))
    out["exact_1"] = _ll_exact(buf, group)
    out["num_experts"] = _outcome(lambda: _ll(
        buf, x, idx * 2 if r == 1 else idx, num_experts=2 * _E if r == 1 else _E))
    out["exact_2"] = _ll_exact(buf, group)
    out["capacity"] = _outcome(lambda: _ll(buf, x, idx, cap=16 if r == 1 else 8))
    out["exact_3"] = _ll_exact(buf, group)
    out["dtype"] = _outcome(lambda: _ll(buf, x.half() if r == 1 else x, idx))
    out["exact_4"] = _ll_exact(buf, group)
    out["use_fp8"] = _outcome(lambda: _ll(buf, x, idx, use_fp8=r == 1))
    recv_x, _, handle, _, _ = _ll(buf, x, idx)
    out["combine_x"] = _outcome(lambda: buf.low_latency_combine(
        _meta(recv_x) if r == 1 else recv_x, idx, torch.ones(idx.shape), handle))
    out["exact_5"] = _ll_exact(buf, group)
    return out


def test_v1_low_latency_fails_together_and_the_next_call_is_exact() -> None:
    outs = ubep.launch(_ll_worker, 2)
    # the ranks run under this test's default dtype (tests/torch/conftest.py's BF16 run)
    assert {out["default_dtype"] for out in outs} == {str(torch.get_default_dtype())}
    _assert_together(outs, "first_device", 1, "x=device(type='meta')", "on device meta")
    _assert_together(outs, "x_device", 1, "x=device(type='meta')", "on device meta")
    _assert_together(outs, "num_experts", 1, "num_experts 16 on rank 1, 8 on rank 0")
    _assert_together(outs, "capacity", 1, "capacity 16 on rank 1, 8 on rank 0")
    _assert_together(outs, "dtype", 1, "dtype float16 on rank 1, bfloat16 on rank 0")
    _assert_together(outs, "combine_x", 1, "x=device(type='meta')", "on device meta")
    _assert_together(outs, "use_fp8", 1, "use_fp8 True on rank 1, False on rank 0")
    for out in outs:
        assert all(out[f"exact_{i}"] for i in range(6)), out


# --------------------------------------------------------------------- V2
def _v2_worker(group: Any) -> dict[str, Any]:
    from ubep.deep_ep import EPBuffer

    r, out = group.rank, {}
    buf = EPBuffer(group, num_max_tokens_per_rank=16, explicitly_destroy=True,
                   timeout_s=_TIMEOUT_S)
    x, idx, w = _inputs(r)

    def exact() -> bool:
        recv_x, _, _, handle = buf.dispatch(x, idx, w, num_experts=_E)[:4]
        y = buf.combine(torch.ones(recv_x.shape, dtype=torch.bfloat16), handle)[0]
        # every row of ones comes back once per distinct rank the token went to
        ranks = torch.tensor([float(torch.unique(row // (_E // group.num_ranks)).numel())
                              for row in idx])
        return torch.equal(y.float(), ranks[:, None].expand(-1, _H))

    out["exact_0"] = exact()
    out["x_device"] = _outcome(lambda: buf.dispatch(_meta(x) if r == 1 else x, idx, w,
                                                    num_experts=_E))
    out["exact_1"] = exact()
    out["dtype"] = _outcome(lambda: buf.dispatch(x.half() if r == 1 else x, idx, w,
                                                 num_experts=_E))
    out["exact_2"] = exact()
    out["num_experts"] = _outcome(lambda: buf.dispatch(
        x, idx * 2 if r == 1 else idx, w, num_experts=2 * _E if r == 1 else _E))
    out["exact_3"] = exact()
    out["capacity"] = _outcome(lambda: buf.dispatch(
        x, idx, w, num_experts=_E, num_max_tokens_per_rank=8 if r == 1 else 16))
    out["exact_4"] = exact()
    # combine (the dispatch Buffer's own): its x on the meta device on rank 1
    recv_x, _, _, handle = buf.dispatch(x, idx, w, num_experts=_E)[:4]
    out["combine_x"] = _outcome(lambda: buf.combine(_meta(recv_x) if r == 1 else recv_x, handle))
    out["exact_5"] = exact()
    buf.destroy()
    return out


def test_v2_fails_together_and_the_next_call_is_exact() -> None:
    outs = ubep.launch(_v2_worker, 2)
    _assert_together(outs, "x_device", 1, "meta")
    _assert_together(outs, "dtype", 1, "float16", "bfloat16")
    _assert_together(outs, "num_experts", 1, "num_experts")
    _assert_together(outs, "capacity", 1, "capacity 8 on rank 1, 16 on rank 0")
    _assert_together(outs, "combine_x", 1, "meta")
    for out in outs:
        assert all(out[f"exact_{i}"] for i in range(6)), out


# --------------------------------------------------------------------- the README's snippet
def _readme_errors_snippet() -> str:
    """The README's error-handling block (indented under its "Errors" item), dedented."""
    import re
    import textwrap
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    item = text[text.index("* **Errors**"):]
    block = re.search(r"^  ```python\n(.*?)^  ```", item, re.S | re.M)
    assert block is not None, "the Errors item has no python block"
    return textwrap.dedent(block.group(1))


def _readme_worker(group: Any) -> list[tuple[bool, float, bool]]:
    r = group.rank
    code = compile(_readme_errors_snippet(), "README.md (Errors)", "exec")
    cfg = ubep.BufferConfig(max_tokens_per_rank=_T, hidden=_H, num_topk=_K, num_experts=_E,
                            dtype="bf16", timeout_s=_TIMEOUT_S)
    xs, idxs, ws = testing.inputs("bf16", _E, _K, _H, [_T] * group.num_ranks, 9, "uniform")
    refs = reference.dispatch(xs, idxs, ws, _E, layout="expert")
    steps = []
    with ubep.Buffer(group, cfg) as buf:
        for step in range(4):
            bad = r == 1 and step == 1  # rank 1's input is bad once; it carries on serving
            ns = {"ubep": ubep, "buf": buf, "x": xs[r][:, :-1] if bad else xs[r],
                  "topk_idx": idxs[r], "topk_weights": ws[r]}
            t0 = time.monotonic()
            exec(code, ns)
            res = ns["res"]
            exact = res is not None and not testing.compare(res, refs[r])
            steps.append((res is None, time.monotonic() - t0, exact))
    return steps


def test_readme_error_snippet_recovers_while_the_bad_rank_carries_on() -> None:
    outs = ubep.launch(_readme_worker, 2, timeout_s=4 * _TIMEOUT_S)
    for r, steps in enumerate(outs):
        for step, (failed, took, exact) in enumerate(steps):
            assert took < _QUICK_S, (r, step, took)
            assert failed == (step == 1), (r, step)  # the bad call fails on both ranks
            assert exact or step == 1, (r, step)
