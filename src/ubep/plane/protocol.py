"""The data-plane contract: what a :class:`ubep.Buffer` drives (an :class:`Engine`), what it
runs on (a :class:`ProcessGroup` and the :class:`GlobalMemory` it maps), the call records it
hands an engine and what an engine is opened with (:class:`EngineSpec`).

Engines: the native engine on one host (``ubep.runtime``, transport ``"shm"``), ``ubep.mpi``'s
RMA engine across hosts (``"mpi"``), any other a :func:`ubep.plane.register_engine` row names.
Nothing here assumes where an engine's memory lives or which clock it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..sched import CoreSplit, Plan, ScheduleSpec
from ..topology import Topology
from .layout import SegmentLayout

if TYPE_CHECKING:
    from .records import ErrorRecord

__all__ = [
    "PLAIN", "CallOptions", "CombineCall", "DispatchCall", "Engine", "EngineSpec", "GlobalMemory",
    "ProcessGroup",
]


class GlobalMemory(Protocol):
    """This rank's view of one global memory object: a region per rank.

    Attributes:
        transport: the engine this memory serves unless a config names another
            (``BufferConfig.transport``): ``"shm"`` where every peer's region is reachable with
            loads and stores from this process, ``"mpi"`` where some are not.
        addresses: base address in this process of every rank's region (rank order), or
            ``None`` when some peer's region is not reachable with loads and stores from here.
        local_array: this rank's own region, a writable ``uint8`` array.
        pids, start_times: every rank's process id and start time (liveness; 0 = unknown).
    """

    transport: str
    addresses: list[int] | None
    local_array: np.ndarray
    pids: list[int]
    start_times: list[int]

    def unlink(self) -> None:
        """Drop every name of every rank's region (call once every peer has mapped them: any
        rank may, so a rank that dies right after the mapping leaves nothing named)."""

    def close(self) -> None:
        """Release this rank's mappings (local, not collective)."""


class ProcessGroup(Protocol):
    """What :class:`ubep.Buffer` needs from a group of ranks (``ubep.runtime.Group``,
    ``ubep.mpi``, ``ubep.torch.group``)."""

    rank: int
    num_ranks: int
    topology: Topology

    def barrier(self, timeout_s: float | None = None) -> None: ...

    def allgather(self, value: Any, timeout_s: float | None = None) -> list[Any]: ...

    def map_global(
        self, size_bytes: int, kind: str, timeout_s: float | None = None
    ) -> GlobalMemory: ...


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What an engine is opened with (:func:`ubep.plane.open_engine`), the same on every rank
    but ``rank``.

    Attributes:
        config: the ``BufferConfig`` the engine runs (M2N: the physical one).
        layout: where each record and region lies in a rank's memory.
        rank, num_ranks, num_cores: this rank, the group's size, the cores a call may use.
        uid: the Buffer's identity (agreed by every rank at construction).
        dtype_name: ``ubep.dtypes`` name of ``x`` (the handle's ``x_dtype``).
        values: the numpy dtype of ``recv_x``'s elements (quantised rows: the 1-byte values).
        combine_storage: the numpy dtype of ``expert_out`` and ``y``.
        scale_cols: float32 scales per ``recv_x`` row (quantised rows), else 0.
        device: where the engine's memory and results live (``"cpu"``; ``"cuda:N"``: its
            registry row's answer, ``ubep.plane.registry.engine_device``).
    """

    config: Any
    layout: SegmentLayout
    rank: int
    num_ranks: int
    num_cores: int
    uid: int
    dtype_name: str
    values: np.dtype[Any]
    combine_storage: np.dtype[Any]
    scale_cols: int = 0
    device: str = "cpu"


@dataclass(frozen=True, slots=True)
class DispatchCall:
    """One dispatch of checked arrays, as :class:`~ubep.plane.host.HostEngine` hands it to a
    row kernel (``run_dispatch``: the native engine reads the fields by name). Output arrays
    have capacity ``cap_rows`` rows; ``counts`` is ``[num_local_experts + num_ranks]``: rows
    per local expert, then rows received from each source rank; ``send_dst_row`` is
    ``[num_tokens, num_topk or num_ranks]``.

    Attributes:
        index: the dispatch's sequence number (receive region ``index % num_regions``).
        plan: what each core does (``ubep.buffer.tasks.CoreTasks``): ``None`` for one core,
            else the core split, with the scheduler's tables for several send cores (the engine
            builds the units), or a whole ``Plan``.
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
    name the same one), as :class:`~ubep.plane.host.HostEngine` hands it to a row kernel
    (``run_combine``).

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


