"""Every ``UBEP_*`` environment variable ubep reads, in one place.

ubep never writes the environment (``ubep.launch`` passes rank and rendezvous to its children as
arguments). Variables are read when the object that needs them is created, not at import.

Launch by another launcher (``mpiexec``, a job script, ``torchrun``-style): start ``N`` processes
with

* ``UBEP_RANK``: this process's rank, ``0 <= rank < UBEP_WORLD_SIZE``.
* ``UBEP_WORLD_SIZE``: number of ranks.
* ``UBEP_RENDEZVOUS``: path of a directory, private to the job (owned by the user, mode 0700,
  empty at start), on a filesystem every rank sees (one host: any local directory). Ranks
  exchange their process ids and shared-memory segment names through small files there. Create
  it fresh per job (``mktemp -d``) and remove it afterwards. A rank that dies while it sets up
  a group or a Buffer leaves a segment that its peers have not yet mapped; each rank starts a
  reaper of its own (a stdlib-only process in a session of its own) that removes it once the
  rank is gone, however it died and whether or not the directory is still there, and a
  surviving rank removes it too (while it waits, when the set-up fails, when it closes its
  group). ``python -m ubep.runtime.reaper --sweep DIR`` removes every segment the directory
  records whose creator is gone (for a job whose reapers were killed as well).

and call :func:`ubep.runtime.group_from_env` in each process.

Tuning and debugging:

* ``UBEP_TIMEOUT_S``: default deadline in seconds of :meth:`Group.barrier` and of group set-up
  (default 120).
* ``UBEP_WAIT_YIELD_US``: how long a wait inside dispatch/combine spins and yields before it
  sleeps in the kernel until a peer rings its doorbell (default 50 us). Lower it when ranks
  outnumber the cores; raise it to trade CPU for latency on an idle host.

Multi-host (``ubep.mpi``, read by :func:`ubep.mpi.init` when ``ranks_per_host`` is not given):

* ``UBEP_MPI_RANKS_PER_HOST``: treat every ``k`` consecutive MPI ranks as one host (``k`` must
  divide the ranks of each real host). Ranks of different (virtual) hosts exchange rows with MPI
  RMA only, so one machine can run and test the cross-host path.
* ``UBEP_MPI_FORCE_RMA``: ``1`` = every rank is its own host (``UBEP_MPI_RANKS_PER_HOST=1``):
  every row goes through ``MPI_Put``/``MPI_Get``, no shared-memory loads or stores between
  ranks. ``0`` or unset: the real hosts.

vLLM (:mod:`ubep.vllm`, read by the plugin when vLLM loads it, in every vLLM process):

* ``UBEP_VLLM_ALL2ALL``: ``1`` = a ubep Buffer on vLLM's expert-parallel group serves the
  dispatch and combine of vLLM's CPU communicator (docs/VLLM.md). ``0`` or unset: vLLM's own.

Their former names ``UBEP_DIST_RANKS_PER_HOST`` and ``UBEP_DIST_FORCE_RMA`` are still read (a
``DeprecationWarning`` says to rename them) when the new name is unset.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import InvalidArgumentError

__all__ = [
    "ENV_VARS",
    "LaunchEnv",
    "launch_env",
    "mpi_ranks_per_host_from_env",
    "timeout_s_from_env",
    "wait_yield_us_from_env",
]

ENV_VARS: dict[str, str] = {
    "UBEP_RANK": "rank of this process (env-var launch)",
    "UBEP_WORLD_SIZE": "number of ranks (env-var launch)",
    "UBEP_RENDEZVOUS": "private (0700) directory the ranks rendezvous in (env-var launch)",
    "UBEP_TIMEOUT_S": "default deadline of group set-up and barriers, seconds (default 120)",
    "UBEP_WAIT_YIELD_US": "spin/yield time of a data-plane wait before it sleeps (default 50)",
    "UBEP_MPI_RANKS_PER_HOST": "ubep.mpi: every k consecutive MPI ranks form one (virtual) host",
    "UBEP_MPI_FORCE_RMA": "ubep.mpi: 1 = every rank its own host (all rows over MPI RMA)",
    "UBEP_VLLM_ALL2ALL": "ubep.vllm: 1 = ubep serves vLLM's expert-parallel all2all on CPU",
}

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_WAIT_YIELD_US = 50.0


@dataclass(frozen=True)
class LaunchEnv:
    """The launch variables of this process."""

    rank: int
    world_size: int
    rendezvous: str


def _int_var(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise InvalidArgumentError(name, value, "must be an integer") from None


def launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Read ``UBEP_RANK``, ``UBEP_WORLD_SIZE`` and ``UBEP_RENDEZVOUS`` (all required)."""
    env = dict(os.environ if environ is None else environ)
    missing = [v for v in ("UBEP_RANK", "UBEP_WORLD_SIZE", "UBEP_RENDEZVOUS") if v not in env]
    if missing:
        raise InvalidArgumentError(
            "environment", missing, "env-var launch needs UBEP_RANK, UBEP_WORLD_SIZE and "
            "UBEP_RENDEZVOUS (see ubep.env)",
        )
    rank = _int_var("UBEP_RANK", env["UBEP_RANK"])
    world = _int_var("UBEP_WORLD_SIZE", env["UBEP_WORLD_SIZE"])
    if world < 1:
        raise InvalidArgumentError("UBEP_WORLD_SIZE", world, "must be >= 1")
    if not 0 <= rank < world:
        raise InvalidArgumentError("UBEP_RANK", rank, f"must be in [0, UBEP_WORLD_SIZE={world})")
    return LaunchEnv(rank=rank, world_size=world, rendezvous=env["UBEP_RENDEZVOUS"])


