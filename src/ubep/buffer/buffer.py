"""``ubep.Buffer``: expert-parallel dispatch and combine between the ranks of a group.

One ``Buffer`` per communicator and shape, like DeepEP's: it owns a shared-memory segment per
rank (receive regions, control words, combine staging) and a native engine that runs each call
in one C call with the GIL released. Everything else is plain numpy in and out.

Example (inside a function started by :func:`ubep.launch`)::

    cfg = BufferConfig(max_tokens_per_rank=128, hidden=2048, num_topk=8, num_experts=64,
                       dtype="bf16")
    with Buffer(group, cfg) as buf:
        res = buf.dispatch(x, topk_idx, topk_weights)       # x: [num_tokens, 2048] uint16
        out = my_experts(res.recv_x, res.recv_topk_idx)      # one row per received row
        y = buf.combine(out, res.handle)                     # [num_tokens, 2048]

Results match :func:`ubep.reference.dispatch` / :func:`ubep.reference.combine` bit for bit
(field names, row order and dtypes included).

Lifetimes: ``res.recv_x`` is a read-only *view* of the receive region (no copy: that is what
makes dispatch one memcpy in every ASP sync mode). It stays valid until the second dispatch after it
is called (the view of dispatch ``n`` survives dispatch ``n+1``; dispatch ``n+2`` may reuse its
memory, and SP re-arms it then). Pass ``copy=True`` for an owned array. Every other field, the
handle included, is an owned array. With TFF each block's epoch word lands beside the rows, in a
word array of its own (ubep.plane.layout).

Combine reads the expert outputs where they lie: if ``expert_out`` already lives in this rank's
segment (``buf.get_combine_buffer(handle)``, or ``res.recv_x`` itself) nothing is copied;
otherwise it is copied once into the segment, and every source pulls and reduces its rows in
one pass (float32 accumulation in the reference's order).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import secrets
import threading
from collections.abc import Callable
from typing import Any, ClassVar, Literal, cast, overload

import numpy as np

from .. import dtypes as _dt
from .. import quant as _quant
from ..config import BufferConfig
from ..errors import InvalidArgumentError, RemoteError, UbepError
from ..m2n import logical_result, physical_config, slot_shift
from ..plane.host import HostEngine
from ..plane.protocol import PLAIN, CallOptions, Engine, EngineSpec, GlobalMemory, ProcessGroup
from ..plane.records import ErrorRecord
from ..plane.registry import engine_device, memory_bytes, open_engine, own_memory
from ..plane.results import DispatchHandle, DispatchResult, PendingCall, RuntimeHandle
from ..routing import experts_per_rank
from ..torch_bridge import as_process_group, is_torch_tensor, torch_door
from ..trace import recorder as _trace
from .checks import ArgChecks
from .inflight import InFlightCalls
from .regions import layout_of
from .replicas import LogicalRouting
from .state import AFTER as _AFTER
from .state import BEFORE as _BEFORE
from .state import NATIVE as _NATIVE
from .state import InFlight
from .step import StepKeeping
from .tasks import NO_SPLIT, CoreTasks

__all__ = ["Buffer"]

# what the hot path compares by identity (a module global: np.ndarray costs two lookups)
_NDARRAY = np.ndarray
_INT64, _FLOAT32 = np.dtype(np.int64), np.dtype(np.float32)  # the door's routing dtypes


# ABCMeta: the masking Buffer registers as a Buffer (``Buffer.register``), holding one
class Buffer(metaclass=abc.ABCMeta):
    """Dispatch/combine buffers of one rank (collective constructor: every rank builds one with
    the same config, in the same order).

    Args:
        group: the ranks: a ``torch.distributed`` process group (the world or a
            ``new_group`` subgroup, under torchrun; ranks in the group's order), a
            :class:`~ubep.runtime.group.Group` (``ubep.launch``) or any
            :class:`~ubep.plane.ProcessGroup` (``ubep.mpi.init()`` under mpiexec).
        config: :class:`BufferConfig` (must be equal on every rank).
        routing: how each dispatch's ``topk_idx`` becomes the slots this Buffer sends to, for a
            Buffer serving under a layer that routes (the masking Buffer's members' Buffer:
            :class:`~ubep.buffer.replicas.LogicalRouting`, called inside each dispatch, so a bad
            id is a clean reject); default: ``config.expert_map``'s, or none.

    Attributes:
        uid: the id every rank agreed on at construction (what a handle of this Buffer carries
            as ``buffer_uid``).
    """


    num_cores: int
    num_local_experts: int

    # the class that serves on_peer_loss="mask" (ubep.buffer.elastic registers it on import,
    # so this module needs no import of it)
    masking_class: ClassVar[type[Any] | None] = None

    def __new__(cls, group: ProcessGroup, config: BufferConfig, *,
                routing: LogicalRouting | None = None) -> Buffer:
        masking = Buffer.masking_class
        if cls is Buffer and masking is not None and isinstance(config, BufferConfig) and (
            config.on_peer_loss == "mask"
        ):
            if routing is not None:
                raise InvalidArgumentError("routing", type(routing).__name__,
                                           "is for a Buffer under a masking one: "
                                           "on_peer_loss='mask' routes by itself")
            # a MaskingBuffer: the same calls over the ranks still alive (ubep.buffer.elastic)
            return cast(Buffer, masking(group, config))
        return super().__new__(cls)

    @staticmethod
    def rejoin(rendezvous: str, rank: int, config: BufferConfig, *,
               timeout_s: float | None = None) -> Any:
        """From a new process, join a running Buffer with ``on_peer_loss="mask"`` as the lost
        ``rank``, once its members call ``admit()`` (:meth:`ubep.buffer.MaskingBuffer.rejoin`;
        docs/ELASTIC.md)."""
        masking = Buffer.masking_class
        if not isinstance(config, BufferConfig) or config.on_peer_loss != "mask" or (
            masking is None
        ):
            raise InvalidArgumentError("config", config,
                                       "rejoin needs a BufferConfig with on_peer_loss='mask'")
        return masking.rejoin(rendezvous, rank, config, timeout_s=timeout_s)

    def __init__(self, group: ProcessGroup, config: BufferConfig, *,
                 routing: LogicalRouting | None = None) -> None:
        group = as_process_group(group)  # a torch.distributed group -> ubep.torch.group
        self.group = group
        self.config = config  # the caller's (M2N: logical experts and roles)
        self._cfg = config  # the one the engine runs (_configure)
        self.rank = group.rank
        self.num_ranks = group.num_ranks
        self._epoch = 0  # sequence number of the last call (every rank agrees on it)
        self._num_dispatches = 0
        self._generation = 0  # resyncs so far
        self._lock = threading.Lock()  # one call at a time (a second thread is refused)
        self._dead: str | None = None  # a peer died: refused for good
        self._lost: str | None = None  # out of step: refused until resync()
        self._closed = False
        self._trace_capacity = 0  # spans each core keeps (ubep.trace.record); 0: no tracing
        self._memory: GlobalMemory | None = None
        self._engine: Any = None
        self._in_flight: list[InFlight] = []  # split-phase calls awaiting their hook, in order
        self._fast: Any = None  # the engine, when it takes blocking calls' arrays unchecked
        self._torch: Any = None  # the torch door, made on the first torch call
        self._tensor: type | None = None  # torch.Tensor once the door exists (the hot path's)
        self._route: LogicalRouting | None = None  # routing or expert_map's (_configure)
        self._tensors_direct = False  # tensors go to the engine as they come (_setup)
        self.uid = 0  # agreed below
        self.expert_ranks: tuple[int, ...] | None = None  # M2N roles (_configure)
        self._no_experts = False  # an M2N sender (_configure)
        self._m2n_shift = 0  # M2N, expert layout: slot id + shift = logical id (_configure)
        # Construction is collective: every rank validates, then all exchange the outcome, so a
        # config only one rank rejects fails on every rank instead of pairing with its next one.
        error: Exception | None = None
        try:
            self._configure(config, routing)
        except Exception as exc:  # bad config, or no native build: fail on every rank
            error = exc
        mine = {
            "config": (dataclasses.asdict(config) | {"num_cores": self.num_cores})
            if error is None else None,
            "error": None if error is None else str(error),
            "uid": secrets.randbits(62),
        }
        everyone = group.allgather(mine)
        if error is not None:
            raise error
        failed = [r for r, m in enumerate(everyone) if m["error"] is not None]
        if failed:
            raise RemoteError(failed[0], everyone[failed[0]]["error"])
        _check_same_config([m["config"] for m in everyone])
        self.uid = int(everyone[0]["uid"])
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _configure(self, config: BufferConfig, routing: LogicalRouting | None) -> None:
        """Local validation and derived sizes (raises ``InvalidArgumentError``)."""
        if not isinstance(config, BufferConfig):
            raise InvalidArgumentError("config", type(config).__name__, "must be a BufferConfig")
        if routing is not None and not isinstance(routing, LogicalRouting):
            raise InvalidArgumentError("routing", type(routing).__name__,
                                       "must be a ubep.buffer.replicas.LogicalRouting")
        # M2N (expert_ranks, None without): the engine runs the physical config, an expert
        # map of the placement (ubep.m2n); self.config stays the caller's
        self.config = config
        self.expert_ranks = config.expert_ranks
        self._no_experts = config.expert_ranks is not None and self.rank not in (
            config.expert_ranks)
        self._m2n_shift = slot_shift(config, self.rank, self.num_ranks)
        config = physical_config(config, self.num_ranks)
        self._cfg = config
        self.num_local_experts = experts_per_rank(config.num_experts, self.num_ranks)
        self.num_cores = config.num_cores or self.group.topology.cores_per_rank
        # every blocking call may take the one native call: its result needs no translation
        # (M2N's logical ids); with ASP on several cores it carries its core split
        self._one_call = self.expert_ranks is None
        self._tasks = CoreTasks(config, self.num_cores, self.group.topology, self.rank)
        # M2N: results in the caller's numbering (the engine runs physical slots)
        self._finish_dispatch: Callable[[Any], Any] = _same if self.expert_ranks is None else (
            functools.partial(_logical, self._no_experts, self._m2n_shift))
        self._dtype = _dt.dtype_of(config.dtype)
        self._cdtype = _dt.dtype_of(config.combine_dtype)
        # the door's dtypes of x and expert_out (compared by identity on the hot path)
        self._x_storage = np.dtype(self._dtype.storage)
        self._c_storage = np.dtype(self._cdtype.storage)
        self.layout = layout_of(config, self.num_ranks, self.num_cores)
        # the bytes each rank maps: the engine's own size where its registry row gives one
        # (which also refuses, by the field, a config that engine does not serve)
        self._memory_bytes = memory_bytes(config, self.num_ranks, self.num_cores) or (
            self.layout.size_bytes)
        # redundant experts: a caller's logical topk_idx -> the physical slots sent to
        # (ubep.expert_map); a masking Buffer hands its own to its members' Buffer
        self._route = routing if routing is not None or config.expert_map is None else (
            LogicalRouting(config.expert_map, config.num_experts, self.num_ranks,
                           self.group.topology.hop_matrix()[self.rank], config.num_topk))

    def _setup(self) -> None:
        g, lay, cfg = self.group, self.layout, self._cfg
        # an engine that brings its own memory (its registry row says) gets none mapped here
        own = own_memory(cfg)
        mem = None if own is not None else g.map_global(self._memory_bytes, "buffer")
        self._memory = mem
        # the engine of the config's transport (the memory's by default): a registry row, no
        # question asked of the memory or the engine
        values = self._dtype.storage if cfg.quant is None else _quant.FORMATS[cfg.quant].storage
        spec = EngineSpec(
            config=cfg, layout=lay, rank=self.rank, num_ranks=self.num_ranks,
            num_cores=self.num_cores, uid=self.uid, dtype_name=self._dtype.name,
            values=np.dtype(values), combine_storage=np.dtype(self._cdtype.storage),
            scale_cols=0 if cfg.quant is None else cfg.hidden // _quant.QUANT_BLOCK,
            device=engine_device(cfg))
        if own is not None:
            engine = own(g, spec)
        else:
            assert mem is not None
            engine = open_engine(mem, spec)
        # the jobs, each an object this Buffer holds (ubep.buffer.state), handed the engine
        # and the uid; built with the engine, so an open engine always has them (close)
        self._steps = StepKeeping(self, engine, self.uid)
        self._calls = InFlightCalls(self, engine)
        self._checks = ArgChecks(self, engine, self.uid)
        self._engine = engine
        # an engine that takes a blocking call's arrays unchecked is offered them first
        self._fast = engine if engine.takes_unchecked else None
        # a call of tensors goes to an engine that takes them as it came (no numpy), where
        # there is no caller's numbering to translate
        self._tensors_direct = (bool(getattr(engine, "takes_tensors", False))
                                and self._route is None and self._one_call)
        engine.reset_all()
        _trace.attach(self)  # BufferConfig.trace, or inside ubep.trace.record()
        # Every peer has mapped every segment once this barrier completes: unlink the names so
        # nothing survives a crash from here on.
        g.barrier(cfg.timeout_s)
        if mem is not None:
            mem.unlink()

    @staticmethod
    def size_hint(config: BufferConfig, num_ranks: int, num_cores: int | None = None) -> int:
        """Bytes of shared memory one rank's Buffer maps for itself (each rank maps every
        peer's too, but only its own is backed by its memory).

        With ``expert_ranks`` (M2N) every rank maps the same size, a sender too: its receive
        regions stay sized as an expert rank's (the native engine places every rank's regions
        at the same offsets), though nothing is ever sent to them."""
        if not isinstance(config, BufferConfig):
            raise InvalidArgumentError("config", type(config).__name__, "must be a BufferConfig")
        config = physical_config(config, num_ranks)
        experts_per_rank(config.num_experts, num_ranks)
        if num_cores is None:
            from ..topology import host

            num_cores = config.num_cores or host(num_ranks).cores_per_rank
        return memory_bytes(config, num_ranks, num_cores) or (
            layout_of(config, num_ranks, num_cores).size_bytes)

    @overload
    def dispatch(
        self, x: object, topk_idx: object, topk_weights: object, *, copy: bool = ...,
        return_recv_hook: Literal[False] = ..., x_scales: object = ...,
    ) -> DispatchResult[RuntimeHandle]: ...
    @overload
    def dispatch(
        self, x: object, topk_idx: object, topk_weights: object, *, copy: bool = ...,
        return_recv_hook: Literal[True], x_scales: object = ...,
    ) -> PendingCall[DispatchResult[RuntimeHandle]]: ...
    def dispatch(
        self, x: object, topk_idx: object, topk_weights: object, *, copy: bool = False,
        return_recv_hook: bool = False, x_scales: object = None,
    ) -> DispatchResult[RuntimeHandle] | PendingCall[DispatchResult[RuntimeHandle]]:
        """Send every token to the ranks of its experts (collective).

        Args:
            x: ``[num_tokens, hidden]`` payload of ``config.dtype`` (bf16 as uint16, or a CPU
                ``torch`` tensor), ``num_tokens <= max_tokens_per_rank`` (0 is fine).
            topk_idx: ``[num_tokens, num_topk]`` integer global expert ids, -1 = masked slot.
            topk_weights: ``[num_tokens, num_topk]`` float32.
            copy: return ``recv_x`` as an owned array instead of a view.
            x_scales: with ``BufferConfig.quant``, ``x`` may come quantised already (DeepEP's
                normal-mode FP8 input): 1-byte values and these float32 ``[num_tokens, hidden
                // 128]`` scales travel as they are.
            return_recv_hook: return as soon as this rank's sends are out, with a
                :class:`~ubep.handle.PendingCall` whose ``hook()`` runs the receive half and
                returns the result (DeepEP's low-latency hook). Two calls (dispatch or combine)
                may be in flight per Buffer; a third is refused on every rank until the first's
                hook ran.

        Raises:
            InvalidArgumentError: bad input on this rank (nothing was sent; the next call works).
            RemoteError: another rank failed this call (``clean``: it rejected its input).
            ubep.TimeoutError, PeerLostError, OutOfStepError: the Buffer lost step with its
                peers and refuses calls until :meth:`resync` (a dead peer: for good).
        """
        fast = self._fast
        # The one native call (an engine that takes a blocking call's arrays unchecked),
        # offered only numpy arrays of the door's own dtypes (identity checks, no copy): the
        # door takes them as they are, or copies them into its layout, or declines a shape the
        # checks then reject. Anything else is checked and converted first and goes through
        # the door once, with options: one engine call per dispatch in every case.
        if (fast is not None and self._one_call and self._route is None
                and not (copy or return_recv_hook or self._in_flight) and x_scales is None
                and ((type(x) is _NDARRAY and type(topk_idx) is _NDARRAY
                      and type(topk_weights) is _NDARRAY and x.dtype is self._x_storage
                      and topk_idx.dtype is _INT64 and topk_weights.dtype is _FLOAT32)
                     or type(x) is self._tensor)):
            # (a tensor, once the torch door exists: the engine views each tensor's memory
            # itself and declines what it does not take, which the torch door then takes)
            plan = self._tasks.for_x(x) if self._tasks.planned else None
            # Written out here and in combine rather than in a helper: a decode step meets
            # this code cold, and a Python frame fewer is a microsecond less. Nothing taken
            # (another call holds the Buffer, or it refuses calls): the general path below.
            if plan is not NO_SPLIT and self._lock.acquire(False):
                try:
                    if not (self._closed or self._dead is not None or self._lost is not None):
                        epoch = self._epoch = self._epoch + 1
                        index = self._num_dispatches
                        self._num_dispatches = index + 1
                        try:
                            got = fast.dispatch(x, topk_idx, topk_weights, epoch, index,
                                                self._generation, plan)
                            if type(got) is ErrorRecord:
                                raise self._steps.error(got)
                        except BaseException as exc:
                            raise self._steps.one_call_failed(epoch, index, exc) from None
                        if got is not None:
                            return got if type(x) is _NDARRAY else self._torch.result_of(got, x)
                        # declined, nothing done: the checks name what they reject
                        self._epoch, self._num_dispatches = epoch - 1, index
                        if type(x) is _NDARRAY:
                            return self._dispatch(x, topk_idx, topk_weights, False, False,
                                                  None, offered=True)
                finally:
                    self._lock.release()
        if (type(x) is not _NDARRAY and is_torch_tensor(x)
                and not (self._tensors_direct and x_scales is None)):
            # torch in, torch out: the call itself runs on numpy views, through the door
            # above where it can (the door's plans are made once per Buffer); an engine that
            # takes tensors is handed them as they came (_tensors_direct)
            door = self._torch
            if door is None:  # the first torch call: the door, and the hot path takes tensors
                door = self._torch = _torch_door_of(self._engine, self._cfg, self.dispatch,
                                                    self.combine)
                self._tensor = door.tensor_type
            return cast(Any, door.dispatch(x, topk_idx, topk_weights, copy, return_recv_hook,
                                           x_scales))
        self._steps.enter()
        try:
            return self._dispatch(x, topk_idx, topk_weights, copy, return_recv_hook, x_scales)
        finally:
            self._lock.release()

    def _dispatch(
        self, x: object, topk_idx: object, topk_weights: object, copy: bool, hook: bool,
        x_scales: object, *, offered: bool = False,
    ) -> DispatchResult[RuntimeHandle] | PendingCall[DispatchResult[RuntimeHandle]]:
        """The call through the checks (this thread holds the Buffer); ``offered``: the engine
        declined these arrays already, so it is not offered them again."""
        self._calls.complete_staged()
        self._calls.check()
        self._epoch += 1
        epoch = self._epoch
        index = self._num_dispatches
        self._num_dispatches += 1
        split = hook or bool(self._in_flight)
        opts = CallOptions(split, copy, x_scales is not None) if (
            split or copy or x_scales is not None) else PLAIN
        stage = _BEFORE
        try:
            if self._route is not None:  # logical ids -> physical slots (checked: a clean reject)
                topk_idx = self._route(topk_idx)
            xa, idx, w = cast(Any, (x, topk_idx, topk_weights)) if (
                self._tensors_direct and x_scales is None and is_torch_tensor(x)
            ) else self._checks.dispatch_args(x, topk_idx, topk_weights, x_scales)
            if offered:
                raise _declined(self.rank)
            plan = self._tasks.for_idx(idx)
            stage = _NATIVE
            # the one engine call: its result built by the engine (None: the first half ran)
            got = self._engine.dispatch(xa, idx, w, epoch, index, self._generation, plan, opts)
            stage = _AFTER
            if type(got) is ErrorRecord:
                raise self._steps.error(got)
        except BaseException as exc:
            err, clean = self._steps.failed(epoch, stage, exc)
            if clean:
                # rejected on every rank before anything reached a peer: no dispatch happened,
                # so no dispatch counter moves (a peer that made a mismatched combine call,
                # rejected as cleanly, did not count one either)
                self._num_dispatches = index
            raise err from None
        return self._calls.issued("dispatch", epoch, got, self._finish_dispatch, hook, index)

    @overload
    def combine(
        self, expert_out: object, handle: DispatchHandle, *,
        return_recv_hook: Literal[False] = ...,
    ) -> np.ndarray: ...
    @overload
    def combine(
        self, expert_out: object, handle: DispatchHandle, *, return_recv_hook: Literal[True],
    ) -> PendingCall[np.ndarray]: ...
    def combine(
        self, expert_out: object, handle: DispatchHandle, *, return_recv_hook: bool = False
    ) -> np.ndarray | PendingCall[np.ndarray]:
        """Bring expert outputs back and reduce them per source token (collective).

        Args:
            expert_out: ``[handle.num_recv_rows, hidden]`` of ``config.combine_dtype``, row ``i``
                answering row ``i`` of this rank's ``recv_x``.
            handle: ``result.handle`` of a dispatch on this Buffer (since its last resync);
                every rank must pass the handle of the same dispatch.
            return_recv_hook: as :meth:`dispatch`: return once this rank's expert outputs are
                published; ``hook()`` reduces and returns ``y``. ``expert_out`` must not change
                until then.

        Returns:
            ``[handle.num_tokens, hidden]`` array nothing else writes: expert layout
            ``y[t] = sum_k w[t,k] * out(t,k)``, rank layout ``y[t] = sum over ranks of the rows
            sent back``. From 32 MiB, a blocking call of exact numpy arrays returns a view
            (``y.base`` is a uint8 block, ``OWNDATA`` is False) of one of two blocks the Buffer
            hands out again only once nothing references the earlier ``y`` in it, not even a
            view or a tensor over it.
        """
        fast = self._fast
        # the one native call, as in dispatch (a handle the engine built, outputs of the door's
        # dtype: the door takes them or copies them into its layout)
        if (fast is not None and not (return_recv_hook or self._in_flight)
                and ((type(expert_out) is _NDARRAY and expert_out.dtype is self._c_storage)
                     or type(expert_out) is self._tensor)
                and type(handle) is RuntimeHandle and self._lock.acquire(False)):
            try:
                if not (self._closed or self._dead is not None or self._lost is not None):
                    epoch = self._epoch = self._epoch + 1
                    index = self._num_dispatches
                    try:
                        y = fast.combine(expert_out, handle, epoch, self._generation, index)
                        if type(y) is ErrorRecord:
                            raise self._steps.error(y)
                    except BaseException as exc:
                        raise self._steps.one_call_failed(epoch, index, exc) from None
                    if y is not None:
                        return y if type(expert_out) is _NDARRAY else self._torch.y_of(y)
                    self._epoch = epoch - 1  # declined, nothing done: the checks say why
                    if type(expert_out) is _NDARRAY:
                        return self._combine(expert_out, handle, False, offered=True)
            finally:
                self._lock.release()
        if (type(expert_out) is not _NDARRAY and is_torch_tensor(expert_out)
                and not self._tensors_direct):
            # torch in, torch out (as dispatch)
            door = self._torch
            if door is None:
                door = self._torch = _torch_door_of(self._engine, self._cfg, self.dispatch,
                                                    self.combine)
                self._tensor = door.tensor_type
            return cast(Any, door.combine(expert_out, handle, return_recv_hook))
        self._steps.enter()
        try:
            return self._combine(expert_out, handle, return_recv_hook)
        finally:
            self._lock.release()

    def _combine(
        self, expert_out: object, handle: DispatchHandle, hook: bool, *, offered: bool = False
    ) -> np.ndarray | PendingCall[np.ndarray]:
        """As :meth:`_dispatch`, for a combine."""
        self._calls.check()
        self._epoch += 1
        epoch = self._epoch
        split = hook or bool(self._in_flight)
        stage = _BEFORE
        try:
            h, eo = (self._checks.handle(handle), expert_out) if (
                self._tensors_direct and is_torch_tensor(expert_out)
            ) else self._checks.combine_args(expert_out, handle)
            if offered:
                raise _declined(self.rank)
            stage = _NATIVE
            got = self._engine.combine(eo, h, epoch, self._generation, self._num_dispatches,
                                       CallOptions(split=True) if split else PLAIN)
            stage = _AFTER
            if type(got) is ErrorRecord:
                raise self._steps.error(got)
        except BaseException as exc:
            raise self._steps.failed(epoch, stage, exc)[0] from None
        return self._calls.issued("combine", epoch, got, _same, hook, None)

    def reject(self, error: BaseException) -> BaseException:
        """This rank's next call fails here before it starts, for ``error`` (bad input found by
        a layer above the Buffer: a facade's checks): the peers' call raises ``RemoteError``
        (clean: the next call works) instead of waiting for this rank. Returns the exception
        to raise (``error``, or the Buffer's own if it refuses calls)."""
        return self._steps.reject(error)

    def sign(self, signature: int) -> bool:
        """What this rank's next dispatches are: a 64-bit word (``ubep.buffer.signature``; 0,
        the default, says nothing beyond the config every rank shares) that rides in the count
        records of each dispatch. A dispatch whose word differs from a peer's is rejected on
        every rank that differs (``InvalidArgumentError`` naming what differs, a clean reject:
        the next call works) before any row reaches a peer. Local, between calls; False where
        the engine does not compare words (then only 0 is accepted)."""
        setter = getattr(self._engine, "set_signature", None)
        if setter is None:
            return not signature
        setter(int(signature))
        return True

    def resync(self, timeout_s: float | None = None) -> None:
        """Re-establish agreement with the peers after a lost step (collective: every rank;
        :meth:`ubep.buffer.step.StepKeeping.resync`). Handles and ``recv_x`` views from
        before are invalid afterwards; a dead peer cannot be resynced with."""
        self._steps.resync(timeout_s)

    @property
    def engine(self) -> Engine:
        """The data plane this Buffer drives (its transport's ``ubep.plane.Engine``), for what
        asks an engine through the contract's own methods (tracing: ``trace_enable``)."""
        return cast(Engine, self._engine)

    def recv_x_valid(self, handle: DispatchHandle) -> bool:
        """Whether ``recv_x`` of the dispatch that returned ``handle`` still holds that
        dispatch's rows (:meth:`ubep.buffer.checks.ArgChecks.recv_x_valid`). Local."""
        return self._checks.recv_x_valid(handle)

    def get_combine_buffer(self, handle: DispatchHandle) -> np.ndarray:
        """A writable ``[handle.num_recv_rows, hidden]`` array in this rank's segment: write the
        expert outputs here and pass it to :meth:`combine` to skip the copy (zero-copy combine).
        Handles of consecutive dispatches get different buffers. Not collective."""
        self._steps.enter()
        try:
            h = self._checks.handle(handle)
            got = self._engine.combine_buffer(int(getattr(h, "dispatch_index", -1)),
                                              h.num_recv_rows)
            if type(got) is ErrorRecord:
                raise self._steps.error(got)
            return cast(np.ndarray, got)
        finally:
            self._lock.release()

    def close(self) -> None:
        """Stop the engine's threads and unmap the segments (local, not collective; views into
        the segments keep their memory alive until they are dropped). A call still running in
        another thread is waited for (at most its deadline): its cores use the segments."""
        if self._closed:
            return
        if not self._lock.acquire(timeout=float(self._cfg.timeout_s) + 5.0):
            raise UbepError(f"rank {self.rank}: cannot close the Buffer: a call on it in "
                            "another thread (or in the code this signal handler interrupted) is "
                            "still running")
        try:
            engine = self._engine
            if engine is not None:  # open: its jobs exist (_setup)
                self._calls.abandon("the Buffer was closed before its hook")
            self._closed = True
            self._fast = None
            self._torch = self._tensor = None  # its region views go with the engine's
            if engine is not None:
                _trace.detach(self)  # a recorder takes the spans before the engine goes
                engine.close()  # also drops the engine's views of the receive regions
            if self._memory is not None:
                self._memory.close()
            self._memory = None
        finally:
            self._lock.release()

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self._cfg
        return (
            f"Buffer(rank={self.rank}/{self.num_ranks}, engine={c.engine}, sync={c.sync}, "
            f"layout={c.layout}, dtype={c.dtype}, hidden={c.hidden}, "
            f"max_tokens_per_rank={c.max_tokens_per_rank}, cores={self.num_cores})"
        )


def _declined(rank: int) -> UbepError:
    """The error of a call whose arrays the engine's door declined though the checks take
    them: the door declines only shapes the checks reject, and a call whose outputs (or layout
    copies) it could not allocate. A clean reject, before anything reached a peer."""
    return UbepError(f"rank {rank}: the engine could not allocate this call's outputs")


def _same(y: Any) -> Any:
    """A combine's result as the engine built it."""
    return y


def _logical(sender: bool, shift: int, res: Any) -> Any:
    """An M2N dispatch result in the caller's numbering (``ubep.m2n.logical_result``)."""
    logical_result(res, sender, shift)
    return res


def _check_same_config(configs: list[dict[str, Any]]) -> None:
    """Raise, on every rank alike, naming the first field on which a rank's config differs
    from rank 0's and both values (a whole BufferConfig is too long to read in one line)."""
    for rank, theirs in enumerate(configs):
        for field, first in configs[0].items():
            if theirs.get(field) != first:
                raise InvalidArgumentError(
                    f"config.{field}", first,
                    f"differs between ranks: rank 0 has {first!r}, rank {rank} has "
                    f"{theirs.get(field)!r} (every rank needs the same BufferConfig)")


def _torch_door_of(engine: Any, cfg: BufferConfig, call_dispatch: Callable[..., Any],
                   call_combine: Callable[..., Any]) -> Any:
    """The torch door of a Buffer running ``cfg`` on ``engine`` (made on its first torch
    call): its dtype plans and a torch view of each receive region, made once
    (``ubep.torch._convert.TorchDoor``); its calls come back through ``call_dispatch`` and
    ``call_combine``."""
    regions = engine.regions.recv_views if isinstance(engine, HostEngine) else None
    return torch_door(
        x_dtype=_dt.dtype_of(cfg.dtype).name, combine_dtype=_dt.dtype_of(cfg.combine_dtype).name,
        quant=cfg.quant, call_dispatch=call_dispatch, call_combine=call_combine, regions=regions)
