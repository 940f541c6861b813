"""DeepEP's raw buffers on ubep: ``Buffer.get_local_buffer_tensor`` and its peer view.

DeepEP allocates an NVLink buffer of ``num_nvl_bytes`` per rank (mapped by every peer of the
node through CUDA IPC) and an RDMA buffer of ``num_rdma_bytes`` (NVSHMEM), and hands out a
tensor over this rank's part. Here each is one region per rank in the group's global memory
(``group.map_global``: a POSIX shared-memory segment per rank on one host, an MPI window
across hosts), mapped by every peer. So a write into the tensor lands where DeepEP's lands:
in memory the peers have mapped (:meth:`RawBuffers.tensor` with ``rank``: a peer's region,
load/store reachable on one host).

DeepEP sizes programs' buffers generously (often 1 GB) and ubep pre-faults its segments, so a
region is mapped on the first request of its kind (collective then, as the creation of every
ubep buffer), not at construction.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError, UbepError
from ..runtime.abi import HEADER_BYTES
from .backend import LocalBackend

__all__ = ["RawBuffers"]

_KINDS = {False: "deepep.nvl", True: "deepep.rdma"}


class RawBuffers:
    """The NVL and RDMA regions of one DeepEP facade (``sizes``: bytes by ``use_rdma_buffer``)."""

    def __init__(self, group: Any, sizes: dict[bool, int]) -> None:
        self._group = group
        self._sizes = sizes
        self._regions: dict[bool, Any] = {}

    def tensor(self, dtype: torch.dtype, size: Any, offset: int, use_rdma_buffer: bool,
               rank: int | None = None) -> torch.Tensor:
        """``dtype`` elements of the region from byte ``offset`` to its end (DeepEP's offset is
        in bytes), the first ``size.numel()`` of them shaped ``size`` when given."""
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgumentError("dtype", dtype, "must be a torch.dtype")
        num_bytes = int(self._sizes[bool(use_rdma_buffer)])
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= num_bytes:
            raise InvalidArgumentError("offset", offset,
                                       f"must be a byte offset in [0, {num_bytes}]")
        element = torch.empty(0, dtype=dtype).element_size()
        raw = self._region_bytes(bool(use_rdma_buffer), rank)[offset:]
        flat = torch.from_numpy(raw[: raw.size // element * element]).view(dtype)
        if size is None:
            return flat
        shape = torch.Size(size)
        if shape.numel() > flat.numel():
            raise InvalidArgumentError(
                "size", tuple(shape), f"needs {shape.numel()} elements, the buffer holds "
                f"{flat.numel()} from offset {offset} (num_{'rdma' if use_rdma_buffer else 'nvl'}"
                "_bytes)")
        return flat[: shape.numel()].view(shape)

    def close(self) -> None:
        for region in self._regions.values():
            close = getattr(region, "close", None)
            if close is not None:
                close()
        self._regions.clear()

    def _region_bytes(self, use_rdma: bool, rank: int | None) -> np.ndarray:
        num_bytes = int(self._sizes[use_rdma])
        region = self._regions.get(use_rdma)
        if region is None:
            region = self._regions[use_rdma] = self._map(use_rdma, num_bytes)
        me = int(self._group.rank)
        if rank is None or rank == me:
            local = region if isinstance(region, np.ndarray) else region.local_array
            return np.asarray(local[HEADER_BYTES: HEADER_BYTES + num_bytes])
        segments = getattr(region, "segments", None)
        if isinstance(rank, bool) or not isinstance(rank, int) or not (
            0 <= rank < int(self._group.num_ranks)
        ):
            raise InvalidArgumentError("rank", rank, "must be a rank of the group")
        if segments is None:
            raise InvalidArgumentError(
                "rank", rank, "a peer's buffer is load/store reachable only in shared memory "
                "(one host); this group's peers reach it through the MPI engine")
        return np.asarray(segments[rank].array[HEADER_BYTES: HEADER_BYTES + num_bytes])

    def _map(self, use_rdma: bool, num_bytes: int) -> Any:
        if isinstance(self._group, LocalBackend):  # ranks are threads: nothing to share
            return np.zeros(HEADER_BYTES + num_bytes, dtype=np.uint8)
        map_global = getattr(self._group, "map_global", None)
        if map_global is None:
            raise UbepError(f"{type(self._group).__name__} has no global memory to map")
        region = map_global(HEADER_BYTES + max(num_bytes, 1), _KINDS[use_rdma])
        # every peer has mapped it once all pass the barrier: the name can go
        self._group.barrier()
        region.unlink()
        return region
