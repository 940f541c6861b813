"""Programs shaped like the frameworks' DeepEP V2 callers, run on ``ubep.deep_ep`` under
``ubep.launch`` (2 ranks), bit for bit against single-process oracles: a vLLM-style
prepare/finalize (FP8, expanded, grouped per expert), an SGLang-style dispatcher (split
a/b halves over ``defer_epilogue``), a DeepSpeed-style expert layer (forward and the backward
through a cached dispatch); then bad input (an error on every rank, the next call working),
the redundant-expert pair over a ``BufferAllocator`` plan, and the rest of the surface."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from tests._shm import leaked_since, ubep_segments  # noqa: E402
from tests.torch import _deepep_v2_oracle as oracle  # noqa: E402
from tests.torch._deepep_v2_oracle import Case, Shape  # noqa: E402
from ubep.runtime import launch  # noqa: E402

SHAPE = Shape(num_ranks=2)
CASE = Case(expert_alignment=4, num_bias=0, skewed=False, seed=11)
LB_SLOTS, LB_BYTES, LB_HIDDEN = 2, 64, 16
MAPPING = [[4, -1], [0, 3]]  # rank 0 holds a copy of expert 4; rank 1 of experts 0 and 3


def _scale(e: torch.Tensor) -> torch.Tensor:
    # expert e multiplies its rows by 2 ** (3e - 9): wide enough that FP32 sums round, so a
    # different reduction order changes bits
    return torch.exp2(e.float() * 3.0 - 9.0)


def _dequant(values: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    return values.float() * sf.float().repeat_interleave(128, dim=1)


# ------------------------------------------------------------------ the programs (on each rank)
def _vllm_style(buf: Any, inp: dict[str, Any], rank: int) -> dict[str, Any]:
    """prepare: FP8 dispatch into the expanded layout (m_indices from emit_expert_ids);
    experts: dequantise, scale, apply the router weight; finalize: combine."""
    L = SHAPE.local
    (vals, sf), _, recv_w, handle, _ = buf.dispatch(
        inp["x_fp8"], inp["topk_idx"], inp["topk_weights"], num_experts=SHAPE.num_experts,
        expert_alignment=4, do_expand=True, do_zero_padding=True, emit_expert_ids=True,
        use_tma_aligned_col_major_sf=True)
    col_major = sf.stride() == (1, -(-sf.shape[0] // 4) * 4)  # DeepEP's TMA-aligned layout
    m_indices = handle.recv_expert_ids
    expert = torch.where(m_indices >= 0, m_indices + rank * L, 0)
    y = (_dequant(vals, sf) * _scale(expert)[:, None] * recv_w[:, None]).to(torch.bfloat16)
    out, _, _ = buf.combine(y, handle)
    starts = [0, *(-(-int(p) // 4) * 4 for p in handle.psum_num_recv_tokens_per_expert[:-1])]
    return {"out": oracle.bits(out), "m_indices": m_indices.numpy(), "starts": starts,
            "col_major": col_major,
            "counts": handle.num_unaligned_recv_tokens_per_expert.numpy()}


class _SGLangStyleDispatcher:
    """dispatch_a/dispatch_b and combine_a/combine_b: the first half issues, the second waits."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.event, self.handle = buf, None, None

    def dispatch_a(self, x: Any, topk_idx: Any, topk_weights: Any) -> None:
        self.event = self.buf.dispatch(x, topk_idx, topk_weights, num_experts=SHAPE.num_experts,
                                       previous_event=self.buf.capture(),
                                       allocate_on_comm_stream=True,
                                       async_with_compute_stream=True, defer_epilogue=True)

    def dispatch_b(self) -> tuple[Any, Any, Any]:
        recv_x, recv_idx, recv_w, self.handle = self.event.wait()
        return recv_x, recv_idx, recv_w

    def combine_a(self, y: Any) -> None:
        self.event = self.buf.combine(y, self.handle, async_with_compute_stream=True,
                                      defer_epilogue=True)

    def combine_b(self) -> Any:
        out, _ = self.event.wait()
        return out


