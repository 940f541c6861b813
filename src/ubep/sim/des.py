"""The discrete-event kernel under :mod:`ubep.sim.events`: SimPy's idea in a few lines.

An :class:`Environment` owns the clock and a heap of ``(time, priority, seq, event)``; an
:class:`Event` runs its callbacks when popped; a :class:`Process` is a generator that yields
events and is resumed when they fire. As in SimPy, an event happens once (triggering it twice
raises) and time never runs backwards (a negative delay raises): both would be bugs of the
model that drives the kernel, which silently clamping them would hide.

Events at the same instant run in priority order: ``NORMAL`` events (arrivals, completions)
before ``LATE`` ones (choices of what to serve next), then in the order they were scheduled.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Generator
from typing import Any

from ..errors import InvalidArgumentError

__all__ = ["LATE", "NORMAL", "TIE_NS", "Environment", "Event", "EventTriggeredTwiceError",
           "Process", "ProcessGenerator", "then", "tie_key"]

NORMAL, LATE = 0, 1
# Times closer than this count as simultaneous when a port or consumer picks what to serve next,
# so float noise cannot reorder rows that the model considers tied (analytic mode: the same rule).
TIE_NS = 1e-3


def tie_key(time: float) -> int:
    return round(time / TIE_NS)


class EventTriggeredTwiceError(RuntimeError):
    """An event was triggered a second time (SimPy: "has already been triggered")."""


ProcessGenerator = Generator["Event", Any, Any]


class Environment:
    """The clock and the event heap."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = itertools.count()

    def schedule(self, event: Event, delay: float = 0.0, priority: int = NORMAL) -> None:
        if not delay >= 0.0:  # also refuses NaN
            raise InvalidArgumentError("delay", delay, "must be >= 0 (time never runs backwards)")
        heapq.heappush(self._heap, (self.now + delay, priority, next(self._seq), event))

    def event(self) -> Event:
        return Event(self)

    def timeout(self, delay: float, priority: int = NORMAL) -> Event:
        ev = Event(self)
        self.schedule(ev, delay, priority)
        ev.triggered = True
        return ev

    def at(self, time: float, priority: int = NORMAL) -> Event:
        """An event that fires at absolute ``time`` (now if that is in the past: a caller that
        computed a finish time before the clock reached it)."""
        return self.timeout(max(0.0, time - self.now), priority)

    def process(self, generator: ProcessGenerator) -> Process:
        return Process(self, generator)

    def run(self) -> None:
        while self._heap:
            time, _, _, event = heapq.heappop(self._heap)
            self.now = time
            event.fire()


class Event:
    """Something that happens once; callbacks run when the heap pops it."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.callbacks: list[Callable[[Event], None]] = []
        self.triggered = False
        self.processed = False
        self.value: Any = None

    def succeed(self, value: Any = None, priority: int = NORMAL) -> Event:
        if self.triggered:
            raise EventTriggeredTwiceError(f"{self!r} has already been triggered")
        self.triggered = True
        self.value = value
        self.env.schedule(self, 0.0, priority)
        return self

    def fire(self) -> None:
        self.processed = True
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback(self)


def then(event: Event, action: Callable[[], object]) -> None:
    """Run ``action()`` when ``event`` fires."""
    def fire(_ev: Event) -> None:
        action()

    event.callbacks.append(fire)


class Process(Event):
    """A generator driven by the events it yields; fires when the generator returns."""

    def __init__(self, env: Environment, generator: ProcessGenerator) -> None:
        super().__init__(env)
        self._gen = generator
        start = env.event()
        start.callbacks.append(self._resume)
        start.succeed()

    def _resume(self, event: Event) -> None:
        try:
            target = self._gen.send(event.value)
        except StopIteration as stop:
            self.succeed(stop.value)
            return
        if target.processed:  # already happened: resume at once (next heap pop)
            again = self.env.event()
            again.callbacks.append(self._resume)
            again.succeed(target.value)
        else:
            target.callbacks.append(self._resume)
