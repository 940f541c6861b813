"""Which ubep shared-memory segments a test left behind.

Other jobs on the machine may be creating ubep segments at the same time, so a segment counts as
leaked only if it is new and its owner (the pid in its header, see ``ubep.runtime.shm``) is this
process or no longer alive.
"""

from __future__ import annotations

import os
import struct

from ubep.plane.liveness import alive
from ubep.plane.records import HDR_PID as _PID_OFFSET
from ubep.runtime.shm import SHM_DIR

__all__ = ["leaked_since", "ubep_segments"]

_PID = struct.Struct("<Q")


def ubep_segments() -> set[str]:
    """The names of every ubep segment in /dev/shm now."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("ubep")}
    except FileNotFoundError:
        return set()


def _owner_pid(name: str) -> int | None:
    try:
        with open(os.path.join(SHM_DIR, name), "rb") as f:
            f.seek(_PID_OFFSET)
            raw = f.read(_PID.size)
    except OSError:
        return None
    return _PID.unpack(raw)[0] if len(raw) == _PID.size else None


def _leaked(name: str) -> bool:
    pid = _owner_pid(name)
    return pid is None or pid == os.getpid() or not alive(pid, 0)


def leaked_since(before: set[str]) -> list[str]:
    """The segments that appeared since ``before`` (:func:`ubep_segments`) and whose owner is
    this process or dead, sorted."""
    return sorted(n for n in ubep_segments() - before if _leaked(n))
