"""A Buffer's engine wrapped to count the calls of its two doors (dispatch, combine)."""

from __future__ import annotations

from typing import Any


class EngineSpy:
    """Forwards everything to ``engine``; ``calls[door]`` counts the calls made, ``ran[door]``
    those the engine answered itself (anything but None, which hands the call back)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.calls = {"dispatch": 0, "combine": 0}
        self.ran = {"dispatch": 0, "combine": 0}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def _count(self, door: str, *args: Any) -> Any:
        self.calls[door] += 1
        got = getattr(self._engine, door)(*args)
        self.ran[door] += got is not None
        return got

    def dispatch(self, *args: Any) -> Any:
        return self._count("dispatch", *args)

    def combine(self, *args: Any) -> Any:
        return self._count("combine", *args)
