"""A group of ranks on one host: identity, rendezvous, liveness and a control-plane barrier.

Ranks meet in a private rendezvous directory (mode 0700, owned by this user): each writes a small
``hello`` file (pid, process start time, uid, its group segment) with an atomic rename, then
reads everyone else's. From then on the control plane runs over shared memory: each rank owns a
one-page *group segment* whose barrier counter peers poll. Variable-size exchanges (segment names
of a new Buffer) go through numbered files in the same directory (:meth:`Group.allgather`).

Liveness: a peer is alive while its pid exists, is not a zombie and still has the start time it
had at rendezvous (so a recycled pid is not mistaken for it).

Global memory (:meth:`Group.map_global`): one segment per rank, every peer's mapped here. Other
group kinds (``ubep.mpi.MpiGroup`` over MPI) implement the same :class:`ProcessGroup` protocol,
so :class:`ubep.Buffer` runs on any of them (``ubep.plane.protocol``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import subprocess
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import topology as topo
from ..closing import Closing
from ..env import launch_env, timeout_s_from_env
from ..errors import InvalidArgumentError, PeerLostError, TimeoutError, UbepError
from ..plane.control import Backoff, wait_until

# the liveness test and start times (standard library only; one copy, the reaper's too)
from ..plane.liveness import alive as process_alive
from ..plane.liveness import start_time_of as process_start_time
from ..plane.protocol import GlobalMemory, ProcessGroup
from .host_topology import host_topology, own_cpus
from .reaper import end_feed, spawn
from .shm import HEADER_BYTES, Segment, forget_segment, remove_dead_owners_segments

__all__ = [
    "GlobalMemory",
    "Group",
    "ProcessGroup",
    "ShmGlobalMemory",
    "gather_files",
    "group_from_env",
    "map_shm_global",
]

_GROUP_SEGMENT_BYTES = 4096
# A reaper starts in tens of milliseconds; these bound a loaded host's worst case.
_REAPER_START_S = 30.0
_REAPER_EXIT_S = 2.0
_BARRIER_OFFSET = HEADER_BYTES  # u64 counter: number of barriers this rank has entered
# spin 64 polls, yield for 50 ms, then sleep up to 1 ms (see Group._poll)
_BACKOFF = Backoff(spin_polls=64, yield_s=0.05, sleep_slope=0.1)


class ShmGlobalMemory:
    """:class:`GlobalMemory` of one host: a POSIX shared-memory segment per rank."""

    transport = "shm"  # every region is load/store reachable: the native engine

    def __init__(
        self, segments: list[Segment], rank: int, pids: list[int], start_times: list[int],
        marker_dir: str,
    ) -> None:
        self.segments = segments
        self.marker_dir = marker_dir
        self.rank = rank
        self.addresses: list[int] | None = [s.address for s in segments]
        self.local_array = segments[rank].array
        self.pids = pids
        self.start_times = start_times

    def unlink(self) -> None:
        unlink_all(self.segments, self.marker_dir)

    def close(self) -> None:
        self.local_array = np.zeros(0, dtype=np.uint8)
        for seg in self.segments:
            seg.close()
        self.segments = []



class PeerProcess:
    """Liveness of one peer process (pid + start time, Linux /proc; kill(pid, 0) elsewhere)."""

    def __init__(self, rank: int, pid: int, start_time: int) -> None:
        self.rank = rank
        self.pid = pid
        self.start_time = start_time

    def alive(self) -> bool:
        return process_alive(self.pid, self.start_time)


class Group(Closing):
    """``num_ranks`` processes that run collectives together.

    Build one with :func:`ubep.launch` (it passes the group to your function) or, for processes
    started by another launcher, :func:`group_from_env`.

    Attributes:
        rank: this process's rank.
        num_ranks: number of ranks.
        topology: the fabric model (default: the host's, from the ranks' CPU affinities and
            ``/sys``, :func:`ubep.runtime.host_topology.host_topology`; on a host that shows one
            class between ranks that is :func:`ubep.topology.host`).
        group_id: 16 random bytes shared by the group (stamped into every segment header).
        rendezvous: the rendezvous directory.
        peers: liveness handles of every rank (this one included).
        reaper_dir: the private directory of this rank's own reaper (``None`` when a launcher's
            reaper owns the rendezvous directory, as ``ubep.launch``'s does): every segment this
            rank creates is named there too until it is unlinked, and the reaper, in a session
            of its own, removes what is still named once this process is gone, however it
            died, whether or not the rendezvous directory is still there.
    """

    control_plane = "shm"  # a masking Buffer agrees through the rendezvous directory

    def __init__(
        self,
        rank: int,
        num_ranks: int,
        rendezvous: str,
        *,
        group_id: bytes | None = None,
        topology: topo.Topology | None = None,
        timeout_s: float | None = None,
        own_reaper: bool = True,
    ) -> None:
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise InvalidArgumentError("num_ranks", num_ranks, "must be a positive integer")
        if not isinstance(rank, int) or not 0 <= rank < num_ranks:
            raise InvalidArgumentError("rank", rank, f"must be in [0, {num_ranks})")
        if topology is not None and topology.num_ranks != num_ranks:
            raise InvalidArgumentError(
                "topology", topology.name, f"has {topology.num_ranks} ranks, group has {num_ranks}"
            )
        self.rank = rank
        self.num_ranks = num_ranks
        self.topology = topology or topo.host(num_ranks)  # from /sys once every rank said hello
        self.rendezvous = rendezvous
        self.default_timeout_s = timeout_s_from_env() if timeout_s is None else float(timeout_s)
        self._seq = 0  # allgather sequence number
        self._barriers = 0
        self._closed = False
        _check_private_dir(rendezvous)
        deadline = time.monotonic() + self.default_timeout_s
        self._segments: list[Segment] = []
        self._known: dict[int, PeerProcess] = {}  # peers whose hello this rank has read
        self._reaper: subprocess.Popen[bytes] | None = None
        self.reaper_dir: str | None = None
        if own_reaper:
            self._reaper, self.reaper_dir = _start_own_reaper()
        try:
            hello = self._rendezvous(group_id, deadline)
            self.group_id: bytes = bytes.fromhex(hello[0]["group_id"])
            self.peers = [PeerProcess(r, h["pid"], h["start_time"]) for r, h in enumerate(hello)]
            if topology is None:
                self.topology = host_topology([h.get("cpus") for h in hello])
            self._segments = self._map_group_segments(hello)
            self._counters = [
                seg.array[_BARRIER_OFFSET:_BARRIER_OFFSET + 8].view(np.uint64)
                for seg in self._segments
            ]
            # Every rank has mapped every group segment once this first barrier completes.
            self.barrier(max(0.0, deadline - time.monotonic()) or 1e-3)
        except BaseException:
            # Nothing of this rank may outlive a failed set-up, nor of a peer that died in it.
            if hasattr(self, "_own_segment"):
                self._own_segment.close()
            for seg in self._segments:
                seg.close()
            remove_dead_owners_segments(rendezvous)
            self._stop_reaper()
            raise
        unlink_all(self._segments, rendezvous)

    # --- public -------------------------------------------------------------------------

    def barrier(self, timeout_s: float | None = None) -> None:
        """Block until every rank has entered this barrier (control plane only).

        Raises ``ubep.TimeoutError`` naming the missing ranks, or ``ubep.PeerLostError`` if one
        of them died.
        """
        self._check_open()
        timeout = self.default_timeout_s if timeout_s is None else float(timeout_s)
        self._barriers += 1
        target = self._barriers
        self._counters[self.rank][0] = target
        deadline = time.monotonic() + timeout

        def missing() -> list[int]:
            return [r for r, c in enumerate(self._counters) if int(c[0]) < target]

        self._poll(missing, deadline, f"barrier {target}")

    def allgather(self, value: Any, timeout_s: float | None = None) -> list[Any]:
        """Exchange one JSON-serialisable value with every rank (control plane; files)."""
        self._check_open()
        timeout = self.default_timeout_s if timeout_s is None else float(timeout_s)
        self._seq += 1
        seq = self._seq
        out = self._gather(f"ag.{seq}", value, timeout, f"allgather {seq}")
        # Everyone has entered exchange `seq`, hence finished reading exchange `seq - 1`.
        if seq >= 2:
            _remove(self._path(f"ag.{seq - 1}.{self.rank}.json"))
        return out

    def exchange(self, key: str, value: Any, timeout_s: float | None = None) -> list[Any]:
        """Exchange one JSON-serialisable value with every rank under ``key`` (control plane).

        Unlike :meth:`allgather`, it does not count calls: a rank that timed out and calls
        again with the same key pairs with the peers' first call (what ``Buffer.resync`` needs
        to be retryable). Keys must be unique per exchange (``[A-Za-z0-9_.-]``).
        """
        self._check_open()
        if not key or any(not (c.isalnum() or c in "_.-") for c in key):
            raise InvalidArgumentError("key", key, "must be non-empty [A-Za-z0-9_.-]")
        timeout = self.default_timeout_s if timeout_s is None else float(timeout_s)
        return self._gather(f"x.{key}", value, timeout, f"exchange {key}")

    def _gather(self, name: str, value: Any, timeout: float, what: str) -> list[Any]:
        """Write ``value`` as ``<name>.<rank>.json``, then read every rank's file of ``name``
        (polling until ``timeout`` seconds from now; ``what`` names the wait in errors)."""
        return gather_files(lambda r: self._path(f"{name}.{r}.json"), self.rank,
                            self.num_ranks, value,
                            lambda missing: self._poll(missing, time.monotonic() + timeout, what))

    def map_global(
        self, size_bytes: int, kind: str, timeout_s: float | None = None
    ) -> ShmGlobalMemory:
        """Create this rank's segment of ``size_bytes`` and map every peer's (collective).

        The segment name is recorded in the rendezvous directory until :meth:`unlink` (so the
        launcher can remove it if a rank dies during set-up); call ``unlink()`` once every peer
        has mapped it (after a barrier).
        """
        self._check_open()
        return map_shm_global(self, size_bytes, kind, timeout_s)

    def check_peers(self) -> None:
        """Raise ``PeerLostError`` if any peer process has died."""
        dead = [p.rank for p in self.peers if p.rank != self.rank and not p.alive()]
        if dead:
            raise PeerLostError(f"rank {self.rank}: peer rank(s) {dead} died")

    def close(self) -> None:
        """Unmap the group segments (local; not collective)."""
        if self._closed:
            return
        self._closed = True
        self._counters = []
        for seg in self._segments:
            seg.close()
        self._segments = []
        # A peer that died while it set up an object (its segment mapped by nobody yet) is
        # swept here at the latest: the rendezvous directory may be removed once ranks exit.
        remove_dead_owners_segments(self.rendezvous)
        self._stop_reaper()

    def __repr__(self) -> str:
        return f"Group(rank={self.rank}, num_ranks={self.num_ranks}, topology={self.topology.name})"

    # --- internals ----------------------------------------------------------------------

    def _stop_reaper(self) -> None:
        """End this rank's reaper: with every segment of this rank unlinked (their names gone
        from its directory) it removes the directory and exits at once."""
        if self._reaper is not None:
            reaper, self._reaper = self._reaper, None
            end_feed(reaper, _REAPER_EXIT_S)

    def _check_open(self) -> None:
        if self._closed:
            raise UbepError(f"rank {self.rank}: the group is closed")

    def _path(self, name: str) -> str:
        return os.path.join(self.rendezvous, name)

    def _poll(self, missing: Callable[[], list[int]], deadline: float, what: str) -> None:
        """Wait until ``missing()`` (the ranks not there yet) is empty, checking liveness.

        Yielding (not sleeping) for the first 50 ms keeps the exit skew of a barrier at a few
        microseconds, which benchmarks that time one call between two barriers rely on.
        """
        left: list[int] = []

        def ready() -> bool:
            left[:] = missing()
            return not left

        def check_peers() -> None:
            # A creator that died before its peers mapped its segment: reclaimed now, whether
            # or not this wait needs it (a rank that dies before its hello is known only so).
            swept = remove_dead_owners_segments(self.rendezvous)
            if swept and not hasattr(self, "peers"):
                raise PeerLostError(f"rank {self.rank}: a rank died during the rendezvous "
                                    f"(its segment(s) {swept} removed) while this rank waited "
                                    f"in {what}")
            # Before the rendezvous completes, a rank that said hello and died is as lost as
            # one missing later (it will never reach the barrier).
            known = self.peers if hasattr(self, "peers") else list(self._known.values())
            dead = [p.rank for p in known if p.rank != self.rank and not p.alive()
                    and (p.rank in left or not hasattr(self, "peers"))]
            if dead:
                remove_dead_owners_segments(self.rendezvous)
                raise PeerLostError(
                    f"rank {self.rank}: rank(s) {dead} died while this rank waited in {what}"
                )

        def timed_out(waited_s: float) -> BaseException:
            remove_dead_owners_segments(self.rendezvous)
            return TimeoutError(f"rank {self.rank}: {what} timed out waiting for rank(s) {left}")

        wait_until(ready, deadline, check_peers=check_peers, timed_out=timed_out,
                   backoff=_BACKOFF)

    def _rendezvous(self, group_id: bytes | None, deadline: float) -> list[dict[str, Any]]:
        if self.rank == 0 and group_id is None:
            group_id = secrets.token_bytes(16)
        self._own_segment = Segment.create(
            _GROUP_SEGMENT_BYTES,
            group_id=group_id or b"pending",
            owner_rank=self.rank,
            kind="group",
            marker_dir=self.rendezvous,
            reaper_dir=self.reaper_dir,
        )
        me = {
            "rank": self.rank,
            "pid": os.getpid(),
            "uid": os.getuid(),
            "start_time": process_start_time(os.getpid()),
            "cpus": own_cpus(),  # the host topology's hop classes
            "segment": self._own_segment.name,
            "group_id": group_id.hex() if group_id is not None else None,
        }
        _write_json(self._path(f"hello.{self.rank}.json"), me)
        hello: list[dict[str, Any] | None] = [None] * self.num_ranks

        def missing() -> list[int]:
            for r in range(self.num_ranks):
                if hello[r] is None:
                    got = _read_json(self._path(f"hello.{r}.json"))
                    if got is not None:
                        hello[r] = got
                        self._known[r] = PeerProcess(r, got["pid"], got["start_time"])
            return [r for r in range(self.num_ranks) if hello[r] is None]

        self._poll(missing, deadline, "rendezvous")
        done = [h for h in hello if h is not None]
        for h in done:
            if h["uid"] != os.getuid():
                raise UbepError(f"rank {h['rank']} runs as uid {h['uid']}, not {os.getuid()}")
        if done[0]["group_id"] is None:
            raise UbepError("rank 0 published no group id")
        gid = bytes.fromhex(done[0]["group_id"])
        if group_id is not None and gid != group_id:
            raise UbepError("ranks were given different group ids (two jobs in one directory?)")
        if group_id is None:
            # Stamp the real id now that rank 0 has published it (peers check the header).
            self._own_segment.array[32:48] = np.frombuffer(gid, dtype=np.uint8)
        return done

    def _map_group_segments(self, hello: list[dict[str, Any]]) -> list[Segment]:
        segs: list[Segment] = []
        try:
            for r, h in enumerate(hello):
                if r == self.rank:
                    segs.append(self._own_segment)
                    continue
                segs.append(self._open_when_stamped(h["segment"], r))
        except BaseException:
            for s in segs:
                if s is not self._own_segment:
                    s.close()
            self._own_segment.close()
            raise
        return segs

    def _open_when_stamped(self, name: str, owner: int) -> Segment:
        # In env-var launches a peer stamps the group id right after reading rank 0's hello,
        # so a header mismatch can be transient: retry until the rendezvous deadline.
        deadline = time.monotonic() + self.default_timeout_s
        while True:
            try:
                return Segment.open_peer(
                    name, size_bytes=_GROUP_SEGMENT_BYTES, group_id=self._gid_hint(),
                    owner_rank=owner, kind="group",
                )
            except (UbepError, FileNotFoundError):
                if not self._known[owner].alive():  # said hello, then died: it never stamps
                    raise PeerLostError(
                        f"rank {self.rank}: rank {owner} died during the rendezvous") from None
                if time.monotonic() >= deadline:
                    raise
                time.sleep(1e-3)

    def _gid_hint(self) -> bytes:
        raw = _read_json(self._path("hello.0.json"))
        assert raw is not None
        return bytes.fromhex(raw["group_id"])


def map_shm_global(
    group: Any, size_bytes: int, kind: str, timeout_s: float | None = None
) -> ShmGlobalMemory:
    """The shared-memory :class:`GlobalMemory` of a one-host group (``Group``, the torch
    group): create this rank's segment (named in ``group.rendezvous`` until it is unlinked),
    exchange the names with ``group.allgather`` and map every peer's (collective)."""
    own = Segment.create(
        size_bytes, group_id=group.group_id, owner_rank=group.rank, kind=kind,
        marker_dir=group.rendezvous, reaper_dir=getattr(group, "reaper_dir", None),
    )
    segs: list[Segment] = []
    try:
        names = group.allgather(own.name, timeout_s)
        for r, name in enumerate(names):
            if r == group.rank:
                segs.append(own)
            else:
                segs.append(Segment.open_peer(
                    name, size_bytes=size_bytes, group_id=group.group_id, owner_rank=r,
                    kind=kind,
                ))
    except BaseException:
        for seg in segs:
            seg.close()
        if own not in segs:
            own.close()
        raise
    pids = [p.pid for p in group.peers]
    starts = [p.start_time or process_start_time(p.pid) for p in group.peers]
    return ShmGlobalMemory(segs, group.rank, pids, starts, group.rendezvous)


