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
run without processes or shared memory; its results are ``ubep.reference``'s (called with
``float64=True``): the oracle itself. :func:`as_backend` wraps a ``ubep.Buffer``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from .. import reference
from ..errors import InvalidArgumentError, RemoteError, TimeoutError
from ..handle import DispatchHandle, DispatchResult
from ..modes import LAYOUTS
from ..routing import experts_per_rank, validate_topk_idx

__all__ = [
    "EPBackend",
    "LocalBackend",
    "LocalDispatchResult",
    "LocalHandle",
    "LocalWorld",
    "PendingOp",
    "as_backend",
    "issue_combine",
    "issue_dispatch",
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


class PendingOp:
    """A call issued with ``return_recv_hook=True`` (:mod:`ubep.torch.ops`, the DeepEP facade):
    ``hook()`` (or ``wait()``) runs ``finish`` once and returns what the blocking call returns;
    a second ``hook()`` returns the same object. :meth:`settled` wraps a call that finished when
    it was issued (a backend without split-phase calls)."""

    def __init__(self, finish: Any) -> None:
        self._finish = finish
        self._result: Any = None

    @classmethod
    def settled(cls, result: Any) -> PendingOp:
        op = cls(None)
        op._result = result
        return op

    @property
    def done(self) -> bool:
        return self._finish is None

    def hook(self) -> Any:
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        return self._result

    wait = hook


def issue_dispatch(backend: EPBackend, x: np.ndarray, topk_idx: np.ndarray,
                   topk_weights: np.ndarray, x_scales: np.ndarray | None = None, *,
                   split: bool = True) -> Any:
    """A dispatch whose receive half runs at ``.hook()`` where the backend can split it
    (``ubep.Buffer``'s ``return_recv_hook``) and ``split`` asks for it, else a finished one
    with the same interface. ``x_scales``: ``x`` is quantised already (a quantising
    ``ubep.Buffer`` only)."""
    issue = getattr(backend, "dispatch_async", None) if split else None
    extra = {} if x_scales is None else {"x_scales": x_scales}
    if issue is not None:
        return issue(x, topk_idx, topk_weights, **extra)
    return PendingOp.settled(backend.dispatch(x, topk_idx, topk_weights, **extra))


def issue_combine(backend: EPBackend, expert_out: np.ndarray, handle: Any,
                  topk_weights: np.ndarray | None = None, *, split: bool = True) -> Any:
    """:func:`issue_dispatch` for combine: ``.hook()`` returns ``y``."""
    issue = getattr(backend, "combine_async", None) if split else None
    if issue is not None:
        return issue(expert_out, handle, topk_weights)
    return PendingOp.settled(backend.combine(expert_out, handle, topk_weights))


def _weights_array(w: object) -> np.ndarray:
    # float32 like the runtime; float64 is kept so float64 gradient checks stay exact.
    a = np.asarray(w)
    return a if a.dtype == np.float64 else a.astype(np.float32)


# The in-process world's results and handles are the reference's (it computes them).
LocalHandle = DispatchHandle
LocalDispatchResult = DispatchResult[DispatchHandle]


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


@dataclass(frozen=True)
class _Rejected:
    """A rank's place in a call of the in-process world that it rejected (LocalBackend.reject)."""

    message: str


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

    def reject(self, message: str) -> None:
        """Take part in the peers' next dispatch or combine with a failure instead of inputs:
        their call raises :class:`ubep.RemoteError` naming this rank (collective)."""
        self.world._exchange(self.rank, _Rejected(message))

    def _everyone(self, item: Any) -> list[Any]:
        everyone = self.world._exchange(self.rank, item)
        for r, got in enumerate(everyone):
            if isinstance(got, _Rejected):
                raise RemoteError(r, got.message)
        return everyone

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
        everyone = self._everyone((x, idx, w))
        xs, idxs, ws = zip(*everyone, strict=True)
        widths = {a.shape[1] for a in xs}
        if len(widths) != 1:
            raise InvalidArgumentError("x", sorted(widths), "hidden differs between ranks")
        # float64: the gradient checks' payloads and weights (ubep.reference, "float64")
        return reference.dispatch(list(xs), list(idxs), list(ws), self.num_experts,
                                  layout=self.layout, float64=True)[self.rank]

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
            if self.layout == "rank":
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
        everyone = self._everyone((out, handle, topk_weights))
        outs, handles, weights = zip(*everyone, strict=True)
        reweighted = None if all(w is None for w in weights) else list(weights)
        return reference.combine(list(outs), list(handles), float64=True,
                                 topk_weights=reweighted)[self.rank]


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
