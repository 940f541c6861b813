"""The vLLM processes of the tests and of ``benchmarks/bench_vllm.py``: a free port, the
environment, stopping a process's whole session, and the POSIX shared memory vLLM leaves.

vLLM's engines talk through ``multiprocessing.shared_memory`` segments (``psm_*``) and
semaphores (``sem.mp-*``), its CPU communicators through ``vllm_dist_*`` segments, and they
unlink them when they shut down; a process that is SIGKILLed (a deadline, a DP rank killed on
purpose) cannot, and its resource tracker dies with its session. So a session is asked to stop
first (SIGTERM), killed only if it does not, and what its processes left in /dev/shm is removed
once none of them lives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["free_port", "stop_session", "sweep_vllm_shm", "vllm_env", "vllm_shm"]

SHM = Path("/dev/shm")
_PREFIXES = ("psm_", "sem.mp-", "vllm_")  # vllm_dist_*: its CPU TP communicator
STOP_GRACE_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_env(base: dict[str, str], **extra: str) -> dict[str, str]:
    """This process's environment without vLLM's and ubep's variables, then ``base``, then
    ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "UBEP_"))}
    env.update(base)
    env.update(extra)
    return env


def stop_session(proc: subprocess.Popen[str]) -> None:
    """Stop ``proc``'s whole session (vLLM's engine and worker processes too): SIGTERM, and
    SIGKILL what is left after ``STOP_GRACE_S``."""
    for sig, grace_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 30.0)):
        with contextlib.suppress(ProcessLookupError):  # the leader may be gone, not its children
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + grace_s
        while _session_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not _session_alive(proc.pid):
            break
    proc.wait(timeout=30)


def _session_alive(sid: int) -> bool:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry.name)) == sid and _state(entry) != "Z":
                    return True
    return False


def _state(entry: Path) -> str:
    stat = (entry / "stat").read_text()
    return stat[stat.rindex(")") + 2]


def vllm_shm() -> set[str]:
    """The names of vLLM's kind of POSIX shared memory in /dev/shm now."""
    with contextlib.suppress(FileNotFoundError):
        return {p.name for p in SHM.iterdir() if p.name.startswith(_PREFIXES)}
    return set()


def sweep_vllm_shm(before: set[str]) -> list[str]:
    """Remove what appeared since ``before`` (:func:`vllm_shm`) that no live process has
    mapped or open (another job's stays); the names removed."""
    gone = []
    in_use = _in_use()
    for name in sorted(vllm_shm() - before):
        if name not in in_use:
            with contextlib.suppress(FileNotFoundError):
                (SHM / name).unlink()
                gone.append(name)
    return gone


def _in_use() -> set[str]:
    used: set[str] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in (entry / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    used.add(line.rsplit("/dev/shm/", 1)[1].split()[0])
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("/dev/shm/"):
                        used.add(target[len("/dev/shm/"):])
    return used
