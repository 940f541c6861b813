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
word array of its own (ubep.runtime.layout).

Combine reads the expert outputs where they lie: if ``expert_out`` already lives in this rank's
segment (``buf.get_combine_buffer(handle)``, or ``res.recv_x`` itself) nothing is copied;
otherwise it is copied once into the segment, and every source pulls and reduces its rows in
one pass (float32 accumulation in the reference's order).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
from typing import Any, ClassVar, Literal, cast, overload

import numpy as np

from .. import dtypes as _dt
from .. import quant as _quant
from ..config import BufferConfig
from ..engine import CombineCall, DispatchCall
from ..errors import InvalidArgumentError, RemoteError, UbepError
from ..handle import DispatchHandle, DispatchResult, PendingCall, RuntimeHandle
from ..m2n import logical_result, physical_config, slot_shift
from ..routing import experts_per_rank
from ..runtime.abi import ErrorRecord, engine_params, load_native
from ..runtime.group import ProcessGroup
from ..sched import CoreSplit, ScheduleSpec, core_split, schedule_spec
from ..torch_bridge import as_process_group, combine_in_torch, dispatch_in_torch, is_torch_tensor
from .checks import ArgChecks
from .inflight import InFlightCalls
from .regions import combine_region, int64_outputs, layout_of, new_frozen, rows_view
from .replicas import LogicalRouting
from .state import AFTER as _AFTER
from .state import BEFORE as _BEFORE
from .state import NATIVE as _NATIVE

__all__ = ["Buffer"]

_NO_SPLIT = object()  # Buffer._split_plan: the call needs the general path


class Buffer(InFlightCalls, ArgChecks):
    """Dispatch/combine buffers of one rank (collective constructor: every rank builds one with
    the same config, in the same order).

    Args:
        group: the ranks: a ``torch.distributed`` process group (the world or a
            ``new_group`` subgroup, under torchrun; ranks in the group's order), a
            :class:`~ubep.runtime.group.Group` (``ubep.launch``) or any
            :class:`~ubep.runtime.group.ProcessGroup` (``ubep.mpi.init()`` under mpiexec).
        config: :class:`BufferConfig` (must be equal on every rank).
    """


    # the class that serves on_peer_loss="mask" (ubep.buffer.elastic registers it on import,
    # so this module needs no import of it)
    masking_class: ClassVar[type[Any] | None] = None

    def __new__(cls, group: ProcessGroup, config: BufferConfig) -> Buffer:
        masking = Buffer.masking_class
        if cls is Buffer and masking is not None and isinstance(config, BufferConfig) and (
            config.on_peer_loss == "mask"
        ):
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

    def __init__(self, group: ProcessGroup, config: BufferConfig) -> None:
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
        self._dead = None  # a peer died: refused for good
        self._lost = None  # out of step: refused until resync()
        self._closed = False
        self._segments = []
        self._memory = None
        self._engine = None
        self._in_flight = []  # split-phase calls awaiting their hook, in order
        self._fast = None  # the one-call path of blocking calls
        self._route = None  # expert_map's routing (_configure)
        self.expert_ranks: tuple[int, ...] | None = None  # M2N roles (_configure)
        self._no_experts = False  # an M2N sender (_configure)
        self._m2n_shift = 0  # M2N, expert layout: slot id + shift = logical id (_configure)
        # Construction is collective: every rank validates, then all exchange the outcome, so a
        # config only one rank rejects fails on every rank instead of pairing with its next one.
        error: Exception | None = None
        try:
            self._configure(config)
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
        if any(m["config"] != everyone[0]["config"] for m in everyone):
            raise InvalidArgumentError(
                "config", config, "differs between ranks (every rank needs the same BufferConfig)"
            )
        self._uid = everyone[0]["uid"]
        try:
            self._setup()
        except BaseException:
            self._teardown()
            raise

    def _configure(self, config: BufferConfig) -> None:
        """Local validation and derived sizes (raises ``InvalidArgumentError``)."""
        if not isinstance(config, BufferConfig):
            raise InvalidArgumentError("config", type(config).__name__, "must be a BufferConfig")
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
        self._planned = config.engine == "asp" and self.num_cores >= 2
        self._splits: dict[int, CoreSplit | ScheduleSpec | None] = {}
        self._dtype = _dt.dtype_of(config.dtype)
        self._cdtype = _dt.dtype_of(config.combine_dtype)
        self.layout = layout_of(config, self.num_ranks, self.num_cores)
        self._native = load_native()
        # redundant experts: a caller's logical topk_idx -> the physical slots sent to
        # (ubep.expert_map); a masking Buffer installs its own over its members' Buffer
        self._route = None if config.expert_map is None else LogicalRouting(
            config.expert_map, config.num_experts, self.num_ranks,
            self.group.topology.hop_matrix()[self.rank], config.num_topk)

    def _setup(self) -> None:
        g, lay = self.group, self.layout
        mem = g.map_global(lay.size_bytes, "buffer")
        self._memory = mem
        self._segments = list(getattr(mem, "segments", []))
        cores = self.num_cores
        threads = self._cfg.threads
        if threads is None:
            threads = cores * self.num_ranks <= (os.cpu_count() or 1)
        if mem.addresses is not None:
            background = self._cfg.background
            if background is None:
                background = (cores + 1) * self.num_ranks <= (os.cpu_count() or 1)
            params = engine_params(self._cfg, lay, rank=self.rank, num_ranks=self.num_ranks,
                                   num_cores=cores, threaded=bool(threads) and cores > 1,
                                   background=background)
            self._engine = self._native.Engine(params, mem.addresses, mem.pids, mem.start_times)
        else:
            if self._cfg.integrity != "off":  # the same on every rank: all peers remote
                raise InvalidArgumentError(
                    "integrity", self._cfg.integrity,
                    "row checksums are implemented by the one-host engine only (docs/INTEGRITY.md)")
            self._engine = mem.make_engine(self._cfg, lay)  # peers on other hosts (ubep.mpi)
        self._engine.reset_all()
        # Every peer has mapped every segment once this barrier completes: unlink the names so
        # nothing survives a crash from here on.
        g.barrier(self._cfg.timeout_s)
        mem.unlink()
        seg = mem.local_array
        self._out_regions = [
            seg[lay.off_out + i * lay.out_bytes: lay.off_out + (i + 1) * lay.out_bytes]
            for i in range(lay.num_regions)
        ]
        # Full-capacity read-only recv_x views, sliced per call (building one costs ~2 us);
        # quantised rows: the values, and the float32 scales after them in each row
        cfg = self._cfg
        values = self._dtype.storage if cfg.quant is None else _quant.FORMATS[cfg.quant].storage
        self._recv_views = [rows_view(r, lay, values, 0, cfg.hidden) for r in self._out_regions]
        self._scale_views = [] if cfg.quant is None else [
            rows_view(r, lay, np.dtype(np.float32), cfg.hidden, cfg.hidden // _quant.QUANT_BLOCK)
            for r in self._out_regions
        ]
        self._comb_regions = [
            seg[lay.off_comb + i * lay.comb_bytes: lay.off_comb + (i + 1) * lay.comb_bytes]
            for i in range(2)
        ]
        if hasattr(self._engine, "set_fast"):  # the native engine's one-call path
            self._fast = self._engine
            self._fast.set_fast(
                DispatchResult, RuntimeHandle,
                {"buffer_uid": self._uid, "rank": self.rank, "layout": cfg.layout,
                 "hidden": cfg.hidden, "num_ranks": self.num_ranks,
                 "num_experts": cfg.num_experts, "x_dtype": self._dtype.name},
                self._recv_views, self._scale_views or None, self._dtype.storage,
                self._cdtype.storage)

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
        return layout_of(config, num_ranks, num_cores).size_bytes

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
        if (fast is not None and self._one_call and self._route is None
                and not (copy or return_recv_hook or self._in_flight) and x_scales is None):
            plan = self._split_plan(x) if self._planned else None
            # The one native call, written out here and in combine rather than in a helper: a
            # decode step meets this code cold, and a Python frame fewer is a microsecond less.
            # Nothing taken (another call holds the Buffer, it refuses calls, or the native
            # call returns None: not its arrays): the general path takes the call.
            if plan is not _NO_SPLIT and self._lock.acquire(False):
                try:
                    if not (self._closed or self._dead is not None or self._lost is not None):
                        epoch = self._epoch = self._epoch + 1
                        index = self._num_dispatches
                        self._num_dispatches = index + 1
                        try:
                            got = fast.dispatch_fast(x, topk_idx, topk_weights, epoch, index,
                                                     self._generation, plan)
                            if type(got) is ErrorRecord:
                                raise self._error(got)
                        except BaseException as exc:
                            raise self._hot_failed(epoch, index, exc) from None
                        if got is not None:
                            return got
                        self._epoch, self._num_dispatches = epoch - 1, index
                finally:
                    self._lock.release()
        if is_torch_tensor(x):  # torch in, torch out: the call itself runs on numpy views
            return cast(Any, dispatch_in_torch(
                self.dispatch, x, topk_idx, topk_weights, x_scales, self._cfg.quant, copy=copy,
                return_recv_hook=return_recv_hook))
        self._enter()
        try:
            return self._dispatch(x, topk_idx, topk_weights, copy, return_recv_hook, x_scales)
        finally:
            self._lock.release()

    def _hot_failed(self, epoch: int, index: int, exc: BaseException) -> BaseException:
        """What a failed one native call (dispatch or combine: ``index`` is the dispatches made
        before it) raises; a clean reject leaves no dispatch counted."""
        err, clean = self._failed(epoch, _NATIVE, exc)
        if clean:
            self._num_dispatches = index
        return err

    def _dispatch(
        self, x: object, topk_idx: object, topk_weights: object, copy: bool, hook: bool,
        x_scales: object,
    ) -> DispatchResult[RuntimeHandle] | PendingCall[DispatchResult[RuntimeHandle]]:
        self._complete_staged_dispatch()
        self._check_in_flight()
        self._epoch += 1
        epoch = self._epoch
        index = self._num_dispatches
        self._num_dispatches += 1
        stage = _BEFORE
        try:
            if self._route is not None:  # logical ids -> physical slots (checked: a clean reject)
                topk_idx = self._route(topk_idx)
            fast = self._fast
            # a call the one native call can take was offered to it already, in
            # Buffer.dispatch (not again here)
            offered = self._one_call and self._route is None
            if fast is not None and not (copy or hook or self._in_flight or offered) and (
                    x_scales is None):
                # the blocking call with an expert map or M2N ids: checked,
                # run and its result built in one native call; None: not its case (other types,
                # bad input), nothing was done
                plan = self._split_plan(x)
                if plan is not _NO_SPLIT:
                    stage = _NATIVE
                    got = self._fast_answer(fast.dispatch_fast(
                        x, topk_idx, topk_weights, epoch, index, self._generation, plan))
                    if got is not None:
                        if self.expert_ranks is not None:  # M2N: the caller's ids
                            logical_result(got, self._no_experts, self._m2n_shift)
                        return got
                    stage = _BEFORE
            xa, idx, w = self._check_dispatch_args(x, topk_idx, topk_weights, x_scales)
            plan = self._plan(idx)
            cfg, lay = self._cfg, self.layout
            ntok = xa.shape[0]
            cap, K, L, R = lay.cap_rows, cfg.num_topk, self.num_local_experts, self.num_ranks
            expert = cfg.layout == "expert"
            o_idx, meta, counts, o_dst = int64_outputs(cap, K, L, R, ntok, expert)
            o_w = np.empty(cap if expert else (cap, K), np.float32)
            stage = _NATIVE
            got = self._engine.dispatch(DispatchCall(
                x=xa, topk_idx=idx, topk_weights=w, num_tokens=ntok, epoch=epoch, index=index,
                recv_topk_idx=o_idx, recv_topk_weights=o_w, recv_src_rank=meta[0],
                recv_src_token=meta[1], recv_src_k=meta[2], counts=counts, send_dst_row=o_dst,
                plan=plan, split=hook or bool(self._in_flight), prequant=x_scales is not None,
            ))
            stage = _AFTER
            if type(got) is ErrorRecord:
                raise self._error(got)
        except BaseException as exc:
            err, clean = self._failed(epoch, stage, exc)
            if clean:
                # rejected on every rank before anything reached a peer: no dispatch happened,
                # so no dispatch counter moves (a peer that made a mismatched combine call,
                # rejected as cleanly, did not count one either)
                self._num_dispatches = index
            raise err from None

        def finish(n: int) -> DispatchResult[RuntimeHandle]:
            return self._dispatch_result(n, index, ntok, copy, o_idx, o_w, meta, counts, o_dst,
                                         idx, w)

        return self._issued("dispatch", epoch, got, finish, hook, index)

    def _dispatch_result(
        self, n: int, index: int, ntok: int, copy: bool, o_idx: np.ndarray, o_w: np.ndarray,
        meta: np.ndarray, counts: np.ndarray, o_dst: np.ndarray, idx: np.ndarray, w: np.ndarray,
    ) -> DispatchResult[RuntimeHandle]:
        cfg, lay = self._cfg, self.layout
        L, R = self.num_local_experts, self.num_ranks
        recv_x = self._recv_views[index % lay.num_regions][:n]
        scales = self._scale_views[index % lay.num_regions][:n] if self._scale_views else None
        if copy:
            recv_x = recv_x.copy()
            scales = None if scales is None else scales.copy()
        # shared by the result and the handle, and what combine trusts: not writable
        for owned in (meta, o_dst, idx, w):
            owned.flags.writeable = False
        src_rank, src_token, src_k = meta[0, :n], meta[1, :n], meta[2, :n]
        handle = new_frozen(
            RuntimeHandle,
            layout=cfg.layout,
            rank=self.rank,
            num_ranks=R,
            num_experts=cfg.num_experts,
            num_tokens=ntok,
            hidden=cfg.hidden,
            x_dtype=self._dtype.name,
            topk_idx=idx,
            topk_weights=w,
            recv_src_rank=src_rank,
            recv_src_token=src_token,
            recv_src_k=src_k,
            num_recv_rows_per_rank=counts[L:],
            send_dst_row=o_dst,
            dispatch_index=index,
            buffer_uid=self._uid,
            generation=self._generation,
        )
        return new_frozen(
            DispatchResult,
            recv_x=recv_x,
            recv_topk_idx=o_idx[:n] + self._m2n_shift if self._m2n_shift else o_idx[:n],
            recv_topk_weights=o_w[:n],
            num_recv_tokens_per_expert=counts[:0 if self._no_experts else L],
            recv_src_rank=src_rank,
            recv_src_token=src_token,
            recv_src_k=src_k,
            handle=handle,
            recv_x_scales=scales,
        )

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
        # the one native call, as in dispatch
        if (fast is not None and not (return_recv_hook or self._in_flight)
                and self._lock.acquire(False)):
            try:
                if not (self._closed or self._dead is not None or self._lost is not None):
                    epoch = self._epoch = self._epoch + 1
                    index = self._num_dispatches
                    try:
                        y = fast.combine_fast(expert_out, handle, epoch, self._generation, index)
                        if type(y) is ErrorRecord:
                            raise self._error(y)
                    except BaseException as exc:
                        raise self._hot_failed(epoch, index, exc) from None
                    if y is not None:
                        return y
                    self._epoch = epoch - 1
            finally:
                self._lock.release()
        if is_torch_tensor(expert_out):  # torch in, torch out (as dispatch)
            return cast(Any, combine_in_torch(self.combine, expert_out, handle,
                                              return_recv_hook=return_recv_hook))
        self._enter()
        try:
            return self._combine(expert_out, handle, return_recv_hook)
        finally:
            self._lock.release()

    def _combine(
        self, expert_out: object, handle: DispatchHandle, hook: bool
    ) -> np.ndarray | PendingCall[np.ndarray]:
        self._check_in_flight()
        self._epoch += 1
        epoch = self._epoch
        stage = _BEFORE
        try:
            # (a blocking call of exact arrays was offered to the one native call already,
            # in Buffer.combine: what comes here converts or raises)
            h, eo = self._check_combine_args(expert_out, handle)
            creg = combine_region(h)
            assert h.send_dst_row is not None  # checked by _check_combine_args
            y = np.empty((h.num_tokens, self._cfg.hidden), dtype=self._cdtype.storage)
            stage = _NATIVE
            got = self._engine.combine(CombineCall(
                expert_out=eo, num_rows=h.num_recv_rows, topk_idx=h.topk_idx,
                topk_weights=h.topk_weights, send_dst_row=h.send_dst_row,
                num_tokens=h.num_tokens, epoch=epoch, region=creg, y=y,
                dispatch_index=h.dispatch_index,  # type: ignore[attr-defined]
                split=hook or bool(self._in_flight),
            ))
            stage = _AFTER
            if type(got) is ErrorRecord:
                raise self._error(got)
        except BaseException as exc:
            raise self._failed(epoch, stage, exc)[0] from None
        return self._issued("combine", epoch, got, lambda n: y, hook, None)

    def get_combine_buffer(self, handle: DispatchHandle) -> np.ndarray:
        """A writable ``[handle.num_recv_rows, hidden]`` array in this rank's segment: write the
        expert outputs here and pass it to :meth:`combine` to skip the copy (zero-copy combine).
        Handles of consecutive dispatches get different buffers. Not collective."""
        self._enter()
        try:
            h = self._check_handle(handle)
            creg = combine_region(h)
            last = int(self._engine.comb_last_epoch(creg))
            got = self._engine.wait_done(last, float(self._cfg.timeout_s))
            if type(got) is ErrorRecord:
                raise self._error(got)
            rows, hidden = h.num_recv_rows, self._cfg.hidden
            region = self._comb_regions[creg]
            return np.ndarray((rows, hidden), dtype=self._cdtype.storage, buffer=region)
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
            self._abandon_in_flight("the Buffer was closed before its hook")
            self._closed = True
            self._teardown()
        finally:
            self._lock.release()

    def _teardown(self) -> None:
        self._fast = None
        if self._engine is not None:
            self._engine.close()  # also drops the engine's views of the receive regions
        self._out_regions = []
        self._recv_views = []
        self._scale_views = []
        self._comb_regions = []
        if self._memory is not None:
            self._memory.close()
        self._memory = None
        self._segments = []

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

    def _plan(self, idx: np.ndarray) -> CoreSplit | ScheduleSpec | None:
        """What each core of this rank does (ASP with more than one core; one core validates,
        counts and sends in one pass): :meth:`_core_split`'s answer for this batch."""
        return self._core_split(idx.shape[0])

    def _fast_answer(self, got: Any) -> Any:
        """What a one-call entry returned: None (not its case: nothing was done), the call's
        result, or the engine's ErrorRecord, raised here (``_failed`` classifies a UbepError
        from inside the data plane as it does one from after it)."""
        if type(got) is ErrorRecord:
            raise self._error(got)
        return got

    def _split_plan(self, x: object) -> CoreSplit | ScheduleSpec | object | None:
        """The plan of a blocking call's one native call (:meth:`_core_split`), or
        ``_NO_SPLIT`` when ``x`` is not a 2-D array (which the one call would refuse): the
        general path."""
        if type(x) is not np.ndarray or x.ndim != 2:
            return _NO_SPLIT
        return self._core_split(x.shape[0])

    def _core_split(self, num_tokens: int) -> CoreSplit | ScheduleSpec | None:
        """The cores' tasks for a batch of ``num_tokens`` (cached per batch size): None (one
        core, BSP, or no tokens: one pass does everything); Appendix A's count/send split; with
        two or more send cores, the split and the scheduler's tables (``ScheduleSpec``): the
        engine builds the Plan of ``config.policy`` itself from the routing it validates, the
        Plan ``ubep.sched.schedule`` would give, with no Python per call."""
        got = self._splits.get(num_tokens, _NO_SPLIT)
        if got is not _NO_SPLIT:
            return cast("CoreSplit | ScheduleSpec | None", got)
        cfg = self._cfg
        split: CoreSplit | ScheduleSpec | None = None
        if self._planned and num_tokens > 0:
            split = core_split(self.num_cores, cfg.num_experts, cfg.num_topk, num_tokens)
            if split.num_send_cores >= 2:
                split = schedule_spec(split, self.group.topology, rank=self.rank,
                                      num_experts=cfg.num_experts, policy=cfg.policy)
        self._splits[num_tokens] = split
        return split
