"""An in-process stand-in for ``ubep.mpi`` over RMA: ranks are threads of this process.

:class:`FakeWorld` gives each rank a :class:`FakeGroup` whose global memory has no load/store
addresses, so :class:`ubep.Buffer` drives the real :class:`ubep.mpi.engine.RmaEngine` on it. The
transport copies a put or get at once, except to a rank in ``world.stopped``: those operations
stay pending (``done()`` is False) until :meth:`FakeWorld.resume`, as an emulated-RMA put to a
SIGSTOPped process does. ``ranks_per_host=k`` groups every ``k`` consecutive ranks into a host:
their regions are also each other's ``peer_arrays`` (loads and stores, as through a host's
shared window), while puts still go through the transport. ``world.dead`` is what the liveness
check reports. An operation to a rank in ``world.wedging`` never returns until
:meth:`FakeWorld.unwedge`, as Open MPI's TCP one-sided component can spin inside ``MPI_Rput``
to a process that just died.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ubep import topology as topo
from ubep.mpi.watchdog import CallRunner


class FakeWorld:
    def __init__(self, num_ranks: int, ranks_per_host: int = 1) -> None:
        self.num_ranks = num_ranks
        self.ranks_per_host = ranks_per_host
        self.lock = threading.Lock()
        self.regions: dict[int, list[np.ndarray | None]] = {}  # per global object, per rank
        self.stopped: set[int] = set()
        self.dead: set[int] = set()
        self.wedging: set[int] = set()
        self._unwedged = threading.Event()
        self._barrier = threading.Barrier(num_ranks)
        self._values: list[Any] = [None] * num_ranks
        self._pending: list[Callable[[], None]] = []
        self.groups = [FakeGroup(self, r) for r in range(num_ranks)]

    def exchange(self, rank: int, value: Any, timeout_s: float) -> list[Any]:
        self._barrier.wait(timeout_s)
        self._values[rank] = value
        self._barrier.wait(timeout_s)
        out = list(self._values)
        self._barrier.wait(timeout_s)
        return out

    def region(self, index: int, rank: int, size: int) -> np.ndarray:
        with self.lock:
            regs = self.regions.setdefault(index, [None] * self.num_ranks)
            if regs[rank] is None:
                regs[rank] = np.zeros(size, np.uint8)
            arr = regs[rank]
            assert arr is not None
            return arr

    def peer(self, index: int, rank: int) -> np.ndarray:
        with self.lock:
            arr = self.regions[index][rank]
        assert arr is not None
        return arr

    def transfer(self, dst: int, op: Callable[[], None]) -> bool:
        """Run ``op`` now unless ``dst`` is stopped (then at resume); whether it ran."""
        if dst in self.wedging:
            self._unwedged.wait()
        with self.lock:
            if dst in self.stopped:
                self._pending.append(op)
                return False
        op()
        return True

    def unwedge(self) -> None:
        """Let every operation stuck on a ``wedging`` rank return (the test's threads end)."""
        self._unwedged.set()

    def resume(self, rank: int) -> None:
        with self.lock:
            self.stopped.discard(rank)
            ops, self._pending = self._pending, []
        for op in ops:
            op()


class FakeGroup:
    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.num_ranks = world.num_ranks
        self.topology = topo.host(world.num_ranks, 1)
        self.ranks_per_host = world.ranks_per_host
        self.num_hosts = world.num_ranks // world.ranks_per_host
        self.host_of = [q // world.ranks_per_host for q in range(world.num_ranks)]
        self.pids = [os.getpid()] * world.num_ranks
        self.start_times = [0] * world.num_ranks
        self._objects = 0
        self.runner = CallRunner(f"fake rank {rank}")

    def barrier(self, timeout_s: float | None = None) -> None:
        self.world.exchange(self.rank, None, timeout_s or 30.0)

    def allgather(self, value: Any, timeout_s: float | None = None) -> list[Any]:
        return self.world.exchange(self.rank, value, timeout_s or 30.0)

    def map_global(self, size_bytes: int, kind: str, timeout_s: float | None = None) -> FakeMemory:
        index = self._objects
        self._objects += 1
        mem = FakeMemory(self, index, size_bytes, kind)
        self.barrier(timeout_s)  # every rank's region exists before anyone writes to it
        if self.ranks_per_host > 1:  # a host's regions are each other's loads and stores
            mem.peer_arrays = [self.world.peer(index, q) if self.host_of[q] == self.host_of[
                self.rank] else None for q in range(self.num_ranks)]
        return mem

    def dead_peers(self, peers: list[int] | None = None) -> list[int]:
        ranks = range(self.num_ranks) if peers is None else peers
        return [q for q in ranks if q in self.world.dead]

    def progress(self) -> None:
        pass


class FakeMemory:
    def __init__(self, group: FakeGroup, index: int, size_bytes: int, kind: str = "") -> None:
        self.group = group
        self.index = index
        self.kind = kind
        self.puts: list[tuple[int, int]] = []  # (destination, bytes) of every put
        self.addresses = None
        self.transport = "mpi"
        self.local_array = group.world.region(index, group.rank, size_bytes)
        # every peer behind RMA (as on one host per rank): no region is stored to directly
        self.peer_arrays: list[np.ndarray | None] = [None] * group.num_ranks
        self.pids = group.pids
        self.start_times = group.start_times
        self._waiting: list[tuple[int, list[bool]]] = []

    def unlink(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _issue(self, dst: int, op: Callable[[], None]) -> None:
        flag = [False]

        def run() -> None:
            op()
            flag[0] = True

        self.group.world.transfer(dst, run)
        self._waiting.append((dst, flag))

    def put(self, dst: int, offset: int, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8).copy()
        self.puts.append((dst, raw.size))
        peer = self.group.world.peer(self.index, dst)
        self._issue(dst, lambda: peer.__setitem__(slice(offset, offset + raw.size), raw))

    def put_words(self, dst: int, offset: int, words: np.ndarray, stride: int) -> None:
        words = np.ascontiguousarray(words, dtype=np.uint64).copy()
        peer = self.group.world.peer(self.index, dst)

        def op() -> None:
            view = np.ndarray((words.size,), np.uint64, peer, offset, (stride,))
            view[:] = words

        self._issue(dst, op)

    def get_runs(self, dst: int, runs: list[tuple[int, int]], out: np.ndarray) -> None:
        raw = out.reshape(-1).view(np.uint8)
        peer = self.group.world.peer(self.index, dst)

        def op() -> None:
            at = 0
            for off, n in runs:
                raw[at: at + n] = peer[off: off + n]
                at += n

        self._issue(dst, op)

    def done(self, dst: int | None = None) -> bool:
        self._waiting = [(d, f) for d, f in self._waiting if not f[0]]
        return not any(dst is None or d == dst for d, _ in self._waiting)

    def flush(self, dst: int) -> None:
        assert self.done(dst), "flush before the operations completed would block"

    def flush_all(self) -> None:
        assert self.done(), "flush before the operations completed would block"

    def sync(self) -> None:
        pass


def run_ranks(world: FakeWorld, body: Callable[[FakeGroup], Any], timeout_s: float = 60.0,
              ) -> list[Any]:
    """``body(group)`` on one thread per rank; results in rank order (a rank's exception is
    re-raised)."""
    results: list[Any] = [None] * world.num_ranks
    errors: list[BaseException | None] = [None] * world.num_ranks

    def main(r: int) -> None:
        try:
            results[r] = body(world.groups[r])
        except BaseException as exc:  # re-raised in the caller
            errors[r] = exc

    threads = [threading.Thread(target=main, args=(r,), daemon=True)
               for r in range(world.num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), "a rank did not finish"
    for err in errors:
        if err is not None:
            raise err
    return results
