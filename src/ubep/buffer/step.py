"""Keeping step with the peers: entering a call, classifying a failure, losing step, the
engine's error records, and ``resync``.

A call returns the right answer or raises on every rank. A clean reject (bad input found before
anything reached a peer) keeps every rank in step; anything else that may leave the ranks
disagreeing marks the Buffer out of step, and it refuses calls until every rank has resynced.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..errors import (
    InvalidArgumentError,
    OutOfStepError,
    PeerLostError,
    RemoteError,
    UbepError,
)
from ..plane.protocol import Engine
from ..plane.records import E_BAD_INPUT, E_LOST, E_PEER_LOST, E_REMOTE, ErrorRecord
from .signature import mismatch_error
from .state import AFTER as _AFTER
from .state import BEFORE as _BEFORE
from .state import NATIVE as _NATIVE
from .state import BufferState

__all__ = ["StepKeeping"]


class StepKeeping:
    """Call entry, failure handling and resync of the Buffer ``buf`` (which holds this object
    as ``buf._steps``; the state it keeps is the Buffer's own, its calls read it), over the
    Buffer's ``engine`` and the ``uid`` its ranks agreed on (handed in: no reach into the
    Buffer for them)."""

    __slots__ = ("_engine", "_uid", "buf")

    def __init__(self, buf: BufferState, engine: Engine, uid: int) -> None:
        self.buf = buf
        self._engine = engine
        self._uid = uid

    def resync(self, timeout_s: float | None = None) -> None:
        """Re-establish agreement with the peers after a lost step (collective: every rank).

        After a timeout, a peer's failure mid-call, corrupt control data or mismatched calls,
        the Buffer refuses calls (:class:`ubep.OutOfStepError`); ``resync`` waits until every
        rank has left its calls on this Buffer and entered ``resync`` (at most ``timeout_s``,
        default ``config.timeout_s``; a timed-out resync can simply be called again), clears
        every rank's control records, re-arms the receive regions and agrees on the next call's
        sequence number. Handles and ``recv_x`` views from before are invalid afterwards.
        Harmless on a Buffer that did not lose step, as long as every rank calls it. A dead
        peer cannot be resynced with (build a new group).
        """
        b = self.buf
        if not b._lock.acquire(blocking=False):
            raise UbepError(f"rank {b.rank}: another call is in progress on this Buffer")
        try:
            if b._closed:
                raise UbepError(f"rank {b.rank}: the Buffer is closed")
            if b._dead is not None:
                raise PeerLostError(f"rank {b.rank}: cannot resync, a peer died: {b._dead}")
            timeout = float(b._cfg.timeout_s if timeout_s is None else timeout_s)
            b._calls.abandon("resync() was called before its hook")
            gen = b._generation + 1
            mine = {"epoch": b._epoch, "dispatches": b._num_dispatches}
            # Phase 1: every rank is out of its calls (nobody writes a peer's segment any more).
            states = self.exchange(f"resync.{self._uid}.{gen}.enter", mine, timeout)
            base = max(int(s["epoch"]) for s in states) + 2
            self._engine.resync(base)
            # Phase 2: every rank has cleared its segment before anyone starts a call.
            self.exchange(f"resync.{self._uid}.{gen}.done", base, timeout)
            b._epoch = base - 1
            b._num_dispatches = max(int(s["dispatches"]) for s in states)
            b._generation = gen
            b._lost = None
        finally:
            b._lock.release()

    def enter(self) -> None:
        """Start a call: this thread alone, on a usable Buffer. Refusing changes nothing (no
        counter advances, nothing is published): the refused call never existed."""
        b = self.buf
        if not b._lock.acquire(blocking=False):
            raise UbepError(
                f"rank {b.rank}: another call is in progress on this Buffer (a second thread "
                "or a signal handler): calls on one Buffer must not overlap"
            )
        if b._closed or b._dead is not None or b._lost is not None:
            b._lock.release()
            if b._closed:
                raise UbepError(f"rank {b.rank}: the Buffer is closed")
            if b._dead is not None:
                raise PeerLostError(f"rank {b.rank}: Buffer unusable after a lost peer: "
                                    f"{b._dead}")
            raise OutOfStepError(
                f"rank {b.rank}: the Buffer lost step with its peers ({b._lost}); call "
                "resync() on every rank (or build a new Buffer) before the next call"
            )

    def failed(self, epoch: int, stage: int, exc: BaseException) -> tuple[BaseException, bool]:
        """The exception a call raises for ``exc``, after telling the peers what they need, and
        whether the call was rejected cleanly (on this rank or, by its notice, on a peer).

        Before the data plane ran (``_BEFORE``; or the engine refused its arguments, an
        ``Exception`` at ``_NATIVE``) nothing of the call reached a peer: a clean reject, the
        peers get its failure notice and every rank stays in step. Anything else escaping the
        data plane (an interrupt at ``_NATIVE``) leaves the outcome unknown: lost step.
        """
        b = self.buf
        if stage == _AFTER or (isinstance(exc, UbepError) and stage != _BEFORE):
            # the engine's own error, classified by _error
            clean = isinstance(exc, InvalidArgumentError) or (
                isinstance(exc, RemoteError) and exc.clean)
            return exc, clean
        if stage == _NATIVE and (not isinstance(exc, Exception) or isinstance(exc, MemoryError)):
            self.mark_lost(f"call {epoch} was interrupted by {type(exc).__name__}")
            return exc, False
        if not isinstance(exc, UbepError) and isinstance(exc, Exception):
            exc = UbepError(f"rank {b.rank}: call {epoch} rejected: "
                            f"{type(exc).__name__}: {exc}")
        # with calls in flight this one is not finished by itself: done words say "every call
        # up to here is finished", so the notice goes out without one
        got = self._engine.fail(epoch, E_BAD_INPUT, f"rank {b.rank}: {exc}",
                             0 if b._in_flight else 1, float(b._cfg.timeout_s))
        if type(got) is ErrorRecord:  # peers never finished the call before last: out of step
            self.mark_lost(f"rejected call {epoch} could not be announced: "
                           f"{self.error(got)}")
            return exc, False
        return exc, True

    def one_call_failed(self, epoch: int, index: int, exc: BaseException) -> BaseException:
        """What a failed one native call (dispatch or combine: ``index`` is the dispatches made
        before it) raises; a clean reject leaves no dispatch counted."""
        err, clean = self.failed(epoch, _NATIVE, exc)
        if clean:
            self.buf._num_dispatches = index
        return err

    def reject(self, error: BaseException) -> BaseException:
        """A call rejected before it started, by a layer above the Buffer (a facade's checks):
        it takes its sequence number and fails here as the Buffer's own checks would fail it,
        so the peers' call raises ``RemoteError`` at once (``Buffer.reject``)."""
        b = self.buf
        try:
            self.enter()
        except UbepError:  # the Buffer takes no call now (lost step, closed): nothing to tell
            return error
        try:
            b._calls.check()
        except UbepError:  # nor a third call in flight: the peers' is refused as this one
            b._lock.release()
            return error
        try:
            b._epoch += 1
            return self.failed(b._epoch, _BEFORE, error)[0]
        finally:
            b._lock.release()

    def mark_lost(self, cause: str) -> None:
        """Refuse calls until resync, and tell peers ahead of time (best effort: only if the
        notice slot is free) so their next call fails at once instead of at its deadline."""
        b = self.buf
        if b._lost is not None or b._dead is not None:
            return
        b._lost = cause
        with contextlib.suppress(Exception):
            self._engine.fail(b._epoch + 1, E_LOST,
                           f"rank {b.rank} lost step ({cause}): call resync() on every "
                           "rank", 0, 0.0)

    def exchange(self, key: str, value: Any, timeout_s: float) -> list[Any]:
        """Group-wide exchange keyed by ``key``: a retry after a timeout pairs with the peers'
        first attempt (group kinds without keyed exchanges fall back to ``allgather``)."""
        b = self.buf
        exchange = getattr(b.group, "exchange", None)
        try:
            if exchange is not None:
                return list(exchange(key, value, timeout_s))
            return list(b.group.allgather(value, timeout_s))
        except PeerLostError as exc:
            b._dead = str(exc)
            raise

    def error(self, rec: ErrorRecord) -> UbepError:
        """The exception of an engine's error record; every error but a clean reject (bad
        input here or on a peer) leaves the Buffer out of step."""
        b = self.buf
        if rec.code == E_PEER_LOST:
            b._dead = rec.what
        elif rec.code == E_REMOTE and not rec.clean:
            self.mark_lost(f"rank {rec.peer} failed call {b._epoch}: {rec.message}")
        elif not rec.clean:
            self.mark_lost(rec.what)
        elif rec.code == E_BAD_INPUT and rec.argument == "signature":
            return _signature_error(rec, b.rank)
        return rec.to_exception(b.rank)


def _signature_error(rec: ErrorRecord, rank: int) -> UbepError:
    """A clean reject of a call whose signature differs from a peer's (the engine's value:
    ``mine:theirs:peer``, words in hex), named by the fields that differ."""
    try:
        mine, theirs, peer = rec.message.split(":")
        return mismatch_error(int(mine, 16), int(theirs, 16), int(peer), rank)
    except ValueError:
        return rec.to_exception(rank)
