"""A ubep process group over a ``torch.distributed`` process group (``torchrun`` programs).

``ubep.Buffer(dist.group.WORLD, cfg)`` (or any ``dist.new_group(ranks)`` subgroup) lands here
through :func:`ubep.torch_bridge.as_process_group`; :func:`from_torch` is the same thing by
hand. The torch group carries only the control plane; rows still move through shared memory,
exactly as in a group of ``ubep.launch``:

* **Bootstrap** (collective over the torch group): every rank publishes its pid and process
  start time (liveness, as :attr:`ubep.runtime.Group.peers`), uid, host name and boot id; group
  rank 0 adds a 16-byte group id and a private directory. Ranks are numbered by their rank *in
  the torch group* (``dist.get_rank(group)``), not the world's. Ranks on different hosts (host
  name or ``/proc/sys/kernel/random/boot_id`` differ) cannot share memory: :func:`from_torch`
  then builds the group on ubep's MPI data plane (:mod:`ubep.mpi.torch_group`; the program must
  be one MPI job, launched by ``mpiexec``), and ``TorchGroup`` itself refuses them.
* **Control plane**: :meth:`TorchGroup.allgather` / :meth:`exchange` / :meth:`barrier` are
  asynchronous torch collectives (JSON values), polled against a deadline and the liveness of
  every peer, so a dead or missing rank raises ``ubep.PeerLostError`` / ``ubep.TimeoutError``
  instead of blocking for the backend's own (30 min) timeout. The backend must move CPU tensors
  (gloo; a NCCL-only group is refused with what to do).
* **Global memory** (:meth:`TorchGroup.map_global`): one POSIX segment per rank
  (``ubep.runtime.shm.Segment``: 0600, a 128-bit random name, header-checked by every mapper),
  names exchanged over the torch group, unlinked by ``Buffer`` once every peer mapped them.
* **Cleanup**: torchrun gives no rendezvous directory and no parent that cleans up after its
  children, so group rank 0 starts the reaper ``ubep.launch`` uses (:mod:`ubep.runtime.reaper`,
  standard library only, its own session, the same protocol) that creates the group's private
  directory (segment markers) and, once every rank's process is gone, unlinks whatever segment a
  killed rank left named and removes the directory. Nothing of the group survives its
  processes, SIGKILL included.
* **Lifetime**: ubep holds the torch group *weakly* (the cache and every ``TorchGroup``): torch
  owns it (``dist.destroy_process_group`` drops it), and a ubep object kept past that point must
  not keep it alive. A live gloo group keeps its worker threads, and a worker still releasing the
  tensors of a finished collective when the interpreter exits cannot take the GIL: the thread
  is unwound through C++ code that may not throw and the process aborts ("terminate called
  without an active exception") after the program itself succeeded. Destroyed by torch, the
  group joins its workers there and then. After that, a ubep call that needs the control plane
  raises ``ubep.UbepError`` saying the torch group is gone.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import secrets
import socket
import subprocess
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import topology as topo
from ..closing import Closing
from ..env import timeout_s_from_env
from ..errors import InvalidArgumentError, PeerLostError, TimeoutError, UbepError
from ..mpi.torch_group import launcher_rank
from ..runtime import reaper as _reaper_script
from ..runtime.group import PeerProcess, ShmGlobalMemory, map_shm_global, process_start_time
from ..runtime.host_topology import host_topology, own_cpus
from ..runtime.poll import LIVENESS_PERIOD_S, Backoff, wait_until

__all__ = ["OtherHostsError", "TorchGroup", "check_same_host", "from_torch", "held",
           "host_identity"]

# Between two of _wait's blocking slices (each up to a liveness period, gloo): only a yield, as
# the slice itself is the pause. Other backends' works are polled, sleeping a little between
# polls, longer the longer the wait.
_SLICED = Backoff(yield_s=float("inf"))
_POLLED = Backoff(sleep_slope=0.05)
# an all-gather's slot per rank: its JSON's length (8 bytes) and, if it fits, the JSON itself
_SLOT_BYTES = 512
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
# Backends that run collectives on CPU tensors (the control plane's JSON bytes).
_CPU_BACKENDS = ("gloo", "mpi", "ucc")

_cache_lock = threading.Lock()
# Keyed weakly by the torch group (the value holds it weakly too): an entry goes with its group.
_cache: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


class OtherHostsError(UbepError):
    """The ranks of a torch group are on more than one host (``hellos``: the bootstrap's values
    in group rank order; ``where``: the hosts and their ranks)."""

    def __init__(self, message: str, hellos: list[dict[str, Any]], where: str) -> None:
        super().__init__(message)
        self.hellos, self.where = hellos, where


def from_torch(
    group: Any, *, topology: topo.Topology | None = None, timeout_s: float | None = None
) -> Any:
    """The ubep group of a torch.distributed group, built once per torch group (collective the
    first time: every rank of ``group`` calls it, as every rank builds a Buffer): a
    :class:`TorchGroup` when every rank is on one host, else an ``ubep.mpi.MpiGroup`` of the
    same processes (:mod:`ubep.mpi.torch_group`: the program must run under ``mpiexec``).

    Later calls with the same torch group return the same object, so every ``ubep.Buffer`` on it
    shares one bootstrap and one cleaner process. ``topology``/``timeout_s`` apply to the first
    call only."""
    with _cache_lock:
        hit = _cache.get(group)
        if hit is not None and not hit.closed:
            return hit
    # Built outside the lock: the bootstrap waits for peers, and a thread bootstrapping another
    # torch group meanwhile must not wait for this one.
    try:
        made: Any = TorchGroup(group, topology=topology, timeout_s=timeout_s)
    except OtherHostsError as exc:  # every rank sees the same hellos: all come here
        from ..mpi.torch_group import across_hosts

        made = across_hosts(exc.hellos, int(dist.get_rank(group)), exc.where,
                            timeout_s=timeout_s)
    with _cache_lock:
        _cache[group] = made
    return made


def is_torch_group(group: Any) -> bool:
    """Whether ``group`` is a ``torch.distributed.ProcessGroup``."""
    return isinstance(group, dist.ProcessGroup)


def as_ubep_group(group: Any) -> Any:
    """``group`` itself, or for a torch.distributed group its ubep group (:func:`from_torch`)."""
    return from_torch(group) if is_torch_group(group) else group


def held(group: Any) -> Callable[[], Any]:
    """A way back to ``group`` that never keeps a torch group alive (module docstring,
    Lifetime): a weak reference to a ``torch.distributed`` group (``None`` once torch freed it),
    the object itself for anything else (an MPI communicator, a ubep group)."""
    if isinstance(group, dist.ProcessGroup):
        return weakref.ref(group)
    return lambda: group


def host_identity() -> dict[str, str]:
    """This process's host: its name and the kernel's boot id (different machines, or one
    machine rebooted, never share a boot id; container hosts may share a name)."""
    try:
        with open(_BOOT_ID) as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return {"host": socket.gethostname(), "boot_id": boot_id}


def check_same_host(hellos: list[dict[str, Any]]) -> None:
    """Raise ``ubep.UbepError`` naming ``ubep.mpi`` if the ranks (``hellos`` in group-rank order,
    each with ``host`` and ``boot_id``) are not all on one host."""
    hosts: dict[tuple[str, str], list[int]] = {}
    for rank, h in enumerate(hellos):
        hosts.setdefault((h["host"], h["boot_id"]), []).append(rank)
    if len(hosts) > 1:
        where = "; ".join(f"{name} (boot {boot[:8]}): ranks {ranks}" for (name, boot), ranks
                          in hosts.items())
        raise OtherHostsError(
            f"the ranks of this torch.distributed group are on {len(hosts)} hosts ({where}). "
            "ubep on a torch.distributed group moves rows through shared memory and needs every "
            "rank on one host; across hosts use ubep.mpi (ubep.mpi.init() under mpiexec, "
            "docs/MULTIHOST.md), or give ubep one group per host (dist.new_group).",
            hellos, where)


class TorchGroup(Closing):
    """A :class:`ubep.runtime.group.ProcessGroup` over a ``torch.distributed`` group.

    Attributes:
        torch_group: the torch.distributed group it runs over (held weakly: module docstring;
            reading it after torch destroyed the group raises ``ubep.UbepError``).
        rank: this process's rank in ``torch_group`` (not the world rank).
        num_ranks: ranks in ``torch_group``.
        topology: the fabric model (default: the host's, from the ranks' CPU affinities and
            ``/sys``, :func:`ubep.runtime.host_topology.host_topology`).
        group_id: 16 random bytes from group rank 0 (stamped into every segment header).
        rendezvous: the group's private directory (segment markers; removed by the cleaner).
        peers: liveness handles of every rank, in group-rank order.
    """

    def __init__(
        self, group: Any, *, topology: topo.Topology | None = None, timeout_s: float | None = None
    ) -> None:
        _check_torch_group(group)
        self._torch_group = weakref.ref(group)
        # its CPU collectives run on gloo (a 'cpu:gloo,cuda:nccl' group too): _wait blocks
        self._gloo = "gloo" in str(dist.get_backend(group))
        self.rank = int(dist.get_rank(group))
        self.num_ranks = int(dist.get_world_size(group))
        if topology is not None and topology.num_ranks != self.num_ranks:
            raise InvalidArgumentError(
                "topology", topology.name,
                f"has {topology.num_ranks} ranks, the torch group has {self.num_ranks}",
            )
        self.topology = topology or topo.host(self.num_ranks)  # from /sys after the bootstrap
        self.default_timeout_s = timeout_s_from_env() if timeout_s is None else float(timeout_s)
        self.closed = False
        self.peers: list[PeerProcess] = []
        self._reaper: subprocess.Popen[bytes] | None = None
        deadline = time.monotonic() + self.default_timeout_s
        me: dict[str, Any] = {
            "pid": os.getpid(),
            "start_time": process_start_time(os.getpid()),
            "uid": os.getuid(),
            "cpus": own_cpus(),  # the host topology's hop classes
            "mpi_rank": launcher_rank(),  # across hosts, the MPI job's rank (from_torch)
            **host_identity(),
        }
        if self.rank == 0:
            me["group_id"] = secrets.token_hex(16)
            me["dir"] = self._start_reaper(deadline)
        # The cleaner watches rank 0 alone until every rank is known to share this host.
        watch = [(me["pid"], me["start_time"])]
        try:
            hellos = self._allgather_json(me, deadline, "bootstrap")
            check_same_host(hellos)
            for r, h in enumerate(hellos):
                if h["uid"] != os.getuid():
                    raise UbepError(f"rank {r} runs as uid {h['uid']}, not {os.getuid()}")
            watch = [(h["pid"], h["start_time"]) for h in hellos]
        finally:
            if self.rank == 0:
                self._watch(watch)
        self.group_id: bytes = bytes.fromhex(hellos[0]["group_id"])
        self.rendezvous: str = hellos[0]["dir"]
        self.peers = [PeerProcess(r, h["pid"], h["start_time"]) for r, h in enumerate(hellos)]
        if topology is None:
            self.topology = host_topology([h["cpus"] for h in hellos])

    @property
    def torch_group(self) -> Any:
        group = self._torch_group()
        if group is None:
            raise UbepError(
                f"rank {self.rank}: the torch.distributed group this ubep group ran over is gone "
                "(dist.destroy_process_group ran): create the Buffer on a live group"
            )
        return group

    # --- ProcessGroup -------------------------------------------------------------------

    def allgather(self, value: Any, timeout_s: float | None = None) -> list[Any]:
        """Every rank's JSON-serialisable ``value``, in group-rank order (collective)."""
        self._check_open()
        return self._allgather_json(value, self._deadline(timeout_s), "allgather")

    def exchange(self, key: str, value: Any, timeout_s: float | None = None) -> list[Any]:
        """:meth:`allgather` of ``value`` under a name: every rank must pass the same ``key``
        (a rank that is at another exchange raises ``ubep.UbepError`` naming both keys)."""
        if not isinstance(key, str):
            raise InvalidArgumentError("key", key, "must be a str")
        self._check_open()
        got = self._allgather_json([key, value], self._deadline(timeout_s), f"exchange {key!r}")
        keys = [k for k, _ in got]
        if any(k != key for k in keys):
            raise UbepError(
                f"rank {self.rank}: exchange {key!r} met other exchanges on other ranks "
                f"(keys by rank: {keys}); every rank must make the same exchanges in the same order"
            )
        return [v for _, v in got]

    def barrier(self, timeout_s: float | None = None) -> None:
        """Block until every rank has entered this barrier (a torch collective with a deadline)."""
        self._check_open()
        work = dist.barrier(group=self.torch_group, async_op=True)
        self._wait(work, self._deadline(timeout_s), "barrier")

    def map_global(
        self, size_bytes: int, kind: str, timeout_s: float | None = None
    ) -> ShmGlobalMemory:
        """Create this rank's segment of ``size_bytes`` and map every peer's (collective).

        The name is recorded in the group directory until ``unlink()`` (so the cleaner removes
        it if this process is killed first); call ``unlink()`` once every peer has mapped it
        (after a barrier), as :class:`ubep.Buffer` does."""
        self._check_open()
        return map_shm_global(self, size_bytes, kind, timeout_s)

    def check_peers(self) -> None:
        """Raise ``ubep.PeerLostError`` if any peer process has died."""
        dead = self._dead()
        if dead:
            raise PeerLostError(f"rank {self.rank}: peer rank(s) {dead} died")

    def close(self) -> None:
        """Stop using the group (local). The torch group stays the caller's; the directory goes
        when every rank's process has exited."""
        self.closed = True

    def __repr__(self) -> str:
        return (
            f"TorchGroup(rank={self.rank}, num_ranks={self.num_ranks}, "
            f"topology={self.topology.name})"
        )

    # --- internals ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise UbepError(f"rank {self.rank}: the group is closed")

    def _deadline(self, timeout_s: float | None) -> float:
        return time.monotonic() + (self.default_timeout_s if timeout_s is None else timeout_s)

    def _dead(self) -> list[int]:
        return [p.rank for p in self.peers if p.rank != self.rank and not p.alive()]

    def _allgather_json(self, value: Any, deadline: float, what: str) -> list[Any]:
        """One torch all-gather of fixed slots (length, then the JSON bytes); a second one, of
        the JSON padded to the longest, only when some rank's JSON does not fit its slot. The
        calls' agreements carry a few counts: one round trip instead of two."""
        raw = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
        room = _SLOT_BYTES - 8
        slot = torch.zeros(_SLOT_BYTES, dtype=torch.uint8)
        slot[:8] = torch.tensor([len(raw)], dtype=torch.int64).view(torch.uint8)
        if len(raw) <= room:
            slot[8: 8 + len(raw)] = raw
        slots = self._gather(slot, deadline, what)
        sizes = [int(s[:8].view(torch.int64).item()) for s in slots]
        longest = max(sizes)
        if longest <= room:
            bodies = [bytes(s[8: 8 + n].numpy()) for s, n in zip(slots, sizes, strict=True)]
        else:  # every rank sees the same sizes, so every rank takes this second round
            mine = torch.zeros(longest, dtype=torch.uint8)
            mine[: len(raw)] = raw
            bufs = self._gather(mine, deadline, what)
            bodies = [bytes(b[:n].numpy()) for b, n in zip(bufs, sizes, strict=True)]
        return [json.loads(b.decode()) for b in bodies]

    def _gather(self, mine: torch.Tensor, deadline: float, what: str) -> list[torch.Tensor]:
        """Every rank's ``mine`` (all the same shape), by one torch all-gather with a deadline."""
        bufs = [torch.empty_like(mine) for _ in range(self.num_ranks)]
        self._wait(dist.all_gather(bufs, mine, group=self.torch_group, async_op=True), deadline,
                   what)
        return bufs

    def _wait(self, work: Any, deadline: float, what: str) -> None:
        """Poll a torch Work until done, the deadline, or a dead peer (then the torch group has a
        collective in flight and cannot be used for more collectives: the error says so)."""
        def check_peers() -> None:
            dead = self._dead()
            if dead:
                raise PeerLostError(
                    f"rank {self.rank}: rank(s) {dead} died while this rank waited in {what} "
                    "(the torch.distributed group is unusable from here)"
                )

        def timed_out(waited_s: float) -> BaseException:
            return TimeoutError(
                f"rank {self.rank}: {what} over the torch.distributed group timed out after "
                f"{waited_s:.1f}s (a rank is missing or at another call; the torch group "
                "is unusable from here)"
            )

        def completed() -> bool:
            # Block in torch (the GIL released) for up to one liveness period: the caller wakes
            # as the collective completes, not at the end of a sleep between polls. A slice that
            # runs out raises and leaves the work pending (is_completed() tells that apart from
            # a failed work, whose error the work.wait() below raises). Only gloo's works honour
            # the timeout (MPI's, for one, block until done), so only they are waited on so.
            if work.is_completed():
                return True
            slice_s = min(LIVENESS_PERIOD_S, deadline - time.monotonic())
            with contextlib.suppress(RuntimeError):
                work.wait(timeout=datetime.timedelta(seconds=max(slice_s, 1e-3)))
            return bool(work.is_completed())

        if self._gloo:
            wait_until(completed, deadline, check_peers=check_peers, timed_out=timed_out,
                       backoff=_SLICED)
        else:
            wait_until(work.is_completed, deadline, check_peers=check_peers,
                       timed_out=timed_out, backoff=_POLLED)
        try:
            work.wait()
        except RuntimeError as exc:
            dead = self._dead()
            if dead:
                raise PeerLostError(
                    f"rank {self.rank}: rank(s) {dead} died while this rank waited in {what}"
                ) from exc
            raise UbepError(f"rank {self.rank}: {what} over the torch group failed: {exc}") from exc

    def _start_reaper(self, deadline: float) -> str:
        """Start the cleaner (group rank 0) and return the private directory it created."""
        self._reaper, directory = _reaper_script.spawn(deadline - time.monotonic())
        if not directory:
            raise UbepError(f"rank {self.rank}: the group's cleaner process did not start")
        return directory

    def _watch(self, processes: list[tuple[int, int]]) -> None:
        """Hand the cleaner the processes it waits for (group rank 0)."""
        if self._reaper is None:
            return
        with contextlib.suppress(OSError):  # it died: nothing to do from here but keep running
            _reaper_script.feed(self._reaper, processes)
        _reaper_script.end_feed(self._reaper)


def _check_torch_group(group: Any) -> None:
    if not isinstance(group, dist.ProcessGroup):
        raise InvalidArgumentError(
            "group", type(group).__name__, "must be a torch.distributed.ProcessGroup"
        )
    if not dist.is_initialized():
        raise InvalidArgumentError(
            "group", group, "torch.distributed is not initialised (dist.init_process_group)"
        )
    if dist.get_rank(group) < 0:
        raise InvalidArgumentError(
            "group", group, "this process is not a member of the torch.distributed group"
        )
    backend = str(dist.get_backend(group))
    if not any(b in backend for b in _CPU_BACKENDS):
        raise InvalidArgumentError(
            "group", backend,
            "ubep's control plane runs CPU collectives: use a gloo group "
            "(dist.new_group(ranks, backend='gloo') or init_process_group('cpu:gloo,cuda:nccl'))",
        )
