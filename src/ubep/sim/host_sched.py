"""Ranks that share CPUs, run to block: the host model's executor of one call's tasks, rank by rank.

On this host a call's ranks often get fewer CPUs than there are ranks (2 CPUs shared with other
processes; 4 ranks on 2 CPUs). The scheduler's slices (milliseconds) are longer than a call's
phases, and a rank that waits spins briefly, yields, then sleeps on its doorbell, so a CPU runs
one rank until that rank must wait for a peer, then the next runnable rank: the runtime's traces
show the ranks of one CPU one after another (a rank's wait for a peer's readiness ends when the
peer, on the same CPU, has sent all its rows), not side by side at a fraction of the speed.

So each rank's tasks are timed on their own (its rows, its destinations) and the waits come
out of the schedule: a rank's wait is the work of the ranks that ran on its CPU before the
peer it waits for was done. With a CPU per rank the same executor runs the ranks side by side
and a rank waits only for its peers' own work.

The tasks of one call (docs/FORMATS.md, runtime/native/phases.c):

* ASP: ``init`` (the call's set-up, which publishes this rank's readiness and its counts to
  every rank), then one ``send`` per destination in the canonical order ``r+1, ..., r``: a
  send to ``d`` needs ``d``'s readiness and every source's counts to ``d``, from which it
  places its rows (dispatch_send.c ``dst_ready``, ``compute_bases``), so a rank sends nothing,
  not even its own rows, before every rank's set-up; then ``cumsum`` (the receive's metadata
  from every source's counts and routing), then the receive: every peer's rows to this rank
  sent, then ``reorder`` (the rows' own work);
* BSP: ``init``, the ``send`` s (each needs the destination's readiness), a global barrier
  (every rank has sent; one flag latency after the last arrival), ``flag`` (counts and flags
  written, verified), a second barrier, then ``reorder``.

A wait that outlasts the runtime's yield window sleeps on its rank's doorbell (:class:`Doorbells`,
engine.h ``ring``, wait.c ``wait_step``): it ends a wake-up after its condition holds, and the
rank that publishes what a sleeper waits for pays the futex wake in its ring; a rank that slept
once stays registered for the rest of its call, so every later ring to it makes the system call.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..errors import InvalidArgumentError

__all__ = ["Doorbells", "RankWork", "SchedSpan", "back_to_back", "cpu_share", "cpus_for",
           "serialize"]


@dataclass(frozen=True)
class RankWork:
    """One rank's CPU work in one call (ns).

    Attributes:
        init_ns: the set-up before its sends (it publishes the rank's readiness).
        send_dst: destinations in send order; ``send_ns``: the work of each.
        reorder_ns: the received rows' work once they are all in (ASP) or after the second
            barrier (BSP).
        flag_ns: BSP's counts and flags between its barriers.
        cumsum_ns: ASP's receive metadata after its sends (dispatch.c ph_d_receive: every
            source's counts and routing read, its rows' origin written), once every peer has
            published them (its set-up); BSP's is part of its reorder.
    """

    init_ns: float
    send_dst: tuple[int, ...]
    send_ns: tuple[float, ...]
    reorder_ns: float
    flag_ns: float = 0.0
    cumsum_ns: float = 0.0


@dataclass(frozen=True)
class SchedSpan:
    """A task of one rank (ns from the call's start); ``peer``: a send's destination or what
    a wait waited for (-1: every rank, a barrier or the rows of every peer)."""

    rank: int
    task: str
    start_ns: float
    end_ns: float
    peer: int = -1


@dataclass(frozen=True)
class Doorbells:
    """The cost of a wait that outlasts its yield window (ns; benchmarks/host_wake.c).

    A waiting rank spins, yields for ``yield_ns`` (the runtime's ``UBEP_WAIT_YIELD_US``), then
    registers as a sleeper on its doorbell and sleeps in the kernel. Its wait ends
    ``wake_ns`` after the publication it waits for (the futex wake-up), and the rank that
    publishes pays ``ring_sleep_ns`` for each sleeper its ring reaches (the bell, then the wake
    system call). A rank registered once stays so until its call ends: a ring to it while it
    is awake costs ``ring_armed_ns`` (the system call, with no one to wake).

    Attributes:
        yield_ns: how long a wait spins and yields before it sleeps.
        wake_ns: a sleeper's wake-up, from the publication to it running again.
        ring_sleep_ns: a ring's cost to its publisher per peer asleep on it.
        ring_armed_ns: a ring's cost per peer registered as a sleeper but awake.
    """

    yield_ns: float
    wake_ns: float
    ring_sleep_ns: float
    ring_armed_ns: float

    def __post_init__(self) -> None:
        for name in ("yield_ns", "wake_ns", "ring_sleep_ns", "ring_armed_ns"):
            v = getattr(self, name)
            if not v >= 0:
                raise InvalidArgumentError(name, v, "must be >= 0")


def cpus_for(available: float, ranks: int) -> int:
    """Whole CPUs that ``ranks`` processes which measured ``available`` CPUs run on: the
    nearest whole number, at least 1, at most ``ranks``."""
    if not available > 0:
        raise InvalidArgumentError("available", available, "must be > 0")
    return max(1, min(ranks, int(available + 0.5)))


def cpu_share(available: float, cpus: int) -> float:
    """The share of each of its ``cpus`` CPUs that ranks which measured ``available`` CPUs get
    (``host_micro.cpus_available``): ``available / cpus``, at most 1. Other processes take the
    rest in time slices; a task of ``ns`` on such a CPU lasts ``ns / share`` on average. With the
    ranks at real-time priority (benchmarks/bench_host_tasks.py) it measures 1."""
    if not available > 0:
        raise InvalidArgumentError("available", available, "must be > 0")
    if cpus < 1:
        raise InvalidArgumentError("cpus", cpus, "must be >= 1")
    return min(1.0, float(available) / cpus)


class _Run:
    """The run-to-block schedule: ``free`` CPUs, a FIFO of runnable ranks, ranks blocked on a
    condition, and each rank's position in its task list."""

    def __init__(self, works: Sequence[RankWork], engine: str, cpus: int,
                 barrier_ns: float, share: float = 1.0,
                 start_ns: Sequence[float] | None = None,
                 doorbells: Doorbells | None = None) -> None:
        self.works, self.engine, self.barrier_ns = works, engine, float(barrier_ns)
        self.share = float(share)
        self.doorbells = doorbells
        self.armed: set[int] = set()  # ranks registered as sleepers (until their call ends)
        R = len(works)
        starts = [0.0] * R if start_ns is None else [float(t) for t in start_ns]
        self.step = [0] * R
        self.sent: list[set[int]] = [set() for _ in range(R)]  # sources done sending to r
        self.ready = [False] * R
        self.arrivals: list[set[int]] = [set(), set()]  # ranks at barrier 0 / 1
        self.release: list[float | None] = [None, None]
        self.spans: list[SchedSpan] = []
        self.blocked: dict[int, tuple[float, str, int]] = {}  # rank -> (since, task, peer)
        self.runnable: deque[tuple[int, float]] = deque((r, 0.0) for r in range(R)
                                                        if starts[r] <= 0.0)
        # (time, rank): ranks whose call starts later (a rank's call starts when it has ended
        # its previous one)
        self.starting = sorted((t, r) for r, t in enumerate(starts) if t > 0.0)
        self.queued: set[int] = set(range(R))  # runnable or about to run
        self.running: dict[int, tuple[str, int]] = {}  # rank -> (task, peer) it is running
        self.free = cpus
        self.events: list[tuple[float, int, int]] = []  # (time, seq, rank): a CPU's rank runs
        self.seq = 0
        self.barrier_at: list[tuple[float, int]] = []  # (time, which): barrier releases

    def tasks(self, r: int) -> list[tuple[str, float, int]]:
        """``(task, ns, peer)`` of rank ``r`` in order."""
        w = self.works[r]
        out = [("init", w.init_ns, -1)]
        out += [("send", ns, d) for d, ns in zip(w.send_dst, w.send_ns, strict=True)]
        if self.engine == "bsp":
            out += [("barrier", 0.0, 0), ("flag", w.flag_ns, -1), ("barrier", 0.0, 1)]
        else:
            if w.cumsum_ns > 0:
                out.append(("cumsum", w.cumsum_ns, -1))
            out += [("recv", 0.0, -1)]
        out.append(("reorder", w.reorder_ns, -1))
        return out

    def can_start(self, r: int, task: str, peer: int) -> bool:
        if task == "send":
            if self.engine == "asp":  # the destination's readiness and every source's counts
                return all(self.ready)  # to it, published in each source's set-up
            return peer == r or self.ready[peer]
        if task == "recv":
            return all(s in self.sent[r] for s in range(len(self.works))
                       if s != r and r in self.works[s].send_dst)
        if task == "barrier":
            return self.release[peer] is not None
        if task == "cumsum":  # every source's counts and routing, published in its set-up
            return all(self.ready)
        return True


def serialize(works: Sequence[RankWork], engine: str, cpus: int,
              barrier_ns: float = 0.0, share: float = 1.0,
              start_ns: Sequence[float] | None = None,
              doorbells: Doorbells | None = None) -> list[SchedSpan]:
    """The call's spans when its ranks share ``cpus`` CPUs and each runs until it must wait.

    Runnable ranks take a free CPU in the order they became runnable (rank order at the
    start); a rank runs its tasks back to back until one cannot start (a destination not
    ready, its rows not all sent, a barrier not released), waits (a ``wait`` or ``barrier``
    span from then until it runs again) and gives its CPU to the next runnable rank. A
    barrier releases ``barrier_ns`` after its last arrival. ``share``: the share of each CPU
    the ranks get (:func:`cpu_share`): a task of ``ns`` takes ``ns / share`` (the flag latency
    is measured as the ranks run, already at that share). ``start_ns``: when each rank's call
    starts (default: all at 0); a rank is runnable from then, after the ranks already
    runnable. ``doorbells`` (:class:`Doorbells`): a wait longer than its yield window sleeps,
    ends a wake-up after its condition holds and registers its rank until the call ends; a
    publication (a set-up's readiness, a destination's rows sent, BSP's flags, a barrier
    arrival) rings the ranks it concerns and its rank pays the ring (a span of the same task);
    ``None``: waits end as their condition holds, rings are free."""
    if engine not in ("asp", "bsp"):
        raise InvalidArgumentError("engine", engine, "must be 'asp' or 'bsp'")
    if cpus < 1:
        raise InvalidArgumentError("cpus", cpus, "must be >= 1")
    if not 0.0 < share <= 1.0:
        raise InvalidArgumentError("share", share, "must be in (0, 1]")
    if start_ns is not None and (len(start_ns) != len(works) or min(start_ns, default=0) < 0):
        raise InvalidArgumentError("start_ns", list(start_ns), "needs one time >= 0 per rank")
    run = _Run(works, engine, cpus, barrier_ns, share, start_ns, doorbells)
    now = 0.0
    _dispatch(run, now)
    while run.events or run.barrier_at or run.starting:
        t_ev = run.events[0][0] if run.events else float("inf")
        t_b = min(run.barrier_at)[0] if run.barrier_at else float("inf")
        t_s = run.starting[0][0] if run.starting else float("inf")
        if t_s < min(t_b, t_ev):
            now, r = run.starting.pop(0)
            run.runnable.append((r, now))
        elif t_b <= t_ev:
            now, which = min(run.barrier_at)
            run.barrier_at.remove((now, which))
            run.release[which] = now
            _wake(run, now)
        else:
            now, _, r = heapq.heappop(run.events)
            _step(run, r, now)
        _dispatch(run, now)
    if run.blocked:
        raise InvalidArgumentError("works", sorted(run.blocked), "never get what they wait for")
    return run.spans


def _dispatch(run: _Run, now: float) -> None:
    """Free CPUs take runnable ranks (FIFO)."""
    while run.free and run.runnable:
        r, since = run.runnable.popleft()
        run.free -= 1
        _push(run, max(now, since), r)


def _push(run: _Run, t: float, r: int) -> None:
    run.seq += 1
    heapq.heappush(run.events, (t, run.seq, r))


def _step(run: _Run, r: int, now: float) -> None:
    """Rank ``r`` is on a CPU at ``now``: its last task's effects land (readiness, rows sent),
    then its next task starts, or it waits and frees the CPU, or it is done."""
    tasks = run.tasks(r)
    done = run.running.pop(r, None)
    if done is not None:  # the task that just ended
        task, peer = done
        if task == "init":
            run.ready[r] = True
        elif task == "send":
            run.sent[peer].add(r)
        # its publication rings the ranks it concerns, as they are at this moment
        rung = {peer} - {r} if task == "send" else (
            set(range(len(run.works))) - {r} if task in ("init", "flag") else set())
        cost = _ring_ns(run, rung, now)
        _wake(run, now)
        if cost > 0:  # the ring is the end of the publishing task
            run.spans.append(SchedSpan(r, task, now, now + cost, peer))
            now += cost
    run.queued.discard(r)
    if r in run.blocked:  # back on a CPU: its wait ends now
        since, task, peer = run.blocked.pop(r)
        run.spans.append(SchedSpan(r, "barrier" if task == "barrier" else "wait", since, now,
                                   peer if task == "send" else -1))
    while run.step[r] < len(tasks):
        task, ns, peer = tasks[run.step[r]]
        if task == "barrier" and r not in run.arrivals[peer]:
            cost = _ring_ns(run, set(range(len(run.works))) - {r}, now)
            _arrive(run, r, peer, now)
            if cost > 0:  # its arrival rings every peer
                run.spans.append(SchedSpan(r, "barrier", now, now + cost, -1))
                now += cost
        if not run.can_start(r, task, peer):
            run.blocked[r] = (now, task, peer)
            run.free += 1
            return
        run.step[r] += 1
        if task in ("barrier", "recv"):
            continue
        end = now + ns / run.share
        run.spans.append(SchedSpan(r, task, now, end, peer))
        run.running[r] = (task, peer)
        _push(run, end, r)
        return
    run.free += 1


def _arrive(run: _Run, r: int, which: int, now: float) -> None:
    """``r`` reaches barrier ``which``; the last arrival schedules its release."""
    run.arrivals[which].add(r)
    if len(run.arrivals[which]) == len(run.works):
        run.barrier_at.append((now + run.barrier_ns, which))


def _asleep(run: _Run, r: int, now: float) -> bool:
    """Whether rank ``r`` waits past its yield window at ``now``: asleep on its doorbell."""
    if run.doorbells is None or r not in run.blocked:
        return False
    return now - run.blocked[r][0] > run.doorbells.yield_ns


def _ring_ns(run: _Run, rung: set[int], now: float) -> float:
    """What a ring of the ranks ``rung`` at ``now`` costs its publisher: the wake per rank
    asleep, the system call alone per rank registered but awake (:class:`Doorbells`)."""
    db = run.doorbells
    if db is None:
        return 0.0
    ns = 0.0
    for q in rung:
        if _asleep(run, q, now):
            ns += db.ring_sleep_ns
        elif q in run.armed:
            ns += db.ring_armed_ns
    return ns / run.share


def _wake(run: _Run, now: float) -> None:
    """Blocked ranks whose condition now holds become runnable (in rank order); a rank asleep
    (:func:`_asleep`) a wake-up later, and it stays registered."""
    for r in sorted(run.blocked):
        if r in run.queued:
            continue
        task, _, peer = run.tasks(r)[run.step[r]]
        if run.can_start(r, task, peer):
            run.queued.add(r)
            at = max(now, run.blocked[r][0])
            if run.doorbells is not None and _asleep(run, r, now):
                run.armed.add(r)
                bisect.insort(run.starting, (at + run.doorbells.wake_ns, r))
            else:
                run.runnable.append((r, at))


def back_to_back(works: Sequence[RankWork], engine: str, cpus: int, barrier_ns: float = 0.0,
                 share: float = 1.0, calls: int = 4, doorbells: Doorbells | None = None,
                 loop_gap_ns: float = 0.0) -> list[SchedSpan]:
    """The spans of one call in a loop of calls, each rank's next call starting as soon as it
    has ended its last (its exit and entry are in its ``init``): a rank that ends later (more
    rows received, a longer reorder) enters the next call later, and its peers wait for its
    readiness there, where calls that all start together would wait for nothing. ``calls``
    calls are run, each from the ranks' ends of the one before (relative to the earliest);
    returns the last, its times from the earliest rank's start. ``doorbells``: as
    :func:`serialize` (a rank's registration ends with its call). ``loop_gap_ns``: the
    caller's own work between two calls (the loop around them), which each rank runs on its
    CPU before its next call's set-up: part of its ``init`` span here; where ranks share a
    CPU, the other ranks' turn."""
    if calls < 1:
        raise InvalidArgumentError("calls", calls, "must be >= 1")
    if not loop_gap_ns >= 0:
        raise InvalidArgumentError("loop_gap_ns", loop_gap_ns, "must be >= 0")
    works = [replace(w, init_ns=w.init_ns + float(loop_gap_ns)) for w in works]
    starts = [0.0] * len(works)
    spans: list[SchedSpan] = []
    for _ in range(calls):
        spans = serialize(works, engine, cpus, barrier_ns, share, starts, doorbells)
        ends = [max((s.end_ns for s in spans if s.rank == r), default=starts[r])
                for r in range(len(works))]
        first = min(ends, default=0.0)
        starts = [e - first for e in ends]
    return spans
