"""Event-driven executor: the model of docs/SIMULATOR.md, one event at a time.

The kernel (clock, events, processes) is :mod:`ubep.sim.des`. Two shared resources sit on top:
:class:`SharedEngine` (processor sharing of one rank's send cores, with the per-core speed
falling as more cores send at once) and :class:`Port` (a FIFO link end).

Every core of every rank is a process that walks its tasks exactly as the engine prescribes, so
this mode is meant for small cases and for checking :mod:`ubep.sim.analytic`, which computes the
same quantities in closed form. Events at the same instant run in priority order: ``NORMAL``
events (arrivals, completions) before ``LATE`` ones (ports and consumers choosing what to serve
next), so a choice sees everything that happened at that instant.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from functools import partial

import numpy as np

from ..topology import Topology
from .des import LATE, NORMAL, TIE_NS, Environment, Event, Process, ProcessGenerator, then, tie_key
from .fabric import FabricModel
from .spec import OpSpec, core_rx_wait_ns
from .syncs import sync_mode
from .timeline import SimResult, TaskTimeline

__all__ = [
    "LATE",
    "NORMAL",
    "TIE_NS",
    "Environment",
    "Event",
    "Port",
    "Process",
    "SharedEngine",
    "run_events",
    "then",
    "tie_key",
]


class SharedEngine:
    """Processor sharing: each of the ``k`` jobs in service progresses at ``speed(k)``."""

    def __init__(self, env: Environment, speed: Callable[[int], float]) -> None:
        self.env = env
        self.speed = speed
        self.remaining: dict[Event, float] = {}
        self._last = 0.0
        self._version = 0

    def work(self, amount: float) -> Event:
        self._advance()
        done = self.env.event()
        self.remaining[done] = amount
        self._reschedule()
        return done

    def _advance(self) -> None:
        if self.remaining:
            progress = (self.env.now - self._last) * self.speed(len(self.remaining))
            for job in self.remaining:
                self.remaining[job] -= progress
        self._last = self.env.now

    def _reschedule(self) -> None:
        self._version += 1
        if not self.remaining:
            return
        version = self._version
        wait = max(0.0, min(self.remaining.values())) / self.speed(len(self.remaining))
        then(self.env.timeout(wait), partial(self._on_timer, version))

    def _on_timer(self, version: int) -> None:
        if version != self._version:  # superseded by a later arrival or departure
            return
        self._advance()
        scale = max(1.0, max(abs(v) for v in self.remaining.values()))
        for job in [j for j, left in self.remaining.items() if left <= 1e-9 * scale]:
            del self.remaining[job]
            job.succeed()
        self._reschedule()


class Port:
    """A link end that passes rows in arrival order (ties: lower unit id first).

    Store-and-forward: ``d_i = max(a_i, d_{i-1}) + s_i``. Cut-through: ``d_i = max(a_i,
    d_{i-1} + s_i)`` (the row's bytes were already serialised upstream).
    """

    def __init__(self, env: Environment, cut_through: bool) -> None:
        self.env = env
        self.cut_through = cut_through
        self._waiting: list[tuple[int, int, float, float, Event]] = []
        self._last = -np.inf
        self._kicked = False

    def send(self, uid: int, service_ns: float) -> Event:
        done = self.env.event()
        now = self.env.now
        self._waiting.append((tie_key(now), uid, now, service_ns, done))
        if not self._kicked:
            # Decide a moment later, so that every row arriving "now" competes in uid order.
            self._kicked = True
            kick = self.env.timeout(TIE_NS, LATE)
            kick.callbacks.append(self._serve)
        return done

    def _serve(self, _ev: Event) -> None:
        self._kicked = False
        for _key, _uid, arrive, service, done in sorted(self._waiting, key=lambda w: w[:2]):
            if self.cut_through:
                self._last = max(arrive, self._last + service)
            else:
                self._last = max(arrive, self._last) + service
            # Fire at the exact departure time (the decision came TIE_NS late; never earlier
            # than now) and hand the exact time on as the event's value.
            then(self.env.at(self._last), partial(done.succeed, self._last))
        self._waiting.clear()


class _Consumer:
    """One core's queue of ready receive items, served earliest-ready first."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.queue: list[tuple[int, int, float]] = []
        self.wakeup: Event | None = None

    def push(self, item: int) -> None:
        heapq.heappush(self.queue, (tie_key(self.env.now), item, self.env.now))
        if self.wakeup is not None and not self.wakeup.triggered:
            self.wakeup.succeed(priority=LATE)


def run_events(spec: OpSpec, topology: Topology, fabric: FabricModel) -> SimResult:
    """Time ``spec`` by discrete-event simulation (small cases; see module docstring)."""
    return _EventRun(spec, topology, fabric).run()


class _EventRun:
    """All processes of one operator call."""

    def __init__(self, spec: OpSpec, topology: Topology, fabric: FabricModel) -> None:
        self.spec, self.topo, self.fab = spec, topology, fabric
        self.env = Environment()
        self.lat = np.asarray(topology.latency_ns, dtype=np.float64)
        self.bw = np.asarray(topology.bandwidth_gbps, dtype=np.float64)
        self.hops = topology.hop_matrix().astype(np.int64)
        R, n = spec.num_ranks, spec.cores_per_rank
        self.spans: list[tuple[str, int, int, float, float]] = []
        self.engines = [SharedEngine(self.env, lambda k: float(fabric.speed(k))) for _ in range(R)]
        self.egress = [Port(self.env, cut_through=False) for _ in range(R)]
        self.ingress = [Port(self.env, cut_through=True) for _ in range(R)]
        num_units, num_items = spec.num_units, spec.num_items
        self.unit_end = np.zeros(num_units)
        self.unit_land = np.zeros(num_units)
        self.unit_ready = np.zeros(num_units)
        self.item_end = np.zeros(num_items)
        self.core_send_end = np.zeros((R, spec.num_send_cores))
        self.core_land_end = np.zeros((R, spec.num_send_cores))
        self.core_ack_end = np.zeros((R, spec.num_send_cores))
        self.core_rtt = np.zeros((R, spec.num_send_cores))
        self.unit_depart = np.zeros(spec.num_units)
        self.rank_end = np.zeros(R)
        # Receive items: rows still missing, ready time so far, consumers per (rank, core).
        self.item_missing = np.bincount(spec.unit_item, minlength=num_items)
        self.item_ready = np.full(num_items, -np.inf)
        self.consumers = [[_Consumer(self.env) for _ in range(n)] for _ in range(R)]
        self.offsets_ready = [self.env.event() for _ in range(R)]
        if spec.op == "combine" or spec.engine == "bsp":
            for ev in self.offsets_ready:  # nothing to wait for (BSP: consume starts later)
                ev.succeed()
        # ASP DC / SW batches (one core's rows to one destination): rows still to land, and the
        # checksum / flag that follows the batch's last unit.
        self.batched = spec.engine == "asp" and bool(sync_mode(spec.sync).batch_signal)
        self.batch_left = dict(zip(*np.unique(spec.unit_batch, return_counts=True), strict=True))
        self.batch_signal = {int(b): -np.inf for b in self.batch_left}
        self.batch_units: dict[int, list[int]] = {}
        for u, b in enumerate(spec.unit_batch):
            self.batch_units.setdefault(int(b), []).append(u)
        self.acks_left = np.bincount(spec.unit_src, minlength=R)
        self.data_done = [self.env.event() for _ in range(R)]
        for r in range(R):
            if self.acks_left[r] == 0:
                self.data_done[r].succeed()
        # Flag / count words: entry events per receiver in scan order, grouped by poll core.
        self.entries: list[dict[int, list[Event]]] = [{} for _ in range(R)]
        self.entry_of: dict[tuple[int, int], Event] = {}
        for d in range(R):
            e = 0
            for s in range(R):
                for c in np.flatnonzero(spec.chunk_dst == d):
                    ev = self.env.event()
                    core = spec.poll_first + e % spec.poll_cores
                    self.entries[d].setdefault(core, []).append(ev)
                    self.entry_of[(s, int(c))] = ev
                    e += 1

    # -- helpers ---------------------------------------------------------------------------
    def span(self, task: str, rank: int, core: int, start: float) -> None:
        self.spans.append((task, rank, core, start, self.env.now))

    def units_of(self, rank: int, core: int) -> range:
        i = rank * self.spec.num_send_cores + core
        return range(int(self.spec.core_ptr[i]), int(self.spec.core_ptr[i + 1]))

    # -- data path -------------------------------------------------------------------------
    def send_core(self, r: int, j: int) -> ProcessGenerator:
        start = self.env.now
        units = self.units_of(r, j)
        stalled = 0.0  # the core's own stalls so far: they delay its later units (1.2)
        for u in units:
            yield self.engines[r].work(float(self.spec.unit_work_ns[u]))
            stalled += float(self.spec.unit_stall_ns[u])
            self.unit_end[u] = self.env.now + stalled
            if stalled:
                then(self.env.timeout(stalled), partial(self._issue, u))
            else:
                self._issue(u)
        if len(units):
            if stalled:
                yield self.env.timeout(stalled)
            self.core_send_end[r, j] = self.env.now
            self.span("send", r, j, start)

    def _issue(self, u: int, _ev: Event | None = None) -> None:
        self.env.process(self.fly(u))
        if self.batched and self._last_in_batch(u):
            lat = self.lat[self.spec.unit_hop[u]]
            then(self.env.timeout(lat), partial(self.batch_signal_at, int(self.spec.unit_batch[u])))

    def _last_in_batch(self, u: int) -> bool:
        # A batch is one core's rows to one destination: its last row is its highest unit.
        return self.batch_units[int(self.spec.unit_batch[u])][-1] == u

    def fly(self, u: int) -> ProcessGenerator:
        s = self.spec
        src, dst, hop = int(s.unit_src[u]), int(s.unit_dst[u]), int(s.unit_hop[u])
        j = int(s.unit_core[u])
        if hop == 0:
            rtt = 2.0 * self.lat[0]
            self.core_rtt[src, j] = max(self.core_rtt[src, j], rtt)
            yield self.env.timeout(self.lat[0])
            land = self.env.now
        else:
            service = float(s.unit_wire_bytes[u]) / self.bw[hop]
            depart = yield self.egress[src].send(u, service)
            # program (1)'s round trip: link occupancy (depart - issue) + out and back
            rtt = depart - self.unit_end[u] + 2.0 * self.lat[hop]
            self.core_rtt[src, j] = max(self.core_rtt[src, j], rtt)
            yield self.env.at(depart + self.lat[hop])
            land = yield self.ingress[dst].send(u, service)
            yield self.env.at(land)
            self.unit_depart[u] = depart
        self.unit_land[u] = land
        self.core_land_end[src, j] = max(self.core_land_end[src, j], self.env.now)
        if s.engine == "asp":  # an ASP rank is done once its own writes have landed, too
            self.rank_end[src] = max(self.rank_end[src], self.env.now)
        self.landed(u)
        yield self.env.timeout(self.lat[hop])  # the acknowledgement travels back
        self.core_ack_end[src, j] = max(self.core_ack_end[src, j], self.env.now)
        self.acked(u)

    def landed(self, u: int) -> None:
        b = int(self.spec.unit_batch[u])
        if self.batched:
            self.batch_left[b] -= 1
            self.try_release(b)
        else:
            self.row_ready(u)

    def acked(self, u: int) -> None:
        src = int(self.spec.unit_src[u])
        self.acks_left[src] -= 1
        if self.acks_left[src] == 0:
            self.data_done[src].succeed()

    def batch_signal_at(self, b: int) -> None:
        self.batch_signal[b] = self.env.now
        self.try_release(b)

    def try_release(self, b: int) -> None:
        if self.batch_left[b] == 0 and self.batch_signal[b] > -np.inf:
            self.release(b)

    def release(self, b: int) -> None:
        for u in self.batch_units[b]:
            self.row_ready(u)

    def row_ready(self, u: int) -> None:
        self.unit_ready[u] = self.env.now
        i = int(self.spec.unit_item[u])
        self.item_ready[i] = max(self.item_ready[i], self.env.now)
        self.item_missing[i] -= 1
        if self.item_missing[i] == 0:
            rank = int(self.spec.item_rank[i])
            offsets = self.offsets_ready[rank]
            if offsets.processed:
                self.consumers[rank][int(self.spec.item_core[i])].push(i)
            else:
                then(offsets, partial(self._push_later, i, rank))

    def _push_later(self, i: int, rank: int) -> None:
        self.item_ready[i] = max(self.item_ready[i], self.env.now)
        self.consumers[rank][int(self.spec.item_core[i])].push(i)

    # -- control path ----------------------------------------------------------------------
    def write_words(self, r: int, core: int) -> ProcessGenerator:
        """Count (and flag) words of one core, at their offsets from the phase start."""
        start = self.env.now
        chunks = np.flatnonzero(self.spec.chunk_core == core)
        for c in chunks:
            yield self.env.at(start + float(self.spec.chunk_offset_ns[r, c]))
            d = int(self.spec.chunk_dst[c])
            entry = self.entry_of[(r, int(c))]
            then(self.env.timeout(self.lat[self.hops[r, d]]), entry.succeed)

    def poll(self, r: int, core: int) -> ProcessGenerator:
        """Stop-and-wait scan of this core's entries in their static order, ``poll_lanes``
        entries per poll."""
        entries = self.entries[r].get(core, [])
        lanes = int(self.fab.poll_lanes)
        for first in range(0, len(entries), lanes):
            for ev in entries[first:first + lanes]:
                if not ev.processed:
                    yield ev
            yield self.env.timeout(self.fab.poll_ns)

    def consume(self, r: int, core: int) -> ProcessGenerator:
        s = self.spec
        todo = int(np.count_nonzero((s.item_rank == r) & (s.item_core == core)))
        me = self.consumers[r][core]
        first, free = np.inf, self.env.now
        for _ in range(todo):
            if not me.queue:
                me.wakeup = self.env.event()
                yield me.wakeup
            # Let every item that is ready "now" join before choosing (see TIE_NS); the start
            # time is still computed exactly from the item's ready time.
            yield self.env.timeout(TIE_NS, LATE)
            _, item, ready = heapq.heappop(me.queue)
            start = max(free, ready)
            first = min(first, start)
            free = start + float(s.item_cost_ns[item])
            yield self.env.at(free)
            self.item_end[item] = free
        if todo:
            self.spans.append(("consume", r, core, first, free))

    # -- engines ---------------------------------------------------------------------------
    def bsp_core(self, r: int, j: int, barrier: list[Event], arrived: list[int],
                 ranks: range) -> ProcessGenerator:
        yield from self.init(r, j)
        if j < self.spec.num_send_cores:
            yield self.env.process(self.send_core(r, j))
        for phase in range(2):
            t = self.env.now
            arrived[phase] += 1
            if arrived[phase] == self.spec.cores_per_rank * len(ranks):
                self.env.process(self.bsp_barrier(ranks, phase, barrier))
            yield barrier[phase]
            self.span("barrier", r, j, t)
            if phase == 0:
                yield from self.timed("flag", r, j, self.env.process(self.write_words(r, j)))
                yield from self.timed("verify", r, j, self.env.process(self.poll(r, j)))
        if self.spec.cumsum_ns > 0:
            yield from self.timed("cumsum", r, j, self.env.timeout(self.spec.cumsum_ns))
        yield self.env.process(self.consume(r, j))
        self.rank_end[r] = max(self.rank_end[r], self.env.now)

    def bsp_barrier(self, ranks: range, phase: int, barrier: list[Event]) -> ProcessGenerator:
        # ``ranks``: the ranks whose cores the SyncAll joins (one, or every rank if global)
        for r in ranks:
            if phase == 0 and not self.data_done[r].processed:
                yield self.data_done[r]  # SyncAll also waits until every write is acknowledged
        yield self.env.timeout(self.fab.syncall_ns(self.topo))
        barrier[phase].succeed()

    def init(self, r: int, j: int) -> ProcessGenerator:
        """Every core's Init phase, from the call's start (``yield from``: no extra event)."""
        yield from self.timed("init", r, j, self.env.timeout(self.fab.init_ns))

    def timed(self, task: str, r: int, j: int, until: Event) -> ProcessGenerator:
        """Wait for ``until`` (a sub-process or a timeout started now) on core ``j`` of rank
        ``r`` and record the wait as one ``task`` span (``yield from``: no extra event)."""
        t = self.env.now
        yield until
        self.span(task, r, j, t)

    def asp_send(self, r: int, j: int) -> ProcessGenerator:
        yield from self.init(r, j)
        yield self.env.process(self.send_core(r, j))
        yield self.env.process(self.consume(r, j))
        self.rank_end[r] = max(self.rank_end[r], self.env.now)

    def asp_count(self, r: int, j: int, polled: list[Event]) -> ProcessGenerator:
        yield from self.init(r, j)
        if self.spec.chunk_core.size:
            yield from self.timed("count", r, j, self.env.process(self.write_words(r, j)))
            yield from self.timed("verify", r, j, self.env.process(self.poll(r, j)))
            polled[j - self.spec.num_send_cores].succeed()
            if j == self.spec.num_send_cores:  # count core 0 builds the prefix sums
                for ev in polled:
                    if not ev.processed:
                        yield ev
                yield from self.timed("cumsum", r, j, self.env.timeout(self.spec.cumsum_ns))
                self.offsets_ready[r].succeed()
        yield self.env.process(self.consume(r, j))
        self.rank_end[r] = max(self.rank_end[r], self.env.now)

    def run(self) -> SimResult:
        s, env = self.spec, self.env
        R = s.num_ranks
        shared = ([env.event(), env.event()], [0, 0]) if self.fab.syncall_global else None
        for r in range(R):
            if s.engine == "bsp":
                barrier, arrived = shared or ([env.event(), env.event()], [0, 0])
                joined = range(R) if shared else range(r, r + 1)
                for j in range(s.cores_per_rank):
                    env.process(self.bsp_core(r, j, barrier, arrived, joined))
            else:
                for j in range(s.num_send_cores):
                    env.process(self.asp_send(r, j))
                polled = [env.event() for _ in range(s.num_count_cores)]
                for j in range(s.num_send_cores, s.consume_cores):
                    env.process(self.asp_count(r, j, polled))
        env.run()
        by_task: dict[str, list[tuple[int, int, float, float]]] = {}
        for task, r, c, a, b in self.spans:
            by_task.setdefault(task, []).append((r, c, a, b))
        timeline = TaskTimeline.build([
            (task, *(np.array(col) for col in zip(*rows, strict=True)))  # type: ignore[misc]
            for task, rows in by_task.items()
        ])
        consume_work = np.bincount(s.item_rank, weights=s.item_cost_ns, minlength=R)
        return SimResult(
            op=s.op, engine=s.engine, sync=s.sync, mode="events",
            latency_ns=float(self.rank_end.max(initial=0.0)), rank_end_ns=self.rank_end,
            timeline=timeline, unit_end_ns=self.unit_end, unit_land_ns=self.unit_land,
            unit_ready_ns=self.unit_ready, core_send_end_ns=self.core_send_end,
            core_land_end_ns=self.core_land_end, item_end_ns=self.item_end,
            consume_work_ns=consume_work, core_ack_end_ns=self.core_ack_end,
            core_rtt_ns=self.core_rtt,
            core_rx_wait_ns=core_rx_wait_ns(s, self.topo, self.unit_land, self.unit_depart),
            cores_per_rank=s.cores_per_rank, spec=s,
        )
