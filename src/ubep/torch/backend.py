"""The small protocol ``ubep.torch`` drives, an in-process fake of it, and the runtime adapter.

``ubep.torch`` needs four things from a communicator, all on numpy arrays:

* ``dispatch(x, topk_idx, topk_weights) -> result`` with the attributes of the runtime's
  ``DispatchResult`` (``recv_x``, ``recv_topk_idx``, ``recv_topk_weights``,
  ``num_recv_tokens_per_expert``, ``recv_src_rank``, ``recv_src_token``, ``recv_src_k``,
  ``handle``), with the meanings of ``ubep.reference`` (``recv_src_k``: the top-k slot of each
  row, which the expert layout's weight gradient needs);
* ``combine(expert_out, handle, topk_weights=None) -> y``: in the ``"expert"`` layout
  ``y[t] = sum_k w[t, k] * out(t, k)`` accumulated in float32 in ascending ``k``, where ``w`` is
  ``topk_weights`` if given (``[num_tokens, num_topk]``, this rank's) else the weights that were
  dispatched; in the ``"rank"`` layout ``y[t] = sum over destination ranks, ascending, of the
  row sent back`` (no weights: the caller applied them);
* ``rank``, ``num_ranks``, ``num_experts``, ``layout``.

Row order (both layouts, the definition in ``ubep.reference``): ``"expert"`` = for each local
expert in order, the rows of every source rank in ascending rank, then ascending token;
``"rank"`` = by source rank, then token, one row per token that has at least one expert here.

:class:`LocalWorld` implements the protocol for N ranks that are threads of one process (a
barrier-based exchange over Python objects). Unlike the runtime it accepts float64 payloads
(accumulating in float64), which is what the float64 gradient checks need, and it lets unit tests
run without processes or shared memory. :func:`as_backend` wraps a ``ubep.Buffer``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from ..errors import InvalidArgumentError, TimeoutError
from ..handle import DispatchResult
from ..modes import LAYOUTS
from ..routing import experts_per_rank, validate_topk_idx

__all__ = [
    "EPBackend",
    "LocalBackend",
    "LocalDispatchResult",
    "LocalHandle",
    "LocalWorld",
    "as_backend",
    "run_threads",
]


@runtime_checkable
class EPBackend(Protocol):
    """What :mod:`ubep.torch` needs from a communicator (see the module docstring)."""

    rank: int
    num_ranks: int
    num_experts: int
    layout: str

    def dispatch(self, x: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray) -> Any: ...

    def combine(
        self, expert_out: np.ndarray, handle: Any, topk_weights: np.ndarray | None = None
    ) -> np.ndarray: ...


# --------------------------------------------------------------------------- float helpers
def _to_acc(a: np.ndarray) -> np.ndarray:
    """Exact accumulation-type values of a payload: float64 stays, every other float -> float32."""
    if a.dtype == np.float64:
        return a
    if a.dtype == np.uint16:  # bf16 bits
        return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if a.dtype.kind == "f":
        return a.astype(np.float32)
    raise InvalidArgumentError("expert_out", a.dtype, "combine needs a float payload")


def _from_acc(a: np.ndarray, like: np.dtype) -> np.ndarray:
    if like == np.float64:
        return a
    if like == np.uint16:
        from ..dtypes import BF16

        return BF16.from_float32(a.astype(np.float32))
    return a.astype(like)


def _weights_array(w: object) -> np.ndarray:
    # float32 like the runtime; float64 is kept so float64 gradient checks stay exact.
    a = np.asarray(w)
    return a if a.dtype == np.float64 else a.astype(np.float32)


# --------------------------------------------------------------------------- single-process math
@dataclass(frozen=True)
class LocalHandle:
    """What combine needs to route rows back: per received row its source and slot."""

    layout: str
    recv_src_rank: np.ndarray
    recv_src_token: np.ndarray
    recv_src_k: np.ndarray  # rank layout: the lowest slot whose expert lives here
    num_tokens: int  # tokens this rank dispatched
    num_topk: int
    topk_weights: np.ndarray  # this rank's dispatched weights [num_tokens, num_topk]


# Results of the in-process world are the shared result type, typed with its own handle.
LocalDispatchResult = DispatchResult[LocalHandle]


def _dispatch_one(
    rank: int,
    xs: Sequence[np.ndarray],
    idxs: Sequence[np.ndarray],
    ws: Sequence[np.ndarray],
    num_experts: int,
    layout: str,
) -> LocalDispatchResult:
    num_ranks = len(xs)
    per_rank = experts_per_rank(num_experts, num_ranks)
    lo = rank * per_rank
    hidden = xs[rank].shape[1]
    num_topk = idxs[rank].shape[1]
    src_rank: list[np.ndarray] = []
    src_token: list[np.ndarray] = []
    src_k: list[np.ndarray] = []
    counts = np.zeros(per_rank, dtype=np.int64)
    if layout == "expert":
        for local in range(per_rank):
            for s in range(num_ranks):
                tok, k = np.nonzero(idxs[s] == lo + local)  # row-major: ascending token
                src_rank.append(np.full(len(tok), s, dtype=np.int64))
                src_token.append(tok.astype(np.int64))
                src_k.append(k.astype(np.int64))
                counts[local] += len(tok)
    else:
        for s in range(num_ranks):
            here = (idxs[s] >= lo) & (idxs[s] < lo + per_rank)
            tok = np.nonzero(here.any(axis=1))[0]
            src_rank.append(np.full(len(tok), s, dtype=np.int64))
            src_token.append(tok.astype(np.int64))
            for local in range(per_rank):
                counts[local] += int((idxs[s][tok] == lo + local).any(axis=1).sum())
    rr = np.concatenate(src_rank) if src_rank else np.zeros(0, np.int64)
    tt = np.concatenate(src_token) if src_token else np.zeros(0, np.int64)
    num_rows = len(rr)
    recv_x = np.empty((num_rows, hidden), dtype=xs[rank].dtype)
    for s in range(num_ranks):
        sel = rr == s
        recv_x[sel] = xs[s][tt[sel]]
    if layout == "expert":
        kk = np.concatenate(src_k) if src_k else np.zeros(0, np.int64)
        recv_idx = np.empty(num_rows, dtype=np.int64)
        recv_w = np.empty(num_rows, dtype=ws[rank].dtype)
        for s in range(num_ranks):
            sel = rr == s
            recv_idx[sel] = idxs[s][tt[sel], kk[sel]]  # global expert id, as ubep.reference
            recv_w[sel] = ws[s][tt[sel], kk[sel]]
    else:
        recv_idx = np.full((num_rows, num_topk), -1, dtype=np.int64)
        recv_w = np.zeros((num_rows, num_topk), dtype=ws[rank].dtype)
        for s in range(num_ranks):
            sel = rr == s
            ids = idxs[s][tt[sel]]
            local = (ids >= lo) & (ids < lo + per_rank)
            recv_idx[sel] = np.where(local, ids - lo, -1)
            recv_w[sel] = np.where(local, ws[s][tt[sel]], 0.0)
        kk = np.argmax(recv_idx >= 0, axis=1).astype(np.int64)  # lowest local slot
    handle = LocalHandle(layout, rr, tt, kk, xs[rank].shape[0], num_topk, ws[rank])
    return LocalDispatchResult(recv_x, recv_idx, recv_w, counts, rr, tt, kk, handle)


def _combine_one(
    rank: int,
    outs: Sequence[np.ndarray],
    handles: Sequence[LocalHandle],
    my_handle: LocalHandle,
    topk_weights: np.ndarray | None,
) -> np.ndarray:
    hidden = outs[rank].shape[1]
    dtype = outs[rank].dtype
    acc_dtype = np.float64 if dtype == np.float64 else np.float32
    if my_handle.layout == "expert":
        w = my_handle.topk_weights if topk_weights is None else topk_weights
        # Gather out(t, k) into [num_tokens, num_topk, hidden], then add in ascending k.
        per_slot = np.zeros((my_handle.num_tokens, my_handle.num_topk, hidden), dtype=acc_dtype)
        present = np.zeros((my_handle.num_tokens, my_handle.num_topk), dtype=bool)
        for r, h in enumerate(handles):
            sel = h.recv_src_rank == rank
            per_slot[h.recv_src_token[sel], h.recv_src_k[sel]] = _to_acc(outs[r][sel])
            present[h.recv_src_token[sel], h.recv_src_k[sel]] = True
        y = np.zeros((my_handle.num_tokens, hidden), dtype=acc_dtype)
        wa = np.asarray(w).astype(acc_dtype)
        for k in range(my_handle.num_topk):
            rows = present[:, k]
            y[rows] += wa[rows, k, None] * per_slot[rows, k]
    else:
        y = np.zeros((my_handle.num_tokens, hidden), dtype=acc_dtype)
        for r, h in enumerate(handles):
            sel = h.recv_src_rank == rank
            y[h.recv_src_token[sel]] += _to_acc(outs[r][sel])
    return _from_acc(y, dtype)


# --------------------------------------------------------------------------- threads as ranks
class LocalWorld:
    """N ranks living as threads of this process; ``world.backend(rank)`` is rank ``rank``'s view.

    Every collective call deposits this rank's inputs, waits for all ranks (a barrier with a
    timeout, so a missing rank raises :class:`ubep.TimeoutError` instead of hanging), computes
    its own outputs from everyone's inputs, and waits again so the slots can be reused.
    """

    def __init__(
        self, num_ranks: int, num_experts: int, *, layout: str = "expert", timeout_s: float = 30.0
    ) -> None:
        experts_per_rank(num_experts, num_ranks)
        if layout not in LAYOUTS:
            raise InvalidArgumentError("layout", layout, f"must be one of {LAYOUTS}")
        self.num_ranks = num_ranks
        self.num_experts = num_experts
        self.layout = layout
        self.timeout_s = timeout_s
        self._barrier = threading.Barrier(num_ranks, timeout=timeout_s)
        self._slots: list[Any] = [None] * num_ranks
        #: number of dispatch and combine calls made by rank 0 (tests count collectives)
        self.num_calls = {"dispatch": 0, "combine": 0}

    def backend(self, rank: int, layout: str | None = None) -> LocalBackend:
        """Rank ``rank``'s view; ``layout`` overrides the world's default layout."""
        if not 0 <= rank < self.num_ranks:
            raise InvalidArgumentError("rank", rank, f"must be in [0, {self.num_ranks})")
        layout = self.layout if layout is None else layout
        if layout not in LAYOUTS:
            raise InvalidArgumentError("layout", layout, f"must be one of {LAYOUTS}")
        return LocalBackend(self, rank, layout)

    def _exchange(self, rank: int, item: Any) -> list[Any]:
        self._slots[rank] = item
        self._wait(rank)
        items = list(self._slots)
        self._wait(rank)
        return items

    def _wait(self, rank: int) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise TimeoutError(
                f"rank {rank}: LocalWorld barrier broken (a rank timed out after "
                f"{self.timeout_s}s or failed)"
            ) from None


class LocalBackend:
    """One rank of a :class:`LocalWorld` (implements :class:`EPBackend`)."""

    def __init__(self, world: LocalWorld, rank: int, layout: str) -> None:
        self.world = world
        self.rank = rank
        self.num_ranks = world.num_ranks
        self.num_experts = world.num_experts
        self.layout = layout

    def with_layout(self, layout: str) -> LocalBackend:
        """The same rank of the same world, moving rows in ``layout``."""
        return self.world.backend(self.rank, layout)

    def allgather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (small metadata; collective)."""
        return self.world._exchange(self.rank, value)

    def dispatch(
        self, x: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray
    ) -> LocalDispatchResult:
        x = np.asarray(x)
        if x.ndim != 2:
            raise InvalidArgumentError("x", x.shape, "must be 2-D [num_tokens, hidden]")
        idx = validate_topk_idx(topk_idx, self.num_experts, num_tokens=x.shape[0])
        w = _weights_array(topk_weights)
        if w.shape != idx.shape:
            raise InvalidArgumentError("topk_weights", w.shape, f"must match topk_idx {idx.shape}")
        if self.rank == 0:
            self.world.num_calls["dispatch"] += 1
        everyone = self.world._exchange(self.rank, (x, idx, w))
        xs, idxs, ws = zip(*everyone, strict=True)
        widths = {a.shape[1] for a in xs}
        if len(widths) != 1:
            raise InvalidArgumentError("x", sorted(widths), "hidden differs between ranks")
        return _dispatch_one(self.rank, xs, idxs, ws, self.num_experts, self.layout)

    def combine(
        self,
        expert_out: np.ndarray,
        handle: LocalHandle,
        topk_weights: np.ndarray | None = None,
    ) -> np.ndarray:
        out = np.asarray(expert_out)
        if out.ndim != 2 or out.shape[0] != len(handle.recv_src_rank):
            raise InvalidArgumentError(
                "expert_out", out.shape, f"must be [{len(handle.recv_src_rank)}, hidden]"
            )
        if topk_weights is not None:
            if self.layout != "expert":
                raise InvalidArgumentError(
                    "topk_weights", "given", "the rank layout combines without weights"
                )
            topk_weights = _weights_array(topk_weights)
            if topk_weights.shape != (handle.num_tokens, handle.num_topk):
                raise InvalidArgumentError(
                    "topk_weights",
                    topk_weights.shape,
                    f"must be [{handle.num_tokens}, {handle.num_topk}]",
                )
        if self.rank == 0:
            self.world.num_calls["combine"] += 1
        everyone = self.world._exchange(self.rank, (out, handle))
        outs, handles = zip(*everyone, strict=True)
        return _combine_one(self.rank, outs, handles, handle, topk_weights)


