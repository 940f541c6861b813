"""Traces in the Chrome trace event format (JSON; Perfetto and ``chrome://tracing`` open it).

One process per (trace, rank), one thread per core and a thread ``calls`` for the calls that
enclose the tasks; every task a complete event (``ph: "X"``, microseconds) carrying the span's
fields in ``args``; a flow (``ph: "s"`` -> ``"f"``) from each send to the ``wait`` or
``reorder`` span on the peer that consumed it, where the trace has one. A written
file loads back into :class:`~ubep.trace.spans.Trace` objects, and files of several ranks merge
into one.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from .spans import CallSpan, Span, Trace

__all__ = ["join", "load", "merge", "to_chrome", "write"]

_PIDS_PER_TRACE = 100_000  # pid = trace index * this + rank: ranks of two traces never collide
_CALLS_TID = 0  # the thread of the call spans; core c is thread c + 1
_RECEIVERS = ("wait", "reorder")


def to_chrome(traces: Sequence[Trace]) -> dict[str, Any]:
    """The trace event JSON object (``{"traceEvents": [...], "displayTimeUnit": "ns"}``)."""
    events: list[dict[str, Any]] = []
    for index, trace in enumerate(traces):
        base = index * _PIDS_PER_TRACE
        events += _metadata(trace, base)
        events += [_call_event(trace, c, base) for c in trace.calls]
        events += [_task_event(trace, s, base) for s in trace.spans]
        events += _flows(trace, base, flow_base=index * 10_000_000)
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def write(traces: Sequence[Trace], path: str | Path) -> Path:
    """Write ``traces`` as one trace event file; returns its path."""
    out = Path(path)
    out.write_text(json.dumps(to_chrome(traces)))
    return out


def load(path: str | Path) -> list[Trace]:
    """The traces a file written by :func:`write` (or :func:`merge`) holds, one per label."""
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    spans: dict[tuple[str, str], list[Span]] = {}
    calls: dict[tuple[str, str], list[CallSpan]] = {}
    for e in events:
        args = e.get("args", {})
        if e.get("ph") != "X" or "ubep_label" not in args:
            continue
        key = (args["ubep_source"], args["ubep_label"])
        start, end = args["start_ns"], args["end_ns"]
        if e.get("cat") == "call":
            calls.setdefault(key, []).append(CallSpan(args["rank"], e["name"], start, end))
        else:
            spans.setdefault(key, []).append(Span(
                args["rank"], args["core"], e["name"], start, end, args["unit"], args["peer"],
                args["rows"], args["size_bytes"]))
    keys = sorted(set(spans) | set(calls))
    return [Trace(src, label, tuple(spans.get((src, label), ())),
                  tuple(calls.get((src, label), ()))) for src, label in keys]


def merge(paths: Sequence[str | Path], out: str | Path) -> Path:
    """One trace event file from several (the ranks' own files, or runs to put side by side).
    Traces of one source and label whose ranks are disjoint (one run's rank files) become one,
    so its sends flow to their receives across ranks; a trace whose ranks another of its label
    already holds (the same run twice) stays apart, its processes numbered after it."""
    if not paths:
        raise InvalidArgumentError("paths", [], "needs at least one trace file")
    return write(join([t for path in paths for t in load(path)]), out)


def join(traces: Sequence[Trace], *, runs_apart: bool = True) -> list[Trace]:
    """One trace per source and label, in first-seen order: the spans and calls of traces
    that share both are put together (a run's rank files, or one Buffer read twice). With
    ``runs_apart`` a trace whose ranks the one before it of its label already holds (the same
    run twice) stays a trace of its own."""
    out: list[Trace] = []
    for t in traces:
        into = next((i for i, o in enumerate(out) if (o.source, o.label) == (t.source, t.label)
                     and not (runs_apart and set(o.ranks()) & set(t.ranks()))), None)
        if into is None:
            out.append(t)
        else:
            o = out[into]
            out[into] = Trace(o.source, o.label, o.spans + t.spans, o.calls + t.calls)
    return out


def _metadata(trace: Trace, base: int) -> list[dict[str, Any]]:
    events = []
    cores = sorted({(s.rank, s.core) for s in trace.spans})
    for rank in trace.ranks():
        pid = base + rank
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": _CALLS_TID,
                       "args": {"name": f"{trace.label} ({trace.source}) rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": _CALLS_TID,
                       "args": {"sort_index": pid}})
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": _CALLS_TID,
                       "args": {"name": "calls"}})
    for rank, core in cores:
        events.append({"name": "thread_name", "ph": "M", "pid": base + rank, "tid": core + 1,
                       "args": {"name": f"core {core}"}})
    return events


def _us(ns: float) -> float:
    return ns / 1e3


def _common_args(trace: Trace) -> dict[str, Any]:
    return {"ubep_source": trace.source, "ubep_label": trace.label}


def _call_event(trace: Trace, c: CallSpan, base: int) -> dict[str, Any]:
    return {"name": c.name, "cat": "call", "ph": "X", "ts": _us(c.start_ns),
            "dur": _us(c.end_ns - c.start_ns), "pid": base + c.rank, "tid": _CALLS_TID,
            "args": _common_args(trace) | {"rank": c.rank, "start_ns": c.start_ns,
                                           "end_ns": c.end_ns}}


def _task_event(trace: Trace, s: Span, base: int) -> dict[str, Any]:
    return {"name": s.task, "cat": trace.source, "ph": "X", "ts": _us(s.start_ns),
            "dur": _us(s.duration_ns), "pid": base + s.rank, "tid": s.core + 1,
            "args": _common_args(trace) | {
                "rank": s.rank, "core": s.core, "unit": s.unit, "peer": s.peer, "rows": s.rows,
                "size_bytes": s.size_bytes, "start_ns": s.start_ns, "end_ns": s.end_ns}}


def _flows(trace: Trace, base: int, flow_base: int) -> list[dict[str, Any]]:
    """A flow from each send to the receiving span on its peer that consumed it: the first
    that names the send's unit and this rank as its peer (the simulator's receives name the
    row's unit); where the peer's receives name no unit (the runtime's take a source's rows at
    once), the first that names this rank and received rows within the peer's call of the
    same name and order (a rank's k-th dispatch feeds its peers' k-th), or, outside any call,
    the first that ends after the send starts."""
    named: dict[tuple[int, int, int], Span] = {}
    unnamed: dict[tuple[int, int], list[Span]] = {}
    for s in sorted(trace.spans, key=lambda s: s.start_ns):
        if s.task in _RECEIVERS and s.peer >= 0:
            if s.unit >= 0:
                named.setdefault((s.rank, s.peer, s.unit), s)
            elif s.rows > 0:  # a sender's wait for its peer's readiness moves no rows
                unnamed.setdefault((s.rank, s.peer), []).append(s)
    calls = _CallOrder(trace.calls)
    in_call: dict[tuple[int, int, tuple[str, int] | None], Span] = {}
    for (rank, peer), spans in unnamed.items():
        for s in spans:
            in_call.setdefault((rank, peer, calls.of(rank, s.start_ns)), s)
    events: list[dict[str, Any]] = []
    for n, s in enumerate(trace.spans):
        if s.task != "send" or s.peer < 0:
            continue
        recv = named.get((s.peer, s.rank, s.unit)) if s.unit >= 0 else None
        if recv is None:
            call = calls.of(s.rank, s.start_ns)
            recv = (in_call.get((s.peer, s.rank, call)) if call is not None else
                    next((q for q in unnamed.get((s.peer, s.rank), ())
                          if q.end_ns >= s.start_ns), None))
        if recv is None:
            continue
        fid = flow_base + n
        events.append({"name": "rows", "cat": "flow", "ph": "s", "id": fid, "pid": base + s.rank,
                       "tid": s.core + 1, "ts": _us((s.start_ns + s.end_ns) / 2)})
        events.append({"name": "rows", "cat": "flow", "ph": "f", "bp": "e", "id": fid,
                       "pid": base + recv.rank, "tid": recv.core + 1,
                       "ts": _us(max(recv.start_ns, s.start_ns))})
    return events


class _CallOrder:
    """Which call of its rank a time falls in: ``(name, k)`` for the rank's k-th call of that
    name (in start order), None outside every call."""

    def __init__(self, calls: Sequence[CallSpan]) -> None:
        self._calls: dict[int, list[tuple[float, float, str, int]]] = {}
        seen: dict[tuple[int, str], int] = {}
        for c in sorted(calls, key=lambda c: c.start_ns):
            k = seen.get((c.rank, c.name), 0)
            seen[(c.rank, c.name)] = k + 1
            self._calls.setdefault(c.rank, []).append((c.start_ns, c.end_ns, c.name, k))
        self._starts = {r: [c[0] for c in cs] for r, cs in self._calls.items()}

    def of(self, rank: int, t: float) -> tuple[str, int] | None:
        starts = self._starts.get(rank)
        if not starts:
            return None
        i = bisect.bisect_right(starts, t) - 1
        if i < 0:
            return None
        _, end, name, k = self._calls[rank][i]
        return (name, k) if t <= end else None
