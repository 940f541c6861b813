"""Clean-up that survives SIGKILL of a whole ``ubep.launch`` job: the reaper process.

``ubep.launch`` starts this file as a script (``python -I reaper.py``: standard library only,
nothing of ubep is imported, so it starts in a few tens of milliseconds) in a session of its own,
so a signal to the job's process group does not reach it. The reaper

1. creates the private rendezvous directory (mode 0700) and writes its path to stdout: the
   directory exists only while a reaper is there to remove it;
2. reads the pids of the ranks from stdin as the launcher starts them (``<pid> <start time>``
   per line);
3. at end of file on stdin (the launcher returned, raised, or was killed: the kernel closes
   the pipe in every case) waits until every rank has exited (ranks die with their launcher,
   see ``launch._child_main``), then unlinks every shared-memory segment whose name is recorded
   in the directory (a marker is written before the segment is created) and removes the
   directory.

The same marker sweep is used by the launcher itself, and by the ranks of an env-var launch
(``remove_dead_owners_segments``: only segments whose creator process is gone).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time

SHM_DIR = "/dev/shm"
MARKER_PREFIX = "segment."
_RANKS_EXIT_S = 30.0  # a rank killed by its parent's death is gone in milliseconds
_POLL_S = 0.02


def valid_segment_name(name: str) -> bool:
    """``ubep-`` followed by 32 lowercase hex digits (``shm.new_segment_name``)."""
    tail = name[len("ubep-"):]
    return name.startswith("ubep-") and len(tail) == 32 and all(
        c in "0123456789abcdef" for c in tail)


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


def write_marker(marker_dir: str, name: str) -> str:
    """Record ``name`` (and this process as its owner) before the segment is created."""
    path = os.path.join(marker_dir, MARKER_PREFIX + name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()} {start_time_of(os.getpid())}\n")
    return path


def _markers(marker_dir: str) -> list[tuple[str, str]]:
    try:
        entries = os.listdir(marker_dir)
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        name = entry[len(MARKER_PREFIX):]
        if entry.startswith(MARKER_PREFIX) and valid_segment_name(name):
            out.append((name, os.path.join(marker_dir, entry)))
    return out


def _owner(marker: str) -> tuple[int, int] | None:
    try:
        with open(marker) as f:
            pid, start = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        return None  # being written, or gone
    return pid, start


def _unlink(name: str, marker: str) -> bool:
    removed = False
    try:
        os.unlink(os.path.join(SHM_DIR, name))
        removed = True
    except FileNotFoundError:
        pass
    with contextlib.suppress(FileNotFoundError):
        os.unlink(marker)
    return removed


def remove_marked_segments(marker_dir: str) -> list[str]:
    """Unlink every segment recorded in ``marker_dir`` that still exists; return their names.

    For a launcher whose ranks have all exited: only names this job created are touched.
    """
    return [name for name, marker in _markers(marker_dir) if _unlink(name, marker)]


def remove_dead_owners_segments(marker_dir: str) -> list[str]:
    """Unlink the recorded segments whose creator process is gone (any rank may call it while
    others run: a live owner's segment is left alone)."""
    removed = []
    for name, marker in _markers(marker_dir):
        owner = _owner(marker)
        if owner is not None and not alive(*owner) and _unlink(name, marker):
            removed.append(name)
    return removed


def _wait_gone(ranks: list[tuple[int, int]]) -> None:
    deadline = time.monotonic() + _RANKS_EXIT_S
    while any(alive(p, s) for p, s in ranks) and time.monotonic() < deadline:
        time.sleep(_POLL_S)


def main() -> int:
    rendezvous = tempfile.mkdtemp(prefix="ubep-rdv-")
    try:
        sys.stdout.write(rendezvous + "\n")
        sys.stdout.flush()
        ranks: list[tuple[int, int]] = []
        for line in sys.stdin:  # until the launcher closes the pipe or dies
            with contextlib.suppress(ValueError):
                pid, start = (int(v) for v in line.split())
                ranks.append((pid, start))
        # Ranks get SIGKILL when the launcher dies, a moment after the pipe closed: wait for
        # the ranks the launcher registered and for the creator of every recorded segment.
        _wait_gone(ranks)
        _wait_gone([o for _, m in _markers(rendezvous) if (o := _owner(m)) is not None])
    finally:
        remove_marked_segments(rendezvous)
        shutil.rmtree(rendezvous, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
