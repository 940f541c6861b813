"""Results of one simulated operator call: per-core, per-task timelines and per-unit times.

Both executors return a :class:`SimResult`. The timeline is stored column-wise (one row per
(rank, core, task occurrence)) because an EP256 x 48-core run has tens of thousands of rows;
:meth:`TaskTimeline.spans` turns a slice of it into :class:`TaskSpan` objects for reading.

The executors' timeline holds one ``send`` and one ``consume`` span per core, which is what the
figures read. :meth:`SimResult.unit_timeline` cuts those spans into the units a core sent and
the rows it consumed, each naming its Plan unit, peer rank, rows and payload bytes as the
runtime's spans do (``ubep.trace``); it is built only when asked, off the executors' hot path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ..errors import InvalidArgumentError
from .order import lex_order

if TYPE_CHECKING:
    from .spec import OpSpec

__all__ = ["SYNC_TASKS", "TASKS", "SimResult", "TaskSpan", "TaskTimeline"]

# Task names. "flag" is BSP's SendFlag & TokenCnt; "count" is ASP's TokenCnt-Sending; "consume"
# is Token-Reordering (dispatch) or the weighted reduction (combine); "route" and "checksum" are
# the work of the cores an ASP rank gives to routing and the global checksum (sim/preprocess.py).
TASKS = ("init", "send", "barrier", "flag", "verify", "count", "cumsum", "consume", "route",
         "checksum")
# Tasks that exist only to synchronise (the "BSP cost" of Figure 7).
SYNC_TASKS = ("barrier", "flag", "verify")


@dataclass(frozen=True)
class TaskSpan:
    """One task occurrence on one core (what it moved: :meth:`SimResult.unit_timeline`)."""

    rank: int
    core: int
    task: str
    start_ns: float
    end_ns: float

    @property
    def duration_ns(self) -> float:
        return self.end_ns - self.start_ns


@dataclass(frozen=True)
class TaskTimeline:
    """Column store of task spans: ``rank, core, task`` (index into :data:`TASKS`), times, and
    what a span moved: ``unit`` (a send's index in its rank's Plan, BSP the first of a run of
    units; a consumed row's unit in its sender's Plan; else -1), ``peer`` (a send's
    destination, a consumed row's source; else -1), ``rows`` and payload ``size_bytes`` (0 for
    the tasks that move no rows, and for the executors' per-core spans, which leave the
    detail to :meth:`SimResult.unit_timeline`)."""

    # the names of the task codes, read by ubep.trace.spans (which imports nothing of sim)
    task_names: ClassVar[tuple[str, ...]] = TASKS

    rank: np.ndarray
    core: np.ndarray
    task: np.ndarray
    start_ns: np.ndarray
    end_ns: np.ndarray
    unit: np.ndarray
    peer: np.ndarray
    rows: np.ndarray
    size_bytes: np.ndarray

    @staticmethod
    def build(
        parts: list[tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    ) -> TaskTimeline:
        """From ``(task, rank, core, start, end)`` array groups, sorted by (rank, core, start);
        no span names a unit, peer or rows."""
        if not parts:
            empty = np.zeros(0)
            return TaskTimeline(empty.astype(np.int32), empty.astype(np.int32),
                                empty.astype(np.int8), empty, empty, *_no_detail(0))
        rank = np.concatenate([np.asarray(p[1], dtype=np.int32) for p in parts])
        core = np.concatenate([np.asarray(p[2], dtype=np.int32) for p in parts])
        task = np.concatenate(
            [np.full(np.size(p[1]), TASKS.index(p[0]), dtype=np.int8) for p in parts]
        )
        start = np.concatenate([np.asarray(p[3], dtype=np.float64) for p in parts])
        end = np.concatenate([np.asarray(p[4], dtype=np.float64) for p in parts])
        order = np.lexsort((task, start, core, rank))
        return TaskTimeline(rank[order], core[order], task[order], start[order], end[order],
                            *_no_detail(rank.size))

    def __len__(self) -> int:
        return int(self.rank.size)

    def mask(self, *, rank: int | None = None, core: int | None = None,
             task: str | None = None) -> np.ndarray:
        m = np.ones(self.rank.size, dtype=bool)
        if rank is not None:
            m &= self.rank == rank
        if core is not None:
            m &= self.core == core
        if task is not None:
            if task not in TASKS:
                raise InvalidArgumentError("task", task, f"must be one of {TASKS}")
            m &= self.task == TASKS.index(task)
        return m

    def spans(self, *, rank: int | None = None, core: int | None = None,
              task: str | None = None) -> list[TaskSpan]:
        idx = np.flatnonzero(self.mask(rank=rank, core=core, task=task))
        return [TaskSpan(int(self.rank[i]), int(self.core[i]), TASKS[self.task[i]],
                         float(self.start_ns[i]), float(self.end_ns[i])) for i in idx]

    def busy_ns(self, *, rank: int, task: str) -> float:
        """Sum over cores of the time rank ``rank`` spends in ``task``."""
        m = self.mask(rank=rank, task=task)
        return float(np.sum(self.end_ns[m] - self.start_ns[m]))


@dataclass(frozen=True)
class SimResult:
    """One simulated operator call.

    Attributes:
        op, engine, sync, mode: what was simulated and by which executor.
        latency_ns: operator latency (the slowest rank's end).
        rank_end_ns: ``[num_ranks]`` when each rank's last core finished.
        timeline: per-core task spans.
        unit_end_ns: ``[U]`` when the issuing core finished each unit (spec unit order).
        unit_land_ns: ``[U]`` when the unit's last byte is in the receiver's memory.
        unit_ready_ns: ``[U]`` when the receiver may consume it (sync mode decides).
        core_send_end_ns: ``[num_ranks, num_send_cores]`` each send core's last issue.
        core_land_end_ns: ``[num_ranks, num_send_cores]`` when each send core's last unit landed.
        core_ack_end_ns: ``[num_ranks, num_send_cores]`` when the acknowledgement of each send
            core's last store is back: the core's stores are complete (program (1) of the
            paper: the sum of the core's issue times plus the round trip of its farthest row).
        core_rtt_ns: ``[num_ranks, num_send_cores]`` the largest round trip of each send core's
            rows (program (1)'s ``max_i RTT_i``): the row's occupancy of its rank's link
            (queueing behind other cores' rows and its own serialisation) plus ``2 L[h]``;
            0 for a core without units.
        core_rx_wait_ns: ``[num_ranks, num_send_cores]`` the mean, over each send core's rows,
            of a row's wait at its receiver's port (``land - depart - L[h]``: the queue every
            sender to that receiver shares; 0 for a hop-0 row and a core without units).
        item_end_ns: ``[I]`` when each receive item was consumed.
        consume_work_ns: ``[num_ranks]`` core time spent consuming items (without the waits
            for items to become ready that consume spans include).
        cores_per_rank: the AIVs of a rank (0: unknown, the cores that appear in the
            timeline); the per-AIV views count every one of them.
        spec: the :class:`~ubep.sim.spec.OpSpec` that was timed (which unit went where),
            read by :meth:`unit_timeline`; ``None`` for a result built without one.
    """

    op: str
    engine: str
    sync: str
    mode: str
    latency_ns: float
    rank_end_ns: np.ndarray
    timeline: TaskTimeline
    unit_end_ns: np.ndarray
    unit_land_ns: np.ndarray
    unit_ready_ns: np.ndarray
    core_send_end_ns: np.ndarray
    core_land_end_ns: np.ndarray
    item_end_ns: np.ndarray
    consume_work_ns: np.ndarray
    core_ack_end_ns: np.ndarray
    core_rtt_ns: np.ndarray
    core_rx_wait_ns: np.ndarray
    cores_per_rank: int = 0
    spec: OpSpec | None = None

    @property
    def slowest_rank(self) -> int:
        return int(np.argmax(self.rank_end_ns))

    def send_latency_ns(self, *, until: str = "issue") -> np.ndarray:
        """``[num_ranks, num_send_cores]`` per-core token-send latency (0 for a core without
        units): from the start of its send task until its last unit is issued
        (``until="issue"``, the core's own Token-Sending time), has landed (``"land"``,
        which adds flight and queueing at the receivers' ports), is acknowledged (``"ack"``)
        or, ``"rtt"``, program (1) of the paper: the core's issue time (``"issue"``: its rows'
        work and its own waits) plus the largest round trip of its rows through the rank's
        link (:attr:`core_rtt_ns`), without queueing at the receivers; ``"sent"``, Figure
        9's per-AIV token-send latency (docs/SIMULATOR.md 1.8): program (1) plus the mean wait
        of the core's rows at their receivers' ports (:attr:`core_rx_wait_ns`). Its own rows'
        hop mix sets the first term (their work, window waits and farthest round trip), the
        receivers' queues, which every core sending there shares, the second."""
        m = self.timeline.mask(task="send")
        start = np.zeros_like(self.core_land_end_ns)
        start[self.timeline.rank[m], self.timeline.core[m]] = self.timeline.start_ns[m]
        end = {"issue": self.core_send_end_ns, "land": self.core_land_end_ns,
               "ack": self.core_ack_end_ns,
               "rtt": np.where(self.core_send_end_ns > 0,
                               self.core_send_end_ns + self.core_rtt_ns, 0.0),
               "sent": np.where(self.core_send_end_ns > 0, self.core_send_end_ns
                                + self.core_rtt_ns + self.core_rx_wait_ns, 0.0)}.get(until)
        if end is None:
            raise InvalidArgumentError("until", until,
                                       "must be 'issue', 'land', 'ack', 'rtt' or 'sent'")
        return np.where(end > 0, end - start, 0.0)

    def unit_timeline(self) -> TaskTimeline:
        """:attr:`timeline` with each core's ``send`` span cut into what the core sent and each
        ``consume`` span into what it consumed, every piece naming its unit, peer, rows and
        payload bytes (the runtime's spans, ``ubep.trace``); the other spans as they are.

        Sends: ASP one span per unit (one row) in the core's issue order, ``unit`` its index in
        the sending rank's Plan; BSP one span per run of consecutive units to one destination
        (``unit`` the run's first, ``rows`` its length), as a runtime BSP core records its share
        of a destination. Consumes: a dispatch one span per row (``unit`` and ``peer``: its
        sender's Plan unit and rank), a combine one per token reduced (``rows``: the expert
        outputs summed). Each piece runs from the end of the one before it on its core (the
        first from the per-core span's start), so waits fold into the piece that follows them,
        as on the runtime's cores, and the pieces tile the per-core span. Built on each call
        (not on the executors' path); a result without its :attr:`spec` returns the timeline.
        """
        if self.spec is None:
            return self.timeline
        return _unit_timeline(self.timeline, self.spec, self.unit_end_ns, self.item_end_ns)

    def consume_wait_ns(self) -> np.ndarray:
        """``[R, n]`` the time each core waits inside its reordering: from the end of its
        other tasks (Init, sends, counting, barriers) to the end of its last row, less the
        rows' own work (the spec's item costs): the gap before its first row and the waits
        between rows, which the executors fold into the ``consume`` span (1.7) -- for rows
        not yet landed, a batch's flag or checksum, the prefix sums. This names them, as the
        runtime's traces record a ``wait``. 0 for a core that reorders nothing; needs
        :attr:`spec`."""
        if self.spec is None:
            raise InvalidArgumentError("spec", None, "needs the spec of the simulation")
        R, n = int(self.rank_end_ns.size), self.cores_per_rank
        tl = self.timeline
        cons = tl.task == TASKS.index("consume")
        avail = np.zeros((R, n))
        np.maximum.at(avail, (tl.rank[~cons], tl.core[~cons]), tl.end_ns[~cons])
        end = np.zeros((R, n))
        np.maximum.at(end, (tl.rank[cons], tl.core[cons]), tl.end_ns[cons])
        spec = self.spec
        work = np.zeros((R, n))
        np.add.at(work, (spec.item_rank, spec.item_core), spec.item_cost_ns)
        return np.where(end > 0, np.maximum(end - avail - work, 0.0), 0.0)

    def task_span_ns(self, rank: int | None = None) -> dict[str, float]:
        """Per task: wall time from its first start to its last end on ``rank`` (default: the
        slowest rank). Tasks overlap under ASP, so these do not add up to the latency."""
        r = self.slowest_rank if rank is None else rank
        out: dict[str, float] = {}
        for name in TASKS:
            m = self.timeline.mask(rank=r, task=name)
            if m.any():
                out[name] = float(self.timeline.end_ns[m].max() - self.timeline.start_ns[m].min())
        return out

    def _aivs(self, rank: int) -> int:
        m = self.timeline.rank == rank
        seen = int(self.timeline.core[m].max(initial=-1)) + 1
        return max(self.cores_per_rank, seen)

    def aiv_end_ns(self, rank: int | None = None) -> np.ndarray:
        """``[cores_per_rank]`` each AIV's time on ``rank`` (default: the slowest): from the
        call's start to the end of the AIV's last task (reordering included; a BSP core's
        tasks run to the last barrier and past it; an ASP routing and checksum AIV to the end
        of its checksum). An AIV without a task (a core no part of the engine uses) is 0."""
        r = self.slowest_rank if rank is None else rank
        out = np.zeros(self._aivs(r))
        m = self.timeline.rank == r
        np.maximum.at(out, self.timeline.core[m], self.timeline.end_ns[m])
        return out

    def aiv_sum_ns(self, rank: int | None = None) -> float:
        """Per-AIV time of Figures 7, 8 and 12: the sum over the rank's AIVs of
        :meth:`aiv_end_ns` (default: the slowest rank, whose end is the operator latency).
        Under BSP every AIV waits for the last one at each barrier, so this is about
        ``cores_per_rank x latency``; under ASP an AIV stops when its own tasks end."""
        return float(self.aiv_end_ns(rank).sum())

    def aiv_split_ns(self, rank: int | None = None) -> tuple[float, float]:
        """``(all_to_all_ns, other_ns)`` of :meth:`aiv_sum_ns`, summed over the rank's AIVs:
        all-to-all is the work of moving and ordering data (init, send, count, cumsum, routing
        and the reordering work without its waits), other = the AIV sum - all-to-all
        (barriers, flags, verification, the global checksum and every wait for data, other
        cores or other ranks)."""
        r = self.slowest_rank if rank is None else rank
        tl = self.timeline
        work = sum(tl.busy_ns(rank=r, task=t)
                   for t in ("init", "send", "count", "cumsum", "route"))
        work += float(self.consume_work_ns[r])
        total = self.aiv_sum_ns(r)
        return work, total - work


_SEND, _CONSUME = TASKS.index("send"), TASKS.index("consume")
_FIELDS = ("rank", "core", "task", "start_ns", "end_ns", "unit", "peer", "rows", "size_bytes")
_Columns = tuple[np.ndarray, ...]  # TaskTimeline's columns, in _FIELDS order


def _no_detail(size: int) -> _Columns:
    """The ``unit, peer, rows, size_bytes`` columns of spans that name none."""
    return (np.full(size, -1, dtype=np.int64), np.full(size, -1, dtype=np.int32),
            np.zeros(size, dtype=np.int64), np.zeros(size, dtype=np.int64))


def _unit_timeline(tl: TaskTimeline, spec: OpSpec, unit_end: np.ndarray,
                   item_end: np.ndarray) -> TaskTimeline:
    """:meth:`SimResult.unit_timeline`."""
    keep = (tl.task != _SEND) & (tl.task != _CONSUME)
    whole = tuple(getattr(tl, f)[keep] for f in _FIELDS)
    parts = [whole, _sends(tl, spec, unit_end), _consumes(tl, spec, item_end)]
    cols = [np.concatenate([p[i] for p in parts]) for i in range(len(_FIELDS))]
    rank, core, task, start = cols[:4]
    order = np.lexsort((task, start, core, rank))
    return TaskTimeline(*(c[order] for c in cols))


def _cell_times(tl: TaskTimeline, task: int, cells: int, width: int) -> np.ndarray:
    """``[cells]`` start of each core's span of ``task`` (cell ``rank * width + core``)."""
    out = np.zeros(cells)
    m = tl.task == task
    out[tl.rank[m].astype(np.int64) * width + tl.core[m]] = tl.start_ns[m]
    return out


def _back_to_back(ends: np.ndarray, first: np.ndarray,
                  first_start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(start, end)`` of pieces that follow one another on their core (``ends`` in the
    core's order, ``first`` marks each core's first piece, which starts at ``first_start``):
    each starts where the one before it ended; an end that float rounding put before its
    start moves up to it, so no piece runs backwards."""
    end = ends.astype(np.float64, copy=True)
    while True:
        start = np.where(first, first_start, np.concatenate(([0.0], end[:-1])))
        behind = end < start
        if not behind.any():
            return start, end
        end[behind] = start[behind]


def _plan_unit(spec: OpSpec, units: np.ndarray) -> np.ndarray:
    """Each spec unit's index in its sending rank's Plan (a rank's units are contiguous)."""
    first_of_rank = spec.core_ptr[spec.unit_src[units] * spec.num_send_cores]
    return units - first_of_rank


def _sends(tl: TaskTimeline, spec: OpSpec, unit_end: np.ndarray) -> _Columns:
    n_s, size = spec.num_send_cores, spec.num_units
    if size == 0:
        return _empty()
    cell = spec.unit_src * n_s + spec.unit_core
    first = np.zeros(size, dtype=bool)
    first[spec.core_ptr[:-1][spec.core_ptr[:-1] < size]] = True
    start, end = _back_to_back(unit_end, first,
                               _cell_times(tl, _SEND, spec.num_ranks * n_s, n_s)[cell])
    # a piece: one unit (ASP), or a run of units to one destination (BSP)
    piece = first.copy()
    if spec.engine == "bsp":
        piece[1:] |= spec.unit_dst[1:] != spec.unit_dst[:-1]
    else:
        piece[:] = True
    heads = np.flatnonzero(piece)
    tails = np.append(heads[1:], size) - 1
    rows = tails - heads + 1
    return (spec.unit_src[heads].astype(np.int32), spec.unit_core[heads].astype(np.int32),
            np.full(heads.size, _SEND, dtype=np.int8), start[heads], end[tails],
            _plan_unit(spec, heads), spec.unit_dst[heads].astype(np.int32),
            rows.astype(np.int64), rows * spec.row_bytes)


def _consumes(tl: TaskTimeline, spec: OpSpec, item_end: np.ndarray) -> _Columns:
    size, n = spec.num_items, spec.cores_per_rank
    if size == 0:
        return _empty()
    cell = spec.item_rank * n + spec.item_core
    order = lex_order((np.arange(size), item_end, cell))  # each core's items as it took them
    cell_o = cell[order]
    first = np.concatenate(([True], cell_o[1:] != cell_o[:-1]))
    start, end = _back_to_back(item_end[order], first,
                               _cell_times(tl, _CONSUME, spec.num_ranks * n, n)[cell_o])
    if spec.op == "dispatch":  # one row an item: name its unit and sender
        unit_of = np.empty(size, dtype=np.int64)
        unit_of[spec.unit_item] = np.arange(spec.num_units)
        units = unit_of[order]
        unit, peer = _plan_unit(spec, units), spec.unit_src[units].astype(np.int32)
        rows = np.ones(size, dtype=np.int64)
    else:  # a token's reduction over rows from several senders
        unit, peer = np.full(size, -1, dtype=np.int64), np.full(size, -1, dtype=np.int32)
        rows = np.bincount(spec.unit_item, minlength=size)[order].astype(np.int64)
    return (spec.item_rank[order].astype(np.int32), spec.item_core[order].astype(np.int32),
            np.full(size, _CONSUME, dtype=np.int8), start, end, unit, peer, rows,
            rows * spec.row_bytes)


def _empty() -> _Columns:
    none = np.zeros(0)
    return (none.astype(np.int32), none.astype(np.int32), none.astype(np.int8), none, none,
            *_no_detail(0))
