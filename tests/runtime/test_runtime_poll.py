"""The one control-plane wait (ubep.runtime.poll.wait_until): what it polls, when it checks
peers and what it raises, with deadlines already past so nothing depends on timing."""

from __future__ import annotations

import time

import pytest

from ubep.errors import PeerLostError, TimeoutError
from ubep.runtime.poll import Backoff, wait_until


def _never_peers() -> None:
    pass


def test_a_ready_completion_returns_without_reading_the_clock_or_peers() -> None:
    calls = []

    def check_peers() -> None:
        calls.append("peers")

    wait_until(lambda: True, 0.0, check_peers=check_peers,
               timed_out=lambda s: AssertionError("no deadline for a done wait"),
               backoff=Backoff(), liveness_period_s=0.0)
    assert calls == []


def test_spin_polls_are_made_before_the_deadline_is_seen() -> None:
    polls = []

    def ready() -> bool:
        polls.append(1)
        return False

    with pytest.raises(TimeoutError, match="waited"):
        wait_until(ready, time.monotonic() - 1.0, check_peers=_never_peers,
                   timed_out=lambda s: TimeoutError(f"waited {s:.3f} s"),
                   backoff=Backoff(spin_polls=7))
    assert len(polls) == 7  # the 7th poll reads the clock: past the deadline


def test_completion_seen_after_backoff_pauses() -> None:
    left = [3]

    def ready() -> bool:
        left[0] -= 1
        return left[0] < 0

    wait_until(ready, time.monotonic() + 60.0, check_peers=_never_peers,
               timed_out=lambda s: AssertionError("must not time out"),
               backoff=Backoff(yield_s=1.0))
    assert left[0] == -1  # polled exactly until ready: 3 misses, then done


def test_a_dead_peer_is_reported_before_the_timeout() -> None:
    def check_peers() -> None:
        raise PeerLostError("rank 0: rank(s) [1] died")

    with pytest.raises(PeerLostError, match=r"\[1\] died"):
        wait_until(lambda: False, time.monotonic() - 1.0, check_peers=check_peers,
                   timed_out=lambda s: TimeoutError("late"), backoff=Backoff(),
                   liveness_period_s=0.0)