def timeout_s_from_env(environ: dict[str, str] | None = None) -> float:
    """``UBEP_TIMEOUT_S`` as a positive float, or the default (120 s)."""
    return _float_var(environ, "UBEP_TIMEOUT_S", DEFAULT_TIMEOUT_S, "seconds", positive=True)


# a variable's name -> the name it had before (still read, with a DeprecationWarning)
FORMER_NAMES = {"UBEP_MPI_RANKS_PER_HOST": "UBEP_DIST_RANKS_PER_HOST",
                "UBEP_MPI_FORCE_RMA": "UBEP_DIST_FORCE_RMA"}


def _renamed(env: Mapping[str, str], name: str) -> str | None:
    """``name``'s value, else its former name's (with a ``DeprecationWarning``), else None."""
    if name in env:
        return env[name]
    old = FORMER_NAMES[name]
    if old in env:
        warnings.warn(f"{old} is deprecated: set {name} instead", DeprecationWarning,
                      stacklevel=3)
        return env[old]
    return None


def mpi_ranks_per_host_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """``UBEP_MPI_RANKS_PER_HOST`` (a positive integer), 1 if ``UBEP_MPI_FORCE_RMA=1``, else
    ``None`` (the real hosts). Setting both is an error unless they agree."""
    env = os.environ if environ is None else environ
    raw_force = _renamed(env, "UBEP_MPI_FORCE_RMA") or "0"
    if raw_force not in ("0", "1", ""):
        raise InvalidArgumentError("UBEP_MPI_FORCE_RMA", raw_force, "must be 0 or 1")
    per_host: int | None = None
    raw = _renamed(env, "UBEP_MPI_RANKS_PER_HOST")
    if raw:
        per_host = _int_var("UBEP_MPI_RANKS_PER_HOST", raw)
        if per_host < 1:
            raise InvalidArgumentError("UBEP_MPI_RANKS_PER_HOST", raw, "must be >= 1")
    if raw_force == "1":
        if per_host not in (None, 1):
            raise InvalidArgumentError(
                "UBEP_MPI_RANKS_PER_HOST", raw, "contradicts UBEP_MPI_FORCE_RMA=1 (which means 1)"
            )
        return 1
    return per_host


def wait_yield_us_from_env(environ: dict[str, str] | None = None) -> float:
    """``UBEP_WAIT_YIELD_US`` as a float >= 0, or the default (50 us)."""
    return _float_var(environ, "UBEP_WAIT_YIELD_US", DEFAULT_WAIT_YIELD_US, "us",
                      positive=False)


def _float_var(environ: dict[str, str] | None, name: str, default: float, unit: str, *,
               positive: bool) -> float:
    """Variable ``name`` as a float (> 0, or >= 0 unless ``positive``), or ``default``."""
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgumentError(name, raw, f"must be a number of {unit}") from None
    if not (value > 0 if positive else value >= 0):
        raise InvalidArgumentError(name, raw, "must be > 0" if positive else "must be >= 0")
    return value


def vllm_all2all_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """``UBEP_VLLM_ALL2ALL``: ``1`` True, ``0`` or unset False; anything else an error."""
    env = os.environ if environ is None else environ
    raw = env.get("UBEP_VLLM_ALL2ALL", "0")
    if raw not in ("0", "1", ""):
        raise InvalidArgumentError("UBEP_VLLM_ALL2ALL", raw, "must be 0 or 1")
    return raw == "1"
