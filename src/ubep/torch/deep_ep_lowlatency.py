"""The low-latency mode of ``ubep.deep_ep``: its calls (``low_latency_dispatch`` /
``low_latency_combine``: :class:`LowLatencyPath`, held by the Buffer) and its tensors in
DeepEP's layout, ``[num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks, hidden]``.

On a ``ubep.Buffer`` (every group but the in-process test world and shrink mode) the Buffer runs
``layout="expert_padded"``: the engine lands each row at its DeepEP place, so ``recv_x`` (and
FP8's float32 scales) are views of the Buffer's own receive region and
``get_next_low_latency_combine_buffer`` a view of its combine region (:class:`PaddedViews`,
made once per region): no tensor of that shape is allocated, zeroed or packed per call. As
DeepEP's, only the first ``recv_count[e]`` rows of expert ``e`` are defined. The in-process
world and shrink mode (whose masking Buffers re-order rows after a loss) receive packed rows
and copy them into new tensors (:class:`LowLatencyOutputs`). On an engine that takes tensors
(``transport="triton"``) the pair is :class:`.deep_ep_device.DeviceLowLatency`'s: torch on
the engine's device, no numpy.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from ..errors import InvalidArgumentError, UbepError
from ..runtime.abi import native_or_none
from ._convert import (
    PAYLOAD_DTYPES,
    from_numpy,
    storage_views,
    tensor_of_storage,
    to_numpy,
)
from .backend import EPBackend, issue_combine
from .deep_ep_checks import check_device
from .deep_ep_device import DeviceHandle, DeviceLowLatency, on_device
from .deep_ep_types import EventOverlap, LowLatencyHandle, _event
from .fp8 import FP8_BLOCK, UE8M0_PACK, pack_ue8m0

if TYPE_CHECKING:
    from .deep_ep_core import FacadeCore

__all__ = ["LowLatencyOutputs", "LowLatencyPath", "PaddedViews", "combine_input"]


def _tensor_over(a: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor over ``a``'s memory, its strides kept (a receive region's rows are strided),
    reinterpreted as ``dtype`` (same item size: FP8 over bytes; ``None``: BF16 over uint16
    bits, else ``a``'s own type). A read-only region is wrapped too: torch's warning about that
    is silenced, the tensor is a view of data the caller reads."""
    if a.flags.writeable:
        t = torch.from_numpy(a)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(a)
    if dtype is None:
        dtype = torch.bfloat16 if a.dtype == np.uint16 else t.dtype
    return t if t.dtype == dtype else t.view(dtype)


def _tensor_of(a: Any) -> torch.Tensor:
    """``a`` itself where it is a tensor (a result of the Buffer's torch door), else
    :func:`_tensor_over` it."""
    return a if isinstance(a, torch.Tensor) else _tensor_over(a)


