"""``deep_ep.Buffer(group, ..., transport="triton")``: DeepEP's normal dispatch and combine run
on the Triton engine (under Triton's interpreter), bit for bit against dense computations
every rank makes from every rank's seeded inputs; every other call of the facade (the
low-latency pair in BF16, FP8 and UE8M0, FP8 and cached normal dispatches, a dispatch without
topk) bit for bit against the native engine's results, with tensors to the engine and no row
through numpy; and ``ubep.Buffer`` on it takes torch tensors and gives torch tensors, bit for
bit against ``ubep.reference``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.triton.conftest import needs_triton

torch = pytest.importorskip("torch")

import ubep  # noqa: E402
from ubep import deep_ep, reference, testing  # noqa: E402

_EXPERTS, _HIDDEN, _RANKS = 8, 128, 2
_TOKENS = (5, 3)


def _inputs(rank: int) -> tuple[Any, Any, Any]:
    g = torch.Generator().manual_seed(100 + rank)
    n = _TOKENS[rank]
    idx = torch.stack([torch.randperm(_EXPERTS, generator=g)[:2] for _ in range(n)])
    x = torch.randn(n, _HIDDEN, generator=g).to(torch.bfloat16)
    return x, idx.to(deep_ep.topk_idx_t), torch.rand(n, 2, generator=g)


def _owner(idx: Any) -> Any:
    return idx // (_EXPERTS // _RANKS)


def _rank_body(group: Any) -> dict[str, Any]:
    r = group.rank
    buf = deep_ep.Buffer(group, num_nvl_bytes=1 << 20, max_tokens_per_rank=8,
                         transport="triton", timeout_s=120.0)
    x, idx, w = _inputs(r)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, _EXPERTS)
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    # the dense oracle: rank r receives each source's tokens that have an expert on r, in
    # (source, token) order, their local expert ids (-1 elsewhere) and weights
    want_x, want_idx, want_w = [], [], []
    for s in range(_RANKS):
        xs, idxs, ws = _inputs(s)
        mine = _owner(idxs) == r
        rows = mine.any(dim=1)
        want_x.append(xs[rows])
        want_idx.append(torch.where(mine, idxs - r * (_EXPERTS // _RANKS), -1)[rows])
        want_w.append(torch.where(mine, ws, 0.0)[rows])
    # identity experts: each token comes back once per rank it went to, summed in float32
    y, _, _ = buf.combine(recv_x, handle)
    copies = (_owner(idx)[:, :, None] == torch.arange(_RANKS)).any(dim=1).sum(dim=1)
    engines = {type(b.buffer._engine).__name__ for b in buf.core.backends.table.values()}
    return _torch_in_torch_out(group) | {
        "recv_x": torch.equal(recv_x.view(torch.int16), torch.cat(want_x).view(torch.int16)),
        "recv_topk_idx": torch.equal(recv_idx, torch.cat(want_idx)),
        "recv_topk_weights": torch.equal(recv_w, torch.cat(want_w)),
        "y": torch.equal(y.view(torch.int16), (x.float() * copies[:, None]).to(
            torch.bfloat16).view(torch.int16)),
        "engines": engines,
    }


def _torch_in_torch_out(group: Any) -> dict[str, Any]:
    r = group.rank
    cfg = ubep.BufferConfig(max_tokens_per_rank=8, hidden=_HIDDEN, num_topk=2,
                            num_experts=_EXPERTS, dtype="bf16", sync="tff", layout="expert",
                            transport="triton", timeout_s=120.0)
    xs, idxs, ws = testing.inputs("bf16", _EXPERTS, 2, _HIDDEN, list(_TOKENS), 3, "uniform")
    with ubep.Buffer(group, cfg) as buf:
        res = buf.dispatch(torch.from_numpy(xs[r]).view(torch.bfloat16),
                           torch.from_numpy(idxs[r]), torch.from_numpy(ws[r]))
        refs = reference.dispatch(xs, idxs, ws, _EXPERTS)
        y = buf.combine(res.recv_x, res.handle)  # identity experts
    want = reference.combine([ref.recv_x for ref in refs], refs)[r]
    return {"torch_result": testing.compare(res, refs[r]) + (
                [] if res.recv_x.dtype == torch.bfloat16 else ["recv_x is not a bf16 tensor"]),
            "torch_y": (isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
                        and testing.same_bits(y, want))}


@needs_triton
def test_deep_ep_normal_dispatch_and_combine_on_the_triton_engine() -> None:
    for got in ubep.launch(_rank_body, _RANKS, timeout_s=300.0):
        assert got == {"recv_x": True, "recv_topk_idx": True, "recv_topk_weights": True,
                       "y": True, "engines": {"TritonPlane"}, "torch_result": [],
                       "torch_y": True}



def _low_latency_body(group: Any) -> str:
    """DeepEP's low-latency round trip (``return_recv_hook=True``: a split-phase dispatch) on
    the Triton engine, against the dense computation of ``tests/torch``'s flow (its
    tolerance: experts scale rows in BF16)."""
    from tests.torch import test_torch_deep_ep as flow

    r = group.rank
    buf = deep_ep.Buffer(group, low_latency_mode=True, transport="triton", timeout_s=120.0)
    x, idx, w = flow._inputs(r)
    recv, count, handle, _, hook = buf.low_latency_dispatch(
        x, idx, flow.LL_MAX_TOKENS, flow.E, use_fp8=False, return_recv_hook=True)
    hook()
    local = flow.E // flow.R
    out = torch.zeros(recv.shape, dtype=torch.bfloat16)
    for e in range(local):
        n = int(count[e])
        out[e, :n] = (recv[e, :n].float() * flow._scale(torch.tensor(r * local + e))).to(
            torch.bfloat16)
    y, _, _ = buf.low_latency_combine(out, idx, w, handle)
    flow.check_low_latency(r, y, False)
    return "ok"


@needs_triton
def test_deep_ep_low_latency_round_trip_on_the_triton_engine() -> None:
    from tests.torch import test_torch_deep_ep as flow

    assert ubep.launch(_low_latency_body, flow.R, timeout_s=300.0) == ["ok"] * flow.R


def _unconverted_body(group: Any) -> list[str]:
    """DeepEP's normal dispatch and combine hand the caller's ``x`` and expert outputs to the
    Triton engine as the tensors they are (no numpy view, no copy), and get tensors back."""
    from ubep.triton.plane import TritonPlane

    seen: list[tuple[str, Any]] = []
    real_dispatch, real_combine = TritonPlane.dispatch, TritonPlane.combine

    def dispatch(self: Any, x: Any, *args: Any) -> Any:
        seen.append(("dispatch", x))
        return real_dispatch(self, x, *args)

    def combine(self: Any, expert_out: Any, *args: Any) -> Any:
        seen.append(("combine", expert_out))
        return real_combine(self, expert_out, *args)

    errors: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TritonPlane, "dispatch", dispatch)
        mp.setattr(TritonPlane, "combine", combine)
        buf = deep_ep.Buffer(group, num_nvl_bytes=1 << 20, max_tokens_per_rank=8,
                             transport="triton", timeout_s=120.0)
        x, idx, w = _inputs(group.rank)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, _EXPERTS)
        recv_x, _, _, _, handle, _ = buf.dispatch(
            x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        y, _, _ = buf.combine(recv_x, handle)
    want = [("dispatch", x), ("combine", recv_x)]
    for (call, got), (_, given) in zip(seen, want, strict=True):
        if not (type(got) is torch.Tensor and got.data_ptr() == given.data_ptr()):
            errors.append(f"rank {group.rank}: {call} reached the engine as "
                          f"{type(got).__name__}, not the caller's tensor")
    for name, t in (("recv_x", recv_x), ("y", y)):
        if not (type(t) is torch.Tensor and t.device == x.device and t.dtype == x.dtype):
            errors.append(f"rank {group.rank}: {name} came back as {type(t).__name__}")
    return errors


@needs_triton
def test_deep_ep_normal_calls_hand_the_engine_the_callers_tensors() -> None:
    errors = [e for rank in ubep.launch(_unconverted_body, _RANKS, timeout_s=300.0)
              for e in rank]
    assert not errors, "\n".join(errors)


# ----------------------------------------------------------------- every call on the device
# conversions to numpy the facade may make on the device path: the routing it checks on the
# host (get_dispatch_layout's counts, the normal handle's bookkeeping), never a row
_ROUTING_ARGS = {"topk_idx", "topk_weights", "num_tokens_per_expert", "is_token_in_rank",
                 "num_tokens_per_rank", "num_tokens_per_rdma_rank"}
_CONVERSIONS = ("to_numpy", "from_numpy", "from_numpy_as", "received_rows", "owned_rows",
                "combine_input", "on_host")


def _is_row_conversion(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a watched conversion moves rows (not routing): ``on_host`` of a payload (the
    routing's integers and float32 weights go to the host's bookkeeping), any other of a
    tensor that is not routing."""
    if name == "on_host":
        return isinstance(args[0], torch.Tensor) and args[0].dtype in (
            torch.bfloat16, torch.float16, torch.uint8, torch.int8, torch.float8_e4m3fn)
    return kwargs.get("argument") not in _ROUTING_ARGS


