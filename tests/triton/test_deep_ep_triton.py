"""``deep_ep.Buffer(group, ..., transport="triton")``: DeepEP's normal dispatch and combine run
on the Triton engine (under Triton's interpreter), bit for bit against dense computations
every rank makes from every rank's seeded inputs; and ``ubep.Buffer`` on it takes torch
tensors and gives torch tensors, bit for bit against ``ubep.reference``."""

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
