"""A DeepEP program traced with one ``ubep.trace.record`` block: the facade's normal and
low-latency Buffers each get a trace label of their own, and the facade's own Python work shows
as named spans of the ``"python"`` trace (the oracle: the calls the program made)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ubep.runtime import launch

torch = pytest.importorskip("torch")

import ubep.trace  # noqa: E402
from ubep.trace.recorder import WORK_LABEL  # noqa: E402

TOKENS, HIDDEN, EXPERTS, TOPK = 8, 256, 8, 2
CALLS = ["deep_ep.combine", "deep_ep.dispatch", "deep_ep.get_dispatch_layout",
         "deep_ep.low_latency_combine", "deep_ep.low_latency_dispatch"]


def _worker(group: Any, out: str) -> bool:
    from ubep import deep_ep

    g = torch.Generator().manual_seed(group.rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(TOKENS)])
    idx = idx.to(deep_ep.topk_idx_t)
    w = torch.ones(TOKENS, TOPK)
    buf = deep_ep.Buffer(group, num_nvl_bytes=1 << 24, low_latency_mode=True)
    with ubep.trace.record(out):
        ntr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, EXPERTS)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=ntr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
            topk_idx=idx, topk_weights=w)
        buf.combine(recv_x, handle, topk_weights=recv_w)
        recv, _count, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, TOKENS, EXPERTS,
                                                                 use_fp8=False)
        buf.low_latency_combine(recv, idx, w, ll_handle)
    return True


def test_normal_and_low_latency_buffers_get_a_label_each_and_python_work_is_named(
        tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    assert launch(_worker, 2, str(out), timeout_s=240) == [True, True]
    traces = {t.label: t for t in ubep.trace.load(out)}
    normal = [t for label, t in traces.items() if label.startswith("deep_ep normal (")]
    low = [t for label, t in traces.items() if label.startswith("deep_ep low-latency (")]
    assert len(normal) == 1 and len(low) == 1, sorted(traces)
    assert set(traces) == {normal[0].label, low[0].label, WORK_LABEL}
    # each Buffer's engine calls, once a rank. The normal label's: the step's dispatch and
    # combine (its weights are the ones the dispatch received: each source sums its own, no
    # call), and the empty dispatch that moves every rank off it before the low-latency
    # Buffer's call (CallGate)
    calls = {normal[0].label: ["combine"] + ["dispatch"] * 2,
             low[0].label: ["combine", "dispatch"]}
    for trace in (normal[0], low[0]):
        assert trace.ranks() == [0, 1]
        for r in (0, 1):
            assert sorted(c.name for c in trace.calls if c.rank == r) == calls[trace.label]
    work = traces[WORK_LABEL]
    assert work.spans == ()
    for r in (0, 1):
        mine = [c for c in work.calls if c.rank == r]
        assert sorted(c.name for c in mine) == CALLS
        assert all(c.end_ns >= c.start_ns for c in mine)
    # the facade's dispatch span holds its engine call: the Python work is around it
    py = next(c for c in work.calls if c.rank == 0 and c.name == "deep_ep.dispatch")
    engine = min((c for c in normal[0].calls if c.rank == 0 and c.name == "dispatch"),
                 key=lambda c: c.start_ns)  # the step's: the gate's switches come later
    assert py.start_ns <= engine.start_ns and engine.end_ns <= py.end_ns
