"""The timeline schema and its Chrome trace event export: the simulator's spans of a small case
(its unit timeline) land in the schema one for one; every exported event carries the format's
required fields; files load back to the same spans and merge without pid collisions, a run's
rank files with the flows between them; flows join a send to the wait that consumed its unit."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from tests.sim.test_sim_model import ROW, fabric, plan, two_ranks
from ubep.errors import InvalidArgumentError
from ubep.sim import simulate
from ubep.trace import Span, Trace, from_sim, load, merge, to_chrome, write
from ubep.trace.spans import CallSpan


def _sim_trace(engine: str) -> Trace:
    f, topo = fabric(barrier_ns=500.0), two_ranks(cores=4)
    plans = [plan(r, [(0, 0, 1 - r, 0), (1, 0, 1 - r, 1)], n_send=2, n_count=1, topo=topo)
             for r in (0, 1)]
    res = simulate(plans, topo, f, engine=engine, sync="sw", row_bytes=ROW)
    return from_sim(res, f"{engine} sw dispatch")


@pytest.mark.parametrize("engine", ["asp", "bsp"])
def test_sim_spans_map_one_for_one_never_overlap_on_a_core_and_nest_in_their_call(
        engine: str) -> None:
    f, topo = fabric(barrier_ns=500.0), two_ranks(cores=4)
    plans = [plan(r, [(0, 0, 1 - r, 0), (1, 0, 1 - r, 1)], n_send=2, n_count=1, topo=topo)
             for r in (0, 1)]
    res = simulate(plans, topo, f, engine=engine, sync="sw", row_bytes=ROW)
    trace = from_sim(res, "case")
    fine = res.unit_timeline()
    assert len(trace.spans) == len(fine)
    assert sum(s.task == "send" for s in trace.spans) == int(
        (fine.task == 1).sum())  # ubep.sim.timeline.TASKS[1] == "send"
    # ASP: a send span per unit (one row); BSP: per run of units to one destination
    rows = sum(s.rows for s in trace.spans if s.task == "send")
    assert rows == sum(p.num_units for p in plans)
    ends = {c.rank: c.end_ns for c in trace.calls}
    for (rank, _), spans in trace.by_core().items():
        for a, b in itertools.pairwise(spans):
            assert a.end_ns <= b.start_ns + 1e-9, (a, b)
        assert all(s.start_ns >= 0.0 and s.end_ns <= ends[rank] + 1e-9 for s in spans)


def test_every_event_has_the_trace_event_formats_required_fields(tmp_path: Path) -> None:
    data = to_chrome([_sim_trace("asp"), _sim_trace("bsp")])
    json.dumps(data)  # serialisable as it is
    events = data["traceEvents"]
    assert events
    for e in events:
        assert {"name", "ph", "pid", "tid"} <= set(e), e
        if e["ph"] != "M":
            assert isinstance(e["ts"], float | int)
        if e["ph"] == "X":
            assert e["dur"] >= 0
    # one process per (trace, rank): the two traces' rank 0 are different processes
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert len(names) == 4 and len(set(names.values())) == 4


def test_a_written_file_loads_back_to_the_same_spans_and_calls(tmp_path: Path) -> None:
    traces = [_sim_trace("asp"), _sim_trace("bsp")]
    back = {t.label: t for t in load(write(traces, tmp_path / "t.json"))}
    assert back.keys() == {t.label for t in traces}
    for t in traces:
        assert back[t.label].source == t.source == "sim"
        assert sorted(back[t.label].spans, key=_key) == sorted(t.spans, key=_key)
        assert set(back[t.label].calls) == set(t.calls)


def _flows(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in data["traceEvents"] if e.get("cat") == "flow"]


def _key(s: Span) -> tuple[int, int, float, str]:
    return (s.rank, s.core, s.start_ns, s.task)


def test_rank_files_merge_into_one_and_colliding_runs_get_their_own_pids(
        tmp_path: Path) -> None:
    run = _sim_trace("asp")
    per_rank = [Trace(run.source, run.label, tuple(s for s in run.spans if s.rank == r),
                      tuple(c for c in run.calls if c.rank == r)) for r in (0, 1)]
    files = [write([t], tmp_path / f"rank{r}.json") for r, t in enumerate(per_rank)]
    assert not _flows(json.loads(files[0].read_text()))  # a rank's file: no peer to flow to
    merged_file = merge(files, tmp_path / "all.json")
    merged = load(merged_file)
    assert len(merged) == 1 and sorted(merged[0].spans, key=_key) == sorted(run.spans, key=_key)
    # merged, the sends of one rank's file flow to the receives in the other's, as in the run's
    want = _flows(to_chrome([run]))
    assert want and len(_flows(json.loads(merged_file.read_text()))) == len(want)
    # the same run twice: its ranks' pids collide, and the second copy moves
    twice = json.loads(merge([files[0], files[0]], tmp_path / "twice.json").read_text())
    pids = [e["pid"] for e in twice["traceEvents"] if e["name"] == "process_name"]
    assert len(pids) == 2 and len(set(pids)) == 2


def test_a_flow_joins_each_send_to_the_wait_that_consumed_its_unit() -> None:
    spans = (
        Span(0, 0, "send", 0.0, 100.0, unit=3, peer=1, rows=2, size_bytes=512),
        Span(0, 1, "send", 0.0, 80.0, unit=4, peer=1, rows=1, size_bytes=256),
        Span(1, 0, "wait", 50.0, 150.0, unit=3, peer=0),
        Span(1, 0, "reorder", 150.0, 170.0, unit=4, peer=0, rows=1),
    )
    events = to_chrome([Trace("runtime", "t", spans, (CallSpan(0, "dispatch", 0, 200),))])
    flows = [e for e in events["traceEvents"] if e.get("cat") == "flow"]
    starts = {e["id"]: e for e in flows if e["ph"] == "s"}
    finishes = {e["id"]: e for e in flows if e["ph"] == "f"}
    assert starts.keys() == finishes.keys() and len(starts) == 2
    targets = sorted((starts[i]["tid"], finishes[i]["pid"], finishes[i]["tid"]) for i in starts)
    assert targets == [(1, 1, 1), (2, 1, 1)]  # core c is thread c + 1; both land on rank 1 core 0


def test_a_send_flows_to_the_receive_of_its_peers_call_of_the_same_order() -> None:
    """Receives that name no unit (the runtime's: a source's rows at once): a send of rank 0's
    k-th dispatch flows to rank 1's receive of rank 0's rows in rank 1's k-th dispatch, not to
    a wait that moved no rows; a send outside every call to the first receive ending after it
    starts."""
    calls = tuple(CallSpan(r, "dispatch", 1000.0 * k + 10 * r, 1000.0 * k + 900)
                  for k in range(2) for r in (0, 1))
    spans = [Span(0, 0, "send", 1000.0 * k + 100, 1000.0 * k + 200, unit=k, peer=1, rows=1,
                  size_bytes=256) for k in range(2)]
    spans += [Span(1, 1, "wait", 1000.0 * k + 50, 1000.0 * k + 60, peer=0)  # readiness: no rows
              for k in range(2)]
    spans += [Span(1, k, "reorder", 1000.0 * k + 300, 1000.0 * k + 400, peer=0, rows=1)
              for k in range(2)]  # call k's receive on core k
    spans += [Span(0, 2, "send", 2500.0, 2600.0, unit=9, peer=1, rows=1),  # outside any call
              Span(1, 3, "wait", 2700.0, 2800.0, peer=0, rows=1)]
    events = to_chrome([Trace("runtime", "t", tuple(spans), calls)])["traceEvents"]
    flows = [e for e in events if e.get("cat") == "flow"]
    start = {e["id"]: (e["tid"], e["ts"]) for e in flows if e["ph"] == "s"}
    finish = {e["id"]: (e["pid"], e["tid"]) for e in flows if e["ph"] == "f"}
    assert start.keys() == finish.keys()
    got = sorted((start[i], finish[i]) for i in start)
    # core c is thread c + 1; ts in microseconds
    assert got == [((1, 0.15), (1, 1)), ((1, 1.15), (1, 2)), ((3, 2.55), (1, 4))]


def test_a_span_refuses_an_unknown_task_and_a_negative_duration() -> None:
    with pytest.raises(InvalidArgumentError, match="task"):
        Span(0, 0, "compute", 0.0, 1.0)
    with pytest.raises(InvalidArgumentError, match="end_ns"):
        Span(0, 0, "send", 2.0, 1.0)


def test_ubep_sim_trace_writes_the_calls_it_timed(tmp_path: Path) -> None:
    from ubep.cli import main

    out = tmp_path / "sim.json"
    assert main(["sim", "run", "--ranks", "4", "--tokens", "16", "--hidden", "256", "--topk", "2",
                 "--engine", "bsp", "--sync", "sw", "--trace", str(out)]) == 0
    (trace,) = load(out)
    assert trace.source == "sim" and trace.ranks() == [0, 1, 2, 3]
    assert {s.task for s in trace.spans} >= {"send", "barrier"}
    sends = [s for s in trace.spans if s.task == "send"]  # a small call: its units named
    assert sum(s.rows for s in sends) == 4 * 16 * 2 and all(s.peer >= 0 for s in sends)
    assert all(c.name == "dispatch" for c in trace.calls) and len(trace.calls) == 4


def test_trace_run_refuses_a_prediction_the_simulator_cannot_make_before_any_rank_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ubep.cli import main

    measured = tmp_path / "bsp.json"
    assert main(["trace", "run", "--ranks", "2", "--tokens", "8", "--hidden", "256",
                 "--engine", "bsp", "--sync", "tff", "-o", str(measured),
                 "--predicted", str(tmp_path / "sim.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ubep trace: error: sync='tff'") and "'sw'" in err, err
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written
