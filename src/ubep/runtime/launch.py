"""``ubep.launch``: run a function on N spawned ranks and collect what they return.

Each rank is a fresh process (``spawn``: nothing inherited but the arguments), joined into a
:class:`~ubep.runtime.group.Group` through a private temporary directory (mode 0700; no port).
Results come back in rank order. A rank that raises has its exception and traceback re-raised in
the caller as :class:`ubep.errors.RankFailedError` (``__cause__`` is the original exception when
it pickles); the other ranks are given a short grace period to finish (they usually fail fast
with ``PeerLostError``/``RemoteError``) and are then killed. A launch that runs past
``timeout_s`` dumps every live rank's Python stack to stderr (faulthandler), kills them all and
raises ``ubep.TimeoutError``. Shared-memory segments a dead rank had not yet unlinked are removed.

Nothing outlives the launcher: each rank asks the kernel for SIGKILL when its launcher dies
(``PR_SET_PDEATHSIG``, then checks that its parent is still the launcher, which closes the race
with a launcher that died first), and a reaper process in a session of its own
(:mod:`ubep.runtime.reaper`) owns the rendezvous directory: when the launcher is gone, however
it went (SIGKILL of the whole process group included), it waits for the ranks to exit and
removes their unlinked segments and the directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from ..errors import (
    InvalidArgumentError,
    PeerLostError,
    RankFailedError,
    RemoteError,
    TimeoutError,
    UbepError,
)
from ..topology import Topology
from . import reaper as _reaper
from .group import Group
from .main_guard import check_main_guard
from .shm import remove_marked_segments

__all__ = ["LostRank", "launch"]

# After the first failure, how long the other ranks get to finish or fail on their own.
_GRACE_S = 10.0
_CONSEQUENTIAL = (PeerLostError.__name__, RemoteError.__name__)
_REAPER_START_S = 30.0  # a stdlib-only script: tens of ms, unless the host is overloaded
_REAPER_EXIT_S = 10.0
_PR_SET_PDEATHSIG = 1


# BLAS / OpenMP thread pools of one rank each default to every core, so ranks-as-processes
# oversubscribe the host many times over (OpenBLAS's idle threads even spin). As torchrun does,
# a rank gets one compute thread unless the caller set these variables.
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def _one_compute_thread_per_rank() -> Iterator[None]:
    unset = [v for v in _THREAD_VARS if v not in os.environ]
    for var in unset:
        os.environ[var] = "1"  # spawned children copy the parent's environment at start()
    try:
        yield
    finally:
        for var in unset:
            os.environ.pop(var, None)


def launch(
    fn: Callable[..., Any],
    num_ranks: int,
    *args: Any,
    timeout_s: float = 120.0,
    topology: Topology | None = None,
    keep_survivors: bool = False,
) -> list[Any]:
    """Run ``fn(group, *args)`` on ``num_ranks`` new processes; return their results in rank order.

    Args:
        fn: a picklable (module-level) function; its return value must pickle.
        num_ranks: number of ranks (processes) to start.
        *args: passed to ``fn`` after the group (must pickle).
        timeout_s: deadline for the whole run; past it every rank is killed.
        topology: the group's topology (default ``ubep.topology.host(num_ranks)``).
        keep_survivors: for ranks that serve on after a peer's loss (a Buffer with
            ``on_peer_loss="mask"``): a rank that fails does not end the others; its entry
            in the result is a :class:`LostRank`, the others' are their return values.

    Raises:
        RankFailedError: a rank raised or died (message holds its traceback); not with
            ``keep_survivors``.
        ubep.TimeoutError: the run passed ``timeout_s``.
    """
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise InvalidArgumentError("num_ranks", num_ranks, "must be a positive integer")
    if not timeout_s > 0:
        raise InvalidArgumentError("timeout_s", timeout_s, "must be > 0")
    if topology is not None and topology.num_ranks != num_ranks:
        raise InvalidArgumentError(
            "topology", topology.name, f"has {topology.num_ranks} ranks, expected {num_ranks}"
        )
    check_main_guard(sys._getframe(1))  # before any process starts: the ranks re-run the script
    ctx = mp.get_context("spawn")
    reaper, rendezvous = _start_reaper()  # the directory: mode 0700, private to this user
    group_id = os.urandom(16)
    procs: list[Any] = []
    readers: list[Connection] = []
    try:
        with _one_compute_thread_per_rank():
            for rank in range(num_ranks):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_child_main,
                    args=(fn, rank, num_ranks, rendezvous, group_id, topology, args, timeout_s,
                          writer, os.getpid()),
                    name=f"ubep-rank-{rank}",
                    daemon=True,
                )
                proc.start()
                _register(reaper, proc.pid)
                writer.close()
                procs.append(proc)
                readers.append(reader)
        return _collect(procs, readers, timeout_s, keep_survivors)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        for reader in readers:
            reader.close()
        remove_marked_segments(rendezvous)
        _stop_reaper(reaper)  # it removes the directory


def _start_reaper() -> tuple[subprocess.Popen[bytes], str]:
    """The reaper process (its own session) and the rendezvous directory it created."""
    proc, path = _reaper.spawn(_REAPER_START_S)
    if not path:
        raise UbepError(f"ubep.launch: the reaper process did not start (exit code "
                        f"{proc.returncode}) and created no rendezvous directory")
    return proc, path


def _register(reaper: subprocess.Popen[bytes], pid: int | None) -> None:
    assert pid is not None
    _reaper.feed(reaper, [(pid, _reaper.start_time_of(pid))])


def _stop_reaper(reaper: subprocess.Popen[bytes]) -> None:
    """End of input: the reaper sees every rank gone, removes the directory and exits."""
    _reaper.end_feed(reaper, _REAPER_EXIT_S)


def _collect(procs: list[Any], readers: list[Connection], timeout_s: float,
             keep_survivors: bool) -> list[Any]:
    num_ranks = len(procs)
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    failures: dict[int, tuple[str, str, str, BaseException | None, int | None]] = {}
    pending = set(range(num_ranks))
    first_failure_s: float | None = None
    by_conn = {id(r): i for i, r in enumerate(readers)}
    by_sentinel = {p.sentinel: i for i, p in enumerate(procs)}
    while pending:
        now = time.monotonic()
        if first_failure_s is not None and not keep_survivors:
            deadline = min(deadline, first_failure_s + _GRACE_S)
        if now >= deadline:
            break
        waitables: list[Any] = [readers[r] for r in pending] + [procs[r].sentinel for r in pending]
        for ready in wait(waitables, timeout=deadline - now):
            rank = by_sentinel[ready] if isinstance(ready, int) else by_conn[id(ready)]
            if rank not in pending:
                continue
            message = _try_recv(readers[rank])
            if message is None and not isinstance(ready, int):
                continue  # EOF on the pipe: the sentinel reports the exit
            if message is None:
                procs[rank].join(1)  # reap now, so peers' liveness checks see it gone
                code = procs[rank].exitcode
                failures[rank] = ("", _describe_exit(code), "", None, code)
            elif message[0] == "ok":
                results[rank] = message[1]
            else:
                type_name, text, tb, blob = message[1]
                failures[rank] = (type_name, text, tb, _unpickle(blob), None)
            pending.discard(rank)
        if failures and first_failure_s is None:
            first_failure_s = time.monotonic()
    if pending:
        for rank in sorted(pending):
            _dump_stack(procs[rank])
        if not failures:
            raise TimeoutError(
                f"ubep.launch: rank(s) {sorted(pending)} did not finish within "
                f"timeout_s={timeout_s} (stacks dumped to stderr); all ranks killed"
            )
        for rank in pending:
            failures[rank] = ("", "killed: still running after another rank failed", "", None,
                              None)
    if failures and keep_survivors and not pending:
        return [results[r] if r in results else LostRank(r, failures[r][1], failures[r][4])
                for r in range(num_ranks)]
    if failures:
        raise _failure(failures, results)
    return [results[r] for r in range(num_ranks)]


@dataclass(frozen=True)
class LostRank:
    """The entry of a rank that failed in ``launch(..., keep_survivors=True)``.

    Attributes:
        rank: the rank.
        description: what ended it (its exception's message, or how the process exited).
        exitcode: the process exit code (negative: the signal that killed it), ``None`` when
            it raised.
    """

    rank: int
    description: str
    exitcode: int | None


def _failure(
    failures: dict[int, tuple[str, str, str, BaseException | None, int | None]],
    results: dict[int, Any],
) -> RankFailedError:
    # Report the root cause: a rank whose error is not a consequence of another rank's.
    primary = min(failures, key=lambda r: (failures[r][0] in _CONSEQUENTIAL or
                                           not failures[r][0], r))
    type_name, _message, tb, cause, code = failures[primary]
    summary = {r: (f"{f[0]}: {f[1]}" if f[0] else f[1]) for r, f in failures.items()}
    lines = [f"rank {primary} failed: {summary[primary]}"]
    others = {r: s for r, s in summary.items() if r != primary}
    if others:
        lines.append(f"other ranks: {others}")
    if tb:
        lines.append(f"--- traceback of rank {primary} ---\n{tb.rstrip()}")
    err = RankFailedError(
        primary, "\n".join(lines), exitcode=code, remote_type=type_name, remote_traceback=tb,
        results=results, failures=summary,
    )
    if cause is not None:
        err.__cause__ = cause
    return err


def _try_recv(conn: Connection) -> tuple[str, Any] | None:
    """The rank's message if one is waiting, ``None`` at EOF or when nothing is there."""
    try:
        if conn.poll():
            message: tuple[str, Any] = conn.recv()
            return message
    except (EOFError, OSError):
        pass
    return None


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code} without reporting a result"