def _device_calls(group: Any, transport: str | None) -> dict[str, Any]:
    """DeepEP's other calls on ``transport``'s engine: the low-latency pair (BF16 with a
    receive hook, a dropped slot and a zero-copy combine; FP8; FP8 with UE8M0 scales), a
    normal FP8 dispatch (``x=(values, scales)``) and its cached one, a cached BF16 dispatch
    and a dispatch without topk (``is_token_in_rank`` only), each combine after its
    dispatch. Returns every result, as host tensors of their bits."""
    from tests.torch import test_torch_deep_ep as flow
    from ubep.torch.fp8 import quantize_fp8

    r, got = group.rank, {}
    options = {} if transport is None else {"transport": transport}
    x, idx, w = flow._inputs(r)
    local = flow.E // flow.R

    def keep(name: str, t: Any) -> None:
        t = t.detach()
        got[name] = t.view(torch.uint8) if t.dtype.is_floating_point and (
            t.element_size() == 1) else t.view(torch.int16) if t.dtype == torch.bfloat16 else t

    ll = deep_ep.Buffer(group, low_latency_mode=True, timeout_s=120.0, **options)
    stats = torch.full((local,), 7, dtype=torch.int32)
    recv, count, handle, _, hook = ll.low_latency_dispatch(
        x, idx, flow.LL_MAX_TOKENS, flow.E, use_fp8=False, return_recv_hook=True,
        cumulative_local_expert_recv_stats=stats)
    hook()
    keep("ll.stats", stats)
    keep("ll.recv_count", count)
    keep("ll.layout_range", handle.layout_range)
    for e in range(local):  # only the first recv_count[e] rows are defined (as DeepEP's)
        keep(f"ll.recv_x[{e}]", recv[e, : int(count[e])])
        keep(f"ll.src_info[{e}]", handle.src_info[e, : int(count[e])])
    out = (recv.float() * 0.5).to(torch.bfloat16)
    dropped = idx.clone()
    dropped[:, 0] = -1
    y, _, y_hook = ll.low_latency_combine(out, dropped, w, handle, return_recv_hook=True)
    y_hook()
    keep("ll.y_dropped", y)
    ll.get_next_low_latency_combine_buffer(handle)[:, :, :] = out
    keep("ll.y_zero_copy", ll.low_latency_combine(torch.full_like(out, float("nan")), idx, w,
                                                  handle, zero_copy=True)[0])
    for name, ue8m0 in (("fp8", False), ("ue8m0", True)):
        wide = torch.cat([x, -x], dim=1)  # hidden 512: one UE8M0 int32 of four scales
        (q, s), count, handle, event, _ = ll.low_latency_dispatch(
            wide, idx, flow.LL_MAX_TOKENS, flow.E, use_fp8=True, round_scale=ue8m0,
            use_ue8m0=ue8m0, async_finish=True)
        event.current_stream_wait()
        for e in range(local):
            keep(f"ll.{name}.values[{e}]", q[e, : int(count[e])])
            keep(f"ll.{name}.scales[{e}]", s[e, : int(count[e])])
        keep(f"ll.{name}.y", ll.low_latency_combine(
            (q.float().reshape(*q.shape[:2], -1, 128) * (
                s.float() if not ue8m0 else torch.ones(1))[..., None]).reshape(q.shape).to(
                torch.bfloat16), idx, w, handle)[0])

    normal = deep_ep.Buffer(group, max_tokens_per_rank=8, timeout_s=120.0, **options)
    per_rank, _, per_expert, in_rank, _ = normal.get_dispatch_layout(idx, flow.E)
    layout = {"num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank,
              "num_tokens_per_expert": per_expert}
    q, s = quantize_fp8(x, False)
    (rq, rs), *_, fp8_handle, _ = normal.dispatch((q, s), topk_idx=idx, topk_weights=w,
                                                  **layout)
    keep("normal.fp8.values", rq)
    keep("normal.fp8.scales", rs)
    (cq, cs), *_ = normal.dispatch((q, s), handle=fp8_handle)
    keep("cached.fp8.values", cq)
    keep("cached.fp8.scales", cs)
    back = (rq.float().reshape(rq.shape[0], -1, 128) * rs[..., None]).reshape(rq.shape)
    keep("normal.fp8.y", normal.combine(back.to(torch.bfloat16), fp8_handle)[0])
    recv_x, *_, bf16_handle, _ = normal.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
    keep("cached.bf16", normal.dispatch(x, handle=bf16_handle)[0])
    recv_x, recv_idx, recv_w, counts, in_rank_handle, _ = normal.dispatch(
        x, is_token_in_rank=in_rank, num_tokens_per_rank=per_rank,
        num_tokens_per_expert=per_expert)
    keep("no_topk.recv_x", recv_x)
    got["no_topk.counts"] = torch.tensor(counts)
    got["no_topk.topk"] = torch.tensor([recv_idx is None, recv_w is None])
    keep("no_topk.y", normal.combine(recv_x, in_rank_handle)[0])
    return got