@dataclass(frozen=True, slots=True)
class CallOptions:
    """How a call deviates from the plain blocking one (``CallOptions()``; ``None`` in a call
    means the same, with the caller's arrays unchecked).

    Attributes:
        split: run only the first half (``return_recv_hook``, or calls in flight): the call
            returns ``None`` and :meth:`Engine.complete` runs the rest.
        copy: ``recv_x`` (and its scales) an owned copy, not a view of engine memory.
        prequant: ``x`` holds quantised rows already (the caller's values and scales).
    """

    split: bool = False
    copy: bool = False
    prequant: bool = False


PLAIN = CallOptions()  # a plain blocking call of checked arrays (engines may compare by identity)


class Engine(Protocol):
    """The data plane a :class:`ubep.Buffer` drives: one call per dispatch and per combine,
    whose result (or typed error) the engine builds. The native engine on one host
    (``ubep.runtime``), ``ubep.mpi``'s RMA engine and any engine a registry row opens
    (:func:`ubep.plane.open_engine`) keep it.

    Each call reaches the engine once. Its arrays come one of two ways. Without options
    (``opts=None``: a blocking call, offered only to an engine that ``takes_unchecked``) they
    are the caller's numpy arrays of the engine's dtypes (``x`` in storage dtype, int64
    ``topk_idx``, float32 ``topk_weights``; for a combine, ``expert_out`` in combine storage
    dtype and a :class:`~ubep.plane.results.RuntimeHandle`), in any memory layout: the engine
    takes them, copying into its layout what is not C-contiguous and aligned, or returns
    ``None`` having done nothing for a shape it does not serve (the Buffer's checks then
    raise the error that names the argument). Everything else the Buffer checks and
    converts first (``ubep.buffer``'s checks: ``x`` ``[num_tokens, hidden]``, owned
    C-contiguous ``topk_idx`` and ``topk_weights``) and passes with options
    (:class:`CallOptions`), which an engine must take. Results may be arrays or tensors of
    the engine's device; the Buffer reads an engine's memory only through them.

    Every collective method returns its result or an
    :class:`~ubep.plane.records.ErrorRecord` (``code`` 1 bad input, ``message`` the offending
    value; 2 timeout; 3 peer lost; 4 remote failure, ``message`` the peer's notice and ``core``
    the code it carries; 5 internal; 6 out of step), which the Buffer turns into the exception.

    Attributes:
        takes_unchecked: the engine takes a blocking call's arrays of its dtypes unchecked
            (the native engine's one-call path), so the Buffer offers them before checking;
            else every call comes checked, with options.
        takes_tensors: the engine takes torch tensors as they come (``x``, ``topk_idx``,
            ``topk_weights``; ``expert_out``) and checks them itself, from their metadata and
            on its device, each failure naming the argument: the Buffer hands a call of
            tensors over without converting them (an engine without the attribute: ``False``,
            every input a checked numpy array).

    The call protocol every engine keeps: every record a peer reads carries the call's epoch and
    is only accepted for exactly that epoch (count, routing and combine records also carry a
    checksum; progress words their complement); a call that succeeds here but finds a peer's
    failure notice for it fails; a wait checks the liveness of every peer that has not finished
    the call, and has a deadline (``config.timeout_s``).
    """

    takes_unchecked: bool
    takes_tensors: bool

    def dispatch(
        self, x: Any, topk_idx: Any, topk_weights: Any, epoch: int, index: int,
        generation: int, plan: Plan | CoreSplit | ScheduleSpec | None,
        opts: CallOptions | None = None, /,
    ) -> Any:
        """Dispatch ``index`` (receive region ``index % num_regions``; ``generation``: the
        Buffer's resyncs, stamped into the handle), the call of sequence number ``epoch``;
        ``plan``: what each core does (:class:`~ubep.sched.CoreSplit` / ``ScheduleSpec`` /
        ``Plan``, ``None``: one pass). Returns the ``DispatchResult`` (its handle a
        :class:`~ubep.plane.results.RuntimeHandle`), an ``ErrorRecord``, or ``None`` (not
        taken, or with ``opts.split`` the first half ran)."""

    def combine(
        self, expert_out: Any, handle: Any, epoch: int, generation: int, num_dispatches: int,
        opts: CallOptions | None = None, /,
    ) -> Any:
        """Combine ``expert_out`` by ``handle`` (a handle of this engine's dispatch
        ``handle.dispatch_index``; every rank names the same one): ``y``
        ``[handle.num_tokens, hidden]``, an ``ErrorRecord`` or ``None`` as :meth:`dispatch`."""

    def complete(self, epoch: int) -> Any:
        """The second half of the oldest split call (``epoch``): its result or an
        ``ErrorRecord``."""

    def combine_buffer(self, index: int, rows: int) -> Any:
        """A writable ``[rows, hidden]`` array in engine memory for the outputs of dispatch
        ``index`` (a combine of it then copies nothing), once no peer reads the region any
        more; or an ``ErrorRecord``."""

    def stale_view(self, array: Any, dispatch_index: int, num_dispatches: int) -> Any:
        """Why ``array`` may not be combined as the outputs of dispatch ``dispatch_index`` (of
        ``num_dispatches`` so far): it is a view of this engine's receive region that a later
        dispatch filled again. ``(value, problem)`` for the error naming ``expert_out``, else
        ``None`` (an engine whose results are fresh arrays: always ``None``)."""

    def recv_valid(self, dispatch_index: int, num_dispatches: int) -> bool:
        """Whether the rows dispatch ``dispatch_index`` returned (its ``recv_x``) still hold
        what it received, ``num_dispatches`` dispatches in (an engine whose results are fresh
        arrays: always)."""

    def abandon(self, epoch: int, message: str) -> None:
        """The oldest split-phase call fails here without its second half (notice to peers)."""

    def fail(
        self, epoch: int, code: int, message: str, finished: int, timeout_s: float
    ) -> int | ErrorRecord:
        """Publish "call ``epoch`` failed here, for reason ``code``" (1: rejected before anything
        reached a peer; 6: this rank lost step), once every peer finished call ``epoch - 2``
        (waiting at most ``timeout_s``; 0: not at all, then return 1 and publish nothing).
        ``finished``: also mark call ``epoch`` finished here."""

    def set_signature(self, word: int) -> None:
        """What this rank's next dispatches are (a 64-bit word, ``ubep.buffer.signature``; 0
        until set): published in each of its count records and compared with every source's
        before any row of the call reaches a peer; a difference is bad input (``argument``
        ``"signature"``, ``message`` ``"mine:theirs:rank"``, words in hex) on every rank that
        differs. Local, between calls."""

    def resync(self, base_epoch: int) -> None:
        """Forget every call before ``base_epoch`` (local; no peer may be inside a call)."""

    def reset_all(self) -> None:
        """Prepare the receive regions (SP: fill them with the sentinel)."""

    def close(self) -> None:
        """Stop the engine's threads and drop its views of its memory (local)."""

    def trace_enable(self, capacity: int) -> bool:
        """Keep the last ``capacity`` task spans per core from here on (0: stop, the rings
        dropped). ``False``: this engine records no spans, and nothing changed (local)."""

    def trace_spans(self) -> tuple[bytes, tuple[int, ...], int]:
        """The spans recorded since the last read, the rings emptied (``ubep.trace.recorder``'s
        ``SPAN_DTYPE`` records, ring by ring: the cores', then the calls'), each ring's count,
        and the spans dropped; ``(b"", (), 0)`` when off or for an engine that records none."""