def _sglang_style(buf: Any, inp: dict[str, Any], rank: int) -> dict[str, Any]:
    d = _SGLangStyleDispatcher(buf)
    d.dispatch_a(inp["x"], inp["topk_idx"], inp["topk_weights"])
    recv_x, recv_idx, recv_w = d.dispatch_b()
    acc = torch.zeros(recv_x.shape, dtype=torch.float32)
    for k in range(SHAPE.num_topk):
        ok = recv_idx[:, k] >= 0
        s = _scale(recv_idx[:, k].clamp(min=0) + rank * SHAPE.local)
        acc = acc + torch.where(ok[:, None], recv_x.float() * s[:, None] * recv_w[:, k, None], 0.0)
    d.combine_a(acc.to(torch.bfloat16))
    return {"out": oracle.bits(d.combine_b())}


def _deepspeed_style(buf: Any, inp: dict[str, Any], rank: int) -> dict[str, Any]:
    """An expert layer: forward dispatch (expanded), per-expert affine, combine; backward: the
    gradient goes out by a cached dispatch (handle=) and comes back by combine."""
    L = SHAPE.local
    recv_x, _, _, handle, _ = buf.dispatch(inp["x"], inp["topk_idx"],
                                           num_experts=SHAPE.num_experts,
                                        do_expand=True, expert_alignment=2, do_zero_padding=True)
    rows = torch.arange(recv_x.shape[0])
    psum = handle.psum_num_recv_tokens_per_expert
    starts = psum - handle.num_unaligned_recv_tokens_per_expert
    e = torch.bucketize(rows, starts[1:].long(), right=True) + rank * L
    y = (recv_x.float() * _scale(e)[:, None] + 0.5).to(torch.bfloat16)
    out, _, _ = buf.combine(y, handle)
    grad_out = (out.float() * 0.25).to(torch.bfloat16)
    grad_rows, _, _, same, _ = buf.dispatch(grad_out, handle=handle, do_expand=True)
    grad_x, _, _ = buf.combine((grad_rows.float() * _scale(e)[:, None]).to(torch.bfloat16), handle)
    return {"out": oracle.bits(out), "grad_x": oracle.bits(grad_x), "same_handle": same is handle}


# ------------------------------------------------------------------ bad input, LB, surface
def _expect_error(group: Any, fn: Any, good: Any) -> tuple[str, str, list[float]]:
    from ubep.errors import InvalidArgumentError, RemoteError

    try:
        fn()
    except (InvalidArgumentError, RemoteError) as exc:
        kind, text = type(exc).__name__, str(exc)
    else:
        kind, text = "none", ""
    return kind, text, good()


def _bad_inputs(group: Any, buf: Any, other: Any, inp: dict[str, Any]) -> dict[str, Any]:
    rank, E = group.rank, SHAPE.num_experts
    x, idx, w = inp["x"], inp["topk_idx"], inp["topk_weights"]

    def good() -> list[float]:  # a correct round trip: all-ones rows -> distinct ranks
        recv_x, _, _, h, _ = buf.dispatch(x, idx.clone(), w, num_experts=E)
        return buf.combine(torch.ones_like(recv_x), h)[0][:, 0].float().tolist()

    handle = buf.dispatch(x, idx, w, num_experts=E)[3]
    foreign = other.dispatch(x, idx.clone(), w, num_experts=E)[3]
    recv_e, _, _, eh, _ = other.dispatch(x, idx.clone(), w, num_experts=E, do_expand=True)
    too_many = torch.zeros(SHAPE.num_max_tokens_per_rank + 1, SHAPE.hidden, dtype=torch.bfloat16)
    wide_idx = torch.zeros(too_many.shape[0], SHAPE.num_topk, dtype=torch.int64)
    cases = {
        "dtype": lambda: buf.dispatch(x.float() if rank == 1 else x, idx, w, num_experts=E),
        "tokens": lambda: buf.dispatch(too_many if rank == 0 else x,
                                       wide_idx if rank == 0 else idx, num_experts=E),
        "foreign": lambda: buf.combine(torch.ones(foreign.num_recv_tokens, SHAPE.hidden,
                                                  dtype=torch.bfloat16), foreign),
        "modified": lambda: (idx.add_(0) if rank == 0 else None,
                             buf.combine(torch.ones(handle.num_recv_tokens, SHAPE.hidden,
                                                    dtype=torch.bfloat16), handle)),
        "weights_single_reduction": lambda: other.combine(
            torch.ones_like(recv_e), eh,
            topk_weights=torch.ones(recv_e.shape[0], dtype=torch.float32)),
        "handle_copy": lambda: buf.dispatch(x, idx.clone(), num_experts=E,
                                            do_handle_copy=rank == 1),
        "defer": lambda: buf.dispatch(x, idx.clone(), num_experts=E, defer_epilogue=True),
    }
    return {name: _expect_error(group, fn, good) for name, fn in cases.items()}


