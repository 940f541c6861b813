"""The discrete-event kernel (ubep.sim.des): SimPy's rules, checked against hand-computed times."""

from __future__ import annotations

import math

import pytest

from ubep.errors import InvalidArgumentError
from ubep.sim.des import LATE, Environment, EventTriggeredTwiceError, ProcessGenerator


def test_an_event_triggered_twice_raises_and_fires_once() -> None:
    env = Environment()
    ev = env.event()
    fired: list[object] = []
    ev.callbacks.append(lambda e: fired.append(e.value))
    ev.succeed("first")
    with pytest.raises(EventTriggeredTwiceError, match="already been triggered"):
        ev.succeed("second")
    env.run()
    assert fired == ["first"]


def test_a_timeout_cannot_be_triggered_again() -> None:
    env = Environment()
    with pytest.raises(EventTriggeredTwiceError):
        env.timeout(5.0).succeed()


@pytest.mark.parametrize("delay", [-1.0, -1e-9, math.nan])
def test_a_negative_delay_raises_naming_the_argument(delay: float) -> None:
    env = Environment()
    with pytest.raises(InvalidArgumentError, match="delay"):
        env.timeout(delay)
    with pytest.raises(InvalidArgumentError, match="delay"):
        env.schedule(env.event(), delay)


def test_at_a_past_time_fires_now_and_the_clock_never_runs_backwards() -> None:
    env = Environment()
    seen: list[float] = []

    def proc() -> ProcessGenerator:
        yield env.timeout(10.0)
        yield env.at(3.0)  # in the past: now
        seen.append(env.now)
        yield env.at(12.5)
        seen.append(env.now)

    env.process(proc())
    env.run()
    assert seen == [10.0, 12.5]


def test_processes_resume_in_time_then_priority_then_schedule_order() -> None:
    # Oracle: the order written out by hand from the rules in des.py's docstring.
    env = Environment()
    log: list[tuple[float, str]] = []

    def worker(name: str, delays: list[float], priority: int = 0) -> ProcessGenerator:
        for d in delays:
            yield env.timeout(d, priority)
            log.append((env.now, name))
        return name

    late = env.process(worker("late", [2.0], LATE))
    a = env.process(worker("a", [1.0, 1.0]))
    b = env.process(worker("b", [2.0]))
    env.run()
    # at t=2: b's timeout was scheduled at t=0, a's second one at t=1; LATE goes last anyway
    assert log == [(1.0, "a"), (2.0, "b"), (2.0, "a"), (2.0, "late")]
    assert (a.value, b.value, late.value) == ("a", "b", "late")