def _on_the_device_body(group: Any) -> dict[str, Any]:
    """:func:`_device_calls` on the host engine (the oracle: ``tests/torch`` checks these
    calls there), then on the Triton engine, watching what reaches the engine and every
    conversion the facade makes."""
    from ubep.torch import _runtime, deep_ep_core, deep_ep_device, deep_ep_lowlatency
    from ubep.torch import deep_ep as facade
    from ubep.triton.plane import TritonPlane

    want = _device_calls(group, None)
    reached: list[tuple[str, Any]] = []
    converted: list[str] = []
    real_dispatch, real_combine = TritonPlane.dispatch, TritonPlane.combine

    def dispatch(self: Any, x: Any, *args: Any) -> Any:
        reached.append(("dispatch", x))
        return real_dispatch(self, x, *args)

    def combine(self: Any, expert_out: Any, *args: Any) -> Any:
        reached.append(("combine", expert_out))
        return real_combine(self, expert_out, *args)

    def watched(module: Any, name: str) -> Any:
        real = getattr(module, name)

        def conversion(*args: Any, **kwargs: Any) -> Any:
            if _is_row_conversion(name, args, kwargs):
                shapes = tuple(getattr(a, "shape", type(a).__name__) for a in args)
                converted.append(f"{module.__name__}.{name}{shapes}")
            return real(*args, **kwargs)

        return conversion

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TritonPlane, "dispatch", dispatch)
        mp.setattr(TritonPlane, "combine", combine)
        for module in (facade, deep_ep_core, deep_ep_lowlatency, deep_ep_device, _runtime):
            for name in _CONVERSIONS:
                if hasattr(module, name):
                    mp.setattr(module, name, watched(module, name))
        got = _device_calls(group, "triton")
    errors = [f"{call} reached the engine as {type(t).__name__}" for call, t in reached
              if not (type(t) is torch.Tensor and t.device.type == "cpu")]
    errors += [f"converted: {c}" for c in converted]
    errors += [f"{name}: {tuple(got[name].shape)} {got[name].dtype} differs from the host "
               f"engine's {tuple(t.shape)} {t.dtype}" for name, t in want.items()
               if name not in got or not (got[name].dtype == t.dtype and torch.equal(
                   got[name], t))]
    return {"errors": [f"rank {group.rank}: {e}" for e in errors], "calls": len(reached)}


