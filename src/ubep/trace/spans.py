"""The one timeline schema: a span is one task one core ran, on one clock.

Both producers fill it: the simulator from its :class:`~ubep.sim.timeline.SimResult` (predicted
times on a modelled fabric), the runtime from its engines' per-core rings (measured times on the
host's monotonic clock, shared by every rank of a host). So a measured call and a predicted
call of the same case compare task by task.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidArgumentError

__all__ = ["TASK_KINDS", "CallSpan", "Span", "Trace", "from_sim"]

#: What a core does, in both producers. ``send`` moves rows of one unit to one peer; ``wait``
#: is a flag or data-as-flag wait; ``reorder`` places received rows (dispatch) and ``reduce``
#: sums expert outputs (combine); ``barrier``, ``flag`` and ``verify`` exist only to synchronise
#: (the BSP cost); ``route`` and ``checksum`` are the preprocessing of the cores set aside for
#: them (the runtime's ``checksum`` checks rows against their senders' sums); ``init`` is a
#: call's set-up; ``cumsum`` turns counts into positions (and writes the receive metadata);
#: ``quant`` quantises rows before they are sent and ``copy`` puts combine's expert outputs
#: where peers read them (the runtime only). The native engine numbers its kinds in this order.
TASK_KINDS = ("init", "count", "cumsum", "verify", "send", "wait", "flag", "barrier", "reorder",
              "reduce", "route", "checksum", "quant", "copy")

# the simulator's task names (ubep.sim.timeline.TASKS) in this schema's kinds; its "consume" is
# a dispatch's reorder and a combine's reduce
_SIM_KIND = {"consume": "reorder", "init": "init", "send": "send", "barrier": "barrier",
             "flag": "flag", "verify": "verify", "count": "count", "cumsum": "cumsum",
             "route": "route", "checksum": "checksum"}


@dataclass(frozen=True)
class Span:
    """One task occurrence on one core.

    Attributes:
        rank, core: where it ran (a core is a thread of the runtime, an AIV of the simulator).
        task: one of :data:`TASK_KINDS`.
        start_ns, end_ns: on the trace's clock (the runtime: the host's monotonic clock; the
            simulator: ns from the call's start).
        unit: a ``send``'s unit (the runtime: its index in the Plan, or in the engine's
            per-destination buckets; BSP: the first of the core's share), else -1.
        peer: the other rank (destination of a ``send``, source of a ``wait`` or ``reorder``,
            destination of a ``count``), else -1.
        rows, size_bytes: rows and payload bytes the task moved or read.
    """

    rank: int
    core: int
    task: str
    start_ns: float
    end_ns: float
    unit: int = -1
    peer: int = -1
    rows: int = 0
    size_bytes: int = 0

    def __post_init__(self) -> None:
        if self.task not in TASK_KINDS:
            raise InvalidArgumentError("task", self.task, f"must be one of {TASK_KINDS}")
        if self.end_ns < self.start_ns:
            raise InvalidArgumentError("end_ns", self.end_ns, f"is before start_ns={self.start_ns}")

    @property
    def duration_ns(self) -> float:
        return self.end_ns - self.start_ns


@dataclass(frozen=True)
class CallSpan:
    """One call (``dispatch`` or ``combine``) on one rank: the span that encloses its tasks."""

    rank: int
    name: str
    start_ns: float
    end_ns: float


@dataclass(frozen=True)
class Trace:
    """The spans of one or more calls, from one producer.

    Attributes:
        source: ``"runtime"`` (measured) or ``"sim"`` (predicted).
        label: what ran (``"asp/tff dispatch"``, ``"cm384 fig9 hierarchical"``); names the
            processes of an exported trace.
        spans: every task span.
        calls: every call span.
    """

    source: str
    label: str
    spans: tuple[Span, ...]
    calls: tuple[CallSpan, ...] = field(default=())

    def ranks(self) -> list[int]:
        return sorted({s.rank for s in self.spans} | {c.rank for c in self.calls})

    def by_core(self) -> dict[tuple[int, int], list[Span]]:
        """``(rank, core) -> spans`` in start order."""
        out: dict[tuple[int, int], list[Span]] = defaultdict(list)
        for s in sorted(self.spans, key=lambda s: (s.rank, s.core, s.start_ns, s.end_ns)):
            out[(s.rank, s.core)].append(s)
        return dict(out)

    def busy_ns(self) -> dict[tuple[int, int, str], float]:
        """``(rank, core, task) -> total ns``: the per-task durations compared between a
        measured and a predicted trace."""
        out: dict[tuple[int, int, str], float] = defaultdict(float)
        for s in self.spans:
            out[(s.rank, s.core, s.task)] += s.duration_ns
        return dict(out)


def from_sim(result: Any, label: str, *, units: bool = True) -> Trace:
    """The simulator's timeline of one call (a :class:`ubep.sim.timeline.SimResult`) in this
    schema: its :meth:`~ubep.sim.timeline.SimResult.unit_timeline`, whose sends name their Plan
    unit, destination, rows and bytes and whose receives the unit and source of the row they
    consumed (so exported flows join them); ``units=False``: its per-core timeline (one send
    and one receive span per core, naming none: a span per row of a large call is too many).
    Its call span on each rank runs from 0 to the rank's end. The timeline names its own task
    codes (``task_names``): the schema sits below the simulator and imports nothing of it."""
    name = str(getattr(result, "op", "call"))
    tl = result.unit_timeline() if units else result.timeline
    kinds = [_SIM_KIND[t] for t in tl.task_names]
    if name == "combine":
        kinds[tl.task_names.index("consume")] = "reduce"
    spans = tuple(
        Span(rank, core, kinds[task], start, end, unit, peer, rows, size)
        for rank, core, task, start, end, unit, peer, rows, size in zip(
            tl.rank.tolist(), tl.core.tolist(), tl.task.tolist(), tl.start_ns.tolist(),
            tl.end_ns.tolist(), tl.unit.tolist(), tl.peer.tolist(), tl.rows.tolist(),
            tl.size_bytes.tolist(), strict=True)
    )
    calls = tuple(CallSpan(r, name, 0.0, float(end))
                  for r, end in enumerate(getattr(result, "rank_end_ns", [])))
    return Trace("sim", label, spans, calls)