def _lb_pair(group: Any) -> dict[str, Any]:
    from ubep.deep_ep import BufferAllocator, EPBuffer, get_num_allocation_alignment

    rank, L = group.rank, SHAPE.local
    plan = BufferAllocator()
    slots = plan.allocate((LB_SLOTS, LB_BYTES), torch.uint8)
    grads = plan.allocate((LB_SLOTS, LB_HIDDEN), torch.float32)
    buf = EPBuffer(group, num_bytes=get_num_allocation_alignment(),
                   lb_allocation_plan_or_num_bytes=plan, explicitly_destroy=True)
    mapping = torch.tensor(MAPPING, dtype=torch.int32)
    slots.fill_(0xA5)
    weights = _lb_weights(torch.arange(L) + rank * L)
    buf.lb_prefetch_weights([slots], [weights], mapping).wait()
    got_slots = slots.clone().numpy()
    grads.copy_(_lb_grads(rank))
    expert_grads = torch.full((L, LB_HIDDEN), 0.5, dtype=torch.float32)  # as DeepEP asks
    buf.lb_reduce_grads(grads, expert_grads, mapping, previous_event=buf.capture())
    out = {"slots": got_slots, "expert_grads": expert_grads.numpy(),
           "in_region": slots.data_ptr() == buf.lb_storage.data_ptr()}
    del slots, grads
    buf.destroy()
    return out


def _lb_weights(experts: torch.Tensor) -> torch.Tensor:
    return ((experts[:, None] * 31 + torch.arange(LB_BYTES)[None, :]) % 251).to(torch.uint8)


def _lb_grads(rank: int) -> torch.Tensor:
    c = torch.arange(LB_SLOTS, dtype=torch.float32)[:, None]
    return torch.sin(c * 1.7 + rank * 0.3 + torch.arange(LB_HIDDEN)[None, :] * 0.11)


def _surface(group: Any, buf: Any) -> dict[str, Any]:
    from ubep.deep_ep import EventHandle
    from ubep.errors import InvalidArgumentError

    out: dict[str, Any] = {
        "physical": buf.get_physical_domain_size(), "logical": buf.get_logical_domain_size(),
        "sms": buf.get_theoretical_num_sms(SHAPE.num_experts, SHAPE.num_topk),
        "qps": buf.get_theoretical_num_qps(20),
        "hint": buf.get_buffer_size_hint(group, 64, 7168, 8),
        "capture": isinstance(buf.capture(), EventHandle),
    }
    buf.barrier()
    try:
        buf.engram_fetch(torch.zeros(1, 1, dtype=torch.int32))
    except InvalidArgumentError as exc:
        out["refused"] = str(exc)
    return out