def _dump_stack(proc: Any) -> None:
    if proc.is_alive() and proc.pid is not None:
        try:
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.2)
        except ProcessLookupError:
            pass


def _unpickle(blob: bytes | None) -> BaseException | None:
    if blob is None:
        return None
    try:
        obj = pickle.loads(blob)
    except Exception:
        return None
    return obj if isinstance(obj, BaseException) else None


def _child_main(
    fn: Callable[..., Any],
    rank: int,
    num_ranks: int,
    rendezvous: str,
    group_id: bytes,
    topology: Topology | None,
    args: tuple[Any, ...],
    timeout_s: float,
    conn: Connection,
    launcher_pid: int,
) -> None:
    _die_with_launcher(launcher_pid)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _mpi_files_in(rendezvous)
    group: Group | None = None
    try:
        # the launcher's reaper owns the rendezvous directory: no reaper of the rank's own
        group = Group(rank, num_ranks, rendezvous, group_id=group_id, topology=topology,
                      timeout_s=timeout_s, own_reaper=False)
        result = fn(group, *args)
        message: tuple[str, Any] = ("ok", result)
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        try:
            blob: bytes | None = pickle.dumps(exc)
        except Exception:
            blob = None
        message = ("err", (type(exc).__name__, str(exc), traceback.format_exc(), blob))
    finally:
        if group is not None:
            group.close()
    message = _finalize_mpi(message)
    try:
        conn.send(message)
    except Exception as exc:  # the result itself does not pickle
        conn.send(("err", (type(exc).__name__, f"result of fn could not be sent: {exc}",
                           traceback.format_exc(), None)))
    conn.close()


