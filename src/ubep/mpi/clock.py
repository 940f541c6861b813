"""Each rank's monotonic clock against rank 0's, for traces of ranks on several hosts.

Task spans are stamped on ``CLOCK_MONOTONIC``, one clock for every rank of a host but a clock
of its own on each host (its zero is that host's boot). To put the spans of a multi-host group
on one time line, every rank on another machine than rank 0 measures its clock's offset to rank
0's by ping-pong (Cristian's method, as NTP): it sends its time ``t0``, rank 0 answers with its
own ``t1`` at once, and the answer arrives at ``t2``. Rank 0's clock read ``t1`` somewhere in
``[t0, t2]`` of this rank's, so ``t1 - (t0 + t2) / 2`` is the offset, off by at most half the
round trip; of ``rounds`` tries, the one with the shortest round trip is kept. Ranks on rank
0's machine share its clock (offset 0, nothing sent).

Every message carries the measurement's sequence number and round, so a late rank's pings of
a measurement rank 0 gave up on are recognised and dropped by the next one. Every wait has the
deadline: a rank that does not come is skipped by rank 0 (its receive cancelled) and measures
nothing itself (``None``); nothing hangs and the group stays usable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import TimeoutError
from ..plane.control import Backoff, wait_until

__all__ = ["ClockOffset", "clock_offset"]

_TAG = 0x7C1C  # the group's private communicator carries no other point-to-point message
_ROUNDS = 16
# a ping-pong is a few microseconds on one machine and tens over TCP: spin, then yield
_BACKOFF = Backoff(spin_polls=20000, yield_s=0.05, sleep_slope=0.05)


@dataclass(frozen=True)
class ClockOffset:
    """This rank's clock against rank 0's: a time ``t`` on this rank's clock is
    ``t + offset_ns`` on rank 0's, within ``error_ns`` (half the best round trip; 0 on rank 0's
    machine)."""

    offset_ns: int
    error_ns: int


def clock_offset(group: Any, seq: int, *, timeout_s: float,
                 rounds: int = _ROUNDS,
                 clock: Callable[[], int] = time.monotonic_ns,
                 measured: list[int] | None = None) -> ClockOffset | None:
    """This rank's :class:`ClockOffset` (collective over ``group``, an ``MpiGroup``), or None
    where it could not be measured by the deadline. ``seq`` numbers the measurement (the same
    on every rank, a new one each time). ``measured``: the ranks that measure (default: those
    on another machine than rank 0); ``clock`` this rank's clock (tests shift it)."""
    hosts = group.hostnames
    ranks = ([r for r in range(group.num_ranks) if hosts[r] != hosts[0]]
             if measured is None else [r for r in measured if r != 0])
    deadline = time.monotonic() + timeout_s
    if group.rank == 0:
        for r in ranks:
            _serve(group, r, seq, rounds, deadline, clock)
        return ClockOffset(0, 0)
    if group.rank not in ranks:
        return ClockOffset(0, 0)
    return _measure(group, seq, rounds, deadline, clock)


def _measure(group: Any, seq: int, rounds: int, deadline: float,
             clock: Callable[[], int]) -> ClockOffset | None:
    best: ClockOffset | None = None
    reply = np.zeros(3, dtype=np.int64)
    for k in range(rounds):
        t0 = clock()
        ping = np.array([seq, k, t0], dtype=np.int64)
        sent = group.comm.Isend(ping, dest=0, tag=_TAG)
        if not _done(group, group.comm.Irecv(reply, source=0, tag=_TAG), deadline):
            group.tested(sent, "the clock ping-pong")()  # 24 bytes went eagerly: done locally
            return None
        t2 = clock()
        _done(group, sent, deadline, cancel=False)
        if reply[0] != seq or reply[1] != k:  # not an answer to this ping: nothing to learn
            continue
        sample = ClockOffset(int(reply[2]) - (t0 + t2) // 2, (t2 - t0 + 1) // 2)
        if best is None or sample.error_ns < best.error_ns:
            best = sample
    return best


def _serve(group: Any, r: int, seq: int, rounds: int, deadline: float,
           clock: Callable[[], int]) -> None:
    """Answer rank ``r``'s ``rounds`` pings of measurement ``seq`` (earlier ones' dropped)."""
    ping = np.zeros(3, dtype=np.int64)
    answered = 0
    while answered < rounds:
        if not _done(group, group.comm.Irecv(ping, source=r, tag=_TAG), deadline):
            return  # r did not come: it measures nothing, the others still can
        t1 = clock()
        if ping[0] != seq:
            continue  # a ping of a measurement given up on
        pong = np.array([seq, ping[1], t1], dtype=np.int64)
        _done(group, group.comm.Isend(pong, dest=r, tag=_TAG), deadline, cancel=False)
        answered += 1


def _done(group: Any, request: Any, deadline: float, *, cancel: bool = True) -> bool:
    """Wait for ``request`` until ``deadline``; False past it, a receive cancelled (a send of
    24 bytes completes locally: past the deadline it is left to MPI)."""
    def timed_out(waited_s: float) -> BaseException:
        return TimeoutError(f"rank {group.rank}: clock ping-pong timed out after "
                            f"{waited_s:.3g} s")

    try:
        wait_until(group.tested(request, "the clock ping-pong"), deadline,
                   check_peers=group.check_peers, timed_out=timed_out, backoff=_BACKOFF)
        return True
    except TimeoutError:
        if cancel:
            request.Cancel()
            request.Wait()  # completes as cancelled (or as done, had it just matched)
        return False
