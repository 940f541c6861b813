"""The low-latency mode's tensors of ``ubep.deep_ep``: DeepEP's expert-major packing of the rows
a dispatch received (``[num_local_experts, slots, hidden]``, its ``src_info`` and
``layout_range``), filled when the rows are in, and the combine input taken back out of it."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ._convert import PAYLOAD_DTYPES, from_numpy
from .deep_ep_types import LowLatencyHandle
from .fp8 import FP8_BLOCK, UE8M0_PACK, pack_ue8m0

__all__ = ["LowLatencyOutputs", "combine_input"]


def _pack_per_expert(rows: torch.Tensor, counts: np.ndarray, packed: torch.Tensor) -> None:
    """Expert-major rows into ``packed [num_local_experts, slots, ...]`` (zeros after each
    count: ``packed`` comes zeroed)."""
    start = 0
    for e, n in enumerate(counts.tolist()):
        packed[e, :n] = rows[start : start + n]
        start += n


def combine_input(handle: LowLatencyHandle, source: torch.Tensor) -> np.ndarray:
    """The valid rows of ``source [num_local_experts, slots, hidden]``, expert-major, as the
    combine input: written straight into ubep's combine buffer when the backend has one (its
    combine then reads them in place), else into a new array."""
    counts = handle.counts
    n, hidden = int(counts.sum()), handle.hidden
    if source.dim() != 3 or source.shape[0] != len(counts) or source.shape[2] != hidden:
        raise InvalidArgumentError(
            "x", tuple(source.shape), f"must be [{len(counts)}, slots, {hidden}]"
        )
    buffer = getattr(handle.backend, "buffer", None)
    if buffer is not None:
        rows = np.asarray(buffer.get_combine_buffer(handle.inner))
    else:
        rows = np.empty((n, hidden), dtype=PAYLOAD_DTYPES[source.dtype])
    dst = from_numpy(rows, torch.bfloat16 if rows.dtype == np.uint16 else None)
    if dst.dtype != source.dtype:
        raise InvalidArgumentError("x", source.dtype, f"must be {dst.dtype} (the combine dtype)")
    start = 0
    for e, c in enumerate(counts.tolist()):
        dst[start : start + c] = source[e, :c]
        start += c
    return rows


class LowLatencyOutputs:
    """What a low-latency dispatch hands out before its rows arrive (DeepEP's tensors are
    allocated by the call and filled by its kernel): filled in place by :meth:`fill`."""

    def __init__(self, num_local: int, slots: int, hidden: int, num_ranks: int,
                 dtype: torch.dtype, use_fp8: bool, use_ue8m0: bool) -> None:
        self.slots, self.use_fp8, self.use_ue8m0 = slots, use_fp8, use_ue8m0
        self.rows = torch.zeros((num_local, slots, hidden), dtype=dtype)
        self.scales: torch.Tensor | None = None
        if use_fp8:
            width = hidden // FP8_BLOCK // (UE8M0_PACK if use_ue8m0 else 1)
            self.scales = torch.zeros((num_local, slots, width),
                                      dtype=torch.int32 if use_ue8m0 else torch.float32)
        self.recv_count = torch.zeros(num_local, dtype=torch.int32)
        self.src_info = torch.full((num_local, slots), -1, dtype=torch.int32)
        self.layout_range = torch.zeros((num_local, num_ranks), dtype=torch.int64)

    @property
    def recv_x(self) -> Any:
        if self.scales is None:
            return self.rows
        return (self.rows.view(torch.float8_e4m3fn), self.scales)

    def fill(self, res: Any, recv_scales: np.ndarray | None, counts: np.ndarray) -> None:
        rows = from_numpy(res.recv_x, self.rows.dtype)
        _pack_per_expert(rows, counts, self.rows)
        if self.scales is not None:
            assert recv_scales is not None
            packed = torch.zeros((len(counts), self.slots, recv_scales.shape[1]))
            _pack_per_expert(torch.from_numpy(recv_scales), counts, packed)
            self.scales.copy_(pack_ue8m0(packed) if self.use_ue8m0 else packed)
        self.recv_count.copy_(torch.from_numpy(counts.astype(np.int32)))
        src_info, layout_range = _ll_layout(res, counts, self.slots, self.layout_range.shape[1])
        self.src_info.copy_(src_info)
        self.layout_range.copy_(layout_range)


def _ll_layout(
    res: Any, counts: np.ndarray, slots: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's ``src_info`` and ``layout_range`` of ubep's expert-major rows (per local
    expert: source ranks ascending, then tokens ascending)."""
    num_local = len(counts)
    expert_of_row = np.repeat(np.arange(num_local), counts)
    slot_of_row = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    src_info = np.full((num_local, slots), -1, dtype=np.int32)
    src_info[expert_of_row, slot_of_row] = np.asarray(res.recv_src_token)
    per_src = np.zeros((num_local, num_ranks), dtype=np.int64)
    np.add.at(per_src, (expert_of_row, np.asarray(res.recv_src_rank, dtype=np.int64)), 1)
    begin = np.cumsum(per_src, axis=1) - per_src
    layout_range = (begin << 32) | per_src
    return torch.from_numpy(src_info), torch.from_numpy(layout_range)
