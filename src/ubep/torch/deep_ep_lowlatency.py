"""The low-latency mode of ``ubep.deep_ep``: its calls (``low_latency_dispatch`` /
``low_latency_combine``, a mixin of the Buffer) and its tensors, DeepEP's expert-major packing of
the rows a dispatch received (``[num_local_experts, slots, hidden]``, its ``src_info`` and
``layout_range``), filled when the rows are in, and the combine input taken back out of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ._convert import PAYLOAD_DTYPES, from_numpy, to_numpy
from .backend import EPBackend, issue_combine
from .deep_ep_types import EventOverlap, LowLatencyHandle, _event
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
    # a masking Buffer re-orders a handle's rows after a loss: no packing into its buffer
    zero_copy = getattr(handle.backend, "zero_copy", True)
    buffer = getattr(handle.backend, "buffer", None) if zero_copy else None
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
            # float32 whatever torch's default dtype: scales rounded to BF16 would dequantise
            # wrong, and UE8M0 packing reads their float32 exponent bits
            packed = torch.zeros((len(counts), self.slots, recv_scales.shape[1]),
                                 dtype=torch.float32)
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


class LowLatencyCalls:
    """DeepEP's low-latency pair on a :class:`ubep.torch.deep_ep.Buffer`: ``layout="expert"``
    buffers, rows packed per local expert, FP8 and receive hooks. A mixin of the Buffer, whose
    dispatch path (``_send``) and shape fields it uses."""

    rank: int
    group_size: int
    _ll_combine_staging: dict[tuple[int, int, int], torch.Tensor]
    _send: Callable[..., tuple[Callable[[], tuple[Any, np.ndarray | None]], EPBackend]]
    _collective: Callable[[Callable[[], Any]], Any]
    _num_local_experts: Callable[[int], int]

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[Any, torch.Tensor, LowLatencyHandle, EventOverlap, Callable[[], None] | None]:
        """``(recv_x, recv_count, handle, event, hook)``. ``recv_x`` is
        ``[num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks, hidden]`` BF16, or
        with ``use_fp8`` a tuple (FP8 e4m3 values, ``[..., hidden // 128]`` float32 scales, or
        with ``use_ue8m0`` ``[..., hidden // 512]`` int32 packed UE8M0 exponents); only the first
        ``recv_count[e]`` rows of expert ``e`` are valid (the rest are zero).

        ``return_recv_hook``: the call returns once this rank's rows are sent, with ``hook``
        (else None), which receives: ``recv_x``, ``recv_count`` and ``handle`` hold the data
        only after it ran (as DeepEP). ``async_finish``: the same, received by
        ``event.current_stream_wait()`` (DeepEP refuses both at once, so does ubep)."""
        num_tokens, hidden = x.shape
        if num_tokens > num_max_dispatch_tokens_per_rank:
            raise InvalidArgumentError(
                "x", num_tokens,
                f"exceeds num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}",
            )
        if use_ue8m0 and not (use_fp8 and round_scale):
            raise InvalidArgumentError(
                "use_ue8m0", True, "needs use_fp8=True and round_scale=True (as DeepEP)"
            )
        _check_async(async_finish, return_recv_hook)
        idx_np = np.ascontiguousarray(to_numpy(topk_idx, argument="topk_idx"), dtype=np.int64)
        if use_fp8:
            block = FP8_BLOCK * (UE8M0_PACK if use_ue8m0 else 1)
            if hidden % block:
                raise InvalidArgumentError("x", hidden, f"hidden must be a multiple of {block}")
        # Unit weights travel with the rows; low_latency_combine gets the real ones.
        receive, backend = self._send(
            "expert", x.contiguous(), None, idx_np, np.ones(idx_np.shape, np.float32),
            num_experts, num_max_dispatch_tokens_per_rank, split=async_finish or return_recv_hook,
            round_scale=round_scale if use_fp8 else None,
        )
        slots = num_max_dispatch_tokens_per_rank * self.group_size
        num_local = self._num_local_experts(num_experts)  # M2N: 0 on a sender
        out = LowLatencyOutputs(num_local, slots, hidden, self.group_size,
                                 torch.uint8 if use_fp8 else x.dtype, use_fp8, use_ue8m0)
        handle = LowLatencyHandle(
            src_info=out.src_info,
            layout_range=out.layout_range,
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
            hidden=hidden,
            num_experts=num_experts,
            inner=None,
            backend=backend,
            counts=np.zeros(num_local, dtype=np.int64),
            topk_idx=idx_np,
        )

        def finish() -> None:
            if handle.inner is not None:
                return
            res, recv_scales = receive()
            counts = np.asarray(res.num_recv_tokens_per_expert, dtype=np.int64)
            out.fill(res, recv_scales, counts)
            stats = cumulative_local_expert_recv_stats
            if stats is not None:
                stats.add_(torch.from_numpy(counts).to(stats.dtype))
            handle.counts[:] = counts
            # the handle was handed out before the rows arrived: its inner handle is set once
            # here (LowLatencyHandle is frozen to its users, not to its maker)
            object.__setattr__(handle, "inner", res.handle)

        if not (async_finish or return_recv_hook):
            finish()
        return (out.recv_x, out.recv_count, handle, _event(async_finish, finish),
                finish if return_recv_hook else None)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The tensor ``low_latency_combine(..., zero_copy=True)`` reads the expert outputs from:
        ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]`` BF16, to
        fill in place. Not collective. That combine packs the valid rows straight into ubep's
        combine buffer in shared memory (``ubep.Buffer.get_combine_buffer``), which the reduce
        then reads without another copy; ``x`` is ignored, as DeepEP."""
        if not isinstance(handle, LowLatencyHandle):
            raise InvalidArgumentError(
                "handle", type(handle).__name__, "must come from low_latency_dispatch"
            )
        key = self._staging_key(handle)
        if key not in self._ll_combine_staging:
            self._ll_combine_staging[key] = torch.zeros(key, dtype=torch.bfloat16)
        return self._ll_combine_staging[key]

    def _staging_key(self, handle: LowLatencyHandle) -> tuple[int, int, int]:
        slots = handle.num_max_dispatch_tokens_per_rank * self.group_size
        return len(handle.counts), slots, handle.hidden

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """Reduce **with weights**: ``(combined_x [num_tokens, hidden], event, hook)``; ``x`` is
        the packed ``[num_local_experts, slots, hidden]`` expert output (ignored with
        ``zero_copy``: the rows come from :meth:`get_next_low_latency_combine_buffer`).
        ``topk_idx`` is the dispatch's, where a slot may be set to -1 to drop it.
        ``return_recv_hook`` / ``async_finish``: as :meth:`low_latency_dispatch`; the combined
        ``x`` holds the sums once the hook (or the event's wait) ran."""
        if not isinstance(handle, LowLatencyHandle):
            raise InvalidArgumentError(
                "handle", type(handle).__name__, "must come from low_latency_dispatch"
            )
        if handle.inner is None:
            raise InvalidArgumentError(
                "handle", "pending", "its dispatch has not received yet: call the dispatch's "
                "hook() (or its event's current_stream_wait()) first"
            )
        _check_async(async_finish, return_recv_hook)
        idx = to_numpy(topk_idx, argument="topk_idx")
        if idx.shape != handle.topk_idx.shape or not np.all((idx == handle.topk_idx) | (idx == -1)):
            raise InvalidArgumentError(
                "topk_idx", tuple(idx.shape), "must be the dispatch's topk_idx (-1 drops a slot)"
            )
        w = np.ascontiguousarray(to_numpy(topk_weights.float(), argument="topk_weights"))
        w = np.where(idx == -1, np.float32(0), w).astype(np.float32)
        source = x
        if zero_copy:
            staging = self._ll_combine_staging.get(self._staging_key(handle))
            if staging is None:
                raise InvalidArgumentError(
                    "zero_copy", True, "fill get_next_low_latency_combine_buffer(handle) first"
                )
            source = staging
        rows = combine_input(handle, source)
        split = (async_finish or return_recv_hook) and getattr(handle.backend, "can_split", True)
        call = self._collective(
            lambda: issue_combine(handle.backend, rows, handle.inner, w, split=split))
        if not (async_finish or return_recv_hook):
            y = from_numpy(call.hook(), source.dtype)
            if out is not None:
                out.copy_(y)
                y = out
            return y, _event(False), None
        y = out if out is not None else torch.empty((len(idx), handle.hidden),
                                                     dtype=source.dtype)

        filled: list[bool] = []

        def finish() -> None:
            if not filled:
                y.copy_(from_numpy(call.hook(), source.dtype))
                filled.append(True)

        return y, _event(async_finish, finish), (finish if return_recv_hook else None)




def _check_async(async_finish: bool, return_recv_hook: bool) -> None:
    if async_finish and return_recv_hook:
        raise InvalidArgumentError(
            "async_finish", True, "cannot be combined with return_recv_hook (as DeepEP)"
        )
