"""Split-phase calls (``return_recv_hook=True``): the calls in flight, their hooks, and what
happens to them when one fails.

Two calls may be in flight per Buffer; hooks complete calls in issue order; a third call is
refused before it exists. A call whose first half reached the peers and that cannot complete
leaves the Buffer out of step (``StepKeeping``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from ..errors import OutOfStepError, UbepError
from ..plane.protocol import Engine
from ..plane.records import ErrorRecord
from ..plane.results import PendingCall
from .state import AFTER as _AFTER
from .state import NATIVE as _NATIVE
from .state import BufferState, InFlight

__all__ = ["MAX_IN_FLIGHT", "InFlightCalls"]

MAX_IN_FLIGHT = 2  # split-phase calls per Buffer (the engine's MAX_PENDING)


class InFlightCalls:
    """The split-phase bookkeeping of the Buffer ``buf`` (held as ``buf._calls``; the calls
    themselves are ``buf._in_flight``, which the Buffer's hot path reads), whose second halves
    run on the Buffer's ``engine`` (handed in)."""

    __slots__ = ("_engine", "buf")

    def __init__(self, buf: BufferState, engine: Engine) -> None:
        self.buf = buf
        self._engine = engine

    def check(self) -> None:
        """A third call while two await their hooks would reuse the receive region and the
        control records of the first: refused here, before it exists (nothing advances, no
        peer is told: peers that made the call wait, within their deadline, for this rank to
        call the hooks and make it again)."""
        b = self.buf
        if len(b._in_flight) >= MAX_IN_FLIGHT:
            calls = ", ".join(str(c.epoch) for c in b._in_flight)
            raise UbepError(
                f"rank {b.rank}: call refused: calls {calls} were issued with "
                "return_recv_hook=True and their hook() was not called; at most "
                f"{MAX_IN_FLIGHT} calls may be in flight on a Buffer: call the hooks, then "
                "make this call again"
            )

    def issued(
        self, kind: str, epoch: int, got: object, finish: Callable[[Any], Any], hook: bool,
        index: int | None,
    ) -> Any:
        """A call whose first half ran (``got is None``: its second half waits for the hook)
        or all of it: the result, or (``hook``) the pending call that hands it out."""
        b = self.buf
        if got is not None and not hook:  # the common blocking call: no pending object
            return finish(got)
        call: PendingCall[Any] = PendingCall(kind, b.rank, epoch, lambda: self.hook(epoch),
                                             -1 if index is None else index)
        if got is None:
            b._in_flight.append(InFlight(epoch, call, finish, index))
        else:  # the engine ran the whole call (one that needs no second half)
            call._settle(True, finish(got))
        if hook:
            return call
        if got is None:
            self.complete_through(epoch)
        return call.hook()

    def complete_staged(self) -> None:
        """Engines that stage rows in one land region (BSP) must finish reading
        a dispatch before peers may write the next one there: a dispatch in flight completes
        before the next dispatch makes the region ready (its hook then returns at once)."""
        b = self.buf
        if b.layout.num_land_regions > 1:
            return
        staged = [c.epoch for c in b._in_flight if c.index is not None]
        if staged:
            self.complete_through(staged[-1])
            if b._lost is not None:
                raise OutOfStepError(f"rank {b.rank}: the Buffer lost step with its peers "
                                     f"({b._lost}); call resync() on every rank")

    def hook(self, epoch: int) -> None:
        """``PendingCall.hook``: complete every call up to ``epoch``, in issue order."""
        b = self.buf
        if not any(c.epoch == epoch for c in b._in_flight):
            return  # settled meanwhile (by a later call or a resync)
        b._steps.enter()
        try:
            self.complete_through(epoch)
        finally:
            b._lock.release()

    def complete_through(self, epoch: int) -> None:
        b = self.buf
        while b._in_flight and b._in_flight[0].epoch <= epoch:
            c = b._in_flight[0]
            stage = _NATIVE
            try:
                got = self._engine.complete(c.epoch)
                del b._in_flight[0]
                stage = _AFTER
                if isinstance(got, ErrorRecord):
                    raise b._steps.error(got)
                c.call._settle(True, c.finish(got))
            except BaseException as exc:
                if stage == _NATIVE and b._in_flight and b._in_flight[0] is c:
                    del b._in_flight[0]
                if stage == _NATIVE:
                    # the call's first half reached the peers: never a clean reject here
                    b._steps.mark_lost(f"call {c.epoch} was cut short by {type(exc).__name__}")
                    err, clean = exc, False
                    if isinstance(exc, Exception) and not isinstance(exc, UbepError):
                        err = OutOfStepError(f"rank {b.rank}: call {c.epoch} did not "
                                             f"complete: {type(exc).__name__}: {exc}")
                else:
                    err, clean = b._steps.failed(c.epoch, stage, exc)
                if clean and not b._in_flight and c.index is not None:
                    b._num_dispatches = c.index  # as a blocking dispatch's clean reject
                elif clean and b._in_flight:
                    b._steps.mark_lost(f"call {c.epoch} failed with a later call in flight: {err}")
                c.call._settle(False, err)
                if b._lost is not None or b._dead is not None:
                    self.abandon(f"call {c.epoch} failed: {err}")
                if not isinstance(exc, Exception):
                    raise  # an interrupt reaches the caller as such

    def abandon(self, cause: str) -> None:
        """Calls still waiting for their hook fail here (their peers learn it by notice)."""
        b = self.buf
        while b._in_flight:
            c = b._in_flight.pop(0)
            with contextlib.suppress(Exception):
                self._engine.abandon(c.epoch, f"rank {b.rank}: call {c.epoch} abandoned: "
                                  f"{cause}")
            c.call._settle(False, OutOfStepError(
                f"rank {b.rank}: call {c.epoch} did not complete: {cause}"))
