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
to a process that just died. Point-to-point messages (``group.dup_comm()``: the RMA engine's
two-sided rows, ubep.mpi.rows2) follow MPI's matching rules (per source and tag, in the order
sent); a send of up to ``EAGER_BYTES`` completes at once (eager), a longer one only once a
receive took it (rendezvous); a message to a stopped rank arrives only at its resume, and one
from a rank in ``world.delayed`` only at :meth:`FakeWorld.release` (a slow link).
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
        self.mail = _Mail()
        self.delayed: set[int] = set()
        self._held: list[tuple[int, Callable[[], None]]] = []
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

    def send(self, src: int, dst: int, op: Callable[[], None]) -> None:
        """A message's delivery: held while ``src`` is delayed, else as :meth:`transfer`."""
        with self.lock:
            if src in self.delayed:
                self._held.append((dst, op))
                return
        self.transfer(dst, op)

    def release(self, rank: int) -> None:
        """Deliver what ``rank`` sent while delayed, in order; its later messages go at once."""
        with self.lock:
            self.delayed.discard(rank)
            held, self._held = self._held, []
        for dst, op in held:
            self.transfer(dst, op)

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
        self._comms = 0
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

    def dup_comm(self) -> FakeComm:
        self._comms += 1
        return FakeComm(self, self._comms)

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
        self.mpi = FAKE_MPI

    def remote(self, dst: int) -> bool:
        return self.peer_arrays[dst] is None

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


class _Request:
    """A send or receive: complete once matched (a send: once a receive took its bytes)."""

    def __init__(self) -> None:
        self.complete = False
        self.cancelled = False
        self.on_cancel: Callable[[], bool] | None = None

    def Test(self) -> bool:  # noqa: N802 (mpi4py's name)
        return self.complete

    def Cancel(self) -> None:  # noqa: N802
        if not self.complete and self.on_cancel is not None and self.on_cancel():
            self.complete = self.cancelled = True


class _Message:
    def __init__(self, src: int, tag: int, data: np.ndarray, req: _Request) -> None:
        self.src, self.tag, self.data, self.req = src, tag, data, req


class _Mail:
    """Every rank's unexpected messages and posted receives, per communicator."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.unexpected: dict[tuple[int, int], list[_Message]] = {}
        self.posted: dict[tuple[int, int], list[tuple[int, int, np.ndarray, _Request]]] = {}

    def deliver(self, box: tuple[int, int], msg: _Message) -> None:
        with self.lock:
            for i, (src, tag, buf, req) in enumerate(self.posted.get(box, [])):
                if src == msg.src and tag in (msg.tag, ANY_TAG):
                    del self.posted[box][i]
                    _copy_into(buf, msg)
                    req.complete = True
                    return
            self.unexpected.setdefault(box, []).append(msg)

    def post(self, box: tuple[int, int], src: int, tag: int, buf: np.ndarray) -> _Request:
        req = _Request()
        with self.lock:
            for i, msg in enumerate(self.unexpected.get(box, [])):
                if msg.src == src and tag in (msg.tag, ANY_TAG):
                    del self.unexpected[box][i]
                    _copy_into(buf, msg)
                    req.complete = True
                    return req
            entry = (src, tag, buf, req)
            self.posted.setdefault(box, []).append(entry)

        def cancel() -> bool:
            with self.lock:
                if entry in self.posted.get(box, []):
                    self.posted[box].remove(entry)
                    return True
                return False

        req.on_cancel = cancel
        return req

    def first(self, box: tuple[int, int], src: int, tag: int, take: bool) -> _Message | None:
        with self.lock:
            for i, msg in enumerate(self.unexpected.get(box, [])):
                if msg.src == src and tag in (msg.tag, ANY_TAG):
                    if take:
                        del self.unexpected[box][i]
                    return msg
        return None


def _copy_into(buf: np.ndarray, msg: _Message) -> None:
    if msg.data.size > buf.size:
        raise FakeMpiError(f"message of {msg.data.size} bytes truncated to {buf.size}")
    buf[: msg.data.size] = msg.data
    msg.req.complete = True


def _bytes(spec: list[Any]) -> np.ndarray:
    """The bytes a buffer spec ``[array, type]`` or ``[array, 1, hindexed]`` describes."""
    raw = np.ascontiguousarray(spec[0]).reshape(-1).view(np.uint8)
    if len(spec) == 3:
        return np.concatenate([raw[d: d + n] for n, d in spec[2].runs]).copy()
    return raw.copy()


class FakeComm:
    def __init__(self, group: FakeGroup, index: int) -> None:
        self.group, self.index = group, index
        self.sends: list[tuple[int, int]] = []  # (destination, bytes) of every message

    def Get_attr(self, key: Any) -> int:  # noqa: N802
        assert key is FAKE_MPI.TAG_UB
        return 1 << 15  # small: a test may run epochs past it

    def Isend(self, spec: list[Any], dest: int, tag: int) -> _Request:  # noqa: N802
        req = _Request()
        msg = _Message(self.group.rank, tag, _bytes(spec), req)
        self.sends.append((dest, msg.data.size))
        req.complete = msg.data.size <= EAGER_BYTES
        world = self.group.world
        world.send(self.group.rank, dest, lambda: world.mail.deliver((self.index, dest), msg))
        return req

    def Irecv(self, spec: list[Any], source: int, tag: int) -> _Request:  # noqa: N802
        buf = np.asarray(spec[0]).reshape(-1).view(np.uint8)
        return self.group.world.mail.post((self.index, self.group.rank), source, tag, buf)

    def Iprobe(self, source: int, tag: int, status: Any) -> bool:  # noqa: N802
        msg = self.group.world.mail.first((self.index, self.group.rank), source, tag, False)
        if msg is not None:
            status.tag, status.count = msg.tag, msg.data.size
        return msg is not None

    def Mprobe(self, source: int, tag: int) -> _Matched:  # noqa: N802
        msg = self.group.world.mail.first((self.index, self.group.rank), source, tag, True)
        assert msg is not None, "Mprobe after Iprobe found no message"
        return _Matched(msg)


class _Matched:
    def __init__(self, msg: _Message) -> None:
        self.msg = msg

    def Irecv(self, spec: list[Any]) -> _Request:  # noqa: N802
        _copy_into(np.asarray(spec[0]).reshape(-1).view(np.uint8), self.msg)
        req = _Request()
        req.complete = True
        return req


class _Status:
    def __init__(self) -> None:
        self.tag = self.count = -1

    def Get_tag(self) -> int:  # noqa: N802
        return self.tag

    def Get_count(self, dtype: Any) -> int:  # noqa: N802
        return self.count


class _Hindexed:
    def __init__(self, runs: list[tuple[int, int]]) -> None:
        self.runs = runs

    def Commit(self) -> _Hindexed:  # noqa: N802
        return self

    def Free(self) -> None:  # noqa: N802
        pass


class _Byte:
    def Create_hindexed(self, lengths: list[int], displs: list[int]) -> _Hindexed:  # noqa: N802
        return _Hindexed(list(zip(lengths, displs, strict=True)))


class FakeMpiError(Exception):
    """What the fake's MPI raises (as ``mpi4py.MPI.Exception``)."""


ANY_TAG = -1
EAGER_BYTES = 4096


class _FakeMpi:
    BYTE = _Byte()
    TAG_UB = object()
    ANY_TAG = ANY_TAG
    Status = _Status
    Exception = FakeMpiError


FAKE_MPI = _FakeMpi()


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
