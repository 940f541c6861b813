"""Who is still in the group: the survivors' agreement on a mask, and the group they go on as.

A masking Buffer (``BufferConfig(on_peer_loss="mask")``) that loses a peer mid-call needs every
survivor to go on with the *same* set of ranks: two survivors serving with different masks would
pair calls that do not match. :func:`agree` gets that without a coordinator that could itself be
the lost rank:

1. every member still running writes a *proposal* (its state: which call failed, what it had
   done) as ``<key>.p.<rank>.json`` in the rendezvous directory (atomic rename);
2. it then waits, up to the deadline, for the proposal of every member whose process is still
   alive (a dead pid is out at once; a stopped or hung one is out when the deadline passes);
3. it publishes the *decision* -- the members whose proposals it read, with their states -- as
   ``<key>.decision.json`` by ``link(2)``, which fails when the name exists: the first decision
   published is the only one, and every member (a late one too) adopts it.

A rank missing from the decision is masked for good: it learns so when it reads the decision
(a stopped rank that wakes reads it too), and it never learns the names of the segments the
survivors map next, so nothing it writes after waking reaches them.

:class:`Roster` names the members (original ranks, their processes, where they meet); a
newcomer that rejoins is added to it. :class:`MemberGroup` is the control plane of a roster: a
group of the members only, renumbered ``0 .. len(members) - 1`` in ascending original rank, so a
Buffer built on it is an ordinary Buffer over those ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import topology as topo
from ..errors import PeerLostError, TimeoutError
from ..plane.control import Backoff, Decision, wait_until
from ..plane.liveness import alive as process_alive
from ..plane.liveness import start_time_of as process_start_time
from .group import (  # the rendezvous directory's atomic JSON files, as the group writes them
    Group,
    PeerProcess,
    ShmGlobalMemory,
    _read_json,
    _write_json,
    gather_files,
    map_shm_global,
)

__all__ = [
    "MemberGroup", "OneHostPlane", "Roster", "admit", "agree", "publish_once", "request_join",
    "roster_of_record",
]

# proposals arrive within microseconds of each other when every member is alive; a stopped
# member is waited for up to the deadline, so the poll backs off to sleeping
_BACKOFF = Backoff(spin_polls=16, yield_s=0.01, sleep_slope=0.1)


def agree(roster: Roster, key: str, state: Any, timeout_s: float) -> Decision:
    """The one decision of the members of ``roster`` on who goes on, under ``key`` (unique per
    loss; every member must use the same). Collective over the members still running; returns
    at the latest ``timeout_s`` after the last of them entered. The decision may leave out this
    rank (the caller then raises ``RankMaskedError``).
    """
    members = roster.members
    _write_json(_path(roster, key, f"p.{roster.rank}"), {"state": state})
    seen: dict[int, Any] = {}
    out: list[int] = []

    def settled() -> bool:
        if os.path.exists(_path(roster, key, "decision")):
            return True
        out[:] = []
        for r in members:
            if r not in seen:
                got = _read_json(_path(roster, key, f"p.{r}"))
                if got is not None:
                    seen[r] = got["state"]
                elif roster.procs[r].alive():
                    out.append(r)
        return not out

    def give_up(waited_s: float) -> BaseException:
        return TimeoutError("")  # the deadline only ends the wait: no rank raises for it

    with contextlib.suppress(TimeoutError):
        wait_until(settled, time.monotonic() + timeout_s, check_peers=lambda: None,
                   timed_out=give_up, backoff=_BACKOFF)
    survivors = tuple(sorted(seen))
    publish_once(_path(roster, key, "decision"), {
        "members": list(survivors),
        "states": [seen[r] for r in survivors],
        "masked": sorted(set(members) - set(survivors)),
    })
    got = _read_json(_path(roster, key, "decision"))
    assert got is not None  # published by this rank or an earlier one, never removed
    return Decision(tuple(got["members"]), tuple(got["states"]), tuple(got["masked"]))


@dataclass(frozen=True)
class Roster:
    """The members of a group that outlives its processes: their original ranks, how to tell
    each is alive, and where they meet.

    Attributes:
        rank: this process's original rank.
        members: original ranks, ascending (this one included).
        procs: liveness of every member by original rank (pid and start time).
        rendezvous: the private directory the group meets in.
        group_id: the id stamped into the group's segments.
        cores_per_rank: cores of each rank (the members' topology).
        default_timeout_s: the deadline of a control-plane wait.
        reaper_dir: this process's own reaper's directory (``Group.reaper_dir``): the members'
            segments are named there too, so they do not outlive this process either.
    """

    rank: int
    members: tuple[int, ...]
    procs: Mapping[int, PeerProcess]
    rendezvous: str
    group_id: bytes
    cores_per_rank: int
    default_timeout_s: float
    reaper_dir: str | None = None

    @staticmethod
    def of(group: Group) -> Roster:
        """Every rank of ``group``."""
        return Roster(group.rank, tuple(range(group.num_ranks)),
                      {p.rank: p for p in group.peers}, group.rendezvous, group.group_id,
                      group.topology.cores_per_rank, group.default_timeout_s,
                      group.reaper_dir)

    def with_members(self, members: Sequence[int]) -> Roster:
        """This roster without the ranks not in ``members``."""
        return dataclasses.replace(self, members=tuple(sorted(members)),
                                   procs={r: self.procs[r] for r in members})


class OneHostPlane:
    """The control plane of a masking Buffer on one host (``ubep.plane.control_plane("shm")``):
    the rendezvous directory's agreement, member groups and admissions over ``roster``.
    ``ubep.mpi.membership.MpiPlane`` is the other one."""

    one_host = True

    def __init__(self, roster: Roster) -> None:
        self.roster = roster

    @classmethod
    def of(cls, group: Group) -> OneHostPlane:
        """The plane of every rank of ``group``."""
        return cls(Roster.of(group))

    @staticmethod
    def agree(roster: Roster, key: str, state: Any, timeout_s: float) -> Decision:
        return agree(roster, key, state, timeout_s)

    @staticmethod
    def member_group(roster: Roster, key: str) -> MemberGroup:
        return MemberGroup(roster, key)

    @staticmethod
    def admit(roster: Roster, key: str, num_ranks: int, extra: dict[str, Any],
              expect: Sequence[int] = (), timeout_s: float = 0.0
              ) -> tuple[Roster, dict[str, Any]]:
        return admit(roster, key, num_ranks, extra, expect=expect, timeout_s=timeout_s)

    @staticmethod
    def rejoin(rendezvous: str, rank: int, timeout_s: float) -> tuple[Roster, dict[str, Any]]:
        """From a new process: wait to be admitted as ``rank``; its roster and the record."""
        record = request_join(rendezvous, rank, timeout_s)
        return roster_of_record(rank, record, rendezvous), record


class MemberGroup:
    """The members of ``roster`` as a group of their own: ``rank`` and ``num_ranks`` renumbered
    ``0 .. len(members) - 1`` in ascending original rank, exchanges and barriers among the
    members only, under ``key`` (unique per membership), global memory mapped among them.
    Implements :class:`~ubep.runtime.group.ProcessGroup`."""

    def __init__(self, roster: Roster, key: str) -> None:
        if roster.rank not in roster.members:
            raise PeerLostError(f"rank {roster.rank} is not a member of {list(roster.members)}")
        self.roster = roster
        self.members = roster.members
        self.key = key
        self.rank = self.members.index(roster.rank)
        self.num_ranks = len(self.members)
        self.topology = topo.host(self.num_ranks, roster.cores_per_rank)
        self.group_id = roster.group_id
        self.rendezvous = roster.rendezvous
        self.reaper_dir = roster.reaper_dir
        self.default_timeout_s = roster.default_timeout_s
        self.peers = [PeerProcess(i, roster.procs[r].pid, roster.procs[r].start_time)
                      for i, r in enumerate(self.members)]
        self._seq = 0

    def allgather(self, value: Any, timeout_s: float | None = None) -> list[Any]:
        self._seq += 1
        return self.exchange(f"ag.{self._seq}", value, timeout_s)

    def exchange(self, key: str, value: Any, timeout_s: float | None = None) -> list[Any]:
        """:meth:`Group.exchange` among the members (keys live under this membership's)."""
        timeout = self.default_timeout_s if timeout_s is None else float(timeout_s)
        name = f"{self.key}.{key}"
        return gather_files(lambda i: _path(self, name, str(i)), self.rank, self.num_ranks,
                            value, lambda missing: self._wait(missing, timeout,
                                                              f"exchange {key}"))

    def barrier(self, timeout_s: float | None = None) -> None:
        self.allgather(None, timeout_s)

    def map_global(self, size_bytes: int, kind: str,
                   timeout_s: float | None = None) -> ShmGlobalMemory:
        return map_shm_global(self, size_bytes, kind, timeout_s)

    def check_peers(self) -> None:
        dead = [self.members[p.rank] for p in self.peers if not p.alive()]
        if dead:
            raise PeerLostError(f"rank {self.roster.rank}: peer rank(s) {dead} died")

    def _wait(self, missing: Any, timeout_s: float, what: str) -> None:
        left: list[int] = []

        def ready() -> bool:
            left[:] = missing()
            return not left

        def check_peers() -> None:
            dead = [self.members[i] for i in left if not self.peers[i].alive()]
            if dead:
                raise PeerLostError(f"rank {self.roster.rank}: rank(s) {dead} died while this "
                                    f"rank waited in {what}")

        def timed_out(waited_s: float) -> BaseException:
            return TimeoutError(f"rank {self.roster.rank}: {what} timed out waiting for rank(s) "
                                f"{[self.members[i] for i in left]}")

        wait_until(ready, time.monotonic() + timeout_s, check_peers=check_peers,
                   timed_out=timed_out, backoff=_BACKOFF)


def _path(group: Any, key: str, part: str) -> str:
    return _file(group.rendezvous, f"{key}.{part}")


def _file(rendezvous: str, name: str) -> str:
    """The file ``name`` of the membership's name space in ``rendezvous``."""
    return os.path.join(rendezvous, f"el.{name}.json")


def publish_once(path: str, obj: object) -> None:
    """Write ``obj`` at ``path`` unless something is there already (first writer wins)."""
    tmp = f"{path}.{os.getpid()}.new"
    _write_json(tmp, obj)
    try:
        os.link(tmp, path)  # atomic, and refuses an existing name
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


# --- letting a new process in --------------------------------------------------------------


def request_join(rendezvous: str, rank: int, timeout_s: float) -> dict[str, Any]:
    """Ask the members meeting in ``rendezvous`` to let this process in as ``rank``; return the
    admission record once they have (:func:`admit`), or raise ``TimeoutError``."""
    nonce = secrets.token_hex(8)
    me = {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), "nonce": nonce}
    _write_json(_file(rendezvous, f"join.{rank}"), me)
    got: list[Any] = []

    def admitted() -> bool:
        got[:] = [_read_json(_file(rendezvous, f"admitted.{nonce}"))]
        return got[0] is not None

    def timed_out(waited_s: float) -> BaseException:
        return TimeoutError(f"rank {rank}: no member admitted this process within "
                            f"{waited_s:.1f} s (the members call admit() between calls)")

    wait_until(admitted, time.monotonic() + timeout_s, check_peers=lambda: None,
               timed_out=timed_out, backoff=_BACKOFF)
    record: dict[str, Any] = got[0]
    return record


def admit(roster: Roster, key: str, num_ranks: int, extra: dict[str, Any],
          expect: Sequence[int] = (), timeout_s: float = 0.0) -> tuple[Roster, dict[str, Any]]:
    """Let in every process that asked to join as a rank that is not a member (collective over
    the members, between calls), first waiting up to ``timeout_s`` for the requests of the
    ranks ``expect``: one decision, the first published, names the joiners; the record
    (members, every member's process, ``extra``) is handed to each joiner. Returns the new
    roster and the record."""
    joiners: dict[str, Any] = {}

    def asked() -> bool:
        for r in range(num_ranks):
            if r in roster.members or str(r) in joiners:
                continue
            req = _read_json(_file(roster.rendezvous, f"join.{r}"))
            if req is not None and process_alive(int(req["pid"]), int(req["start_time"])):
                joiners[str(r)] = req
        return all(str(r) in joiners for r in expect)

    def late(waited_s: float) -> BaseException:
        return TimeoutError("")  # the deadline ends the wait; the decision names who came

    with contextlib.suppress(TimeoutError):
        wait_until(asked, time.monotonic() + timeout_s, check_peers=lambda: None,
                   timed_out=late, backoff=_BACKOFF)
    procs = {str(r): [p.pid, p.start_time] for r, p in roster.procs.items()}
    procs |= {r: [int(q["pid"]), int(q["start_time"])] for r, q in joiners.items()}
    publish_once(_path(roster, key, "admit"), {
        "joiners": joiners, "members": sorted([*roster.members, *map(int, joiners)]),
        "procs": procs, "group_id": roster.group_id.hex(),
        "cores_per_rank": roster.cores_per_rank, "timeout_s": roster.default_timeout_s,
        **extra,
    })
    record = _read_json(_path(roster, key, "admit"))
    assert record is not None
    for req in record["joiners"].values():
        _write_json(_file(roster.rendezvous, f"admitted.{req['nonce']}"), record)
    return roster_of_record(roster.rank, record, roster.rendezvous), record


def roster_of_record(rank: int, record: dict[str, Any], rendezvous: str) -> Roster:
    """The roster an admission record of :func:`admit` describes, seen from ``rank``."""
    members = tuple(int(r) for r in record["members"])
    procs = {int(r): PeerProcess(int(r), int(p[0]), int(p[1]))
             for r, p in record["procs"].items()}
    return Roster(rank, members, {r: procs[r] for r in members}, rendezvous,
                  bytes.fromhex(record["group_id"]), int(record["cores_per_rank"]),
                  float(record["timeout_s"]))