def _worker(group: Any) -> dict[str, Any]:
    from ubep.deep_ep import ElasticBuffer, EPBuffer

    rank = group.rank
    inp = oracle.inputs(SHAPE, Case(fp8=True, seed=CASE.seed), rank)
    ep = EPBuffer(group, num_max_tokens_per_rank=SHAPE.num_max_tokens_per_rank,
                  explicitly_destroy=True, timeout_s=60.0)
    single = EPBuffer(group, num_max_tokens_per_rank=SHAPE.num_max_tokens_per_rank,
                      allow_multiple_reduction=False, explicitly_destroy=True, timeout_s=60.0)
    elastic = ElasticBuffer(group, num_max_tokens_per_rank=SHAPE.num_max_tokens_per_rank,
                            explicitly_destroy=True, timeout_s=60.0)
    out = {"vllm": _vllm_style(ep, inp, rank), "sglang": _sglang_style(ep, inp, rank),
           "deepspeed": _deepspeed_style(elastic, inp, rank),
           "bad": _bad_inputs(group, ep, single, inp), "lb": _lb_pair(group),
           "surface": _surface(group, elastic)}
    handle = ep.dispatch(inp["x"], inp["topk_idx"].clone(), num_experts=SHAPE.num_experts)[3]
    for b in (ep, single, elastic):
        b.destroy()
    try:
        ep.combine(torch.zeros(handle.num_recv_tokens, SHAPE.hidden, dtype=torch.bfloat16),
                   handle)
    except Exception as exc:  # the message is what is checked
        out["after_destroy"] = str(exc)
    return out


