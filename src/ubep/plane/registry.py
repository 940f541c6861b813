"""Which engine serves a Buffer: one row per transport name.

A row maps a name (``BufferConfig(transport=...)``) to the function that opens the engine on a
rank's :class:`~ubep.plane.protocol.GlobalMemory`: ``opener(memory, spec) -> Engine``. The
built-in rows name their opener by ``"module:function"``, imported on first use, so this package
imports no transport; a new transport adds a row (:func:`register_engine`) and nothing else
here. Without ``transport`` a Buffer takes its memory's (``GlobalMemory.transport``: ``"shm"`` where
every peer's region is load/store reachable, else ``"mpi"``).

A row may also size its engine's memory: ``memory_bytes(config, num_ranks, num_cores) -> int``,
the bytes each rank's region needs (an engine with a layout of its own), which also refuses a
config the engine does not serve (``InvalidArgumentError`` naming the field) before anything is
mapped. A row without one runs on :func:`ubep.plane.layout.compute_layout`'s segment.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgumentError
from .protocol import Engine, EngineSpec, GlobalMemory

__all__ = [
    "MemoryBytes", "Opener", "control_plane", "memory_bytes", "open_engine", "register_engine",
    "transports",
]


Opener = Callable[[GlobalMemory, EngineSpec], Engine]
MemoryBytes = Callable[[Any, int, int], int]  # (config, num_ranks, num_cores) -> bytes per rank

# transport name -> its opener, or "module:function" naming it (imported on first use)
_ROWS: dict[str, Opener | str] = {
    "shm": "ubep.runtime.engine:open_shm",
    "mpi": "ubep.mpi.group:open_rma",
    "triton": "ubep.triton.plane:open_triton",
}

# transport name -> the size of its memory, for rows whose engine lays its memory out itself
_SIZES: dict[str, MemoryBytes | str] = {
    "triton": "ubep.triton.plane:memory_bytes",
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


def register_engine(name: str, opener: Opener, memory: MemoryBytes | None = None) -> None:
    """Add (or replace) the row of transport ``name``; ``memory``: its memory's size (module
    docstring), ``None``: the segment of ``ubep.plane.layout``."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError("name", name, "must be a non-empty str")
    _ROWS[name] = opener
    _SIZES.pop(name, None)
    if memory is not None:
        _SIZES[name] = memory


def memory_bytes(config: Any, num_ranks: int, num_cores: int) -> int | None:
    """Bytes of one rank's region for the engine ``config.transport`` names, if its row sizes
    its memory itself; ``None`` for the segment of ``ubep.plane.layout`` (the built-in rows,
    and a config that names no transport: its memory's). Refuses a config that engine does
    not serve, by the field."""
    name = getattr(config, "transport", None)
    if name is None:
        return None
    if name not in _ROWS:  # refused here, before anything is mapped
        raise InvalidArgumentError("transport", name, f"must be one of {tuple(_ROWS)}")
    if name not in _SIZES:
        return None
    size: MemoryBytes = _load(_SIZES, name, "transport")
    return int(size(config, num_ranks, num_cores))


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
