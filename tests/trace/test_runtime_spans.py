"""The runtime's task spans: what every core of every rank ran, checked against independent
oracles. Each rank of a 2-rank group runs one dispatch and combine (checked bit for bit against
``ubep.reference``) on a tracing Buffer and returns its spans.

* the send spans are the Plan's units: ``ubep.sched.schedule`` of the same inputs with the
  Buffer's core split gives each send core's units in order, each exactly once (one send core:
  the multiset of destinations; BSP: the rows to each destination, counted from ``topk_idx``);
* every span nests inside its rank's call span, and no two overlap on one core;
* one clock across ranks: a send's span starts before the receive span that consumed its rows
  (on the peer) ends;
* the exported events carry the trace event format's required fields, and the file loads back;
  a flow joins every send to another rank to a receive of the sender's rows on that rank;
* the simulator's spans (``from_sim`` of ``simulate`` on the same Plans) list the same sends
  (unit, peer, rows, bytes) per core, in the same order, as the runtime's.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ubep import testing
from ubep.buffer import Buffer, BufferConfig
from ubep.errors import InvalidArgumentError
from ubep.runtime import launch
from ubep.sched import core_split, schedule
from ubep.sim import simulate
from ubep.sim.calib import load_fabric
from ubep.topology import host
from ubep.trace import Trace, from_sim, load, record, spans_of, to_chrome, write

HIDDEN, TOPK, EXPERTS = 256, 4, 16


@dataclasses.dataclass(frozen=True)
class Case:
    engine: str
    layout: str
    sync: str
    num_cores: int
    threads: bool
    tokens: int
    hook: bool = False  # split-phase (return_recv_hook)
    background: bool | None = None  # its second half on the background core

    def config(self, trace: bool = True) -> BufferConfig:
        return BufferConfig(
            max_tokens_per_rank=32, hidden=HIDDEN, num_topk=TOPK, num_experts=EXPERTS,
            dtype="bf16", layout=self.layout, engine=self.engine, sync=self.sync,
            num_cores=self.num_cores, threads=self.threads, timeout_s=60.0, trace=trace,
            background=self.background)


# 4 cores at 24 tokens: 3 send cores + 1 count core (the Plan's units); 3 cores at 1 token: one
# send core (the engine's buckets) + 2 count cores; BSP splits every destination's rows over
# the cores; a split-phase call runs its second half on the background core
CASES = [
    Case("asp", "expert", "sw", 4, True, 24),
    Case("asp", "rank", "dc", 4, False, 24),
    Case("asp", "expert", "tff", 3, True, 1),
    Case("asp", "expert", "sp", 4, True, 24, hook=True),
    Case("asp", "rank", "tff", 2, True, 16, hook=True, background=True),
    Case("bsp", "expert", "tff", 4, True, 24),
    Case("bsp", "rank", "sw", 2, False, 16),
    Case("bsp", "expert", "dc", 2, True, 16, hook=True, background=True),
    Case("asp", "expert", "tff", 4, False, 24),
]


def _inputs(case: Case, seed: int) -> tuple[list[Any], list[np.ndarray], list[Any]]:
    return testing.inputs("bf16", EXPERTS, TOPK, HIDDEN, [case.tokens] * 2, seed, "uniform")


def _call(buf: Any, case: Case, xs: list[Any], idxs: list[np.ndarray], ws: list[Any],
          seed: int) -> list[str]:
    if not case.hook:
        return testing.check_call(buf, xs, idxs, ws, seed)
    from ubep import reference

    r = buf.rank
    pending = buf.dispatch(xs[r], idxs[r], ws[r], return_recv_hook=True)
    res = pending.hook()
    refs = reference.dispatch(xs, idxs, ws, EXPERTS, layout=case.layout)
    errors = testing.compare(res, refs[r])
    outs = [testing.expert_outputs("bf16", ref.recv_x, seed * 10 + q) for q, ref in enumerate(refs)]
    y = buf.combine(outs[r], res.handle, return_recv_hook=True).hook()
    want = reference.combine(outs, refs)[r]
    if not testing.same_bits(y, want):
        errors.append("combine differs from the reference")
    return errors


def _worker(group: Any, cases: list[Case], out: str) -> tuple[list[tuple[list[str], Trace]], Any]:
    runs = []
    for i, case in enumerate(cases):
        xs, idxs, ws = _inputs(case, i)
        with Buffer(group, case.config()) as buf:
            errors = _call(buf, case, xs, idxs, ws, i)
            runs.append((errors, spans_of(buf)))
    # record(): an untraced Buffer made before the block traces inside it; each rank writes its
    # file and rank 0 merges them
    with Buffer(group, CASES[0].config(trace=False)) as buf:
        xs, idxs, ws = _inputs(CASES[0], 0)
        testing.check_call(buf, xs, idxs, ws, 0)  # before the block: not recorded
        with record(out):
            errors = testing.check_call(buf, xs, idxs, ws, 0)
        try:
            spans_of(buf)
            refused = None
        except InvalidArgumentError as exc:
            refused = str(exc)
    return runs, (errors, refused)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path]:
    out = tmp_path_factory.mktemp("trace") / "step.json"
    return launch(_worker, 2, CASES, str(out), timeout_s=300), out


def _trace(runs: Any, i: int) -> Trace:
    per_rank = runs[0]
    for r in range(2):
        errors = per_rank[r][0][i][0]
        assert not errors, errors[:5]
    ts = [per_rank[r][0][i][1] for r in range(2)]
    return Trace("runtime", ts[0].label, ts[0].spans + ts[1].spans, ts[0].calls + ts[1].calls)


def _plans(case: Case, idxs: list[np.ndarray]) -> list[Any]:
    topo = dataclasses.replace(host(2), cores_per_rank=case.num_cores)
    split = core_split(case.num_cores, EXPERTS, TOPK, case.tokens)
    return [schedule(idx, topo, rank=r, num_experts=EXPERTS, layout=case.layout,
                     num_send_cores=split.num_send_cores, num_count_cores=split.num_count_cores)
            for r, idx in enumerate(idxs)]


def _rows_to(case: Case, idx: np.ndarray) -> Counter[int]:
    """Rows a rank sends each destination: one per (token, expert) pick (expert layout), one
    per (token, destination rank) (rank layout); brute force over topk_idx."""
    epr = EXPERTS // 2
    out: Counter[int] = Counter()
    for row in idx:
        dsts = [int(e) // epr for e in row if e >= 0]
        out.update(dsts if case.layout == "expert" else set(dsts))
    return out


@pytest.mark.parametrize("i", range(len(CASES)))
def test_send_spans_are_the_plans_units_each_once_in_order(runs: Any, i: int) -> None:
    case, trace = CASES[i], _trace(runs, i)
    _, idxs, _ = _inputs(case, i)
    plans = _plans(case, idxs)
    for r in range(2):
        sends = {c: [s for s in spans if s.task == "send"]
                 for (rank, c), spans in trace.by_core().items() if rank == r}
        want_rows = _rows_to(case, idxs[r])
        got_rows: Counter[int] = Counter()
        for spans in sends.values():
            for s in spans:
                got_rows[s.peer] += s.rows
                assert s.size_bytes == s.rows * HIDDEN * 2
        assert +got_rows == +want_rows, (r, got_rows, want_rows)
        plan = plans[r]
        n_s = len(plan.core_ptr) - 1
        if case.engine == "asp" and n_s > 1:  # the Plan's units, in the Plan's order
            for c in range(case.num_cores):
                want = [u for j in range(c, n_s, case.num_cores)
                        for u in range(plan.core_ptr[j], plan.core_ptr[j + 1])]
                got = [s.unit for s in sends.get(c, [])]
                assert got == want, (r, c)
                assert [s.peer for s in sends.get(c, [])] == plan.send_dst_rank[want].tolist()


@pytest.mark.parametrize("i", range(len(CASES)))
def test_spans_nest_in_their_call_and_never_overlap_on_a_core(runs: Any, i: int) -> None:
    trace = _trace(runs, i)
    kinds = Counter(c.name for c in trace.calls)
    assert kinds == {"dispatch": 2, "combine": 2}, kinds
    assert {s.task for s in trace.spans} >= {"init", "send", "reduce"}
    for (rank, _), spans in trace.by_core().items():
        for a, b in itertools.pairwise(spans):
            assert a.end_ns <= b.start_ns, (a, b)
        calls = [c for c in trace.calls if c.rank == rank]
        for s in spans:
            assert any(c.start_ns <= s.start_ns and s.end_ns <= c.end_ns for c in calls), s


@pytest.mark.parametrize("i", range(len(CASES)))
def test_one_clock_a_send_starts_before_the_receive_it_feeds_ends(runs: Any, i: int) -> None:
    trace = _trace(runs, i)
    for s in trace.spans:
        if s.task != "send" or s.peer == s.rank:
            continue
        got = [q for q in trace.spans if q.rank == s.peer and q.peer == s.rank
               and q.task in ("wait", "reorder")]
        assert got, s
        assert max(q.end_ns for q in got) >= s.start_ns, (s, got)


def test_exported_runtime_events_carry_the_required_fields_and_load_back(
        runs: Any, tmp_path: Path) -> None:
    traces = [_trace(runs, i) for i in (0, 5)]
    data = to_chrome(traces)
    for e in data["traceEvents"]:
        assert {"name", "ph", "pid", "tid"} <= set(e), e
        if e["ph"] != "M":
            assert isinstance(e["ts"], float | int)
        if e["ph"] == "X":
            assert e["dur"] >= 0
    back = load(write(traces, tmp_path / "t.json"))
    assert sorted(len(t.spans) for t in back) == sorted(len(t.spans) for t in traces)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_exported_sends_flow_to_a_receive_of_the_senders_rows_on_the_peer(
        runs: Any, i: int) -> None:
    trace = _trace(runs, i)
    recvs = [s for s in trace.spans if s.task in ("wait", "reorder") and s.rows > 0]
    fed = {(s.rank, s.peer) for s in recvs}
    sends = [s for s in trace.spans if s.task == "send" and (s.peer, s.rank) in fed]
    # every send to another rank has a receive of its rows there (own rows: BSP only)
    assert {s for s in trace.spans if s.task == "send" and s.peer != s.rank} <= set(sends)
    receivers = {(s.rank, s.core) for s in recvs}
    flows = [e for e in to_chrome([trace])["traceEvents"] if e.get("cat") == "flow"]
    starts = {e["id"]: e for e in flows if e["ph"] == "s"}
    ends = {e["id"]: e for e in flows if e["ph"] == "f"}
    assert starts.keys() == ends.keys() and len(starts) == len(sends)
    assert Counter(e["pid"] for e in ends.values()) == Counter(s.peer for s in sends)
    assert all((e["pid"], e["tid"] - 1) in receivers for e in ends.values())


def test_record_merges_every_rank_into_one_file(runs: Any) -> None:
    (per_rank, out) = runs
    for r in range(2):
        errors, refused = per_rank[r][1]
        assert not errors
        assert refused is not None and "does not trace" in refused  # off again after the block
    traces = load(out)
    assert len(traces) == 1 and traces[0].ranks() == [0, 1]
    assert Counter(c.name for c in traces[0].calls) == {"dispatch": 2, "combine": 2}
    assert json.loads(out.read_text())["traceEvents"]
    assert not list(out.parent.glob("step.rank*.json"))  # merged and removed


@pytest.mark.parametrize("i", [0, 1, 3, 8])
def test_the_simulator_lists_the_same_sends_per_core(runs: Any, i: int) -> None:
    """Per core, the same (task, unit, peer, rows, bytes) sends in the same order, the count
    tasks on the same cores, and (TFF) the rows each rank reordered from each peer."""
    case, trace = CASES[i], _trace(runs, i)
    _, idxs, _ = _inputs(case, i)
    topo = dataclasses.replace(host(2), cores_per_rank=case.num_cores)
    res = simulate(_plans(case, idxs), topo, load_fabric("cm384"), engine=case.engine,
                   sync=case.sync, row_bytes=HIDDEN * 2)
    sim = from_sim(res, "predicted")

    def sends(t: Trace) -> dict[tuple[int, int], list[tuple[str, int, int, int, int]]]:
        return {core: got for core, spans in t.by_core().items()
                if (got := [(s.task, s.unit, s.peer, s.rows, s.size_bytes)
                            for s in spans if s.task == "send"])}

    assert sends(sim) == sends(trace)
    assert {(s.rank, s.core) for s in sim.spans if s.task == "count"} == {
        (s.rank, s.core) for s in trace.spans if s.task == "count"}

    def reorders(t: Trace) -> Counter[tuple[int, int]]:  # rows reordered, per rank and source
        got: Counter[tuple[int, int]] = Counter()
        for s in t.spans:
            if s.task == "reorder" and s.peer != s.rank:
                got[(s.rank, s.peer)] += s.rows
        return got

    # a rank's receive spreads its rows over every core in the model, one core a source in
    # the runtime: the rows each rank took from each peer agree
    if case.sync == "tff":
        assert reorders(trace) and reorders(sim) == reorders(trace)


def test_trace_must_be_a_bool() -> None:
    with pytest.raises(InvalidArgumentError, match="trace"):
        dataclasses.replace(CASES[0].config(), trace=1)  # type: ignore[arg-type]


def test_a_python_ring_keeps_the_last_spans_in_order_and_decodes_like_the_native_one() -> None:
    from ubep.trace.recorder import decode
    from ubep.trace.ring import SpanRing

    ring = SpanRing(2)
    assert ring.trace_spans() == (b"", (), 0) and ring.t0() == 0  # off: nothing, no clock
    ring.trace_enable(3)
    for n in range(5):  # core 1 wraps: 0 and 1 are overwritten
        ring.rec(1, "send", ring.t0(), unit=n, peer=0, rows=1, size_bytes=8)
    ring.rec(0, "wait", ring.t0(), peer=1)
    ring.rec(2, "combine", ring.t0())
    packed, counts, dropped = ring.trace_spans()
    assert counts == (1, 3, 1) and dropped == 2
    spans, calls = decode(packed, counts, rank=5)
    assert [(s.core, s.task, s.unit) for s in spans] == [
        (0, "wait", -1), (1, "send", 2), (1, "send", 3), (1, "send", 4)]
    assert [(c.rank, c.name) for c in calls] == [(5, "combine")]
    assert ring.trace_spans()[1] == (0, 0, 0)  # read: emptied
    with pytest.raises(InvalidArgumentError, match="capacity"):
        ring.trace_enable(-1)


def test_the_engines_kinds_are_the_schemas_in_order() -> None:
    """engine.h numbers its span kinds as TASK_KINDS, then the call ring's kinds."""
    import re

    from ubep.trace.recorder import CALL_KINDS
    from ubep.trace.spans import TASK_KINDS

    header = (Path(__file__).parents[2] / "src/ubep/runtime/native/engine.h").read_text()
    body = re.search(r"enum \{\s*(SK_INIT[^}]*)\}", header)
    assert body is not None
    names = [n.strip().split("=")[0].strip() for n in re.sub(r"/\*.*?\*/", "", body.group(1),
                                                               flags=re.S).split(",")]
    names = [n for n in names if n and n != "SK_OWN"]
    assert names == [f"SK_{k.upper()}" for k in (*TASK_KINDS, *CALL_KINDS)]


@pytest.mark.parametrize("capacity", [0, -1, True, 2.5])
def test_record_refuses_a_bad_capacity_before_anything_traces(
        capacity: Any, tmp_path: Path) -> None:
    from ubep.trace import recorder

    with pytest.raises(InvalidArgumentError, match="capacity"), record(
            tmp_path / "t.json", capacity=capacity):
        pass
    assert not recorder._recorders and not list(tmp_path.iterdir())