class _Region:
    """One receive region's tensors: views of the Buffer's memory (``recv_x``, FP8 scales), and
    DeepEP's ``recv_count`` (int32) and UE8M0 exponents, rewritten by each dispatch into the
    region: all valid until the second dispatch after theirs, as the rows."""

    def __init__(self, rows: np.ndarray, scales: np.ndarray | None, num_local: int, slots: int,
                 use_fp8: bool, use_ue8m0: bool) -> None:
        per_rank = rows.shape[0] // slots  # local experts of the engine's (physical) config
        values = torch.float8_e4m3fn if use_fp8 else None
        self.rows = _tensor_over(rows[: per_rank * slots], values).view(
            per_rank, slots, rows.shape[1])[:num_local]
        self.scales: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        if use_fp8:
            assert scales is not None
            self.scales = _tensor_over(scales[: per_rank * slots], torch.float32).view(
                per_rank, slots, scales.shape[1])[:num_local]
            if use_ue8m0:
                self.packed = torch.empty((num_local, slots, scales.shape[1] // UE8M0_PACK),
                                          dtype=torch.int32)
        self.recv_count = torch.zeros(num_local, dtype=torch.int32)
        self._count_np = self.recv_count.numpy()  # the same memory, written by numpy
        self.num_local, self.slots = num_local, slots
        self.recv_x: Any = self.rows if self.scales is None else (
            self.rows, self.packed if self.packed is not None else self.scales)

    def fill(self, counts: np.ndarray) -> None:
        """This region's dispatch received ``counts`` rows per local expert."""
        self._count_np[:] = counts
        if self.packed is not None and self.num_local:
            assert self.scales is not None
            # the defined rows' exponents only (DeepEP leaves the rest undefined too)
            L, S = self.num_local, self.slots
            at = torch.from_numpy(_defined_rows(counts, S))
            self.packed.view(L * S, -1)[at] = pack_ue8m0(self.scales.reshape(L * S, -1)[at])


class PaddedHandle(LowLatencyHandle):
    """The handle of a low-latency dispatch on a padded Buffer: DeepEP's ``src_info`` and
    ``layout_range`` are made from the engine's per-row origins when first read (a decode step
    that never reads them never pays for them), then kept. Each expert's rows hold its sources
    in ascending rank and a slot past its count reads -1, so rank ``j``'s rows of expert ``e``
    are those of its block that name ``j``."""

    @property
    def src_info(self) -> torch.Tensor:
        got = self.__dict__.get("_src_info")
        if got is None:
            tokens = self._origins(self._received().recv_src_token)
            got = self.__dict__["_src_info"] = torch.from_numpy(tokens.astype(np.int32))
        return cast(torch.Tensor, got)

    @property
    def layout_range(self) -> torch.Tensor:
        got = self.__dict__.get("_layout_range")
        if got is None:
            inner = self._received()
            src = self._origins(inner.recv_src_rank)
            out = np.empty((src.shape[0], inner.num_ranks), np.int64)
            begin = np.zeros(src.shape[0], np.int64)
            for j in range(inner.num_ranks):
                n = np.count_nonzero(src == j, axis=1)
                out[:, j] = (begin << 32) | n
                begin += n
            got = self.__dict__["_layout_range"] = torch.from_numpy(out)
        return cast(torch.Tensor, got)

    def _received(self) -> Any:
        _require_received(self)
        return self.inner

    def __repr__(self) -> str:
        state = "pending" if self.inner is None else f"dispatch {self.inner.dispatch_index}"
        return (f"PaddedHandle({state}, num_max_dispatch_tokens_per_rank="
                f"{self.num_max_dispatch_tokens_per_rank}, hidden={self.hidden}, "
                f"num_experts={self.num_experts})")

    def _origins(self, per_row: np.ndarray) -> np.ndarray:
        """``[num_local_experts, slots]`` of a per-row array of the engine's handle."""
        L = len(self.counts)
        slots = self.num_max_dispatch_tokens_per_rank * self.inner.num_ranks
        return np.asarray(per_row)[: L * slots].reshape(L, slots)


def _defined_rows(counts: np.ndarray, slots: int) -> np.ndarray:
    """The padded rows that hold a row: the first ``counts[e]`` of each expert's slots."""
    starts = np.repeat(np.arange(len(counts), dtype=np.int64) * slots, counts)
    return starts + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


class PaddedViews:
    """A padded Buffer's tensors, per receive region and per combine region, made the first time
    each region is used (the regions are the engine's host views, ``HostEngine.regions``)."""

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self._recv: dict[tuple[int, bool, bool], _Region] = {}
        self._comb: dict[int, tuple[np.ndarray, torch.Tensor]] = {}
        self._ones: dict[tuple[int, ...], np.ndarray] = {}

    def unit_weights(self, shape: tuple[int, ...]) -> np.ndarray:
        """Float32 ones of ``shape``, read-only (a dispatch's weights; the Buffer copies them)."""
        ones = self._ones.get(shape)
        if ones is None:
            ones = self._ones[shape] = np.ones(shape, np.float32)
            ones.flags.writeable = False
        return ones

    def region(self, index: int, num_local: int, slots: int, use_fp8: bool,
               use_ue8m0: bool) -> _Region:
        """The tensors of the receive region the Buffer's dispatch ``index`` lands in (its
        engine's public regions: ``ubep.plane.host.HostEngine.regions``)."""
        regions = self.buffer.engine.regions
        reg = index % len(regions.recv_views)
        key = (reg, use_fp8, use_ue8m0)
        region = self._recv.get(key)
        if region is None:
            scales = regions.scale_views[reg] if regions.scale_views else None
            region = _Region(regions.recv_views[reg], scales, num_local, slots, use_fp8,
                             use_ue8m0)
            self._recv[key] = region
        return region

    def combine_buffer(self, handle: LowLatencyHandle, num_local: int,
                       wait: bool = True) -> tuple[np.ndarray, torch.Tensor]:
        """The combine region of ``handle``'s dispatch: as the engine reads it (``[rows,
        hidden]``) and as DeepEP's caller writes it (``[num_local_experts, slots, hidden]``).
        ``wait``: first wait (bounded) until no peer still reads the combine that used it last
        (what ``get_next_low_latency_combine_buffer`` does before the caller writes there; a
        zero-copy combine of what was written needs no second wait)."""
        key = int(handle.inner.dispatch_index) % 2
        got = self._comb.get(key)
        if got is not None and not wait:
            return got
        rows = np.asarray(self.buffer.get_combine_buffer(handle.inner))
        if got is None or got[0].shape != rows.shape:
            slots = handle.num_max_dispatch_tokens_per_rank * handle.inner.num_ranks
            tensor = _tensor_over(rows).view(rows.shape[0] // slots, slots,
                                             rows.shape[1])[:num_local]
            got = (rows, tensor)
            self._comb[key] = got
        return got


def padded_capable(backend: Any) -> bool:
    """Whether ``backend`` is a ``ubep.Buffer`` whose engine keeps its receive regions in host
    memory (the native and RMA engines): what :class:`PaddedViews` views."""
    engine = getattr(getattr(backend, "buffer", None), "engine", None)
    return getattr(engine, "regions", None) is not None


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


class LowLatencyPath:
    """DeepEP's low-latency pair, held by a :class:`ubep.torch.deep_ep.Buffer` (its
    ``low_latency_*`` methods and ``get_next_low_latency_combine_buffer`` call this one's):
    ``layout="expert_padded"`` Buffers viewed in place (:class:`PaddedViews`), or
    ``layout="expert"`` ones whose rows are packed per local expert (the in-process world and
    shrink mode), FP8 and receive hooks. It sends through the facade's core
    (:class:`.deep_ep_core.FacadeCore`: its Buffers per shape, the call gate, the roles)."""

    def __init__(self, core: FacadeCore) -> None:
        self.core = core
        self.group_size = core.group_size
        self._backend = core.backends.get
        self._cached = core.backends.cached
        self._send = core.backends.send
        self._gate = core.gate
        self._num_local_experts = core.roles.num_local_experts
        #: whether the calls run on padded Buffers (views of their regions): not in the
        #: in-process world (no Buffer) nor in shrink mode (masking Buffers)
        self.padded = (core.shrink is None and not core.local
                       and core.options.get("transport") in _PADDED_TRANSPORTS)
        #: the calls on an engine that takes tensors: torch on its device end to end
        self.device = DeviceLowLatency(core) if on_device(core) else None
        # get_next_low_latency_combine_buffer's tensors, by (local experts, slots, hidden)
        self.combine_staging: dict[tuple[int, int, int], torch.Tensor] = {}
        # the views of each padded Buffer (weakly: they go with the backend), and the last
        # one's (a decode loop's one shape)
        self._views: weakref.WeakKeyDictionary[Any, PaddedViews] = weakref.WeakKeyDictionary()
        self._last_views: tuple[weakref.ref[Any], weakref.ref[PaddedViews]] | None = None

    def close(self) -> None:
        """Drop the staging tensors (the facade's ``destroy``)."""
        self.combine_staging.clear()

    def dispatch(
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
        """``ubep.deep_ep.Buffer.low_latency_dispatch`` (its docstring says what it returns)."""
        check_device(x=x, topk_idx=topk_idx)
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
        if self.device is not None:
            return self.device.dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                self._num_local_experts(num_experts), cumulative_local_expert_recv_stats,
                use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
        idx_np = np.ascontiguousarray(to_numpy(topk_idx, argument="topk_idx"), dtype=np.int64)
        if use_fp8:
            block = FP8_BLOCK * (UE8M0_PACK if use_ue8m0 else 1)
            if hidden % block:
                raise InvalidArgumentError("x", hidden, f"hidden must be a multiple of {block}")
        if self.padded:
            # the dispatch's topk_idx, known by its memory where idx_np is a view of it
            ptr = topk_idx.data_ptr() if (topk_idx.dtype == torch.int64 and topk_idx.is_cpu
                                          and topk_idx.is_contiguous()) else None
            backend = self._backend("expert_padded", hidden, idx_np.shape[1], num_experts,
                                    x.dtype, num_max_dispatch_tokens_per_rank,
                                    **(_FP8_COMBINE if use_fp8 else {}),
                                    round_scale=round_scale if use_fp8 else False)
            return self._padded_dispatch(
                backend, to_numpy(x, argument="x"), idx_np, ptr,
                num_max_dispatch_tokens_per_rank, num_experts,
                cumulative_local_expert_recv_stats, use_fp8, use_ue8m0, async_finish,
                return_recv_hook)
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

    def decode_dispatch(
        self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: int, num_experts: int,
        stats: torch.Tensor | None, use_fp8: bool, round_scale: bool, use_ue8m0: bool,
    ) -> tuple[Any, torch.Tensor, LowLatencyHandle, EventOverlap, Callable[[], None] | None] | None:
        """A decode step's blocking dispatch on padded Buffers, recognised from the tensors'
        metadata alone: a CPU ``[num_tokens, hidden]`` ``x`` within
        ``num_max_dispatch_tokens_per_rank``, contiguous CPU int64 ``topk_idx`` of its token
        count, FP8 options DeepEP takes and a hidden size their blocks divide. Nothing here
        raises before the Buffer's call (whose errors reach every rank). ``None`` for anything
        else, which :meth:`dispatch`'s checks take (and name)."""
        if not (self.padded and type(x) is torch.Tensor and type(topk_idx) is torch.Tensor
                and topk_idx.dtype is torch.int64):
            return None
        # both tensors' memory in one native call: CPU tensors only (another device comes back
        # as it was); the ids' view must be contiguous (its memory is the dispatch's, which
        # the combine recognises)
        x_np, idx_np = storage_views(x, topk_idx)
        if type(x_np) is not np.ndarray or type(idx_np) is not np.ndarray or (
                not idx_np.flags.c_contiguous):
            return None
        shape = x_np.shape
        if len(shape) != 2 or idx_np.ndim != 2 or idx_np.shape[0] != shape[0] or (
                shape[0] > num_max_dispatch_tokens_per_rank) or (use_ue8m0 and not (
                    use_fp8 and round_scale)) or (use_fp8 and shape[1] % (
                        FP8_BLOCK * (UE8M0_PACK if use_ue8m0 else 1))):
            return None
        backend = self._cached("expert_padded", shape[1], idx_np.shape[1], num_experts,
                               x.dtype, num_max_dispatch_tokens_per_rank,
                               **(_FP8_COMBINE if use_fp8 else {}),
                               round_scale=round_scale if use_fp8 else False)
        if backend is None:  # its first call: the checked path makes the Buffer
            return None
        return self._padded_dispatch(
            backend, x_np, idx_np, topk_idx.data_ptr(), num_max_dispatch_tokens_per_rank,
            num_experts, stats, use_fp8, use_ue8m0, False, False)

    def _padded_views(self, backend: EPBackend) -> PaddedViews:
        """The views of ``backend``'s Buffer (made once; dropped with the backend)."""
        last = self._last_views
        if last is not None and last[0]() is backend:  # a decode loop's one shape
            views = last[1]()
            if views is not None:
                return views
        views = self._views.get(backend)
        if views is None:
            if not padded_capable(backend):
                raise UbepError("low_latency_dispatch: the Buffer's engine keeps no receive "
                                "region in host memory to view (transport "
                                f"{self.core.options.get('transport')!r})")
            views = self._views[backend] = PaddedViews(backend.buffer)  # type: ignore[attr-defined]
        # weakly: the views (and the mapping under them) go with the backend
        self._last_views = (weakref.ref(backend), weakref.ref(views))
        return views

    def _padded_dispatch(
        self, backend: Any, x_np: np.ndarray, idx_np: np.ndarray, idx_ptr: int | None,
        max_tokens: int, num_experts: int, stats: torch.Tensor | None, use_fp8: bool,
        use_ue8m0: bool, async_finish: bool, return_recv_hook: bool,
    ) -> tuple[Any, torch.Tensor, LowLatencyHandle, EventOverlap, Callable[[], None] | None]:
        """``low_latency_dispatch`` on ``backend``, a padded Buffer: the rows land at DeepEP's
        places and the returned tensors are views of the Buffer's receive region, known at the
        call (its dispatch index is), defined once the receive half ran (module docstring)."""
        split = async_finish or return_recv_hook
        num_local = self._num_local_experts(num_experts)  # M2N: 0 on a sender
        views = self._padded_views(backend)
        # Unit weights travel with the rows (the Buffer copies them into its handle);
        # low_latency_combine gets the real ones. The Buffer's own call: its results are numpy
        # arrays of host memory (padded_capable), read here as they are.
        call = backend.buffer.dispatch(x_np, idx_np, views.unit_weights(idx_np.shape),
                                       return_recv_hook=split)
        # the region its rows land in, known once issued (split: before they arrived)
        index = call.dispatch_index if split else call.handle.dispatch_index
        region = views.region(index, num_local, max_tokens * self.group_size, use_fp8,
                              use_ue8m0)
        handle = object.__new__(PaddedHandle)
        handle.__dict__.update(
            num_max_dispatch_tokens_per_rank=max_tokens, hidden=x_np.shape[1],
            num_experts=num_experts, inner=None, backend=backend, topk_idx=idx_np,
            counts=None, _views=views, _idx_ptr=idx_ptr)

        def finish() -> None:
            if handle.inner is not None:
                return
            res = call.hook() if split else call
            counts = res.num_recv_tokens_per_expert
            region.fill(counts)
            if stats is not None:
                stats.add_(region.recv_count)
            # set once here (the handle is frozen to its users, not to its maker)
            handle.__dict__.update(inner=res.handle, counts=counts)

        if not split:
            finish()
        return (region.recv_x, region.recv_count, handle, _event(async_finish, finish),
                finish if return_recv_hook else None)

    def _padded_combine(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
        handle: LowLatencyHandle, zero_copy: bool, async_finish: bool, return_recv_hook: bool,
        out: torch.Tensor | None,
    ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """``low_latency_combine`` on a padded Buffer: the engine reads the expert outputs at
        their padded places, from ``x`` itself or (``zero_copy``) from the combine region
        ``get_next_low_latency_combine_buffer`` viewed; nothing is packed."""
        inner = handle.inner
        split = async_finish or return_recv_hook
        idx, w = _combine_routing(topk_idx, topk_weights, handle, split)
        num_local = len(handle.counts)
        if zero_copy:
            rows = handle.__dict__["_views"].combine_buffer(handle, num_local, wait=False)[0]
        else:
            slots = handle.num_max_dispatch_tokens_per_rank * self.group_size
            if x.shape != (num_local, slots, handle.hidden):
                raise InvalidArgumentError(
                    "x", tuple(x.shape), f"must be [{num_local}, {slots}, {handle.hidden}]")
            if num_local * slots == inner.recv_src_rank.shape[0]:
                # the tensor as it is: the Buffer's torch door views it and hands y back as a
                # tensor (no conversion on either side)
                rows = x.reshape(-1, handle.hidden)
            else:  # M2N: a sender's engine rows
                given = to_numpy(x, argument="x").reshape(-1, handle.hidden)
                rows = np.empty((len(inner.recv_src_rank), handle.hidden), given.dtype)
                rows[: given.shape[0]] = given
        weighted = _weighted(inner, idx, w)
        buffer = handle.backend.buffer  # type: ignore[attr-defined]
        self._gate.combine_on(handle.backend)  # the next call: a combine there
        if not split:
            y = _tensor_of(buffer.combine(rows, weighted))
            if out is not None:
                out.copy_(y)
                y = out
            return y, _event(False), None
        call = buffer.combine(rows, weighted, return_recv_hook=True)
        y = out if out is not None else torch.empty((len(handle.topk_idx), handle.hidden),
                                                     dtype=_tensor_of(rows[:0]).dtype)
        filled: list[bool] = []

        def finish() -> None:
            if not filled:
                y.copy_(_tensor_of(call.hook()))
                filled.append(True)

        return y, _event(async_finish, finish), (finish if return_recv_hook else None)

    def decode_combine(self, x: Any, topk_idx: Any, topk_weights: Any,
                       handle: Any) -> torch.Tensor | None:
        """A decode step's blocking combine on a padded Buffer, recognised from the tensors'
        metadata alone: the handle of a received dispatch, the expert outputs as a CPU
        ``[num_local_experts, slots, hidden]`` tensor, the dispatch's own ``topk_idx`` tensor
        (its memory: -1 slots set in place are read there) and float32 weights of its shape,
        all contiguous. Nothing here raises before the Buffer's call (whose errors reach every
        rank). ``None`` for anything else, which :meth:`combine`'s checks take (and name)."""
        if type(handle) is not PaddedHandle or handle.inner is None:
            return None
        inner, idx = handle.inner, handle.topk_idx
        if not (type(x) is torch.Tensor and type(topk_idx) is torch.Tensor
                and type(topk_weights) is torch.Tensor
                and topk_idx.data_ptr() == handle.__dict__["_idx_ptr"]):
            return None
        # the three tensors' memory in one native call (CPU tensors only), their layouts read
        # there: the dispatch's ids are a contiguous int64 array at their address (a host
        # address: no device tensor has it), their memory as the dispatch read it
        x_np, ids, w_np = storage_views(x, topk_idx, topk_weights)
        if type(x_np) is not np.ndarray or type(ids) is not np.ndarray or (
                type(w_np) is not np.ndarray) or ids.dtype != _INT64 or (
                w_np.dtype != _FLOAT32) or ids.shape != idx.shape or (
                w_np.shape != idx.shape) or not (x_np.flags.c_contiguous
                                                 and ids.flags.c_contiguous
                                                 and w_np.flags.c_contiguous):
            return None
        rows = inner.recv_src_rank.shape[0]
        shape = x_np.shape
        if len(shape) != 3 or shape[0] * shape[1] != rows or shape[2] != handle.hidden or (
                shape[0] != len(handle.counts)) or (
                shape[1] != handle.num_max_dispatch_tokens_per_rank * self.group_size):
            return None  # M2N's senders' rows, or a shape the checks name
        routed = inner.topk_idx
        if _any_dropped(idx):
            routed = np.where(idx < 0, np.int64(-1), routed)
        buffer = handle.backend.buffer  # type: ignore[attr-defined]
        self._gate.combine_on(handle.backend)  # the next call: a combine there
        y = buffer.combine(x_np.reshape(rows, shape[2]), _weighted(inner, routed, w_np))
        return tensor_of_storage(y, x.dtype)

    def next_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The tensor ``low_latency_combine(..., zero_copy=True)`` reads the expert outputs from:
        ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]`` BF16, to
        fill in place. Not collective. That combine packs the valid rows straight into ubep's
        combine buffer in shared memory (``ubep.Buffer.get_combine_buffer``), which the reduce
        then reads without another copy; ``x`` is ignored, as DeepEP."""
        if not isinstance(handle, LowLatencyHandle):
            raise InvalidArgumentError(
                "handle", type(handle).__name__, "must come from low_latency_dispatch"
            )
        if type(handle) is PaddedHandle:
            _require_received(handle)
            views = handle.__dict__["_views"]
            return cast(torch.Tensor, views.combine_buffer(handle, len(handle.counts))[1])
        if type(handle) is DeviceHandle and self.device is not None:
            _require_received(handle)
            return self.device.next_combine_buffer(handle)
        key = self._staging_key(handle)
        if key not in self.combine_staging:
            self.combine_staging[key] = torch.zeros(key, dtype=torch.bfloat16)
        return self.combine_staging[key]

    def _staging_key(self, handle: LowLatencyHandle) -> tuple[int, int, int]:
        slots = handle.num_max_dispatch_tokens_per_rank * self.group_size
        return len(handle.counts), slots, handle.hidden

    def combine(
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
        _require_received(handle)
        _check_async(async_finish, return_recv_hook)
        check_device(x=x, topk_idx=topk_idx, topk_weights=topk_weights, out=out)
        if type(handle) is PaddedHandle:
            return self._padded_combine(x, topk_idx, topk_weights, handle, zero_copy,
                                        async_finish, return_recv_hook, out)
        if type(handle) is DeviceHandle and self.device is not None:
            return self.device.combine(x, topk_idx, topk_weights, handle, zero_copy,
                                       async_finish, return_recv_hook, out)
        idx = to_numpy(topk_idx, argument="topk_idx")
        if idx.shape != handle.topk_idx.shape or not np.all((idx == handle.topk_idx) | (idx == -1)):
            raise InvalidArgumentError(
                "topk_idx", tuple(idx.shape), "must be the dispatch's topk_idx (-1 drops a slot)"
            )
        w = np.ascontiguousarray(to_numpy(topk_weights.float(), argument="topk_weights"))
        w = np.where(idx == -1, np.float32(0), w).astype(np.float32)
        source = x
        if zero_copy:
            staging = self.combine_staging.get(self._staging_key(handle))
            if staging is None:
                raise InvalidArgumentError(
                    "zero_copy", True, "fill get_next_low_latency_combine_buffer(handle) first"
                )
            source = staging
        rows = combine_input(handle, source)
        split = (async_finish or return_recv_hook) and getattr(handle.backend, "can_split", True)
        if self.core.shrink is None:
            self._gate.combine_on(handle.backend)  # the next call: a combine there
        call = self.core.collective(
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




_INT64, _FLOAT32 = np.dtype(np.int64), np.dtype(np.float32)

# a quantising Buffer's options (DeepEP's FP8 dispatch, BF16 combine), with round_scale
_FP8_COMBINE: dict[str, Any] = {"combine_dtype": torch.bfloat16, "quant": "e4m3"}

# the engines whose receive regions are host memory a view wraps (padded_capable); None: the
# group's own (shm on one host, mpi across hosts)
_PADDED_TRANSPORTS = (None, "shm", "mpi")


def _combine_routing(topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                     handle: LowLatencyHandle, copy: bool) -> tuple[np.ndarray, np.ndarray]:
    """Combine's ``topk_idx`` and float32 weights for the engine's handle: ``topk_idx`` must be
    the dispatch's but for slots set to -1, which the engine drops (its own ids, the slots the
    Buffer routed each pick to, with -1 there: it reads no row for a -1, so no weight multiplies
    anything). ``copy``: owned weights (a split call reads them in its hook)."""
    dispatched = handle.topk_idx
    same = (type(topk_idx) is torch.Tensor
            and topk_idx.data_ptr() == handle.__dict__.get("_idx_ptr")
            and topk_idx.shape == dispatched.shape and topk_idx.dtype is torch.int64)
    idx = topk_idx.numpy() if same and topk_idx.is_contiguous() else to_numpy(
        topk_idx, argument="topk_idx")
    # the dispatch's tensor (its memory) holds the same ids but for the -1 slots; another
    # tensor is compared
    if not same and (idx.shape != dispatched.shape
                     or not np.all((idx == dispatched) | (idx == -1))):
        raise InvalidArgumentError(
            "topk_idx", tuple(idx.shape), "must be the dispatch's topk_idx (-1 drops a slot)")
    w = to_numpy(topk_weights if topk_weights.dtype is torch.float32 else topk_weights.float(),
                 argument="topk_weights")
    if w.shape != idx.shape:
        raise InvalidArgumentError("topk_weights", tuple(w.shape), f"must be {idx.shape}")
    routed = handle.inner.topk_idx
    if _any_dropped(idx):
        routed = np.where(idx < 0, np.int64(-1), routed)
    return routed, (w.copy() if copy else w)


def _any_dropped(idx: np.ndarray) -> bool:
    """Whether a slot of ``idx`` is negative: one native scan where the build has it."""
    native = native_or_none()
    if native is not None and idx.dtype == np.int64 and idx.flags.c_contiguous:
        return bool(native.any_negative(idx))
    return bool((idx < 0).any())


def _weighted(inner: Any, idx: np.ndarray, w: np.ndarray) -> Any:
    """The caller's routing (its -1 slots) and weights in a copy of the dispatch's handle
    ``inner`` (built as the engine builds it: its other fields are the engine's own, checked
    when it was made)."""
    weighted = object.__new__(type(inner))
    fields = weighted.__dict__
    fields.update(inner.__dict__)
    fields["topk_idx"], fields["topk_weights"] = idx, w
    return weighted


def _require_received(handle: LowLatencyHandle) -> None:
    if handle.inner is None:
        raise InvalidArgumentError(
            "handle", "pending", "its dispatch has not received yet: call the dispatch's "
            "hook() (or its event's current_stream_wait()) first"
        )


def _check_async(async_finish: bool, return_recv_hook: bool) -> None:
    if async_finish and return_recv_hook:
        raise InvalidArgumentError(
            "async_finish", True, "cannot be combined with return_recv_hook (as DeepEP)"
        )
