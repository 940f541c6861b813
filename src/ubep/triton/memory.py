"""The memory behind the engine's pointer table: one region per rank, every region reachable
from every rank's kernels at an address this process knows.

* :class:`ShmArena` (CPU, Triton's interpreter): a POSIX shared-memory segment per rank
  (``ubep.runtime.shm`` through ``Group.map_global``: mode 0600, unguessable names, unlinked as
  soon as every rank mapped every segment); the table holds this process's mapping addresses.
* :class:`CudaIpcArena` (GPU): a device buffer per rank, exported with CUDA IPC handles
  (``torch.multiprocessing.reductions``) and opened by every peer process; the table holds the
  device addresses this process got. Ranks may share one GPU. Not run on a GPU yet.
"""

from __future__ import annotations

import base64
import ctypes
import os
import pickle
from typing import Any, Protocol

from ..errors import UbepError
from ..plane.liveness import alive as _alive
from ..plane.liveness import start_time_of

__all__ = ["Arena", "CudaIpcArena", "ShmArena", "open_arena"]


class Arena(Protocol):
    """What the engine needs of its memory (module docstring)."""

    local: Any  # torch uint8 [size_bytes]: this rank's region, on the engine's device
    addresses: list[int]  # every rank's region, as addresses this process's kernels use

    def peer_bytes(self, rank: int, offset: int, size: int) -> bytes:
        """``size`` bytes of rank ``rank``'s region from ``offset`` (host copy)."""

    def alive(self, rank: int) -> bool:
        """Whether rank ``rank``'s process is still running."""

    def close(self) -> None:
        """Release this rank's mappings (local)."""


class ShmArena:
    """Shared-memory regions of one host (module docstring)."""

    def __init__(self, group: Any, size_bytes: int, timeout_s: float) -> None:
        mem = group.map_global(size_bytes, "triton", timeout_s)
        try:
            group.barrier(timeout_s)  # every rank has mapped every segment: drop the names
        finally:
            mem.unlink()
        self._over(mem, owned=True)

    @classmethod
    def over(cls, memory: Any) -> ShmArena:
        """An arena on a one-host ``GlobalMemory`` its caller mapped, owns and closes (a
        Buffer's, when a registry row opens this engine); its regions must be at least
        ``ubep.triton.layout.arena_bytes`` long."""
        arena = cls.__new__(cls)
        arena._over(memory, owned=False)
        return arena

    def _over(self, mem: Any, owned: bool) -> None:
        import torch

        if mem.addresses is None:
            raise UbepError("the Triton engine on a CPU needs every rank's region load/store "
                            "reachable (one host)")
        self._mem, self._owned = mem, owned
        self.local = torch.frombuffer(mem.local_array, dtype=torch.uint8)
        self.addresses = list(mem.addresses)
        self._peers = list(zip(mem.pids, mem.start_times, strict=True))

    def peer_bytes(self, rank: int, offset: int, size: int) -> bytes:
        # every region is mapped in this process at the address the table holds (one host)
        return ctypes.string_at(self.addresses[rank] + offset, size)

    def alive(self, rank: int) -> bool:
        return _alive(*self._peers[rank])

    def close(self) -> None:
        import torch

        self.local = torch.zeros(0, dtype=torch.uint8)
        if self._owned:
            self._owned = False  # closed once, whoever closes it again
            self._mem.close()


class CudaIpcArena:
    """Device regions shared between the ranks' processes by CUDA IPC handles."""

    def __init__(self, group: Any, size_bytes: int, device: Any, timeout_s: float) -> None:
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        self.local = torch.zeros(size_bytes, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
        rebuild, args = reduce_tensor(self.local)
        blob = base64.b64encode(pickle.dumps((rebuild, args))).decode("ascii")
        me = (os.getpid(), start_time_of(os.getpid()))
        got = group.allgather((blob, me), timeout_s)
        self._regions: list[Any] = []
        for r, (b, _) in enumerate(got):
            if r == group.rank:
                self._regions.append(self.local)
            else:
                fn, fn_args = pickle.loads(base64.b64decode(b))  # a peer of this user's group
                self._regions.append(fn(*fn_args))
        self.addresses = [int(t.data_ptr()) for t in self._regions]
        self._peers = [tuple(p) for _, p in got]  # (pid, start time): liveness on this host
        group.barrier(timeout_s)  # no rank frees its buffer before every peer opened it

    def peer_bytes(self, rank: int, offset: int, size: int) -> bytes:
        return bytes(self._regions[rank][offset:offset + size].cpu().numpy().tobytes())

    def alive(self, rank: int) -> bool:
        return _alive(*self._peers[rank])

    def close(self) -> None:
        self._regions = []


def open_arena(group: Any, size_bytes: int, device: Any, timeout_s: float) -> Arena:
    """The arena for ``device`` (``cpu``: shared memory; ``cuda``: CUDA IPC)."""
    if str(device).startswith("cuda"):
        return CudaIpcArena(group, size_bytes, device, timeout_s)
    return ShmArena(group, size_bytes, timeout_s)
