"""Task spans of a running program: turned on per Buffer (``BufferConfig(trace=True)``) or for
every Buffer of a block (:func:`record`), read from the engines' per-core rings into the one
schema (:class:`~ubep.trace.spans.Trace`).

A Buffer's engine hands its spans through the data-plane contract (``ubep.plane.Engine``:
``trace_enable(capacity)``, ``False`` for an engine that records none, and
``trace_spans() -> (packed, counts, dropped)``): :data:`SPAN_DTYPE` records, ring by ring (its
cores', then its calls'), ``counts[c]`` of ring ``c``. The native and MPI RMA engines record
them. Times are the host's monotonic clock
(``CLOCK_MONOTONIC``, ``time.monotonic_ns``), one clock for every rank of a host, so spans of
different ranks line up as they are.

:func:`record` writes, on exit, each rank's spans to ``<path stem>.rank<r>.json``; the process
that holds rank 0 waits (at most ``merge_timeout_s``) for every rank's file and merges them into
``path``, one trace file for Perfetto (``ubep trace merge`` does the same by hand). Under
``torch.distributed`` the ranks that name the files are the world's, so the Buffers of several
EP groups (``dist.new_group``) land in one file, each group its own trace, labelled with its
members' world ranks.

Two Buffers of one configuration would share a label; a program that holds several names each
(:func:`name_buffer`: the DeepEP facade's ``"deep_ep normal"`` and ``"deep_ep low-latency"``),
and its own Python work around the engine calls shows as named spans of the ``"python"`` trace
(:func:`work`, :func:`traced_work`: the facade's conversions and checks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np

from ..errors import InvalidArgumentError, UbepError
from .spans import TASK_KINDS, CallSpan, Span, Trace

__all__ = ["CALL_KINDS", "DEFAULT_CAPACITY", "SPAN_DTYPE", "WORK_LABEL", "Recorder", "decode",
           "name_buffer", "record", "spans_of", "traced_work", "work"]

#: One span as the engines pack it (runtime/native/engine.h, span_t). For a call span ``unit``
#: is the dispatch index (combine: -1) and ``peer`` the call's error code (0: it succeeded).
SPAN_DTYPE = np.dtype([("start_ns", "<i8"), ("end_ns", "<i8"), ("kind", "<i4"), ("unit", "<i4"),
                       ("peer", "<i4"), ("epoch", "<i4"), ("rows", "<i8"),
                       ("size_bytes", "<i8")])
#: the kinds of the call ring, numbered after :data:`~ubep.trace.spans.TASK_KINDS`
CALL_KINDS = ("dispatch", "combine")
#: spans each core keeps (the oldest are overwritten): 48 bytes each
DEFAULT_CAPACITY = 1 << 16

#: the label of the trace that holds a program's own Python work (:func:`work`)
WORK_LABEL = "python"

_lock = threading.Lock()
_buffers: weakref.WeakSet[Any] = weakref.WeakSet()  # every Buffer set up in this process
_names: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # name_buffer
_recorders: list[Recorder] = []
_F = TypeVar("_F", bound=Callable[..., Any])


def decode(packed: bytes, counts: tuple[int, ...], rank: int) -> tuple[list[Span], list[CallSpan]]:
    """Spans and call spans of one engine's ``trace_spans()``."""
    rec = np.frombuffer(packed, SPAN_DTYPE)
    if len(rec) != sum(counts):
        raise InvalidArgumentError("counts", counts, f"do not add up to the {len(rec)} spans")
    spans: list[Span] = []
    calls: list[CallSpan] = []
    call_ring = len(counts) - 1
    at = 0
    for ring, n in enumerate(counts):
        for r in rec[at:at + n].tolist():
            start, end, kind, unit, peer, _epoch, rows, size = r
            if ring == call_ring:
                calls.append(CallSpan(rank, CALL_KINDS[kind - len(TASK_KINDS)], start, end))
            else:
                spans.append(Span(rank, ring, TASK_KINDS[kind], start, end, unit, peer, rows,
                                  size))
        at += n
    return spans, calls


def _label(buffer: Any) -> str:
    cfg = buffer.config
    with _lock:
        name = _names.get(buffer)
    return f"{cfg.engine}/{cfg.sync}" if name is None else f"{name} ({cfg.engine}/{cfg.sync})"


def name_buffer(buffer: Any, name: str) -> None:
    """Label ``buffer``'s trace ``"<name> (<engine>/<sync>)"``, so that a program's Buffers of
    one engine and sync mode (a DeepEP facade's normal and low-latency ones) are told apart."""
    with _lock:
        _names[buffer] = name


@contextlib.contextmanager
def work(name: str, rank: int) -> Iterator[None]:
    """A span ``name`` of this process's own Python work (a facade's conversions and checks
    around its engine calls) on the calls row of ``rank`` (under torch.distributed, the world
    rank) in the :data:`WORK_LABEL` trace; recorded inside :func:`record` only."""
    if not _recorders:  # not recording: nothing but this look
        yield
        return
    start = time.monotonic_ns()
    try:
        yield
    finally:
        world = _own_world_ranks()
        span = CallSpan(world[0] if world else rank, name, start, time.monotonic_ns())
        with _lock:
            for rec in _recorders:
                rec.work.append(span)


