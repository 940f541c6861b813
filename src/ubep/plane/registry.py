"""Which engine serves a Buffer: one row per transport name.

A row maps a name (``BufferConfig(transport=...)``) to the function that opens the engine on a
rank's :class:`~ubep.plane.protocol.GlobalMemory`: ``opener(memory, spec) -> Engine``. The
built-in rows name their opener by ``"module:function"``, imported on first use, so this package
imports no transport; a new transport adds a row (:func:`register_engine`) and nothing else
here. Without ``transport`` a Buffer takes its memory's (``GlobalMemory.transport``: ``"shm"`` where
every peer's region is load/store reachable, else ``"mpi"``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgumentError
from .protocol import Engine, EngineSpec, GlobalMemory

__all__ = [
    "Opener", "control_plane", "open_engine", "register_engine", "transports",
]


Opener = Callable[[GlobalMemory, EngineSpec], Engine]

# transport name -> its opener, or "module:function" naming it (imported on first use)
_ROWS: dict[str, Opener | str] = {
    "shm": "ubep.runtime.engine:open_shm",
    "mpi": "ubep.mpi.group:open_rma",
}


# the control planes a masking Buffer agrees on losses through, by the name a group gives
# (``group.control_plane``): the class, built ``of(group)`` or over a roster
_PLANES: dict[str, Any] = {"shm": "ubep.runtime.membership:OneHostPlane"}


def _load(table: dict[str, Any], name: str, what: str) -> Any:
    row = table.get(name)
    if row is None:
        raise InvalidArgumentError(what, name, f"must be one of {tuple(table)}")
    if isinstance(row, str):
        module, _, attr = row.partition(":")
        row = table[name] = getattr(importlib.import_module(module), attr)
    return row


def control_plane(name: str) -> Any:
    """The control-plane class of ``name`` (``"shm"``: the rendezvous directory's)."""
    return _load(_PLANES, name, "control_plane")


def register_engine(name: str, opener: Opener) -> None:
    """Add (or replace) the row of transport ``name``."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError("name", name, "must be a non-empty str")
    _ROWS[name] = opener


def transports() -> tuple[str, ...]:
    """The transport names a config may give."""
    return tuple(_ROWS)


def _opener(name: str) -> Opener:
    opener: Opener = _load(_ROWS, name, "transport")
    return opener


def open_engine(memory: GlobalMemory, spec: EngineSpec) -> Engine:
    """The engine of ``spec.config.transport`` (its memory's when ``None``) on ``memory``."""
    name = getattr(spec.config, "transport", None) or memory.transport
    return _opener(name)(memory, spec)