# Open MPI's shared-memory transport backs its segment (``sm_segment.<host>.<uid>.<job>.<rank>``)
# with a file in /dev/shm, and only its launcher's daemon removes it: a rank that imports
# mpi4py.MPI outside mpiexec is a singleton with no daemon, so the file outlives it, finalized
# or not. The rank's MPI gets the rendezvous directory instead, which the reaper removes.
_MPI_BACKING_VAR = "OMPI_MCA_btl_sm_backing_directory"


def _mpi_files_in(rendezvous: str) -> None:
    """Point Open MPI's shared-memory files of this rank into ``rendezvous`` (unless the caller
    chose a directory); read when ``fn`` first initialises MPI."""
    if _MPI_BACKING_VAR not in os.environ:
        os.environ[_MPI_BACKING_VAR] = rendezvous


def _finalize_mpi(message: tuple[str, Any]) -> tuple[str, Any]:
    """Finalize the MPI that ``fn`` initialised (importing ``mpi4py.MPI`` does), before the
    result goes out: once the launcher has every result it kills what is still running, and a
    rank killed before mpi4py's exit hook leaves Open MPI's ``sm_segment.*`` files in
    ``/dev/shm``. A rank whose MPI is wedged (``ubep.mpi.watchdog``) must not enter
    ``MPI_Finalize``: its exit hook leaves without it."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return message
    watchdog = sys.modules.get("ubep.mpi.watchdog")
    if watchdog is not None and getattr(watchdog, "_wedged_groups", None):
        return message
    try:
        if mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    except Exception as exc:
        if message[0] == "ok":
            return ("err", (type(exc).__name__, f"MPI_Finalize failed: {exc}",
                            traceback.format_exc(), None))
    return message


def _die_with_launcher(launcher_pid: int) -> None:
    """SIGKILL this rank when the launcher dies (Linux ``PR_SET_PDEATHSIG``). The launcher may
    have died before this line: then the parent is already someone else, and the rank exits.
    The signal follows the launcher *thread* that started the rank, which is the thread that
    waits in :func:`launch` until every rank is gone."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != launcher_pid:
        os._exit(1)  # orphaned before it started: nothing was created yet
