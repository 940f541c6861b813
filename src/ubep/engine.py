"""The data-plane protocol a :class:`ubep.Buffer` drives (the native engine on one host,
``ubep.mpi``'s MPI RMA engine across hosts) and the call records it hands an engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .sched import CoreSplit, Plan, ScheduleSpec

if TYPE_CHECKING:
    from .runtime.abi import ErrorRecord

__all__ = ["CombineCall", "DispatchCall", "Engine", "FastCalls"]


@dataclass(frozen=True, slots=True)
class DispatchCall:
    """One dispatch, as a Buffer hands it to :meth:`Engine.dispatch` (the native engine reads
    the fields by name). Output arrays have capacity ``cap_rows`` rows; ``counts`` is
    ``[num_local_experts + num_ranks]``: rows per local expert, then rows received from each
    source rank; ``send_dst_row`` is ``[num_tokens, num_topk or num_ranks]``.

    Attributes:
        index: the dispatch's sequence number (receive region ``index % num_regions``).
        plan: what each core does (``Buffer._plan``): ``None`` for one core, else the core
            split, with the scheduler's tables for several send cores (the engine builds the
            units), or a whole ``Plan``.
        split: run only the first half (``Engine.complete`` runs the rest).
        prequant: ``x`` holds quantised rows already.
    """

    x: np.ndarray
    topk_idx: np.ndarray
    topk_weights: np.ndarray
    num_tokens: int
    epoch: int
    index: int
    recv_topk_idx: np.ndarray
    recv_topk_weights: np.ndarray
    recv_src_rank: np.ndarray
    recv_src_token: np.ndarray
    recv_src_k: np.ndarray
    counts: np.ndarray
    send_dst_row: np.ndarray
    plan: Plan | CoreSplit | ScheduleSpec | None = None
    split: bool = False
    prequant: bool = False


@dataclass(frozen=True, slots=True)
class CombineCall:
    """One combine into ``y`` of the outputs of dispatch ``dispatch_index`` (every rank must
    name the same one), as a Buffer hands it to :meth:`Engine.combine`.

    Attributes:
        num_rows: rows of ``expert_out`` (the dispatch's received rows).
        topk_idx, topk_weights, send_dst_row: the dispatch handle's routing.
        region: the combine region (0 or 1) ``expert_out`` is staged in.
        split: as :attr:`DispatchCall.split`.
    """

    expert_out: np.ndarray
    num_rows: int
    topk_idx: np.ndarray
    topk_weights: np.ndarray
    send_dst_row: np.ndarray
    num_tokens: int
    epoch: int
    region: int
    y: np.ndarray
    dispatch_index: int
    split: bool = False


class FastCalls(Protocol):
    """The one-call path of blocking calls that the native engine adds
    (``runtime/native/fastpath.c``): arguments checked, the call run and its result built in
    one C call. Each returns None when the call is not its case (nothing was done: the general
    path follows), else the call's result or an :class:`~ubep.runtime.abi.ErrorRecord`."""

    def set_fast(
        self, result_type: type, handle_type: type, handle_const: dict[str, Any],
        recv_views: list[Any], scale_views: list[Any] | None, x_dtype: Any, combine_dtype: Any,
    ) -> None:
        """What the results are built from: the types, the handle's per-Buffer fields and the
        receive regions' full-capacity views (once per Buffer)."""

    def dispatch_fast(
        self, x: object, topk_idx: object, topk_weights: object, epoch: int, index: int,
        generation: int, plan: Any,
    ) -> Any:
        """A whole blocking dispatch: its ``DispatchResult``."""

    def combine_fast(
        self, expert_out: object, handle: object, epoch: int, generation: int,
        num_dispatches: int,
    ) -> Any:
        """A whole blocking combine: ``y``."""


class Engine(Protocol):
    """The data-plane protocol :class:`Buffer` drives: ``ubep.runtime._native.Engine`` (one host,
    loads and stores on shared memory) and any other engine a ``GlobalMemory.make_engine``
    returns (e.g. MPI RMA across hosts). Constructed with ``(params, addresses, pids,
    start_times)`` where ``params`` is :func:`ubep.runtime.abi.engine_params`.

    Every collective method returns either its result or an
    :class:`~ubep.runtime.abi.ErrorRecord` (``code`` 1 bad input, ``message`` the offending
    value; 2 timeout; 3 peer lost; 4 remote failure, ``message`` the peer's notice and ``core``
    the code it carries; 5 internal; 6 out of step); :meth:`Buffer._error` turns it into the
    exception. The native engine builds the records from the type
    :func:`ubep.runtime.abi.load_native` hands it once.

    The call protocol both engines keep: every record a peer reads carries the call's epoch and
    is only accepted for exactly that epoch (count, routing and combine records also carry a
    checksum; progress words their complement); a call that succeeds here but finds a peer's
    failure notice for it fails; a waiting core checks the liveness of every peer that has not
    finished the call.
    """

    def dispatch(self, call: DispatchCall, /) -> int | ErrorRecord | None:
        """One dispatch: the number of received rows; with ``call.split`` ``None`` once the
        first half ran (:meth:`complete` runs the rest), unless the engine ran the whole
        call."""

    def combine(self, call: CombineCall, /) -> int | ErrorRecord | None:
        """One combine: 1 if ``call.expert_out`` was used in place (zero-copy), else 0; with
        ``call.split`` as :meth:`dispatch`."""

    def complete(self, epoch: int) -> int | ErrorRecord:
        """The second half of the oldest split-phase call (``epoch``): its result."""

    def abandon(self, epoch: int, message: str) -> None:
        """The oldest split-phase call fails here without its second half (notice to peers)."""

    def fail(
        self, epoch: int, code: int, message: str, finished: int, timeout_s: float
    ) -> int | ErrorRecord:
        """Publish "call ``epoch`` failed here, for reason ``code``" (1: rejected before anything
        reached a peer; 6: this rank lost step), once every peer finished call ``epoch - 2``
        (waiting at most ``timeout_s``; 0: not at all, then return 1 and publish nothing).
        ``finished``: also mark call ``epoch`` finished here."""

    def resync(self, base_epoch: int) -> None:
        """Forget every call before ``base_epoch`` (local; no peer may be inside a call)."""

    def wait_done(self, epoch: int, timeout_s: float) -> int | ErrorRecord:
        """Wait until every peer has finished call ``epoch``."""

    def comb_last_epoch(self, region: int) -> int:
        """Epoch of the last combine that used combine region ``region`` (0 or 1)."""

    def reset_all(self) -> None:
        """Prepare the receive regions (SP: fill them with the sentinel)."""

    def close(self) -> None:
        """Stop the engine's threads (local)."""
