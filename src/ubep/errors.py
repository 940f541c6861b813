"""Error types of ubep.

One base class, :class:`UbepError`. Subclasses are also the builtin exception a caller would
catch for that kind of failure (``ValueError`` for bad input, ``TimeoutError`` for a wait that
ran past its deadline), so generic ``except ValueError`` code keeps working.
"""

from __future__ import annotations

import builtins
from typing import Any

__all__ = [
    "InvalidArgumentError",
    "PeerLostError",
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


class TimeoutError(UbepError, builtins.TimeoutError):  # noqa: A001 - deliberate, subclasses it
    """A wait passed its deadline. The message names the rank, core and what it waited for."""


class PeerLostError(UbepError, ConnectionError):
    """A peer rank died (its process is gone) while this rank depended on it."""


class RemoteError(UbepError):
    """Another rank rejected the same collective call (its message is included)."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        self.message = message
        super().__init__(f"rank {rank} failed this call: {message}")


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
