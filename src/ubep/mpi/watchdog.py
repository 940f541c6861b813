"""MPI calls under a deadline, even when MPI itself does not return.

Every wait of the RMA engine is a poll under the call's deadline (``MPI_Test``, never a
blocking wait), so a peer that dies or stops makes the call fail in time. One wait is not
ours: Open MPI's one-sided component over TCP (``osc/rdma`` on ``btl/tcp``) is not tested
for operation after a process failure (``mpiexec --with-ft ulfm`` warns so), and an
``MPI_Rput`` issued in the instant a peer dies can spin inside ``opal_progress`` for ever.
No deadline inside the engine can interrupt a C loop.

So each engine call runs on one worker thread per group, and the caller waits for it with
the call's deadline plus :data:`GRACE_S`. A call that is still inside MPI then is *wedged*:
the caller gets :class:`WedgedError` (the engine turns it into ``ubep.PeerLostError``), the group
refuses every later MPI use (a thread is inside MPI, holding its progress engine), and at
interpreter exit the process leaves with ``os._exit`` instead of entering an
``MPI_Finalize`` that would wait for that thread (:func:`_exit_if_wedged`).

Only one call runs at a time (the engine is single-threaded by design), so MPI sees its
calls serialised whatever thread issues them.
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["GRACE_S", "CallRunner", "WedgedError"]

# How long past its own deadline a call may stay inside MPI before it counts as wedged. The
# engine's polls check the deadline between MPI calls; each MPI call it makes is non-blocking,
# so the margin only has to cover a descheduled thread on a loaded host.
GRACE_S = 1.0

_T = TypeVar("_T")
_wedged_groups: list[str] = []  # descriptions, for the exit message


class WedgedError(Exception):
    """An engine call stayed inside MPI past its deadline plus :data:`GRACE_S`."""


class CallRunner:
    """Runs one callable at a time on a daemon worker thread, waited for with a deadline."""

    def __init__(self, name: str, threaded: bool = True, owns_mpi: bool = False) -> None:
        """``threaded=False`` (MPI initialised below ``MPI_THREAD_SERIALIZED``: only the main
        thread may call MPI) runs each call inline, without the guard. ``owns_mpi``: the calls
        are real MPI calls, so a wedge must also keep the process out of ``MPI_Finalize``."""
        self.name = name
        self.wedged = False
        self.threaded = threaded
        self.owns_mpi = owns_mpi
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], _Slot] | None] = (
            queue.SimpleQueue())
        if threaded:
            threading.Thread(target=self._serve, name=f"ubep-mpi-{name}", daemon=True).start()

    def run(self, fn: Callable[[], _T], deadline_s: float) -> _T:
        """``fn()`` on the worker thread; its result, or its exception re-raised here.

        ``deadline_s``: seconds from now after which the call must have failed by itself;
        :class:`WedgedError` if it is still running :data:`GRACE_S` later. A signal that interrupts
        the wait here (KeyboardInterrupt) is re-raised only once the call has ended, so no two
        calls ever overlap."""
        if self.wedged:
            raise WedgedError(f"{self.name}: an earlier call is still inside MPI")
        if not self.threaded:
            return fn()
        slot = _Slot()
        self._jobs.put((fn, slot))
        end = time.monotonic() + max(deadline_s, 0.0) + GRACE_S
        interrupted: BaseException | None = None
        while True:
            try:
                done = slot.event.wait(max(end - time.monotonic(), 0.0))
            except BaseException as exc:  # re-raised once the call ended
                interrupted = interrupted or exc
                continue
            break
        if not done:
            self._wedge()
            raise WedgedError(f"{self.name}: still inside MPI {deadline_s + GRACE_S:.3g} s after "
                         "the call started (Open MPI's one-sided component does not recover "
                         "from a peer failure in every case)")
        if interrupted is not None:
            raise interrupted
        if slot.error is not None:
            raise slot.error
        result: _T = slot.result
        return result

    def stop(self) -> None:
        """End the worker thread (not waited for: a wedged worker never ends)."""
        if self.threaded and not self.wedged:
            self._jobs.put(None)

    def _wedge(self) -> None:
        self.wedged = True
        if self.owns_mpi:
            _wedged_groups.append(self.name)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, slot = job
            try:
                slot.result = fn()
            except BaseException as exc:  # handed to the caller thread
                slot.error = exc
            slot.event.set()


class _Slot:
    __slots__ = ("error", "event", "result")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


@atexit.register
def _exit_if_wedged() -> None:
    # atexit runs last-registered first: this module is imported after mpi4py.MPI registered
    # its MPI_Finalize, so this runs before it. A thread inside MPI would make Finalize wait.
    if not _wedged_groups:
        return
    sys.stdout.flush()
    sys.stderr.write(f"ubep.mpi: leaving without MPI_Finalize: a call of {_wedged_groups[0]} "
                     "is still inside MPI after a peer failure\n")
    sys.stderr.flush()
    os._exit(1)