def recording() -> bool:
    """Whether a :class:`Recorder` is recording (a call's fast path steps aside for the traced
    one while it is)."""
    return bool(_recorders)


def traced_work(name: str) -> Callable[[_F], _F]:
    """A method decorator: each call is a :func:`work` span ``name`` of ``self.rank``."""
    def wrap(method: _F) -> _F:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not _recorders:
                return method(self, *args, **kwargs)
            with work(name, int(self.rank)):
                return method(self, *args, **kwargs)
        return cast(_F, run)
    return wrap


@dataclass(frozen=True)
class _Place:
    """Where a Buffer's ranks sit among the program's processes: ``world_ranks[r]`` is the
    world rank of its rank ``r`` among ``world_size``, and ``tag`` tells its group apart from
    others' in labels ("" for a group of the whole world)."""

    world_ranks: tuple[int, ...]
    world_size: int
    tag: str = ""
    group: Any = field(default=None, compare=False)  # whose clock_offset aligns a host's spans


def _place(buffer: Any) -> _Place:
    """torch.distributed's world for a Buffer on a torch group (an EP subgroup's ranks are not
    the world's: two groups' rank 0 would name one file); else the Buffer's own group."""
    own = _Place(tuple(range(buffer.num_ranks)), buffer.num_ranks, group=buffer.group)
    dist = _torch_dist()
    if dist is None or not hasattr(type(buffer.group), "torch_group"):
        return own
    try:
        members = tuple(int(r) for r in dist.get_process_group_ranks(buffer.group.torch_group))
    except (UbepError, ValueError, RuntimeError):  # the torch group is gone: its own ranks
        return own
    size = int(dist.get_world_size())
    if len(members) != buffer.num_ranks:
        return own
    tag = "" if members == tuple(range(size)) else " world ranks " + ",".join(map(str, members))
    return _Place(members, size, tag)


def _enable(buffer: Any, capacity: int) -> None:
    if not buffer.engine.trace_enable(capacity):  # records no spans: traced by nothing
        if buffer.config.trace:
            raise InvalidArgumentError("trace", True, f"the engine of transport "
                                       f"{buffer.config.transport!r} records no task spans")
        return
    buffer._trace_capacity = capacity


def spans_of(buffer: Any, label: str | None = None) -> Trace:
    """The spans ``buffer`` recorded since the last read (its rings are emptied), as a trace of
    this rank. The Buffer must trace (``BufferConfig(trace=True)`` or inside :func:`record`)."""
    if not getattr(buffer, "_trace_capacity", 0):
        raise InvalidArgumentError("buffer", buffer, "does not trace: make it with "
                                   "BufferConfig(trace=True) or inside ubep.trace.record()")
    packed, counts, _dropped = buffer.engine.trace_spans()
    spans, calls = decode(packed, counts, buffer.rank)
    return Trace("runtime", label or _label(buffer), tuple(spans), tuple(calls))


def attach(buffer: Any) -> None:
    """A Buffer was set up (``Buffer._setup``): it traces if its config or a recorder says so."""
    with _lock:
        _buffers.add(buffer)
        on = bool(_recorders) or buffer.config.trace
    if on:
        _enable(buffer, max([DEFAULT_CAPACITY] + [r.capacity for r in _recorders]))


def detach(buffer: Any) -> None:
    """A Buffer closes (its engine is still open): the recorders take what it recorded."""
    with _lock:
        recorders = list(_recorders)
        _buffers.discard(buffer)
    traced = int(getattr(buffer, "_trace_capacity", 0)) > 0
    if recorders and traced:
        _take(buffer, recorders)


def _take(buffer: Any, recorders: list[Recorder]) -> None:
    """Hand what ``buffer`` recorded to ``recorders``: its spans as a trace of its group,
    relabelled for a subgroup, and where its ranks sit in the world."""
    place = _place(buffer)
    trace = spans_of(buffer, _label(buffer) + place.tag)
    for r in recorders:
        r.add(trace, place)


@dataclass
class Recorder:
    """What one :func:`record` block collected: per label, the spans of the ranks this process
    holds."""

    path: Path
    capacity: int
    traces: list[tuple[Trace, _Place]] = field(default_factory=list)
    work: list[CallSpan] = field(default_factory=list)  # the program's Python work (work())

    def add(self, trace: Trace, place: _Place) -> None:
        self.traces.append((trace, place))

    def rank_path(self, rank: int) -> Path:
        return self.path.with_name(f"{self.path.stem}.rank{rank}.json")