# ------------------------------------------------------------------ oracles and the test
def _two_level(rows: torch.Tensor, idx: torch.Tensor, reduce_in_local: bool = True
               ) -> torch.Tensor:
    """DeepEP's reference combine of per-(token, slot) rows ``[n, K, H]`` (no bias)."""
    n, K, H = rows.shape
    rows = rows.clone()
    rows[idx < 0] = 0
    if reduce_in_local:
        owner = torch.where(idx >= 0, idx // SHAPE.local, -1)
        reduced = torch.zeros_like(rows)
        for t in range(n):
            for r in set(owner[t].tolist()):
                ks = [k for k in range(K) if int(owner[t, k]) == r]
                acc = torch.zeros(H)
                for k in ks:
                    acc = acc + rows[t, k].float()
                reduced[t, ks[-1]] = acc.to(torch.bfloat16)
        rows = reduced
    acc = torch.zeros(n, H)
    for k in range(K):
        acc = acc + rows[:, k].float()
    return acc.to(torch.bfloat16)


def _check_programs(rank: int, got: dict[str, Any]) -> None:
    inp = oracle.inputs(SHAPE, Case(fp8=True, seed=CASE.seed), rank)
    idx, w, K = inp["topk_idx"], inp["topk_weights"], SHAPE.num_topk
    e = idx.clamp(min=0)
    deq = _dequant(*inp["x_fp8"])
    vllm = torch.stack([(deq * _scale(e[:, k])[:, None] * w[:, k, None]).to(torch.bfloat16)
                        for k in range(K)], dim=1)
    np.testing.assert_array_equal(got["vllm"]["out"], oracle.bits(_two_level(vllm, idx)))
    m = got["vllm"]["m_indices"]
    for le, (start, count) in enumerate(zip(got["vllm"]["starts"], got["vllm"]["counts"],
                                            strict=True)):
        assert (m[start: start + count] == le).all()
    assert ((m >= 0).sum()) == got["vllm"]["counts"].sum()
    assert got["vllm"]["col_major"]
    # SGLang-style: each rank sums its slots in FP32 before the one cast
    owner = torch.where(idx >= 0, idx // SHAPE.local, -1)
    rows = torch.zeros(idx.shape[0], K, SHAPE.hidden, dtype=torch.bfloat16)
    x = inp["x"].float()
    for t in range(idx.shape[0]):
        for r in set(owner[t].tolist()) - {-1}:
            ks = [k for k in range(K) if int(owner[t, k]) == r]
            acc = torch.zeros(SHAPE.hidden)
            for k in ks:
                acc = acc + x[t] * _scale(e[t, k]) * w[t, k]
            rows[t, ks[-1]] = acc.to(torch.bfloat16)
    np.testing.assert_array_equal(got["sglang"]["out"],
                                  oracle.bits(_two_level(rows, idx, reduce_in_local=False)))
    # DeepSpeed-style forward and backward
    fwd = torch.stack([(x * _scale(e[:, k])[:, None] + 0.5).to(torch.bfloat16)
                       for k in range(K)], dim=1)
    out = _two_level(fwd, idx)
    np.testing.assert_array_equal(got["deepspeed"]["out"], oracle.bits(out))
    g = (out.float() * 0.25).to(torch.bfloat16).float()
    bwd = torch.stack([(g * _scale(e[:, k])[:, None]).to(torch.bfloat16) for k in range(K)], 1)
    np.testing.assert_array_equal(got["deepspeed"]["grad_x"], oracle.bits(_two_level(bwd, idx)))
    assert got["deepspeed"]["same_handle"]


def _check_bad(rank: int, bad: dict[str, Any]) -> None:
    inp = oracle.inputs(SHAPE, Case(fp8=True, seed=CASE.seed), rank)
    owners = [float(len({e // SHAPE.local for e in row if e >= 0}))
              for row in inp["topk_idx"].tolist()]
    # (the rank whose argument is bad, the argument the message names)
    culprit = {"dtype": (1, "x"), "tokens": (0, "num_max_tokens_per_rank"),
               "foreign": (None, "handle"), "modified": (0, "topk_idx"),
               "weights_single_reduction": (None, "allow_multiple_reduction"),
               "handle_copy": (1, "do_handle_copy"), "defer": (None, "async_with_compute_stream")}
    for name, (kind, text, after) in bad.items():
        who, word = culprit[name]
        expected = "InvalidArgumentError" if who in (None, rank) else "RemoteError"
        assert kind == expected, (name, rank, kind, text)
        assert word in text, (name, text)
        assert after == owners, name  # the next call works


def _check_lb(rank: int, lb: dict[str, Any]) -> None:
    L = SHAPE.local
    for c, expert in enumerate(MAPPING[rank]):
        want = (np.full(LB_BYTES, 0xA5, np.uint8) if expert < 0
                else _lb_weights(torch.tensor([expert]))[0].numpy())
        np.testing.assert_array_equal(lb["slots"][c], want)
    want_grads = torch.full((L, LB_HIDDEN), 0.5, dtype=torch.float32)
    for r in range(SHAPE.num_ranks):  # ranks ascending, then slots: one FP32 add each
        for c, expert in enumerate(MAPPING[r]):
            if expert >= 0 and expert // L == rank:
                want_grads[expert - rank * L] += _lb_grads(r)[c]
    np.testing.assert_array_equal(lb["expert_grads"], want_grads.numpy())
    assert lb["in_region"]


def test_framework_programs_bad_input_lb_and_surface() -> None:
    before = ubep_segments()
    results = launch(_worker, SHAPE.num_ranks, timeout_s=240)
    for rank, got in enumerate(results):
        _check_programs(rank, got)
        _check_bad(rank, got["bad"])
        _check_lb(rank, got["lb"])
        s = got["surface"]
        assert s["physical"] == (1, 2) and s["logical"] == (1, 2)
        assert s["sms"] == 20 and s["qps"] == 129 and s["capture"]
        assert s["hint"] > 0 and s["hint"] % (2 << 20) == 0
        assert "engram_fetch" in s["refused"]
        assert "destroyed" in got["after_destroy"]
    assert not leaked_since(before)


def test_under_torchrun(tmp_path: Any) -> None:
    """2 ranks under a real torchrun on dist.group.WORLD: each rank checks its compact dispatch
    against DeepEP's reference algorithm on all_to_all_single (gloo); the combines equal the
    oracle's bits."""
    from tests.torch import _torchrun_v2_worker as worker
    from tests.torch.test_torchrun import _ok, _torchrun

    job = _torchrun(2, "tests.torch._torchrun_v2_worker", str(tmp_path))
    _ok(job)
    shape = Shape(num_ranks=2)
    for rank in range(2):
        checks = json.loads((tmp_path / f"v2.{rank}.json").read_text())
        assert checks and all(checks.values()), checks
        saved = np.load(tmp_path / f"v2.{rank}.npz")
        inp = oracle.inputs(shape, worker.CASE, rank)
        for name in ("elastic", "ep"):
            np.testing.assert_array_equal(saved[f"{name}.combined"], oracle.bits(
                oracle.combine(shape, inp, rank, reduce_in_local=True)))
            np.testing.assert_array_equal(saved[f"{name}.e_combined"], oracle.bits(
                oracle.combine(shape, inp, rank, reduce_in_local=True)))
