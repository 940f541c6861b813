"""DeepEP's value types on ubep (``ubep.torch.deep_ep``): events, ``Config``, the handles of
both modes (frozen dataclasses that index and unpack like DeepEP's tuples) and a normal-mode
dispatch's checked routing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from .backend import EPBackend

__all__ = ["Config", "EventHandle", "EventOverlap", "LowLatencyHandle", "NormalHandle"]


class EventHandle:
    """DeepEP's CUDA event (recorded on the current stream). Here: the rest of a call issued
    with ``async_finish`` (its receive half), run once by :meth:`current_stream_wait`; an event
    of a finished call has nothing to wait for."""

    def __init__(self, wait: Callable[[], None] | None = None) -> None:
        self._wait = wait

    def current_stream_wait(self) -> None:
        """Complete the call the event belongs to (at most once)."""
        wait, self._wait = self._wait, None
        if wait is not None:
            wait()


class EventOverlap:
    """DeepEP's event wrapper: ``current_stream_wait()`` (and leaving ``with``) completes the
    call the event belongs to."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: Any = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            self.event.current_stream_wait()

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


def _event(async_finish: bool, wait: Callable[[], None] | None = None) -> EventOverlap:
    # DeepEP returns an event only with async_finish (its current_stream_wait asserts one).
    return EventOverlap(EventHandle(wait) if async_finish else None)


@dataclass(frozen=True)
class Config:
    """DeepEP's performance-tuning config (SMs and chunk sizes): accepted, without effect."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: ubep sizes its shared memory from the calls' shapes (``num_nvl_bytes`` is unused)."""
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: there is no RDMA buffer (``num_rdma_bytes`` is unused)."""
        return 0


class _DeepEPTuple:
    """Index, unpack and ``len()`` like the positional tuple DeepEP uses for this handle; the
    tuple is the dataclass's first ``len(_TUPLE_FIELDS)`` fields, in DeepEP's order."""

    _TUPLE_FIELDS: ClassVar[tuple[str, ...]] = ()

    def _as_tuple(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._TUPLE_FIELDS)

    def __getitem__(self, index: int | slice) -> Any:
        return self._as_tuple()[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._as_tuple())

    def __len__(self) -> int:
        return len(self._TUPLE_FIELDS)


@dataclass(frozen=True, eq=False)
class NormalHandle(_DeepEPTuple):
    """What normal-mode ``dispatch`` returns as ``handle``; ``combine`` and cached dispatch take it.

    Indexes like DeepEP's ``(rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)``; ubep moves every
    row in one channel, so the channel matrices have one column.

    Attributes:
        rank_prefix_matrix: ``[num_ranks, num_ranks]`` int32; ``[i][j]`` = tokens ranks ``0..i``
            sent to rank ``j``, so rows from source ``i`` are ``recv_x[m[i-1][rank]:m[i][rank]]``
            (identical on every rank, as DeepEP's).
        channel_prefix_matrix: ``[num_ranks, 1]`` int32, tokens this rank sent to each rank
            (DeepEP: inclusive prefix over channels).
        recv_channel_prefix_matrix: ``[num_ranks, 1]`` int32 zeros: the one channel starts each
            source's block (DeepEP: where each channel's rows start within the source's block).
        recv_src_idx: ``[num_recv_tokens]`` int32, each received row's token index at its source
            (``num_worst_tokens`` entries when given, -1 after the received rows).
        is_token_in_rank: ``[num_tokens, num_ranks]`` bool, where this rank's tokens went.
        send_head: ``[num_tokens, num_ranks]`` int32, the token's row within this rank's block at
            the destination (the tail index of DeepEP's one channel), -1 if not sent there.
        inner, backend: ubep's handle and the buffer the rows went through.
        topk_idx: ``[num_tokens, k]`` int64 routing the rows followed (one column per rank with
            the first expert of that rank when the dispatch had no ``topk_idx``).
        num_experts: experts of that routing.
        num_recv_rows: rows actually received (``<= len(recv_src_idx)``).
    """

    _TUPLE_FIELDS: ClassVar[tuple[str, ...]] = (
        "rank_prefix_matrix",
        "channel_prefix_matrix",
        "recv_channel_prefix_matrix",
        "recv_src_idx",
        "is_token_in_rank",
        "send_head",
    )

    rank_prefix_matrix: torch.Tensor
    channel_prefix_matrix: torch.Tensor
    recv_channel_prefix_matrix: torch.Tensor
    recv_src_idx: torch.Tensor
    is_token_in_rank: torch.Tensor
    send_head: torch.Tensor
    inner: Any = field(repr=False)
    backend: EPBackend = field(repr=False)
    topk_idx: np.ndarray = field(repr=False)
    num_experts: int
    num_recv_rows: int

    @property
    def num_tokens(self) -> int:
        return int(self.topk_idx.shape[0])


@dataclass(frozen=True, eq=False)
class LowLatencyHandle(_DeepEPTuple):
    """What ``low_latency_dispatch`` returns as ``handle``; ``low_latency_combine`` takes it.

    Indexes like DeepEP's ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
    num_experts)``.

    Attributes:
        src_info: ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank]`` int32,
            the source token index of each packed row, -1 after ``recv_count[e]``.
        layout_range: ``[num_local_experts, num_ranks]`` int64, ``(begin << 32) | count``: rows
            ``begin .. begin + count`` of expert ``e`` came from rank ``j`` (ubep packs sources in
            ascending rank, so ``begin`` is the count of lower ranks).
        num_max_dispatch_tokens_per_rank, hidden, num_experts: as passed to dispatch.
        inner, backend: ubep's handle and the buffer the rows went through.
        counts: ``[num_local_experts]`` int64 rows per local expert.
        topk_idx: ``[num_tokens, num_topk]`` int64 as dispatched.
    """

    _TUPLE_FIELDS: ClassVar[tuple[str, ...]] = (
        "src_info",
        "layout_range",
        "num_max_dispatch_tokens_per_rank",
        "hidden",
        "num_experts",
    )

    src_info: torch.Tensor
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    inner: Any = field(repr=False)
    backend: EPBackend = field(repr=False)
    counts: np.ndarray = field(repr=False)
    topk_idx: np.ndarray = field(repr=False)


@dataclass(frozen=True)
class _Route:
    """One normal-mode dispatch's routing, checked on this rank."""

    topk_idx: np.ndarray  # [num_tokens, k] the rows follow (real, or one column per rank)
    topk_weights: np.ndarray  # float32, like topk_idx
    is_token_in_rank: np.ndarray  # [num_tokens, num_ranks] bool
    num_tokens_per_expert: np.ndarray  # [num_experts] int64
    num_experts: int
    with_topk: bool
