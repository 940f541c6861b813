"""Suite-wide checks: no shared-memory segment of ubep outlives the processes that made it.

Other jobs on the machine may be creating ubep segments at the same time, so a segment counts
as leaked only if it appeared during this session and its owner (the pid in its header, see
``ubep.runtime.shm``) is this process or no longer alive.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator

import pytest

from ubep.runtime.abi import HDR_PID as _PID_OFFSET

SHM_DIR = "/dev/shm"
_PID = struct.Struct("<Q")


def _ubep_segments() -> set[str]:
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leaked(name: str) -> bool:
    pid = _owner_pid(name)
    return pid is None or pid == os.getpid() or not _alive(pid)


@pytest.fixture(autouse=True, scope="session")
def no_leaked_segments() -> Iterator[None]:
    before = _ubep_segments()
    yield
    leaked = sorted(n for n in _ubep_segments() - before if _leaked(n))
    for name in leaked:  # clean up so one failure does not poison later runs, then fail loudly
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
    assert not leaked, f"shared-memory segments left in {SHM_DIR}: {leaked}"
