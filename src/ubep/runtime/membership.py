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

:class:`MemberGroup` is the control plane of the survivors: a :class:`~ubep.runtime.group.Group`
restricted to them, renumbered ``0 .. len(members) - 1`` in ascending original rank, so a Buffer
built on it is an ordinary Buffer over fewer ranks.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import topology as topo
from ..errors import PeerLostError, TimeoutError
from .group import (  # the rendezvous directory's atomic JSON files, as the group writes them
    Group,
    PeerProcess,
    ShmGlobalMemory,
    _read_json,
    _write_json,
    map_shm_global,
)
from .poll import Backoff, wait_until

__all__ = ["Decision", "MemberGroup", "agree", "new_key"]

# proposals arrive within microseconds of each other when every member is alive; a stopped
# member is waited for up to the deadline, so the poll backs off to sleeping
_BACKOFF = Backoff(spin_polls=16, yield_s=0.01, sleep_slope=0.1)


@dataclass(frozen=True)
class Decision:
    """The members that go on after a loss (ascending original rank), what each reported, and
    the ranks masked by this decision."""

    members: tuple[int, ...]
    states: tuple[Any, ...]  # one per member, what it passed to agree()
    masked: tuple[int, ...]

    def state_of(self, rank: int) -> Any:
        return self.states[self.members.index(rank)]


def agree(group: Group, key: str, members: Sequence[int], state: Any,
          timeout_s: float) -> Decision:
    """The one decision of the members of ``members`` (original ranks, this one included) on who
    goes on, under ``key`` (unique per loss; every member must use the same). Collective over
    the members still running; returns at the latest ``timeout_s`` after the last of them
    entered. The decision may leave out this rank (the caller then raises ``RankMaskedError``).
    """
    _write_json(_path(group, key, f"p.{group.rank}"), {"state": state})
    seen: dict[int, Any] = {}
    out: list[int] = []

    def settled() -> bool:
        if os.path.exists(_path(group, key, "decision")):
            return True
        out[:] = []
        for r in members:
            if r not in seen:
                got = _read_json(_path(group, key, f"p.{r}"))
                if got is not None:
                    seen[r] = got["state"]
                elif group.peers[r].alive():
                    out.append(r)
        return not out

    def give_up(waited_s: float) -> BaseException:
        return TimeoutError("")  # the deadline only ends the wait: no rank raises for it

    with contextlib.suppress(TimeoutError):
        wait_until(settled, time.monotonic() + timeout_s, check_peers=lambda: None,
                   timed_out=give_up, backoff=_BACKOFF)
    survivors = tuple(sorted(seen))
    _publish_once(_path(group, key, "decision"), {
        "members": list(survivors),
        "states": [seen[r] for r in survivors],
        "masked": sorted(set(members) - set(survivors)),
    })
    got = _read_json(_path(group, key, "decision"))
    assert got is not None  # published by this rank or an earlier one, never removed
    return Decision(tuple(got["members"]), tuple(got["states"]), tuple(got["masked"]))


class MemberGroup:
    """The ranks ``members`` of ``parent`` (ascending original ranks) as a group of their own:
    ``rank`` and ``num_ranks`` renumbered, exchanges and barriers among the members only, under
    ``key`` (unique per membership), global memory mapped among them. Implements
    :class:`~ubep.runtime.group.ProcessGroup`."""

    def __init__(self, parent: Group, members: Sequence[int], key: str) -> None:
        if parent.rank not in members:
            raise PeerLostError(f"rank {parent.rank} is not a member of {list(members)}")
        self.parent = parent
        self.members = tuple(sorted(members))
        self.key = key
        self.rank = self.members.index(parent.rank)
        self.num_ranks = len(self.members)
        self.topology = topo.host(self.num_ranks, parent.topology.cores_per_rank)
        self.group_id = parent.group_id
        self.rendezvous = parent.rendezvous
        self.default_timeout_s = parent.default_timeout_s
        self.peers = [PeerProcess(i, parent.peers[r].pid, parent.peers[r].start_time)
                      for i, r in enumerate(self.members)]
        self._seq = 0

    def allgather(self, value: Any, timeout_s: float | None = None) -> list[Any]:
        self._seq += 1
        return self.exchange(f"ag.{self._seq}", value, timeout_s)

    def exchange(self, key: str, value: Any, timeout_s: float | None = None) -> list[Any]:
        """:meth:`Group.exchange` among the members (keys live under this membership's)."""
        timeout = self.default_timeout_s if timeout_s is None else float(timeout_s)
        name = f"{self.key}.{key}"
        _write_json(_path(self.parent, name, str(self.rank)), {"value": value})
        got: dict[int, Any] = {}

        def missing() -> list[int]:
            for i in range(self.num_ranks):
                if i not in got:
                    v = _read_json(_path(self.parent, name, str(i)))
                    if v is not None:
                        got[i] = v["value"]
            return [i for i in range(self.num_ranks) if i not in got]

        self._wait(missing, timeout, f"exchange {key}")
        return [got[i] for i in range(self.num_ranks)]

    def barrier(self, timeout_s: float | None = None) -> None:
        self.allgather(None, timeout_s)

    def map_global(self, size_bytes: int, kind: str,
                   timeout_s: float | None = None) -> ShmGlobalMemory:
        return map_shm_global(self, size_bytes, kind, timeout_s)

    def check_peers(self) -> None:
        dead = [self.members[p.rank] for p in self.peers if not p.alive()]
        if dead:
            raise PeerLostError(f"rank {self.parent.rank}: peer rank(s) {dead} died")

    def _wait(self, missing: Any, timeout_s: float, what: str) -> None:
        left: list[int] = []

        def ready() -> bool:
            left[:] = missing()
            return not left

        def check_peers() -> None:
            dead = [self.members[i] for i in left if not self.peers[i].alive()]
            if dead:
                raise PeerLostError(f"rank {self.parent.rank}: rank(s) {dead} died while this "
                                    f"rank waited in {what}")

        def timed_out(waited_s: float) -> BaseException:
            return TimeoutError(f"rank {self.parent.rank}: {what} timed out waiting for rank(s) "
                                f"{[self.members[i] for i in left]}")

        wait_until(ready, time.monotonic() + timeout_s, check_peers=check_peers,
                   timed_out=timed_out, backoff=_BACKOFF)


def new_key() -> str:
    """A fresh name space for one loss's agreement (random: a rejoined group never reuses one)."""
    return secrets.token_hex(8)


def _path(group: Any, key: str, part: str) -> str:
    return os.path.join(group.rendezvous, f"el.{key}.{part}.json")


def _publish_once(path: str, obj: object) -> None:
    """Write ``obj`` at ``path`` unless something is there already (first writer wins)."""
    tmp = f"{path}.{os.getpid()}.new"
    _write_json(tmp, obj)
    try:
        os.link(tmp, path)  # atomic, and refuses an existing name
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
