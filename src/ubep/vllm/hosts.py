"""Which of ubep's transports serves vLLM's EP group: shared memory on one host, ubep's MPI
engine when the DP ranks span hosts.

vLLM starts its DP ranks itself, so ubep cannot make them an MPI job; across hosts each DP
rank's process must be started by ``mpiexec`` (one MPI job, one process per DP rank), and
``ubep.mpi.torch_group`` then builds the EP group's ubep group on an MPI communicator of the
same processes in vLLM's rank order (``from_torch``, reached through ``ubep.torch_bridge``).
:func:`ep_group` checks that on every rank at once (the launcher ranks are gathered over
vLLM's own gloo group), so a DP rank started otherwise makes every rank raise the same error,
naming the way to launch, before any ubep memory exists.
"""

from __future__ import annotations

import atexit
from typing import Any

from ..closing import Closing
from ..errors import UbepError
from ..mpi.torch_group import launcher_rank

__all__ = ["LAUNCH", "ep_group", "launch_error", "leave_mpi_at_exit", "transport_of"]

LAUNCH = (
    "start every DP rank's process with one mpiexec, one process per DP rank, e.g. `mpiexec "
    "--host HOST_A:1,HOST_B:1 -n 2 -x UBEP_VLLM_ALL2ALL=1 -x VLLM_DP_SIZE=2 "
    "-x VLLM_DP_MASTER_IP=HOST_A -x VLLM_DP_MASTER_PORT=29555 "
    "sh -c 'VLLM_DP_RANK=$OMPI_COMM_WORLD_RANK exec python prog.py'` (docs/VLLM.md, "
    "\"Across hosts\")"
)


def launch_error(launcher_ranks: list[int | None]) -> UbepError | None:
    """The error for an EP group across hosts whose ranks report ``launcher_ranks`` (each
    rank's MPI rank from its launcher's environment, ``None``: not started by one), or
    ``None`` when they are one MPI job."""
    missing = [r for r, m in enumerate(launcher_ranks) if m is None]
    if missing:
        return UbepError(
            f"vLLM's EP group spans hosts and ubep moves its rows between hosts with MPI, but "
            f"EP rank(s) {missing[:8]} were not started by an MPI launcher: {LAUNCH}")
    given = [m for m in launcher_ranks if m is not None]
    if len(set(given)) != len(given):
        return UbepError(
            f"the EP ranks report the MPI ranks {given}: they are not one MPI job; {LAUNCH}")
    return None


def transport_of(group: Any) -> str:
    """What moves ``group``'s rows, for the log line that says ubep serves."""
    hosts = int(getattr(group, "num_hosts", 1))
    if hosts > 1:
        return (f"ubep's MPI engine (MPI RMA across {hosts} hosts, shared memory inside each "
                "host)")
    return "shared memory (one host)"


def ep_group(cpu_group: Any, internode: bool) -> Any:
    """The ubep group of vLLM's EP group ``cpu_group`` (collective over its ranks, which all
    pass the same ``internode``: vLLM's own finding that the ranks are on several hosts)."""
    import torch.distributed as dist

    from ..torch_bridge import as_process_group

    if internode:
        ranks: list[int | None] = [None] * dist.get_world_size(cpu_group)
        dist.all_gather_object(ranks, launcher_rank(), group=cpu_group)
        error = launch_error(ranks)
        if error is not None:
            raise error
    return as_process_group(cpu_group)


def leave_mpi_at_exit(exchange: Closing, group: Any) -> None:
    """At this process's exit, close ``exchange``'s Buffers and ``group`` (an ``MpiGroup``:
    collective, every DP rank's worker leaves after the same last step) and finalize MPI.

    vLLM's CPU communicator never destroys its all2all manager, and vLLM's CPU worker stalls
    in the interpreter's final garbage collection until vLLM kills it (5 s; with or without
    ubep), so it never reaches mpi4py's ``MPI_Finalize``, which runs after that collection:
    ``mpiexec`` would then call the job's exit abnormal. Python's ``atexit`` runs before it.
    A wedged group (a thread still inside MPI) is left to ``ubep.mpi.watchdog``'s exit."""

    def leave() -> None:
        exchange.close()
        group.close()
        if group.wedged:
            return
        from ..mpi.group import load_mpi

        mpi = load_mpi()
        if not mpi.Is_finalized():
            mpi.Finalize()

    atexit.register(leave)
