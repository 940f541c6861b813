"""The vLLM processes of the tests and of ``benchmarks/bench_vllm.py``: a free port, the
environment, processes whose answers are awaited together, stopping a process's whole session,
and the POSIX shared memory vLLM leaves.

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
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Watched", "expect_lines", "free_port", "stop_session", "sweep_vllm_shm",
           "vllm_env", "vllm_shm"]

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


class Watched:
    """A process in a session of its own, its output copied to ``log`` and its lines that
    start with one of ``prefixes`` kept for :func:`expect_lines`; ``send`` writes a line to
    its stdin."""

    def __init__(self, args: Sequence[str], env: dict[str, str], log: Path,
                 prefixes: tuple[str, ...] = ("READY", "RESULT ")) -> None:
        self.log = log
        self.prefixes = prefixes
        self.lines: queue.Queue[str] = queue.Queue()
        self.proc = subprocess.Popen(
            list(args), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._pump = threading.Thread(target=self._copy, daemon=True)
        self._pump.start()

    def _copy(self) -> None:
        assert self.proc.stdout is not None
        with self.log.open("w") as out:
            for line in self.proc.stdout:
                out.write(line)
                out.flush()
                if line.startswith(self.prefixes):
                    self.lines.put(line.rstrip("\n"))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # an exit is what expect_lines reports
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def exited(self) -> int | None:
        """The exit status once the process is gone and all its output is read, else None."""
        rc = self.proc.poll()
        if rc is not None:
            self._pump.join(timeout=10.0)
        return rc

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def close_input(self) -> None:
        """End its stdin (a vLLM worker of the benchmark then ends)."""
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()

    def stop(self, grace_s: float = 0.0) -> None:
        """Close its stdin, give it ``grace_s`` to end by itself (a vLLM worker then shuts
        its engine down cleanly), then :func:`stop_session`."""
        self.close_input()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        stop_session(self.proc)
        self._pump.join(timeout=10.0)


def expect_lines(procs: Sequence[Watched], prefix: str, timeout_s: float) -> list[str]:
    """The next kept line of every process of ``procs``, which must start with ``prefix``.

    Waits on all of them at once: the first that exits (a DP rank dying while its peers wait
    for it in a collective) raises ``RuntimeError`` with its log's tail at once, and
    ``TimeoutError`` names those that have not answered by the deadline."""
    got: list[str | None] = [None] * len(procs)
    deadline = time.monotonic() + timeout_s
    while True:
        for i, p in enumerate(procs):
            if got[i] is not None:
                continue
            with contextlib.suppress(queue.Empty):
                line = p.lines.get_nowait()
                if not line.startswith(prefix):
                    raise RuntimeError(f"{p.log.name}: {line[:200]!r} instead of {prefix!r}")
                got[i] = line
                continue
            rc = p.exited()
            if rc is not None and p.lines.empty():
                raise RuntimeError(f"{p.log.name}: exited {rc} before {prefix!r}:\n{p.tail()}")
        if all(line is not None for line in got):
            return [line for line in got if line is not None]
        if time.monotonic() > deadline:
            late = [p for p, line in zip(procs, got, strict=True) if line is None]
            raise TimeoutError(f"no {prefix!r} in {timeout_s:.0f} s from "
                               + ", ".join(p.log.name for p in late) + ":\n" + late[0].tail())
        time.sleep(0.05)


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
