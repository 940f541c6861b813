"""Split-phase calls (``return_recv_hook=True``): the calls in flight, their hooks, and what
happens to them when one fails.

Two calls may be in flight per Buffer; hooks complete calls in issue order; a third call is
refused before it exists. A call whose first half reached the peers and that cannot complete
leaves the Buffer out of step (``StepKeeping``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import OutOfStepError, UbepError
from ..plane.records import ErrorRecord
from ..plane.results import PendingCall
from .state import AFTER as _AFTER
from .state import NATIVE as _NATIVE
from .step import StepKeeping

__all__ = ["MAX_IN_FLIGHT", "InFlight", "InFlightCalls"]

MAX_IN_FLIGHT = 2  # split-phase calls per Buffer (the engine's MAX_PENDING)


@dataclass
class InFlight:
    """A split-phase call whose second half has not run."""

    epoch: int
    call: PendingCall[Any]
    finish: Callable[[Any], Any]  # the engine's result -> the call's result
    index: int | None  # dispatch index (None: combine)



class InFlightCalls(StepKeeping):
    """The Buffer's split-phase bookkeeping."""

    def _check_in_flight(self) -> None:
        """A third call while two await their hooks would reuse the receive region and the
        control records of the first: refused here, before it exists (nothing advances, no
        peer is told: peers that made the call wait, within their deadline, for this rank to
        call the hooks and make it again)."""
        if len(self._in_flight) >= MAX_IN_FLIGHT:
            calls = ", ".join(str(c.epoch) for c in self._in_flight)
            raise UbepError(
                f"rank {self.rank}: call refused: calls {calls} were issued with "
                "return_recv_hook=True and their hook() was not called; at most "
                f"{MAX_IN_FLIGHT} calls may be in flight on a Buffer: call the hooks, then "
                "make this call again"
            )

    def _issued(
        self, kind: str, epoch: int, got: object, finish: Callable[[Any], Any], hook: bool,
        index: int | None,
    ) -> Any:
        """A call whose first half ran (``got is None``: its second half waits for the hook)
        or all of it: the result, or (``hook``) the pending call that hands it out."""
        if got is not None and not hook:  # the common blocking call: no pending object
            return finish(got)
        call: PendingCall[Any] = PendingCall(kind, self.rank, epoch,
                                             lambda: self._hook(epoch))
        if got is None:
            self._in_flight.append(InFlight(epoch, call, finish, index))
        else:  # the engine ran the whole call (one that needs no second half)
            call._settle(True, finish(got))
        if hook:
            return call
        if got is None:
            self._complete_through(epoch)
        return call.hook()

    def _complete_staged_dispatch(self) -> None:
        """Engines that stage rows in one land region (BSP) must finish reading
        a dispatch before peers may write the next one there: a dispatch in flight completes
        before the next dispatch makes the region ready (its hook then returns at once)."""
        if self.layout.num_land_regions > 1:
            return
        staged = [c.epoch for c in self._in_flight if c.index is not None]
        if staged:
            self._complete_through(staged[-1])
            if self._lost is not None:
                raise OutOfStepError(f"rank {self.rank}: the Buffer lost step with its peers "
                                     f"({self._lost}); call resync() on every rank")

    def _hook(self, epoch: int) -> None:
        """``PendingCall.hook``: complete every call up to ``epoch``, in issue order."""
        if not any(c.epoch == epoch for c in self._in_flight):
            return  # settled meanwhile (by a later call or a resync)
        self._enter()
        try:
            self._complete_through(epoch)
        finally:
            self._lock.release()

    def _complete_through(self, epoch: int) -> None:
        while self._in_flight and self._in_flight[0].epoch <= epoch:
            c = self._in_flight[0]
            stage = _NATIVE
            try:
                got = self._engine.complete(c.epoch)
                del self._in_flight[0]
                stage = _AFTER
                if isinstance(got, ErrorRecord):
                    raise self._error(got)
                c.call._settle(True, c.finish(got))
            except BaseException as exc:
                if stage == _NATIVE and self._in_flight and self._in_flight[0] is c:
                    del self._in_flight[0]
                if stage == _NATIVE:
                    # the call's first half reached the peers: never a clean reject here
                    self._mark_lost(f"call {c.epoch} was cut short by {type(exc).__name__}")
                    err, clean = exc, False
                    if isinstance(exc, Exception) and not isinstance(exc, UbepError):
                        err = OutOfStepError(f"rank {self.rank}: call {c.epoch} did not "
                                             f"complete: {type(exc).__name__}: {exc}")
                else:
                    err, clean = self._failed(c.epoch, stage, exc)
                if clean and not self._in_flight and c.index is not None:
                    self._num_dispatches = c.index  # as a blocking dispatch's clean reject
                elif clean and self._in_flight:
                    self._mark_lost(f"call {c.epoch} failed with a later call in flight: {err}")
                c.call._settle(False, err)
                if self._lost is not None or self._dead is not None:
                    self._abandon_in_flight(f"call {c.epoch} failed: {err}")
                if not isinstance(exc, Exception):
                    raise  # an interrupt reaches the caller as such

    def _abandon_in_flight(self, cause: str) -> None:
        """Calls still waiting for their hook fail here (their peers learn it by notice)."""
        while self._in_flight:
            c = self._in_flight.pop(0)
            with contextlib.suppress(Exception):
                self._engine.abandon(c.epoch, f"rank {self.rank}: call {c.epoch} abandoned: "
                                              f"{cause}")
            c.call._settle(False, OutOfStepError(
                f"rank {self.rank}: call {c.epoch} did not complete: {cause}"))
