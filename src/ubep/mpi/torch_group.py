"""A ``torch.distributed`` group whose ranks span hosts, on ubep's MPI data plane.

``ubep.Buffer(group)``, ``ubep.deep_ep.Buffer(group)`` and ``ElasticBuffer(group)`` turn a torch
group into a ubep group through :func:`ubep.torch.group.from_torch`. Its bootstrap learns every
rank's host; when they are not all on one, shared memory cannot carry the rows and the group is
built here instead: an MPI communicator of the same processes, in the torch group's rank order,
and :func:`ubep.mpi.init` on it (shared memory inside each host, MPI RMA across hosts,
docs/MULTIHOST.md). The torch group still belongs to the program; ubep moves rows over MPI.

That needs the processes to be one MPI job: the program is launched by ``mpiexec`` (or
``srun --mpi=pmix``) and ``torch.distributed`` is initialised from the launcher's environment,
so that each rank knows its MPI rank (:func:`launcher_rank`, read from the launcher's variables
before MPI is initialised) and the bootstrap can map torch ranks to MPI ranks. A group of
processes started otherwise (``torchrun`` on each host) raises ``ubep.UbepError`` naming the way
to launch.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import UbepError
from .group import MpiGroup, init, load_mpi

__all__ = ["LAUNCH_HINT", "across_hosts", "launcher_rank"]

# The MPI world rank, as MPI launchers put it in each process's environment (Open MPI, PMIx
# launchers such as srun --mpi=pmix, MPICH's Hydra, MVAPICH).
_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")

LAUNCH_HINT = (
    "launch the program as one MPI job, e.g. `mpiexec --hostfile hosts -n 16 --map-by "
    "ppr:8:node -x MASTER_ADDR -x MASTER_PORT python prog.py`, with torch.distributed "
    "initialised from the launcher's environment (RANK=$OMPI_COMM_WORLD_RANK, "
    "WORLD_SIZE=$OMPI_COMM_WORLD_SIZE; docs/MULTIHOST.md, \"torch programs across hosts\")"
)


def launcher_rank() -> int | None:
    """This process's rank in the MPI job that launched it, from the launcher's environment
    (``None``: not started by an MPI launcher). MPI itself is not initialised for this."""
    for name in _RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def across_hosts(hellos: list[dict[str, Any]], rank: int, where: str,
                 timeout_s: float | None = None) -> MpiGroup:
    """The ubep group of a torch group whose ranks are on several hosts (collective over the
    torch group's ranks, which all call it after the same bootstrap).

    ``hellos``: the bootstrap's values in torch group rank order, each with ``mpi_rank`` (the
    launcher's rank, or ``None``); ``rank``: this process's torch group rank; ``where``: the
    hosts and their ranks, for errors."""
    ranks = [h.get("mpi_rank") for h in hellos]
    missing = [r for r, m in enumerate(ranks) if m is None]
    if missing:
        raise UbepError(
            f"the ranks of this torch.distributed group are on several hosts ({where}); ubep "
            "moves rows between hosts with MPI, but rank(s) "
            f"{missing[:8]} were not started by an MPI launcher: {LAUNCH_HINT}")
    mpi_ranks = [int(m) for m in ranks if m is not None]
    if len(set(mpi_ranks)) != len(mpi_ranks):
        raise UbepError(f"ranks of this torch.distributed group report the same MPI rank "
                        f"({mpi_ranks}): they are not one MPI job; {LAUNCH_HINT}")
    mpi = load_mpi()
    world = mpi.COMM_WORLD
    if world.Get_rank() != mpi_ranks[rank] or max(mpi_ranks) >= world.Get_size():
        raise UbepError(
            f"torch rank {rank} is MPI rank {world.Get_rank()} of {world.Get_size()}, but the "
            f"launcher's environment says {mpi_ranks[rank]}: the torch group and the MPI job "
            f"do not match; {LAUNCH_HINT}")
    if mpi_ranks == list(range(world.Get_size())):
        return init(world, timeout_s=timeout_s)  # init duplicates it
    # a subgroup, or torch ranks numbered unlike MPI's: a communicator of the same processes
    # in torch's order (collective over these ranks only)
    members = world.Get_group().Incl(mpi_ranks)
    comm = world.Create_group(members)
    members.Free()
    try:
        return init(comm, timeout_s=timeout_s)
    finally:
        comm.Free()
