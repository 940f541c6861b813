"""Process liveness on this host: a peer is alive while its pid exists, is not a zombie and
still has the start time it had when it joined (so a recycled pid is not mistaken for it).

Standard library only, no package imports: ``runtime/reaper.py`` also loads this file when it
runs as a script.
"""

from __future__ import annotations

import os

__all__ = ["alive", "start_time_of"]


def start_time_of(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (0 if unknown)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return 0
    return int(raw[raw.rfind(b")") + 2:].split()[19])


def alive(pid: int, start_time: int) -> bool:
    """Whether ``pid`` is running and is the process that had ``start_time`` (0: any)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    fields = raw[raw.rfind(b")") + 2:].split()
    if fields and fields[0] in (b"Z", b"X"):
        return False  # exited, not yet reaped
    return not start_time or int(fields[19]) == start_time
