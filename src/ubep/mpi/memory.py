"""Global memory over MPI windows: shared memory inside a host, one-sided RMA across hosts.

Every rank's region is allocated with ``MPI_Win_allocate_shared`` on the communicator of its
(possibly virtual) host, so ranks of one host read and write each other's regions with plain
loads and stores (``MPI_Win_shared_query`` gives the addresses). When the group spans more than
one host, the same memory is also exposed to every rank by ``MPI_Win_create`` on the whole
communicator, locked once for the lifetime of the window (``MPI_Win_lock_all``, passive target):
rows to another host travel by ``MPI_Rput``/``MPI_Rget``.

:class:`MpiGlobalMemory` is also the transport of the RMA engine: ``put`` / ``put_words`` /
``get_runs`` do a store (same host) or a request-based RMA operation (another host); ``done``
tests the requests (``MPI_Test``, never blocks) and ``flush`` completes them at the target once
``done`` holds. Nothing here blocks on a peer: on TCP, ``osc/rdma`` emulates RMA with messages
the target must receive, so a flush with a put in flight to a stopped process would wait for as
long as it stays stopped; the engine polls ``done`` under its deadline instead. Ordering rule,
the one MPI gives: a put is complete at the target only after ``flush(target)``; nothing orders
two puts in flight, not even the bytes of one put. Same-host "flush" is a full memory barrier
(``MPI_Win_sync`` on the shared window), which also orders non-temporal stores.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import UbepError

__all__ = ["MpiGlobalMemory"]

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: map pages for writing without touching their bytes
_PAGE = mmap.PAGESIZE


class MpiGlobalMemory:
    """One rank's region of a global memory object of a :class:`~ubep.mpi.MpiGroup`.

    Attributes (the :class:`ubep.plane.protocol.GlobalMemory` protocol):
        addresses: every rank's region address in this process when all ranks share this host
            (the native engine runs on them), else ``None``.
        local_array: this rank's region, ``uint8``, zero-filled at creation.
        pids, start_times: from the group.
        peer_arrays: per rank, its region as an array when it is on this host, else ``None``.
        released: :meth:`close` was called (the group frees the windows collectively later).
    """

    def __init__(self, group: Any, size_bytes: int, kind: str) -> None:
        """``group``: the :class:`~ubep.mpi.group.MpiGroup` (not imported here: the group
        module builds this one)."""
        self.group = group
        self.kind = kind
        self.size_bytes = size_bytes
        self.released = False
        self._freed = False
        mpi = group.mpi
        self._mpi = mpi
        self.mpi = mpi  # mpi4py.MPI (its Exception: how MPI reports a failed process)
        host = group.host_comm
        info = mpi.Info.Create()
        # One page-aligned allocation per rank (madvise needs page alignment).
        info.Set("alloc_shared_noncontig", "true")
        try:
            self._shared = mpi.Win.Allocate_shared(size_bytes, 1, info=info, comm=host)
        finally:
            info.Free()
        host_ranks = [q for q in range(group.num_ranks) if group.same_host(q)]
        self.peer_arrays: list[np.ndarray | None] = [None] * group.num_ranks
        for i, q in enumerate(host_ranks):
            buf, _unit = self._shared.Shared_query(i)
            self.peer_arrays[q] = np.frombuffer(buf, dtype=np.uint8)[:size_bytes]
        local = self.peer_arrays[group.rank]
        assert local is not None
        self.local_array: np.ndarray = local
        self.local_array[:] = 0  # MPI gives no initial contents; also maps every page
        self.pids = list(group.pids)
        self.start_times = list(group.start_times)
        self._win: Any = None
        self._pending: list[_Pending] = []  # RMA operations not yet seen complete
        # every region load/store reachable: the native engine ("shm"), else the RMA engine
        self.transport = "shm" if len(host_ranks) == group.num_ranks else "mpi"
        if len(host_ranks) == group.num_ranks:
            self.addresses: list[int] | None = [
                int(a.ctypes.data) for a in self.peer_arrays if a is not None
            ]
        else:
            self.addresses = None
            self._win = mpi.Win.Create(self.local_array, 1, comm=group.comm)
            self._win.Lock_all(mpi.MODE_NOCHECK)
        self._shared.Sync()
        group.barrier()  # every rank zeroed its region before anyone writes to it
        for q, arr in enumerate(self.peer_arrays):
            if arr is not None and q != group.rank:
                _populate_write(arr)

    # --- GlobalMemory protocol ----------------------------------------------------------

    def unlink(self) -> None:
        """Nothing to do: MPI windows have no name in the file system."""

    def close(self) -> None:
        """Release this rank's use (local). The windows are freed collectively by the group."""
        self.released = True

    # --- transport ----------------------------------------------------------------------

    def remote(self, dst: int) -> bool:
        """Whether ``dst``'s region is reached through RMA (another host)."""
        return self.peer_arrays[dst] is None

    def put(self, dst: int, offset: int, data: np.ndarray) -> None:
        """Write ``data`` (any contiguous array) at ``offset`` of ``dst``'s region. Another
        host: an ``MPI_Rput``; ``data`` is kept alive until :meth:`done` sees it complete."""
        raw = _bytes_of(data)
        peer = self.peer_arrays[dst]
        if peer is not None:
            peer[offset: offset + raw.size] = raw
        elif raw.size:
            req = self._win.Rput([raw, self._mpi.BYTE], dst,
                                 target=(offset, raw.size, self._mpi.BYTE))
            self._pending.append(_Pending(dst, req, raw, None))

    def put_words(self, dst: int, offset: int, words: np.ndarray, stride: int) -> None:
        """Write ``words`` (uint64) at ``offset``, ``offset + stride``, ... of ``dst``'s region."""
        words = np.ascontiguousarray(words, dtype=np.uint64)
        n = int(words.size)
        if not n:
            return
        peer = self.peer_arrays[dst]
        if peer is not None:
            view = np.ndarray((n,), dtype=np.uint64, buffer=peer, offset=offset, strides=(stride,))
            view[:] = words
            return
        mpi = self._mpi
        vec = mpi.BYTE.Create_vector(n, 8, stride).Commit()
        req = self._win.Rput([words, mpi.BYTE], dst, target=(offset, 1, vec))
        self._pending.append(_Pending(dst, req, words, vec))

    def get_runs(self, dst: int, runs: list[tuple[int, int]], out: np.ndarray) -> None:
        """Read byte runs ``(offset, nbytes)`` of ``dst``'s region, back to back, into ``out``
        (an ``MPI_Rget``: ``out`` holds the bytes once :meth:`done` says so)."""
        raw = _bytes_of(out)
        total = sum(n for _, n in runs)
        if total > raw.size:
            raise UbepError(f"get_runs: {total} bytes do not fit {raw.size}")
        if not total:
            return
        peer = self.peer_arrays[dst]
        if peer is not None:
            at = 0
            for off, n in runs:
                raw[at: at + n] = peer[off: off + n]
                at += n
            return
        mpi = self._mpi
        dtype = mpi.BYTE.Create_hindexed([n for _, n in runs], [off for off, _ in runs]).Commit()
        req = self._win.Rget([raw[:total], mpi.BYTE], dst, target=(0, 1, dtype))
        self._pending.append(_Pending(dst, req, raw, dtype))

    def done(self, dst: int | None = None) -> bool:
        """Whether every operation to ``dst`` (``None``: to anyone) has completed at this end
        (``MPI_Test``: never blocks; drops what completed). A put to a peer that stopped never
        completes on an emulated transport (TCP): callers poll this under their deadline
        instead of entering a flush that would wait for the peer as long as it is stopped."""
        if not self._pending:
            return True
        left: list[_Pending] = []
        for op in self._pending:
            if op.request.Test():
                if op.dtype is not None:
                    op.dtype.Free()
            else:
                left.append(op)
        self._pending = left
        return not any(dst is None or op.dst == dst for op in left)

    def flush(self, dst: int) -> None:
        """Remote completion of every operation to ``dst`` (same host: a fence). Call it only
        once :meth:`done` holds for ``dst``: then nothing is outstanding and ``MPI_Win_flush``
        does not wait for the peer (on TCP, ``osc/rdma`` completes an emulated put only when
        the target acknowledged it; on an RDMA NIC the NIC acknowledges)."""
        if self.peer_arrays[dst] is not None:
            self._shared.Sync()
        else:
            self._win.Flush(dst)

    def flush_all(self) -> None:
        """:meth:`flush` of every peer (again only once :meth:`done` holds)."""
        self._shared.Sync()
        if self._win is not None:
            self._win.Flush_all()

    def sync(self) -> None:
        """Memory barrier before reading words peers write (MPI's rule for polling a window)."""
        self._shared.Sync()
        if self._win is not None:
            self._win.Sync()

    # --- lifetime -----------------------------------------------------------------------

    def free(self) -> None:
        """Free the MPI windows (collective over the group: called by the group only).

        Arrays that still view the memory (a caller's ``recv_x``) become invalid: the Buffer
        docstring says to pass ``copy=True`` to keep results past ``close()``.
        """
        if self._freed:
            return
        self._freed = True
        self.released = True
        self.local_array = np.zeros(0, dtype=np.uint8)
        self.peer_arrays = [None] * len(self.peer_arrays)
        if self._win is not None:
            self._win.Unlock_all()  # completes every operation still pending
            self._mpi.Request.Waitall([op.request for op in self._pending])  # frees them
            for op in self._pending:
                if op.dtype is not None:
                    op.dtype.Free()
            self._pending = []
            self._win.Free()
            self._win = None
        self._shared.Free()


@dataclass(frozen=True)
class _Pending:
    """One RMA operation in flight: its request and what must outlive it (MPI allows freeing a
    datatype an operation still uses; keeping it costs nothing and spares a fragile corner of
    emulated RMA)."""

    dst: int
    request: Any
    buffer: np.ndarray
    dtype: Any


def _bytes_of(a: np.ndarray) -> np.ndarray:
    if not a.flags.c_contiguous:
        raise UbepError("transport: array must be C-contiguous")
    return a.reshape(-1).view(np.uint8)


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _populate_write(arr: np.ndarray) -> None:
    """Map a peer's pages for writing now (first touch inside an operation is ~7x slower).
    Best effort: older kernels refuse the advice and the pages fault in on first use."""
    start = int(arr.ctypes.data)
    lo = start - start % _PAGE
    length = start + arr.size - lo
    _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(length), _MADV_POPULATE_WRITE)
