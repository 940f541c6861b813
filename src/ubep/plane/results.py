"""The dispatch result and handle: what dispatch returns and what combine needs to undo it.

:class:`DispatchResult` is the one result type of every backend (the reference oracle, the
runtime, the torch test world): the same fields, so results compare field by field.

One handle per rank per dispatch (a :class:`RuntimeHandle` from a Buffer), returned inside the
dispatch result (``result.handle``) by the reference oracle and by every backend. It holds
plain numpy arrays, ints and short strings only, so it pickles, crosses process boundaries and
never pins a communication buffer.

A handle describes its rank in both roles:

* as a **source** (its own tokens): ``topk_idx``/``topk_weights`` as dispatched and
  ``send_dst_row``, where each of its rows landed in the destination rank's ``recv_x``, so the
  source can pull the expert outputs back and reduce them;
* as a **receiver** (its ``recv_x`` rows): ``recv_src_rank``/``recv_src_token``/``recv_src_k``,
  so the receiver can push each expert output back to where it came from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from ..errors import InvalidArgumentError, UbepError
from ..modes import BUFFER_LAYOUTS

__all__ = ["DispatchHandle", "DispatchResult", "PendingCall", "RuntimeHandle"]

H = TypeVar("H")


@dataclass(frozen=True, eq=False)
class DispatchResult(Generic[H]):
    """One rank's dispatch output, the same for every backend.

    Attributes:
        recv_x: ``[rows, hidden]`` received rows in ``x``'s storage dtype (the runtime returns a
            read-only view into its receive region unless ``copy=True``).
        recv_topk_idx: int64; ``layout="expert"``: ``[rows]`` global expert id of each row;
            ``layout="rank"``: ``[rows, num_topk]`` local expert ids, -1 elsewhere.
        recv_topk_weights: float32, shaped like ``recv_topk_idx`` (0 where the id is -1).
        num_recv_tokens_per_expert: ``[num_local_experts]`` int64; length 0 on a rank that
            holds no expert (an M2N sender, ``BufferConfig(expert_ranks=)``).
        recv_src_rank, recv_src_token, recv_src_k: ``[rows]`` int64, origin of each row.
        handle: what the backend's combine needs (:class:`DispatchHandle` or a subclass).
        recv_x_scales: with a quantised dispatch (``BufferConfig.quant``) ``[rows, hidden //
            128]`` float32, one scale per 128 channels of ``recv_x`` (then 1-byte ``uint8`` E4M3
            bits or ``int8``); else None.
        num_sent_rows_per_rank: ``[num_ranks, num_ranks]`` int64, the same on every rank:
            ``[s, d]`` rows source rank ``s`` sent rank ``d`` in this dispatch (``layout="rank"``:
            its tokens with a pick on ``d``, DeepEP's ``num_tokens_per_rank`` of ``s``;
            ``"expert"``: its picks of ``d``'s experts). Column ``rank`` is
            ``handle.num_recv_rows_per_rank``. Each source's row travels in its count records,
            so no rank needs an exchange of its own to learn another's routing (DeepEP's
            ``rank_prefix_matrix`` is its cumulative sum over sources). None only from a
            backend that does not learn it.
    """

    recv_x: np.ndarray
    recv_topk_idx: np.ndarray
    recv_topk_weights: np.ndarray
    num_recv_tokens_per_expert: np.ndarray
    recv_src_rank: np.ndarray
    recv_src_token: np.ndarray
    recv_src_k: np.ndarray
    handle: H
    recv_x_scales: np.ndarray | None = None
    num_sent_rows_per_rank: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class DispatchHandle:
    """What combine needs from one rank's dispatch.

    Attributes:
        layout: ``"expert"`` (one received row per (token, expert) pair) or ``"rank"`` (one per
            (token, destination rank) pair).
        rank: the rank this handle belongs to.
        num_ranks, num_experts: the communicator and model size of the dispatch.
        num_tokens: tokens this rank dispatched (rows of its ``x``).
        hidden: elements per token row.
        x_dtype: ``ubep.dtypes`` name of the dispatched ``x`` (``"bf16"``, ``"fp32"``, ...).
        topk_idx: ``[num_tokens, num_topk]`` int64, global expert ids, -1 = masked slot.
        topk_weights: ``[num_tokens, num_topk]`` float32, as given to dispatch.
        recv_src_rank, recv_src_token: ``[num_recv_rows]`` int64, origin of each received row.
        recv_src_k: ``[num_recv_rows]`` int64, the top-k slot of the row (``layout="rank"``: the
            lowest slot whose expert lives on this rank).
        num_recv_rows_per_rank: ``[num_ranks]`` int64, rows received from each source rank.
        send_dst_row: optional int64, row index in the destination rank's ``recv_x`` of each
            sent row, -1 where nothing was sent. ``layout="expert"``: ``[num_tokens, num_topk]``
            (the destination is the rank owning ``topk_idx[t, k]``); ``layout="rank"``:
            ``[num_tokens, num_ranks]`` (column = destination rank). The reference fills it; a
            backend whose combine pushes rows back by ``recv_src_*`` may leave it ``None``
            (a source learns destination rows only from other sources' counts).
    """

    layout: str
    rank: int
    num_ranks: int
    num_experts: int
    num_tokens: int
    hidden: int
    x_dtype: str
    topk_idx: np.ndarray
    topk_weights: np.ndarray
    recv_src_rank: np.ndarray
    recv_src_token: np.ndarray
    recv_src_k: np.ndarray
    num_recv_rows_per_rank: np.ndarray
    send_dst_row: np.ndarray | None = None

    def __post_init__(self) -> None:
        # Cheap consistency checks: a handle from one call mixed with arrays of another is the
        # usual way to corrupt a combine silently.
        if self.layout not in BUFFER_LAYOUTS:
            raise InvalidArgumentError("layout", self.layout, f"must be one of {BUFFER_LAYOUTS}")
        if not 0 <= self.rank < self.num_ranks:
            raise InvalidArgumentError("rank", self.rank, f"must be in [0, {self.num_ranks})")
        if self.topk_idx.shape != self.topk_weights.shape or self.topk_idx.ndim != 2:
            raise InvalidArgumentError(
                "topk_weights", self.topk_weights.shape,
                f"must match topk_idx {self.topk_idx.shape} (2-D)",
            )
        width = self.num_ranks if self.layout == "rank" else self.topk_idx.shape[1]
        if self.send_dst_row is not None and self.send_dst_row.shape != (self.num_tokens, width):
            raise InvalidArgumentError(
                "send_dst_row", self.send_dst_row.shape, f"must be ({self.num_tokens}, {width})"
            )
        n = len(self.recv_src_rank)
        if len(self.recv_src_token) != n or len(self.recv_src_k) != n:
            raise InvalidArgumentError(
                "recv_src_token", len(self.recv_src_token), f"recv_* arrays need {n} entries"
            )
        if self.num_recv_rows_per_rank.shape != (self.num_ranks,):
            raise InvalidArgumentError(
                "num_recv_rows_per_rank", self.num_recv_rows_per_rank.shape,
                f"must be ({self.num_ranks},)",
            )

    @property
    def num_topk(self) -> int:
        return int(self.topk_idx.shape[1])

    @property
    def num_recv_rows(self) -> int:
        """Rows of this rank's ``recv_x`` (and of the ``expert_out`` combine expects)."""
        return len(self.recv_src_rank)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks


@dataclass(frozen=True, eq=False)
class RuntimeHandle(DispatchHandle):
    """A :class:`ubep.handle.DispatchHandle` that also remembers which dispatch of which Buffer
    made it: ``buffer_uid`` (the same on every rank of one Buffer), ``generation`` (the Buffer's
    resync count) and ``dispatch_index``. Combine accepts only a handle of its own Buffer and
    generation, and only when every rank passes the handle of the same dispatch."""

    dispatch_index: int = -1
    buffer_uid: int = 0
    generation: int = -1


T = TypeVar("T")

# what a finished call's result holds, refused by name on a pending call
_RESULT_FIELDS = frozenset(
    ("recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert",
     "recv_src_rank", "recv_src_token", "recv_src_k", "handle", "y", "shape", "dtype")
)


class PendingCall(Generic[T]):
    """A dispatch or combine issued with ``return_recv_hook=True``: this rank's sends are out,
    its receive half runs when :meth:`hook` (or :meth:`wait`) is called, which returns the
    call's result (a :class:`DispatchResult`, or the combined ``y``) or raises the call's error.

    Until then the result is not readable: ``pending.recv_x`` raises instead of handing back a
    region peers are still writing. Calling the hook again returns the same result (or raises
    the same error). Hooks may come in any order; a Buffer completes its calls in issue order.
    """

    __slots__ = ("_complete", "_convert", "_kind", "_outcome", "_rank", "dispatch_index", "epoch")

    def __init__(self, kind: str, rank: int, epoch: int, complete: Callable[[], None],
                 dispatch_index: int = -1) -> None:
        self._kind, self._rank, self.epoch = kind, rank, epoch
        # a dispatch's index on its Buffer (its handle's ``dispatch_index``), known at issue:
        # which receive region its rows land in; -1 for a combine
        self.dispatch_index = dispatch_index
        self._complete = complete
        self._convert: Callable[[Any], Any] | None = None
        self._outcome: tuple[bool, Any] | None = None

    def map_result(self, convert: Callable[[Any], Any]) -> None:
        """Hand the result back through ``convert`` (once, when the call settles): how a call
        made with torch tensors returns torch tensors from its hook."""
        self._convert = convert
        if self._outcome is not None and self._outcome[0]:
            self._outcome = (True, convert(self._outcome[1]))

    @property
    def done(self) -> bool:
        """The receive half has run (the hook returns at once)."""
        return self._outcome is not None

    def hook(self) -> T:
        """Run the receive half (if no later call's hook ran it already) and return the result."""
        if self._outcome is None:
            self._complete()
        assert self._outcome is not None  # _complete always settles this call
        ok, value = self._outcome
        if not ok:
            raise value
        return value

    wait = hook  # DeepEP's EventOverlap / torch futures spelling

    def _settle(self, ok: bool, value: Any) -> None:
        if self._outcome is None:
            if ok and self._convert is not None:
                value = self._convert(value)
            self._outcome = (ok, value)

    def __getattr__(self, name: str) -> Any:
        if name in _RESULT_FIELDS:
            raise UbepError(
                f"rank {self._rank}: {name} of {self._kind} call {self.epoch} is not ready: it "
                "was issued with return_recv_hook=True; call .hook() (or .wait()) first and use "
                "what it returns"
            )
        raise AttributeError(name)

    def __repr__(self) -> str:
        state = "done" if self.done else "receive pending"
        return f"PendingCall({self._kind}, call {self.epoch}, {state})"
