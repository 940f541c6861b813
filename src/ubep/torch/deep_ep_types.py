"""DeepEP's value types on ubep (``ubep.torch.deep_ep``): events, ``Config``, the handles of
both modes (frozen dataclasses that index and unpack like DeepEP's tuples) and a normal-mode
dispatch's checked routing."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch

from ..errors import InvalidArgumentError
from .backend import EPBackend

__all__ = [
    "Config", "EventHandle", "EventOverlap", "InternodeHandle", "LowLatencyHandle", "NormalHandle",
    "topk_idx_t",
]

#: dtype of ``topk_idx`` tensors (DeepEP: chosen at compile time, normally ``torch.int64``).
topk_idx_t = torch.int64


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
    call the event belongs to, then runs the hook registered after the wait (DeepEP V2's
    epilogue) and returns what it returned (V2's ``defer_epilogue`` results; None otherwise)."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: Any = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Callable[[], Any] | None = None
        self._release_handle_by_call = False

    def current_stream_wait(self, release_handle: bool = False) -> Any:
        if self.event is not None:
            self.event.current_stream_wait()
        result = None
        hook, self.hook_after_wait = self.hook_after_wait, None  # consumed even if it raises
        if hook is not None:
            result = hook()
        if release_handle:
            self.event = None
        return result

    def wait(self) -> Any:
        """DeepEP V2's alias of :meth:`current_stream_wait`: the epilogue's result."""
        return self.current_stream_wait()

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        """Run ``hook_after_wait`` after the next wait (one hook at a time, as DeepEP)."""
        if self.hook_after_wait is not None:
            raise InvalidArgumentError("hook_after_wait", "given",
                                       "a hook is already registered on this EventOverlap")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.current_stream_wait(self._release_handle_by_call)
        self._release_handle_by_call = False


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
    row in one channel, so the channel matrices have one column. Each of these tensors is made
    from the dispatch's counts the first time it is read (a decode step's combine reads none of
    them), then stays the same tensor.

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
        num_out_rows: ``len(recv_src_idx)`` (``num_worst_tokens`` when given).
        sent: ``[num_ranks, num_ranks]`` tokens each rank sent each rank (the count records').
        in_rank: ``is_token_in_rank`` as the dispatch routed it (never handed out).
        src_token: each received row's source token (the engine's).
        rank: this rank.
        recv_weights: the float32 weights the dispatch received (a copy; None without
            ``topk_idx``); sent_routing: copies of the ``topk_idx`` and float32 weights this
            rank dispatched, what a combine given back every rank's ``recv_weights`` sums
            (``deep_ep_agree.own_weights_sum``).
        combines: how many combines of this handle began here (their words' tags).
    """

    _TUPLE_FIELDS: ClassVar[tuple[str, ...]] = (
        "rank_prefix_matrix",
        "channel_prefix_matrix",
        "recv_channel_prefix_matrix",
        "recv_src_idx",
        "is_token_in_rank",
        "send_head",
    )

    inner: Any = field(repr=False)
    backend: EPBackend = field(repr=False)
    topk_idx: np.ndarray = field(repr=False)
    num_experts: int
    num_recv_rows: int
    num_out_rows: int
    sent: np.ndarray = field(repr=False)
    in_rank: np.ndarray = field(repr=False)
    src_token: np.ndarray = field(repr=False)
    rank: int
    recv_weights: np.ndarray | None = field(default=None, repr=False)
    sent_routing: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    combines: list[int] = field(default_factory=lambda: [0], repr=False)

    @classmethod
    def built(cls, **fields: Any) -> NormalHandle:
        """The handle of ``fields`` (every field but ``combines``), set without the frozen
        dataclass's ``__init__``, which costs an ``object.__setattr__`` a field: a decode step
        makes one handle per dispatch. The same object as ``NormalHandle(**fields)``."""
        handle = object.__new__(cls)
        handle.__dict__.update(fields, combines=[0])
        return handle

    @property
    def num_tokens(self) -> int:
        return int(self.topk_idx.shape[0])

    @functools.cached_property
    def rank_prefix_matrix(self) -> torch.Tensor:
        return torch.from_numpy(np.cumsum(self.sent, axis=0, dtype=np.int32))

    @functools.cached_property
    def channel_prefix_matrix(self) -> torch.Tensor:
        return torch.from_numpy(self.sent[self.rank, :, None].astype(np.int32))

    @functools.cached_property
    def recv_channel_prefix_matrix(self) -> torch.Tensor:
        return torch.zeros((self.sent.shape[0], 1), dtype=torch.int32)

    @functools.cached_property
    def recv_src_idx(self) -> torch.Tensor:
        src_idx = np.full(self.num_out_rows, -1, dtype=np.int32)
        src_idx[: self.num_recv_rows] = self.src_token
        return torch.from_numpy(src_idx)

    @functools.cached_property
    def is_token_in_rank(self) -> torch.Tensor:
        return torch.from_numpy(self.in_rank.copy())

    @functools.cached_property
    def send_head(self) -> torch.Tensor:
        # a token's place among this rank's tokens sent to each rank: its running count there
        # where it went (from 0), -1 where it did not
        in_rank = self.in_rank
        return torch.from_numpy(np.cumsum(in_rank, axis=0, dtype=np.int32) * in_rank - 1)


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


