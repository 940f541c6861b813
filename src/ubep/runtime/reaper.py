"""Clean-up that survives SIGKILL of a whole job: the reaper process of ``ubep.launch``, of a
torch.distributed-backed group (``ubep.torch.group``, for jobs ``torchrun`` started) and of each
rank of an env-var launch (``ubep.runtime.group_from_env``: its own reaper, listing no ranks,
its directory naming that rank's segments besides the rendezvous directory).

The job's feeder (the ``ubep.launch`` parent, or group rank 0 of a torch group) starts this file
as a script (``python -I -S reaper.py FEEDER_PID FEEDER_START``: standard library only, nothing
of ubep is imported, so it starts in a few tens of milliseconds) in a session of its own, so a
signal to the job's process group does not reach it. One protocol for both:

1. it creates the private directory (``mkdtemp``, mode 0700) and writes its path to stdout:
   the directory exists only while a reaper is there to remove it;
2. it reads the ranks from stdin, ``<pid> <start time>`` per line, as the feeder learns them
   (the launcher as it starts each rank; torch rank 0 all at once after the bootstrap);
3. at end of file on stdin (the feeder closed it, returned, raised or was killed: the kernel
   closes the pipe in every case), or once the feeder is gone, it waits until every listed rank
   and the creator of every recorded segment has exited (ranks of ``ubep.launch`` die with their
   launcher, see ``launch._child_main``; ranks of torchrun run as long as the job), then unlinks
   every shared-memory segment whose name is recorded in the directory (a marker is written
   before the segment is created) and removes the directory.

The same marker sweep is used by the launcher itself, and by the ranks of an env-var launch
over their rendezvous directory (``remove_dead_owners_segments``: only segments whose creator
process is gone); ``python -m ubep.runtime.reaper --sweep DIR`` runs it from a job script.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

if __package__:
    from ..plane.liveness import alive, start_time_of
else:
    # Run as a script (``python -I -S reaper.py``): importing ``ubep.plane.liveness`` would run
    # the packages' ``__init__`` (numpy, the native build), which a reaper must not wait for,
    # so the one copy of the liveness test is loaded from its file, under a name of its own (the
    # search path stays as ``-I`` made it).
    import importlib.util

    _LIVENESS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "plane", "liveness.py")
    _spec = importlib.util.spec_from_file_location("_ubep_reaper_liveness", _LIVENESS)
    assert _spec is not None and _spec.loader is not None
    _liveness = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_liveness)
    alive, start_time_of = _liveness.alive, _liveness.start_time_of

SHM_DIR = "/dev/shm"
MARKER_PREFIX = "segment."
# How often the feeder's (stdin open), then the ranks' liveness is checked: a torchrun job runs
# for hours beside its reaper, which must stay cheap; a finished launch's ranks are gone at once.
_POLL_S = 0.1


def valid_segment_name(name: str) -> bool:
    """``ubep-`` followed by 32 lowercase hex digits (``shm.new_segment_name``)."""
    tail = name[len("ubep-"):]
    return name.startswith("ubep-") and len(tail) == 32 and all(
        c in "0123456789abcdef" for c in tail)


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


def forget_segment(marker_dir: str, name: str) -> None:
    """Unlink segment ``name`` and its marker in ``marker_dir`` (either may be gone already):
    what any rank does for every segment of an object once every peer has mapped it."""
    _unlink(name, os.path.join(marker_dir, MARKER_PREFIX + name))


def remove_marked_segments(marker_dir: str) -> list[str]:
    """Unlink every segment recorded in ``marker_dir`` that still exists; return their names.

    For a launcher whose ranks have all exited: only names this job created are touched.
    """
    return [name for name, marker in _markers(marker_dir) if _unlink(name, marker)]


def remove_dead_owners_segments(marker_dir: str) -> list[str]:
    """Unlink the recorded segments whose creator process is gone, with their markers (any rank
    may call it while others run: a live owner's segment is left alone); return their names,
    also of those the creator's own reaper had unlinked already: each is a rank that died."""
    removed = []
    for name, marker in _markers(marker_dir):
        owner = _owner(marker)
        if owner is not None and not alive(*owner):
            _unlink(name, marker)
            removed.append(name)
    return removed


# --- the feeder's side (ubep.launch, ubep.torch.group) ------------------------------------


def spawn(timeout_s: float) -> tuple[subprocess.Popen[bytes], str]:
    """Start the reaper of this process's job (its own session, this process its feeder).

    Returns the process and the private directory it created; the directory is ``""`` when the
    reaper reported none within ``timeout_s`` seconds (it is then killed; the caller raises).
    Its stderr is closed: it outlives the job, and must not hold a launcher's log pipe open.
    """
    me = os.getpid()
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), str(me), str(start_time_of(me))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, timeout_s))
    directory = proc.stdout.readline().decode().strip() if ready else ""
    proc.stdout.close()
    if not directory:
        proc.kill()
        proc.wait()
    return proc, directory


def feed(proc: subprocess.Popen[bytes], ranks: list[tuple[int, int]]) -> None:
    """List ranks, ``(pid, start time)`` each, to the reaper ``proc``."""
    assert proc.stdin is not None
    proc.stdin.write("".join(f"{pid} {start}\n" for pid, start in ranks).encode())
    proc.stdin.flush()


def end_feed(proc: subprocess.Popen[bytes], wait_s: float = 0.0) -> None:
    """End the list (the reaper cleans up once the listed ranks are gone); wait up to ``wait_s``
    seconds for it to exit (0: do not wait). A reaper that already died is no error here."""
    assert proc.stdin is not None
    with contextlib.suppress(OSError):
        proc.stdin.close()
    if wait_s > 0:
        with contextlib.suppress(subprocess.TimeoutExpired):  # then it finishes on its own
            proc.wait(wait_s)


# --- the reaper's side ----------------------------------------------------------------------


def _read_ranks(feeder: tuple[int, int] | None) -> list[tuple[int, int]]:
    """The ``(pid, start time)`` lines of stdin until end of file, or until ``feeder`` is gone
    (a child that inherited the pipe may hold it open after the feeder died)."""
    ranks: list[tuple[int, int]] = []
    pending = b""
    fd = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([fd], [], [], _POLL_S)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            ranks += _parse(lines)
        elif feeder is not None and not alive(*feeder):
            break
    return ranks + _parse([pending])


def _parse(lines: list[bytes]) -> list[tuple[int, int]]:
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):
            pid, start = (int(v) for v in line.split())
            out.append((pid, start))
    return out


def _wait_gone(processes: list[tuple[int, int]]) -> None:
    while any(alive(pid, start) for pid, start in processes):
        time.sleep(_POLL_S)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "--sweep":  # a job script's: the dead creators' segments
        for name in remove_dead_owners_segments(argv[2]):
            sys.stdout.write(f"removed {name}\n")
        return 0
    feeder = (int(argv[1]), int(argv[2])) if len(argv) == 3 else None
    directory = tempfile.mkdtemp(prefix="ubep-rdv-")
    try:
        sys.stdout.write(directory + "\n")
        sys.stdout.flush()
        ranks = _read_ranks(feeder)
        # The ranks the feeder listed, and the creator of every recorded segment.
        _wait_gone(ranks)
        _wait_gone([o for _, m in _markers(directory) if (o := _owner(m)) is not None])
    finally:
        remove_marked_segments(directory)
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
