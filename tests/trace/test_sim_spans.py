"""The simulator's spans name what they moved, as the runtime's do: checked on small cases
against oracles built without the simulator.

* the send spans of each send core are its units in ``ubep.sched.schedule``'s Plan, in order,
  each once (ASP a span per unit; BSP a span per run of units to one destination), with the
  Plan's destinations; rows per destination equal a brute-force count over ``topk_idx``;
* the receive spans consume every row sent to their rank once, naming its sender and its unit,
  and never end before the send that fed them;
* an exported trace has a flow from every send to the receive on its peer that consumed it;
* the pieces tile the executors' per-core spans, which stay as they were, and both executors
  cut them alike.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from typing import Any

import numpy as np
import pytest

from ubep.routing import zipf_topk
from ubep.sched import schedule
from ubep.sched.combine import combine_plans
from ubep.sim import simulate
from ubep.sim.calib import load_fabric
from ubep.sim.timeline import TASKS
from ubep.topology import host
from ubep.trace import Span, Trace, from_sim, to_chrome

RANKS, CORES, EXPERTS, TOPK, TOKENS = 4, 6, 16, 4, 24
ROW_BYTES = 512
EPR = EXPERTS // RANKS

# (engine, sync, layout, send cores, count cores)
CASES = [("asp", "tff", "expert", 3, 2), ("asp", "sw", "rank", 4, 1), ("asp", "dc", "expert", 2, 2),
         ("bsp", "sw", "expert", CORES, CORES), ("bsp", "sw", "rank", CORES, CORES)]


def _topk() -> list[np.ndarray]:
    every = zipf_topk(TOKENS * RANKS, EXPERTS, TOPK, seed=3)  # skewed: uneven rows per rank
    return [np.ascontiguousarray(p) for p in np.split(every, RANKS)]


def _topology() -> Any:
    return dataclasses.replace(host(RANKS), cores_per_rank=CORES)


def _plans(case: tuple[str, str, str, int, int], idxs: list[np.ndarray]) -> list[Any]:
    engine, _, layout, n_s, n_c = case
    policy = "expert_contiguous" if engine == "bsp" else "hierarchical"
    return [schedule(idx, _topology(), rank=r, num_experts=EXPERTS, policy=policy, layout=layout,
                     num_send_cores=n_s, num_count_cores=n_c) for r, idx in enumerate(idxs)]


def _simulate(case: tuple[str, str, str, int, int], plans: list[Any], mode: str = "analytic",
              op: str = "dispatch") -> Any:
    return simulate(plans, _topology(), load_fabric("cm384"), engine=case[0], sync=case[1],
                    row_bytes=ROW_BYTES, op=op, mode=mode)


def _rows(layout: str, idx: np.ndarray) -> Counter[int]:
    """Rows a rank sends each destination, brute force: one per (token, expert) pick (expert
    layout), one per (token, destination rank) (rank layout)."""
    out: Counter[int] = Counter()
    for row in idx:
        dsts = [int(e) // EPR for e in row if e >= 0]
        out.update(dsts if layout == "expert" else set(dsts))
    return out


def _sends(trace: Trace, rank: int) -> dict[int, list[Span]]:
    """``core -> its send spans in order``, for the cores of ``rank`` that send."""
    return {c: got for (r, c), spans in trace.by_core().items()
            if r == rank and (got := [s for s in spans if s.task == "send"])}


@pytest.mark.parametrize("mode", ["analytic", "events"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:3])))
def test_send_spans_are_each_cores_plan_units_in_order_each_once(
        case: tuple[str, str, str, int, int], mode: str) -> None:
    idxs = _topk()
    plans = _plans(case, idxs)
    trace = from_sim(_simulate(case, plans, mode), "case")
    for r, plan in enumerate(plans):
        sends = _sends(trace, r)
        for j in range(plan.num_send_cores):
            spans = sends.get(j, [])
            if case[0] == "asp":
                assert all(s.rows == 1 for s in spans)
            else:  # a BSP span is a whole run of units to one destination
                assert all(a.peer != b.peer for a, b in itertools.pairwise(spans))
            units = [u for s in spans for u in range(s.unit, s.unit + s.rows)]
            assert units == list(range(plan.core_ptr[j], plan.core_ptr[j + 1])), (r, j)
            peers = [s.peer for s in spans for _ in range(s.rows)]
            assert peers == plan.send_dst_rank[units].tolist(), (r, j)
        assert not set(sends) - set(range(plan.num_send_cores))  # no other core sends
        got: Counter[int] = Counter()
        for s in (s for spans in sends.values() for s in spans):
            got[s.peer] += s.rows
            assert s.size_bytes == s.rows * ROW_BYTES
        assert +got == +_rows(case[2], idxs[r]), r


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:3])))
def test_receive_spans_consume_every_row_once_after_it_was_sent(
        case: tuple[str, str, str, int, int]) -> None:
    idxs = _topk()
    plans = _plans(case, idxs)
    trace = from_sim(_simulate(case, plans), "case")
    sent = {(s.rank, s.unit + i): s for s in trace.spans if s.task == "send"
            for i in range(s.rows)}
    for d in range(RANKS):
        got = Counter((s.peer, s.unit) for s in trace.spans
                      if s.task == "reorder" and s.rank == d)
        want = Counter((p.rank, u) for p in plans for u in range(p.num_units)
                       if p.send_dst_rank[u] == d)
        assert got == want, d
        per_source = Counter(s for s, _ in got.elements())
        assert +per_source == +Counter({s: _rows(case[2], idxs[s])[d] for s in range(RANKS)})
    for s in trace.spans:
        if s.task == "reorder":
            assert s.rows == 1 and s.size_bytes == ROW_BYTES
            assert s.end_ns >= sent[(s.peer, s.unit)].end_ns  # one clock: sent, then consumed


@pytest.mark.parametrize("case", CASES[:1] + CASES[3:4], ids=["asp", "bsp"])
def test_every_send_flows_to_the_receive_on_its_peer_that_consumed_it(
        case: tuple[str, str, str, int, int]) -> None:
    trace = from_sim(_simulate(case, _plans(case, _topk())), "case")
    consumer = {(s.rank, s.peer, s.unit): s for s in trace.spans if s.task == "reorder"}
    sends = [s for s in trace.spans if s.task == "send"]
    events = to_chrome([trace])["traceEvents"]
    starts = {e["id"]: e for e in events if e.get("cat") == "flow" and e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e.get("cat") == "flow" and e["ph"] == "f"}
    assert starts.keys() == ends.keys() and len(starts) == len(sends)
    got = Counter((s["pid"], s["tid"], ends[i]["pid"], ends[i]["tid"]) for i, s in starts.items())
    # core c is thread c + 1; a send's flow ends on the core that consumed its (first) unit
    want = Counter((s.rank, s.core + 1, s.peer, consumer[(s.peer, s.rank, s.unit)].core + 1)
                   for s in sends)
    assert got == want


@pytest.mark.parametrize("mode", ["analytic", "events"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:3])))
def test_the_pieces_tile_the_per_core_spans_which_stay_as_they_were(
        case: tuple[str, str, str, int, int], mode: str) -> None:
    res = _simulate(case, _plans(case, _topk()), mode)
    tl, fine = res.timeline, res.unit_timeline()
    assert not tl.unit.size or (tl.unit.max() == -1 and tl.rows.max() == 0)
    for task in ("send", "consume"):
        k = TASKS.index(task)
        for i in np.flatnonzero(tl.task == k):
            m = (fine.task == k) & (fine.rank == tl.rank[i]) & (fine.core == tl.core[i])
            start, end = fine.start_ns[m], fine.end_ns[m]
            assert start.size and start.min() == tl.start_ns[i]
            assert end.max() == pytest.approx(tl.end_ns[i], abs=1e-6)
            assert float(np.sum(end - start)) == pytest.approx(
                tl.end_ns[i] - tl.start_ns[i], abs=1e-6)
    # every other span as it was
    others = np.isin(tl.task, [TASKS.index("send"), TASKS.index("consume")], invert=True)
    mine = np.isin(fine.task, [TASKS.index("send"), TASKS.index("consume")], invert=True)
    for col in ("rank", "core", "task", "start_ns", "end_ns"):
        np.testing.assert_array_equal(getattr(tl, col)[others], getattr(fine, col)[mine])
    for (_, _), spans in from_sim(res, "case").by_core().items():
        for a, b in itertools.pairwise(spans):
            assert a.end_ns <= b.start_ns + 1e-9, (a, b)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:3])))
def test_both_executors_cut_the_sends_alike(case: tuple[str, str, str, int, int]) -> None:
    plans = _plans(case, _topk())
    got = [sorted((s.rank, s.core, s.unit, s.peer, s.rows) for s in
                  from_sim(_simulate(case, plans, mode), "case").spans if s.task == "send")
           for mode in ("analytic", "events")]
    assert got[0] == got[1]


@pytest.mark.parametrize("case", CASES[:1] + CASES[3:4], ids=["asp", "bsp"])
def test_a_combine_reduces_each_token_over_its_rows(case: tuple[str, str, str, int, int]) -> None:
    dispatch = _plans(case, _topk())
    policy = "expert_contiguous" if case[0] == "bsp" else "hierarchical"
    plans = list(combine_plans(dispatch, _topology(), policy=policy))
    trace = from_sim(_simulate(case, plans, op="combine"), "combine")
    assert not any(s.task == "reorder" for s in trace.spans)
    for d in range(RANKS):
        reduces = [s for s in trace.spans if s.task == "reduce" and s.rank == d]
        # rank d sums, per token it dispatched, one expert output per row it sent
        assert sum(s.rows for s in reduces) == dispatch[d].num_units
        assert len(reduces) == len(set(dispatch[d].send_token.tolist()))
        assert sum(s.rows for s in trace.spans if s.task == "send" and s.peer == d) == \
            dispatch[d].num_units