class _Layout(NamedTuple):
    """A normal dispatch's layout tensors (``get_dispatch_layout``'s), as the intranode and the
    internode path pass them on: each is checked against ``topk_idx`` where both are given."""

    num_tokens_per_rank: torch.Tensor | None = None
    num_tokens_per_rdma_rank: torch.Tensor | None = None
    is_token_in_rank: torch.Tensor | None = None
    num_tokens_per_expert: torch.Tensor | None = None


class _Route(NamedTuple):
    """One normal-mode dispatch's routing, checked on this rank (a tuple: made every call)."""

    topk_idx: np.ndarray  # [num_tokens, k] the rows follow (real, or one column per rank)
    topk_weights: np.ndarray  # float32, like topk_idx
    is_token_in_rank: np.ndarray  # [num_tokens, num_ranks] bool
    num_tokens_per_expert: np.ndarray  # [num_experts] int64
    num_experts: int
    with_topk: bool


@dataclass(frozen=True, eq=False)
class InternodeHandle(_DeepEPTuple):
    """What ``internode_dispatch`` returns as ``handle`` (and ``dispatch`` when the group spans
    hosts); ``internode_combine`` and cached dispatch take it.

    Indexes like DeepEP's ``(is_token_in_rank, rdma_channel_prefix_matrix,
    gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum,
    recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head,
    send_nvl_head)``. DeepEP's "RDMA ranks" are hosts here (``H`` of them; ``P`` ranks per
    host), and every row goes straight from its source rank to its destination rank in one
    channel (DeepEP forwards through the rank of the same local index on the destination
    host), so the fields describe the direct path:

    Attributes:
        is_token_in_rank: ``[num_tokens, num_ranks]`` bool, where this rank's tokens went.
        rdma_channel_prefix_matrix: ``[H, 1]`` int32, tokens this rank sent to each host.
        gbl_channel_prefix_matrix: ``[num_ranks, 1]`` int32, tokens this rank sent to each rank.
        recv_rdma_channel_prefix_matrix: ``[H, 1]`` int32, rows this rank received from each
            host.
        recv_rdma_rank_prefix_sum: ``[H]`` int32, their inclusive prefix sum over hosts.
        recv_gbl_channel_prefix_matrix: ``[num_ranks, 1]`` int32, the first row of each source
            rank's block in ``recv_x``.
        recv_gbl_rank_prefix_sum: ``[num_ranks]`` int32, inclusive prefix sum of the rows from
            each source rank: rows from rank ``i`` are ``recv_x[s[i-1]:s[i]]`` (DeepEP's
            ``handle[-4]``).
        recv_src_meta: ``[num_recv_tokens, 8]`` uint8, per row two int32 (DeepEP's
            ``SourceMeta``): the source host, and a bit per rank of this host (local index)
            that received the same token.
        send_rdma_head: ``[num_tokens, H]`` int32, the token's index among the tokens this rank
            sent to that host, -1 if none went there.
        send_nvl_head: ``[num_recv_tokens, P]`` int32, for each received row, the row of the
            same token in ``recv_x`` of each rank of this host (local index), -1 where it did
            not go.
        base: the rank-layout handle the rows went through (:class:`NormalHandle`).
    """

    _TUPLE_FIELDS: ClassVar[tuple[str, ...]] = (
        "is_token_in_rank",
        "rdma_channel_prefix_matrix",
        "gbl_channel_prefix_matrix",
        "recv_rdma_channel_prefix_matrix",
        "recv_rdma_rank_prefix_sum",
        "recv_gbl_channel_prefix_matrix",
        "recv_gbl_rank_prefix_sum",
        "recv_src_meta",
        "send_rdma_head",
        "send_nvl_head",
    )

    is_token_in_rank: torch.Tensor
    rdma_channel_prefix_matrix: torch.Tensor
    gbl_channel_prefix_matrix: torch.Tensor
    recv_rdma_channel_prefix_matrix: torch.Tensor
    recv_rdma_rank_prefix_sum: torch.Tensor
    recv_gbl_channel_prefix_matrix: torch.Tensor
    recv_gbl_rank_prefix_sum: torch.Tensor
    recv_src_meta: torch.Tensor
    send_rdma_head: torch.Tensor
    send_nvl_head: torch.Tensor
    base: NormalHandle = field(repr=False)
