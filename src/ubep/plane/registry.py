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

A row may instead bring its engine's memory (:func:`own_memory`: ``opener(group, spec) ->
Engine``, a collective over the Buffer's group): the engine opens memory of its device itself
(the Triton row: CUDA IPC handles on a GPU), and the Buffer maps nothing for it. The engine's
device (``EngineSpec.device``) is the row's to say (:func:`engine_device`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgumentError
from .protocol import Engine, EngineSpec, GlobalMemory, ProcessGroup

__all__ = [
    "GroupOpener", "MemoryBytes", "Opener", "control_plane", "engine_device", "memory_bytes",
    "open_engine", "own_memory", "register_engine", "transports",
]


Opener = Callable[[GlobalMemory, EngineSpec], Engine]
MemoryBytes = Callable[[Any, int, int], int]  # (config, num_ranks, num_cores) -> bytes per rank
GroupOpener = Callable[[ProcessGroup, EngineSpec], Engine]  # a row that brings its memory

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


# transport name -> its opener on the group, for rows whose engine brings its own memory, and
# the device its engine runs on (``config -> "cpu" / "cuda:N"``; default "cpu")
_OWN: dict[str, GroupOpener | str] = {
    "triton": "ubep.triton.plane:open_triton_memory",
}
_DEVICES: dict[str, Callable[[Any], str] | str] = {
    "triton": "ubep.triton.plane:engine_device",
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


def register_engine(name: str, opener: Opener, memory: MemoryBytes | None = None, *,
                    own_memory: GroupOpener | None = None,
                    device: Callable[[Any], str] | None = None) -> None:
    """Add (or replace) the row of transport ``name``; ``memory``: its memory's size (module
    docstring), ``None``: the segment of ``ubep.plane.layout``; ``own_memory``: its opener on
    the group when the engine brings its own memory (the Buffer then maps none); ``device``:
    the engine's device for a config (default ``"cpu"``)."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError("name", name, "must be a non-empty str")
    _ROWS[name] = opener
    _SIZES.pop(name, None)
    _OWN.pop(name, None)
    _DEVICES.pop(name, None)
    if memory is not None:
        _SIZES[name] = memory
    if own_memory is not None:
        _OWN[name] = own_memory
    if device is not None:
        _DEVICES[name] = device


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


def own_memory(config: Any) -> GroupOpener | None:
    """The opener on the group of the engine ``config.transport`` names, if that engine brings
    its own memory (the Buffer then maps none: :meth:`ubep.Buffer._setup`); else ``None``."""
    name = getattr(config, "transport", None)
    if name is None or name not in _OWN:
        return None
    opener: GroupOpener = _load(_OWN, name, "transport")
    return opener


def engine_device(config: Any) -> str:
    """The device the engine ``config.transport`` names runs on (``EngineSpec.device``)."""
    name = getattr(config, "transport", None)
    if name is None or name not in _DEVICES:
        return "cpu"
    device: Callable[[Any], str] = _load(_DEVICES, name, "transport")
    return str(device(config))


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
