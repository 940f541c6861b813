"""The MPI call runner (ubep.mpi.watchdog) without MPI: results, exceptions and a stuck call."""

from __future__ import annotations

import threading

import pytest

from ubep.mpi.watchdog import GRACE_S, CallRunner, WedgedError


@pytest.mark.parametrize("threaded", [True, False])
def test_runner_returns_results_and_reraises_on_the_callers_thread(threaded: bool) -> None:
    runner = CallRunner("t", threaded=threaded)
    seen: list[str] = []
    assert runner.run(lambda: seen.append(threading.current_thread().name) or 7, 5.0) == 7
    # a threaded runner runs the call off the caller's thread; an inline one on it
    assert (seen[0] != threading.current_thread().name) == threaded

    def bad() -> int:
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        runner.run(bad, 5.0)
    assert runner.run(lambda: 8, 5.0) == 8 and not runner.wedged
    runner.stop()


def test_a_call_past_its_deadline_wedges_the_runner_for_good() -> None:
    runner = CallRunner("t")
    release = threading.Event()
    try:
        with pytest.raises(WedgedError, match="still inside MPI"):
            runner.run(release.wait, 0.0)  # never sets: stuck until the test releases it
        assert runner.wedged
        with pytest.raises(WedgedError, match="earlier call"):
            runner.run(lambda: 1, 5.0)
    finally:
        release.set()
    assert GRACE_S > 0
