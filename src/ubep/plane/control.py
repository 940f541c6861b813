"""The control plane every group shares: the one wait, and what an agreement on a loss decides.

The one control-plane wait: poll a completion until a deadline, checking peers on the way.

:class:`ubep.runtime.Group` (a barrier counter, rendezvous and exchange files), the torch group
(a ``torch.distributed`` Work) and the MPI group (an MPI request) all wait the same way: poll,
look at the peers' liveness every :data:`LIVENESS_PERIOD_S`, give up at the deadline, and back
off so a long wait costs little CPU. They differ in what they poll, what their errors say and
how eagerly they back off (:class:`Backoff`), which is what :func:`wait_until` takes from them.
The native engine's data-plane waits are C (``native/wait.c``), not this.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["LIVENESS_PERIOD_S", "Backoff", "Decision", "wait_until"]

# Liveness reads /proc per peer: every 20 ms finds a dead peer fast and costs nothing measurable.
LIVENESS_PERIOD_S = 0.02


@dataclass(frozen=True)
class Backoff:
    """How a wait spends its time between polls.

    Attributes:
        spin_polls: polls made back to back before the clock is first read, so a completion a
            few microseconds away is seen without a system call.
        yield_s: for this long from the start, yield the CPU (``sched_yield``) between polls
            rather than sleep: a yielding waiter wakes within microseconds of the completion.
        sleep_slope: after ``yield_s``, sleep ``(waited_s - yield_s) * sleep_slope + 10 us``
            between polls, at most ``max_sleep_s``: longer the longer the wait.
        max_sleep_s: the longest sleep between two polls.
    """

    spin_polls: int = 0
    yield_s: float = 0.0
    sleep_slope: float = 0.05
    max_sleep_s: float = 1e-3

    def pause(self, waited_s: float) -> None:
        """Give the CPU up once, ``waited_s`` seconds into the wait."""
        if waited_s < self.yield_s:
            os.sched_yield()
        else:
            time.sleep(min(self.max_sleep_s, (waited_s - self.yield_s) * self.sleep_slope + 1e-5))


def wait_until(
    ready: Callable[[], bool],
    deadline: float,
    *,
    check_peers: Callable[[], None],
    timed_out: Callable[[float], BaseException],
    backoff: Backoff,
    liveness_period_s: float = LIVENESS_PERIOD_S,
) -> None:
    """Return once ``ready()`` is true (it is polled first, so a done wait never sleeps).

    Args:
        ready: polls the completion (it may make progress: read files, test a request).
        deadline: ``time.monotonic()`` value after which the wait fails.
        check_peers: raises (``ubep.PeerLostError``, the caller's message) if a peer the wait
            needs has died; called every ``liveness_period_s``.
        timed_out: the exception to raise at the deadline, given the seconds waited.
        backoff: the caller's pacing between polls.
    """
    spins = 0
    start = time.monotonic()
    next_check = start + liveness_period_s
    while not ready():
        spins += 1
        if spins < backoff.spin_polls:
            continue
        now = time.monotonic()
        if now >= next_check:
            next_check = now + liveness_period_s
            check_peers()
        if now >= deadline:
            raise timed_out(now - start)
        backoff.pause(now - start)


@dataclass(frozen=True)
class Decision:
    """The members that go on after a loss (ascending original rank), what each reported, and
    the ranks masked by this decision."""

    members: tuple[int, ...]
    states: tuple[Any, ...]  # one per member, what it passed to agree()
    masked: tuple[int, ...]