T = TypeVar("T")


def run_threads(
    fn: Callable[..., T], num_ranks: int, *args: Any, timeout_s: float = 60.0
) -> list[T]:
    """Run ``fn(rank, *args)`` on ``num_ranks`` threads; return results in rank order.

    The first exception of any rank is re-raised here (with its rank in the message); a thread
    still running after ``timeout_s`` raises :class:`ubep.TimeoutError`.
    """
    results: list[Any] = [None] * num_ranks
    errors: list[tuple[int, BaseException]] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, *args)
        except BaseException as exc:
            errors.append((rank, exc))

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        rank, exc = min(errors, key=lambda e: e[0] if not isinstance(e[1], TimeoutError) else 1e9)
        raise RuntimeError(f"rank {rank} failed: {exc!r}") from exc
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"run_threads: a rank was still running after {timeout_s}s")
    return results


# --------------------------------------------------------------------------- adapter
def as_backend(buffer: Any) -> EPBackend:
    """``buffer`` as an :class:`EPBackend`: a ``ubep.Buffer`` is wrapped, anything that already
    implements the protocol passes through."""
    from ..buffer import Buffer

    if isinstance(buffer, Buffer):
        from ._runtime import RuntimeBackend

        return RuntimeBackend(buffer)
    if isinstance(buffer, EPBackend):
        return buffer
    raise InvalidArgumentError(
        "buffer", type(buffer).__name__, "must be a ubep.Buffer or implement ubep.torch.EPBackend"
    )
