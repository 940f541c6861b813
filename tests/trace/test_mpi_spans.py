"""The MPI RMA engine records the same spans from Python: on the in-process RMA transport
(tests/mpi/_fake_rma.py), each rank's sends carry the rows brute force counts from topk_idx
for each destination (ASP: a token once per host it goes to; BSP: a row per pick), every span
nests in its call and none overlap, and a send starts before the wait that took its rows ends;
an ASP receive waits source by source, each wait naming its source and rows, so every send
flows to the wait that took it."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest

from tests.mpi._fake_rma import FakeWorld, run_ranks
from tests.mpi.test_mpi_unit import R3, _cfg, _checked_call, _inputs
from ubep.buffer import Buffer
from ubep.trace import Trace, spans_of, to_chrome


@pytest.mark.parametrize("engine", ["asp", "bsp"])
def test_rma_engine_spans_match_the_routing_and_nest_in_their_calls(engine: str) -> None:
    def body(g: Any) -> tuple[bool, Trace]:
        cfg = _cfg(engine=engine).__class__(**{**_cfg(engine=engine).__dict__, "trace": True})
        with Buffer(g, cfg) as buf:
            ok = _checked_call(buf, g.rank, 3)
            return ok, spans_of(buf)

    out = run_ranks(FakeWorld(R3), body)
    assert all(ok for ok, _ in out)
    trace = Trace("runtime", "rma", tuple(s for _, t in out for s in t.spans),
                  tuple(c for _, t in out for c in t.calls))
    _, idxs, _ = _inputs(3)
    for r in range(R3):
        if engine == "asp":  # a token crosses to another host once (the host copy): a rank a
            # host here, so one row per (token, destination rank)
            want = Counter(d for row in idxs[r] for d in {int(e) // 2 for e in row} if d != r)
        else:  # BSP: a row per pick
            want = Counter(int(e) // 2 for e in idxs[r].reshape(-1) if int(e) // 2 != r)
        got: Counter[int] = Counter()
        # the dispatch's sends (the combine pushes its output rows back with sends of its own)
        dispatch = next(c for c in trace.calls if c.rank == r and c.name == "dispatch")
        for s in trace.spans:
            if (s.rank == r and s.task == "send"
                    and dispatch.start_ns <= s.start_ns <= dispatch.end_ns):
                got[s.peer] += s.rows
                assert s.size_bytes == s.rows * 64 * 4
        assert got == want, (r, got, want)
        calls = [c for c in trace.calls if c.rank == r]
        assert sorted(c.name for c in calls) == ["combine", "dispatch"]
    for (rank, _), spans in trace.by_core().items():
        for a, b in itertools.pairwise(spans):
            assert a.end_ns <= b.start_ns
        calls = [c for c in trace.calls if c.rank == rank]
        assert all(any(c.start_ns <= s.start_ns and s.end_ns <= c.end_ns for c in calls)
                   for s in spans)
    for s in trace.spans:
        if s.task == "send":
            ends = [q.end_ns for q in trace.spans if q.rank == s.peer
                    and q.task in ("wait", "barrier")]
            assert max(ends) >= s.start_ns
    if engine == "asp":
        # the receive waits source by source: each names its source and the rows taken from it
        # (what that source sent here), and every send to another rank flows to one of them
        for r in range(R3):
            took = Counter({q.peer: q.rows for q in trace.spans if q.rank == r
                            and q.task == "wait" and q.peer >= 0})
            sent = Counter({q.rank: q.rows for q in trace.spans if q.peer == r
                            and q.task == "send" and q.rank != r and q.rows})
            assert took == sent and all(q.size_bytes == q.rows * 64 * 4 for q in trace.spans
                                        if q.rank == r and q.task == "wait" and q.peer >= 0)
        flows = [e for e in to_chrome([trace])["traceEvents"] if e.get("cat") == "flow"]
        remote = [q for q in trace.spans if q.task == "send" and q.peer != q.rank and q.rows]
        assert len(flows) == 2 * len(remote) > 0