def unlink_all(segments: list[Segment], marker_dir: str) -> None:
    """Unlink every segment of one object, this rank's and its peers', with their markers.

    Only once every rank has mapped them all (after the barrier that follows the mapping):
    each rank does it, so the names go even if their creator dies before its own unlink.
    """
    for seg in segments:
        if seg.created:
            seg.unlink()
        else:
            forget_segment(marker_dir, seg.name)


def gather_files(path: Callable[[int], str], rank: int, num_ranks: int, value: Any,
                 wait: Callable[[Callable[[], list[int]]], None]) -> list[Any]:
    """One exchange through files: write ``value`` at ``path(rank)``, then read every rank's
    file, ``wait(missing)`` polling ``missing()`` (the ranks whose file is not there yet) until
    it is empty. Every rank's value, in rank order."""
    _write_json(path(rank), {"value": value})
    out: list[Any] = [None] * num_ranks
    found = [False] * num_ranks

    def missing() -> list[int]:
        for r in range(num_ranks):
            if not found[r]:
                got = _read_json(path(r))
                if got is not None:
                    out[r], found[r] = got["value"], True
        return [r for r in range(num_ranks) if not found[r]]

    wait(missing)
    return out


def group_from_env(
    *, topology: topo.Topology | None = None, timeout_s: float | None = None
) -> Group:
    """The :class:`Group` of a process started with ``UBEP_RANK``/``UBEP_WORLD_SIZE``/
    ``UBEP_RENDEZVOUS`` (see :mod:`ubep.env`)."""
    env = launch_env()
    return Group(env.rank, env.world_size, env.rendezvous, topology=topology, timeout_s=timeout_s)


def _start_own_reaper() -> tuple[subprocess.Popen[bytes], str]:
    """A reaper of this process alone (its own session; ``runtime/reaper.py``): it reads no
    ranks, and once this process closes its end of the pipe (closing the group, or dying) it
    waits for the creator of every segment its directory still names, removes them and exits."""
    proc, directory = spawn(_REAPER_START_S)
    if not directory:
        raise UbepError(f"the group's reaper process did not start (exit code {proc.returncode})")
    return proc, directory


def _check_private_dir(path: str) -> None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        raise InvalidArgumentError("rendezvous", path, "directory does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgumentError("rendezvous", path, "is not a directory")
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise InvalidArgumentError(
            "rendezvous", path, "must be owned by this user with mode 0700 (no group/other access)"
        )


def _write_json(path: str, obj: object) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)  # atomic: readers see all of it or nothing


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
