"""Error types of ubep.

One base class, :class:`UbepError`. Subclasses are also the builtin exception a caller would
catch for that kind of failure (``ValueError`` for bad input, ``TimeoutError`` for a wait that
ran past its deadline), so generic ``except ValueError`` code keeps working.
"""

from __future__ import annotations

import builtins
from typing import Any

__all__ = [
    "CallLostError",
    "InvalidArgumentError",
    "NoQuorumError",
    "OutOfStepError",
    "PeerLostError",
    "RankFailedError",
    "RankMaskedError",
    "RemoteError",
    "TimeoutError",
    "UbepError",
]


class UbepError(Exception):
    """Base class of every error ubep raises on purpose."""


class InvalidArgumentError(UbepError, ValueError):
    """Bad input: wrong shape, dtype, value range or combination.

    ``argument`` names the offending argument and ``value`` carries (a summary of) the bad value,
    so callers and logs can tell which of several tensors was wrong.
    """

    def __init__(self, argument: str, value: Any, problem: str) -> None:
        self.argument = argument
        self.value = value
        self.problem = problem
        super().__init__(f"{argument}={_short(value)}: {problem}")


class TimeoutError(UbepError, builtins.TimeoutError):
    """A wait passed its deadline. The message names the rank, core and what it waited for."""


class PeerLostError(UbepError, ConnectionError):
    """A peer rank died (its process is gone) while this rank depended on it."""


class RankMaskedError(PeerLostError):
    """The survivors of a masking Buffer (``on_peer_loss="mask"``) agreed that this rank is lost
    (it died to them, or was stopped or too slow past the deadline): it is out of the group and
    every call on the Buffer raises this until it rejoins."""


class NoQuorumError(RankMaskedError):
    """A masking Buffer over MPI lost ranks, and the side this rank is on holds no quorum
    (more than half of the group's ranks, or ``BufferConfig.min_live_ranks``): it does not
    serve on, so that at most one side of a partition does (``ubep.mpi.quorum``)."""


class CallLostError(PeerLostError):
    """A masking Buffer lost a rank while split-phase calls (``return_recv_hook=True``) were
    open: the survivors masked it and serve the next call over the members, but the calls open
    at the loss did not complete. Every survivor raises this, in the call the loss struck or,
    on a survivor that had finished that call, in its next one."""


class RemoteError(UbepError):
    """Another rank failed the same collective call (its message is included).

    ``clean`` is true when that rank rejected the call before anything of it reached a peer
    (bad input): the ranks are still in step and the next call works. Otherwise the Buffer has
    lost step and refuses calls until :meth:`ubep.Buffer.resync`.
    """

    def __init__(self, rank: int, message: str, clean: bool = True) -> None:
        self.rank = rank
        self.message = message
        self.clean = clean
        super().__init__(f"rank {rank} failed this call: {message}")


class OutOfStepError(UbepError):
    """The Buffer lost step with its peers (a call timed out, a peer failed mid-call, corrupt
    control data was found, ranks made different calls): it refuses every call until
    ``buf.resync()`` has run on every rank (or a new Buffer is built). Never wrong data."""


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RankFailedError(UbepError):
    """A rank started by :func:`ubep.launch` raised, exited abnormally or was killed.

    Attributes:
        rank: the rank reported (the first one whose failure was not a consequence of another
            rank's, e.g. a ``PeerLostError``).
        exitcode: the process exit code (negative: killed by that signal), ``None`` while alive.
        remote_type: class name of the exception the rank raised (``""`` if it died without one).
        remote_traceback: the rank's formatted traceback (``""`` if none).
        results: ``{rank: return value}`` of the ranks that did finish.
        failures: ``{rank: one-line description}`` of every rank that failed.
    """

    def __init__(
        self,
        rank: int,
        message: str,
        *,
        exitcode: int | None = None,
        remote_type: str = "",
        remote_traceback: str = "",
        results: dict[int, Any] | None = None,
        failures: dict[int, str] | None = None,
    ) -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
        self.results = dict(results or {})
        self.failures = dict(failures or {})
        super().__init__(message)


def _reduce_invalid_argument(self: InvalidArgumentError) -> tuple[Any, ...]:
    return (InvalidArgumentError, (self.argument, self.value, self.problem))


def _reduce_remote(self: RemoteError) -> tuple[Any, ...]:
    return (RemoteError, (self.rank, self.message, self.clean))


# Exceptions pickle through ``self.args`` by default, which does not match these constructors;
# ubep.launch sends a rank's exception to the parent, so they must round-trip.
InvalidArgumentError.__reduce__ = _reduce_invalid_argument  # type: ignore[assignment,method-assign]
RemoteError.__reduce__ = _reduce_remote  # type: ignore[assignment,method-assign]


class Unviewable:
    """What the torch door hands a Buffer's call for a tensor numpy cannot view (a GPU tensor, a
    ``meta`` one): not a tensor, so the call does not come back to the bridge, and its checks
    (``ubep.buffer.checks.to_array``) raise ``error`` inside the call, where the rejection
    reaches every rank."""

    __slots__ = ("error",)

    def __init__(self, error: UbepError) -> None:
        self.error = error