@needs_triton
def test_deep_ep_other_calls_keep_tensors_on_the_triton_engine_bit_exact() -> None:
    for got in ubep.launch(_on_the_device_body, _RANKS, timeout_s=600.0):
        assert not got["errors"], "\n".join(got["errors"])
        assert got["calls"] > 10


def _bad_combine_body(group: Any) -> list[str]:
    """A low-latency combine on the Triton engine that rank 1 calls with bad input (a
    ``topk_idx`` that is not the dispatch's, then expert outputs of another dtype): refused
    there by the argument, on rank 0 as ``RemoteError`` from rank 1; the next combine works.
    Returns each call's outcome."""
    from tests.torch import test_torch_deep_ep as flow
    from ubep.errors import InvalidArgumentError, RemoteError

    r = group.rank
    buf = deep_ep.Buffer(group, low_latency_mode=True, transport="triton", timeout_s=120.0)
    x, idx, w = flow._inputs(r)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, flow.LL_MAX_TOKENS, flow.E,
                                                     use_fp8=False)
    out = recv * 2  # identity experts, doubled (exact in BF16)
    wrong = idx.clone()
    wrong[1, 1] = (int(idx[1, 1]) + 1) % flow.E
    dense = sum(torch.where(idx[:, k, None] >= 0, w[:, k, None] * 2 * x.float(), 0.0)
                for k in range(idx.shape[1]))
    outcomes = []
    # a good combine after each bad one (the engine keeps one failure notice a rank: a
    # second reject right after the first could overwrite it before the peer read it)
    for bad in ((out, wrong), (out.float(), idx)):
        try:
            buf.low_latency_combine(*(bad if r == 1 else (out, idx)), w, handle)
            outcomes.append("ok")
        except InvalidArgumentError as exc:
            outcomes.append(f"invalid {exc.argument}")
        except RemoteError as exc:
            outcomes.append(f"remote from {exc.rank}")
        y = buf.low_latency_combine(out, idx, w, handle)[0]
        torch.testing.assert_close(y.float(), dense, rtol=2e-2, atol=2e-2)  # BF16 rows
        outcomes.append("y ok")
    return outcomes


@needs_triton
def test_bad_low_latency_combine_on_the_triton_engine_fails_on_every_rank() -> None:
    got = ubep.launch(_bad_combine_body, _RANKS, timeout_s=300.0)
    assert got == [["remote from 1", "y ok", "remote from 1", "y ok"],
                   ["invalid topk_idx", "y ok", "invalid x", "y ok"]]
