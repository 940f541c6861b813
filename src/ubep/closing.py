"""``with obj:`` closes ``obj``: the context-manager rule of every ubep object that owns a
resource released by ``close()`` (groups, engines), written once (a ``Buffer`` writes its own:
no class of ``ubep.buffer`` inherits another)."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["Closing"]

_T = TypeVar("_T", bound="Closing")


class Closing:
    """Base of an object whose :meth:`close` (local, harmless when repeated) releases what it
    owns; leaving a ``with`` block on it calls ``close()``, whatever ended the block."""

    __slots__ = ()

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