@contextlib.contextmanager
def record(path: str | Path, *, capacity: int = DEFAULT_CAPACITY,
           merge_timeout_s: float = 60.0) -> Iterator[Recorder]:
    """Record the task spans of every Buffer set up or called inside the block; on exit write
    each rank's file and (the process of rank 0) merge them into ``path``.

    Works around any program, a torchrun one too: every rank enters the block and writes its
    own file; rank 0 waits for the others' (``merge_timeout_s``) and merges. A rank's
    engine keeps the last ``capacity`` spans per core.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise InvalidArgumentError("capacity", capacity, "must be a positive integer")
    rec = Recorder(Path(path), capacity)
    with _lock:
        _recorders.append(rec)
        live = [b for b in _buffers if not b._closed]
    for b in live:  # already set up: trace from here on
        _enable(b, max(capacity, getattr(b, "_trace_capacity", 0)))
    try:
        yield rec
    finally:
        with _lock:
            _recorders.remove(rec)
            live = [b for b in _buffers if not b._closed]
            others = bool(_recorders)
        for b in live:
            if getattr(b, "_trace_capacity", 0):
                _take(b, [rec])
                if not (others or b.config.trace):  # traced for this block only: off again
                    b.engine.trace_enable(0)
                    b._trace_capacity = 0
        _write(rec, merge_timeout_s)


def _aligned(rec: Recorder, timeout_s: float) -> list[tuple[Trace, _Place]]:
    """The recorded traces on rank 0's clock: a group whose ranks span hosts (``ubep.mpi``)
    measures each rank's clock against its rank 0's (collective; groups in the order of their
    ``group_id``, which every member sees alike); other groups share one host's clock."""
    groups = {id(p.group): p.group for _, p in rec.traces
              if getattr(p.group, "clock_offset", None) is not None}
    offsets: dict[int, int] = {}
    for key, group in sorted(groups.items(), key=lambda kv: bytes(kv[1].group_id)):
        try:
            got = group.clock_offset(timeout_s)
        except UbepError:  # the group was closed inside the block: its ranks' own clocks
            got = None
        if got is None:
            warnings.warn(f"ubep.trace: rank {group.rank}'s clock could not be measured "
                          f"against rank 0's in {timeout_s} s: its spans stay on its host's "
                          f"clock", RuntimeWarning, stacklevel=4)
        offsets[key] = 0 if got is None else got.offset_ns
    return [(_shifted(t, offsets.get(id(p.group), 0)), p) for t, p in rec.traces]


def _shifted(t: Trace, offset_ns: int) -> Trace:
    if not offset_ns:
        return t
    return Trace(t.source, t.label,
                 tuple(dataclasses.replace(s, start_ns=s.start_ns + offset_ns,
                                           end_ns=s.end_ns + offset_ns) for s in t.spans),
                 tuple(dataclasses.replace(c, start_ns=c.start_ns + offset_ns,
                                           end_ns=c.end_ns + offset_ns) for c in t.calls))


def _write(rec: Recorder, merge_timeout_s: float) -> None:
    from .chrome import join, merge, write

    by_rank: dict[int, list[Trace]] = {r: [] for r in _own_world_ranks()}
    world_size = 0
    for t, place in _aligned(rec, merge_timeout_s):
        world_size = max(world_size, place.world_size)
        for r in t.ranks():
            by_rank.setdefault(place.world_ranks[r], []).append(_only_rank(t, r))
    for r in sorted({c.rank for c in rec.work}):  # ranks already in the world's numbering
        world_size = max(world_size, r + 1)
        by_rank.setdefault(r, []).append(
            Trace("runtime", WORK_LABEL, (), tuple(c for c in rec.work if c.rank == r)))
    for r, traces in by_rank.items():
        tmp = rec.rank_path(r).with_suffix(".tmp")
        write(join(traces, runs_apart=False), tmp)
        os.replace(tmp, rec.rank_path(r))  # whole or absent: rank 0 never reads half a file
    if 0 not in by_rank:
        return
    files = [rec.rank_path(r) for r in range(max(world_size, _world_size()))]
    deadline = time.monotonic() + merge_timeout_s
    while not all(f.exists() for f in files) and time.monotonic() < deadline:
        time.sleep(0.02)
    present = [f for f in files if f.exists()]
    merge(present, rec.path)
    for f in present:
        f.unlink()


def _own_world_ranks() -> list[int]:
    """This process's torch.distributed world rank (a rank that traced nothing still writes
    its file, so rank 0 does not wait for it); none outside torch.distributed."""
    dist = _torch_dist()
    return [int(dist.get_rank())] if dist is not None else []


def _world_size() -> int:
    dist = _torch_dist()
    return int(dist.get_world_size()) if dist is not None else 0


def _torch_dist() -> Any:
    """``torch.distributed`` when this process has imported torch and joined a process group;
    else None (never imports torch itself)."""
    import sys

    if "torch.distributed" not in sys.modules:
        return None
    dist = sys.modules["torch.distributed"]
    return dist if dist.is_available() and dist.is_initialized() else None


def _only_rank(t: Trace, rank: int) -> Trace:
    return Trace(t.source, t.label, tuple(s for s in t.spans if s.rank == rank),
                 tuple(c for c in t.calls if c.rank == rank))
