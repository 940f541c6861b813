"""What a :class:`~ubep.buffer.Buffer` holds that its collaborators act on, declared once.

The Buffer's behaviour is split by job: the calls (``buffer.py``), the calls in flight
(``inflight.py``), keeping step (``step.py``), argument checks (``checks.py``). Each job is an
object the Buffer holds (``buf._calls``, ``buf._steps``, ``buf._checks``), built once the
Buffer's engine is open and typed against this protocol: the state stays the Buffer's, where its
hot path reads it; the engine and the id the ranks agreed on are handed to each job that needs
them, not read off the Buffer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..config import BufferConfig
from ..dtypes import DType
from ..plane.layout import SegmentLayout
from ..plane.protocol import ProcessGroup
from ..plane.results import PendingCall

__all__ = ["AFTER", "BEFORE", "NATIVE", "BufferState", "InFlight"]

# stages of a call, for StepKeeping.failed: before the data plane, inside it, after it returned
BEFORE, NATIVE, AFTER = 0, 1, 2


@dataclass
class InFlight:
    """A split-phase call whose second half has not run."""

    epoch: int
    call: PendingCall[Any]
    finish: Callable[[Any], Any]  # the engine's result -> the call's result
    index: int | None  # dispatch index (None: combine)


class BufferState(Protocol):
    """The attributes of one rank's Buffer its collaborators use (set in ``Buffer.__init__`` /
    ``_setup``)."""

    group: ProcessGroup
    _cfg: BufferConfig  # the one the engine runs (M2N: physical slots, ubep.m2n)
    rank: int
    num_ranks: int
    layout: SegmentLayout
    _epoch: int  # sequence number of the last call (every rank agrees on it)
    _num_dispatches: int
    _generation: int  # resyncs so far
    _lock: threading.Lock  # one call at a time (a second thread is refused)
    _dead: str | None  # a peer died: refused for good
    _lost: str | None  # out of step: refused until resync()
    _closed: bool
    _in_flight: list[InFlight]  # split-phase calls awaiting their hook, in issue order
    _dtype: DType
    _cdtype: DType
    # the collaborators (step.StepKeeping, inflight.InFlightCalls, checks.ArgChecks): typed
    # where the Buffer builds them, not here, so no module of this package imports another
    # in a circle
    _steps: Any
    _calls: Any
    _checks: Any
