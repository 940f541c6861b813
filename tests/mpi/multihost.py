"""Running ``mpiexec`` jobs on a :class:`tests.mpi.netns.HostBed` (shared by the multi-host
tests): ranks placed host by host, ``prterun`` in the first host, remote daemons started by the
bed's launch agent, MPI over TCP on the bridge and shared memory inside each host."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.mpi.netns import HostBed
from tests.mpi.test_mpi import REPO_ROOT, _mpiexec

# the fixture make_bed (tests/mpi/conftest.py): make_bed(n) is a bed of n hosts
MakeBed = Callable[..., HostBed]

# TCP between hosts, shared memory inside one (each host's own /dev/shm); RMA: osc/sm inside
# a host's shared windows, osc/rdma over btl/tcp across hosts (no TCP progress thread: with it,
# Open MPI 5's MPI_Comm_shrink crashed a survivor in most fault runs)
TRANSPORT = ("--mca", "btl", "self,sm,tcp", "--mca", "osc", "sm,rdma")


def job_command(bed: HostBed, per_host: int, argv: list[str], *, mca: tuple[str, ...] = (),
                ft: bool = False, transport: tuple[str, ...] = TRANSPORT) -> list[str]:
    """The command that runs ``python argv...`` as ``per_host`` ranks on every host of ``bed``."""
    hosts = ",".join(f"{h}:{per_host}" for h in bed.hosts)
    enter = [*bed.enter(bed.hosts[0])[:-1], f"--wd={REPO_ROOT}", "--"]
    return [*enter, str(_mpiexec()), "--host", hosts, "--map-by",
            f"ppr:{per_host}:node:oversubscribe", "--mca", "plm_rsh_agent", str(bed.agent),
            *(("--with-ft", "ulfm") if ft else ()), *transport, *mca,
            "-x", "PATH", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
            "-x", "UBEP_TIMEOUT_S", "-x", "UBEP_TEST_*",
            "-n", str(per_host * len(bed.hosts)), sys.executable, *argv]


def job_env(env: dict[str, str] | None = None) -> dict[str, str]:
    full = dict(os.environ) | {"OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                               "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                               "PYTHONPATH": str(REPO_ROOT)}
    return full | (env or {})


def run_job(bed: HostBed, per_host: int, argv: list[str], *, env: dict[str, str] | None = None,
            mca: tuple[str, ...] = (), ft: bool = False, timeout_s: float = 180.0,
            transport: tuple[str, ...] = TRANSPORT,
            while_running: Callable[[subprocess.Popen[str]], Any] | None = None,
            ) -> tuple[int, str]:
    """Run the job to its end (killed at ``timeout_s``: every process of every host);
    ``while_running(proc)`` runs once it started. Its exit code and output."""
    proc = subprocess.Popen(job_command(bed, per_host, argv, mca=mca, ft=ft, transport=transport),
                            env=job_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=REPO_ROOT)
    try:
        if while_running is not None:
            try:
                while_running(proc)
            except AssertionError as exc:  # what the job printed says why it stalled or ended
                _stop(bed, proc)
                output, _ = proc.communicate()
                raise AssertionError(f"{exc}\n--- job output\n{output[-4000:]}") from None
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(bed, proc)
        output, _ = proc.communicate()
        return -9, f"TIMEOUT after {timeout_s} s\n{output}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, output.replace("\x00", "")


def _stop(bed: HostBed, proc: subprocess.Popen[str]) -> None:
    """Kill every process of the job, on every host."""
    for host in bed.hosts:
        bed.signal_host(host, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):  # the job may have ended already
        os.killpg(proc.pid, signal.SIGKILL)


def wait_for(path: Path, timeout_s: float, proc: subprocess.Popen[str] | None = None) -> None:
    """Until ``path`` exists (``AssertionError`` past ``timeout_s`` or when ``proc`` ended)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not path.exists():
        # the job may write the file and end between the two checks: look once more
        if proc is not None and proc.poll() is not None and not path.exists():
            raise AssertionError(f"the job ended before {path.name} appeared")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} did not appear within {timeout_s} s")
        time.sleep(0.02)


def no_shm_left(bed: HostBed) -> None:
    """Nothing of a job is left in any host's ``/dev/shm``."""
    for host in bed.hosts:
        assert bed.shm_entries(host) == [], host
