"""DeepEP's calls on an engine that takes tensors (``transport="triton"``): the caller's tensors
go to the engine as they are and its results, tensors of its device, come back as DeepEP's
tensors made there, with no numpy on the way (a GPU's rows never visit the host).

The host engines' paths (:mod:`.deep_ep_lowlatency`, ``Backends.send``) pack and unpack with
numpy over host memory; on a device the same packing is torch on the engine's device:

* the low-latency pair (:class:`DeviceLowLatency`): the engine packs each local expert's rows
  after the previous expert's (``layout="expert"``); DeepEP's ``[num_local_experts, slots,
  hidden]`` tensors are filled by one ``index_copy_`` at the places the counts give
  (:func:`packed_places`), which the handle keeps, as a device tensor, for the combine's
  ``index_select``;
* FP8 rows (``x=(values, scales)``, and the low-latency dispatch's ``use_fp8``, quantised on
  the device by :func:`quantize_on_device`): the engine moves unquantised payloads, so values
  (their bytes) and float32 scales take one dispatch each, on two Buffers of the same routing;
* a cached normal dispatch (:func:`cached_rows`): the rows follow the handle's routing, as
  they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ..modes import Layout
from ..quant import AMAX_FLOOR, FORMATS
from ._convert import BITS_OF_SIZE, TORCH_OF, padded_rows
from ._runtime import host_bookkeeping
from .deep_ep_types import EventOverlap, LowLatencyHandle, _event
from .fp8 import FP8_BLOCK, UE8M0_PACK, pack_ue8m0

if TYPE_CHECKING:
    from .deep_ep_core import FacadeCore

__all__ = ["DeviceHandle", "DeviceLowLatency", "cached_rows", "fp8_rows", "on_device",
            "packed_places", "quantize_on_device", "received_pair", "routed_fp8"]

#: the transports whose engine takes the caller's tensors on its device
DEVICE_TRANSPORTS = ("triton",)
_E4M3_MAX = FORMATS["e4m3"].qmax  # the largest e4m3 value


def on_device(core: FacadeCore) -> bool:
    """Whether a facade's calls run on an engine that takes tensors (its ``transport``; not
    the in-process world, nor shrink mode's masking Buffers)."""
    return (core.options.get("transport") in DEVICE_TRANSPORTS and core.shrink is None
            and not core.local)


def _dispatched(backend: Any, x: torch.Tensor, idx: Any, w: Any, split: bool) -> Any:
    """The Buffer's dispatch of ``x`` as it is (a ``PendingCall`` with ``split``)."""
    return backend.buffer.dispatch(x, idx, w, return_recv_hook=split)


def _result(call: Any, split: bool) -> Any:
    return call.hook() if split else call


# --------------------------------------------------------------------------- normal mode
def cached_rows(core: FacadeCore, x: torch.Tensor, scales: torch.Tensor | None,
                handle: Any, max_tokens: int) -> Any:
    """A cached normal dispatch's ``recv_x`` (``(values, scales)`` for FP8): ``x`` sent along
    the handle's routing, the engine's rows (fresh tensors of its device) padded to the
    handle's ``num_out_rows``."""
    idx = handle.topk_idx
    zeros = np.zeros(idx.shape, np.float32)
    if scales is not None:
        res, recv_scales = fp8_rows(core, "rank", x, scales, idx, zeros, handle.num_experts,
                                    max_tokens, False)[0]()
        return _padded_pair(res.recv_x, recv_scales, x.dtype, handle.num_out_rows)
    backend = core.backends.get("rank", x.shape[1], idx.shape[1], handle.num_experts, x.dtype,
                                max_tokens)
    recv = _dispatched(backend, x, idx, zeros, False).recv_x
    return recv if recv.shape[0] == handle.num_out_rows else padded_rows(
        recv, handle.num_out_rows)


def fp8_rows(core: FacadeCore, layout: Layout, values: torch.Tensor, scales: torch.Tensor,
             idx: Any, w: Any, num_experts: int, max_tokens: int,
             split: bool) -> tuple[Callable[[], tuple[Any, torch.Tensor]], Any]:
    """FP8 ``values`` and their float32 ``scales`` dispatched along one routing: the values'
    bytes on a 1-byte Buffer (which combines in BF16, as a quantising one), the scales on a
    float32 Buffer of ``hidden // 128`` columns; each goes to its engine as the tensor it is.
    Returns ``receive`` (the values' result, its handle the combine's, and the received
    scales) and the values' backend (the handle's)."""
    backends = core.backends
    k = idx.shape[1]
    rows = backends.get(layout, values.shape[1], k, num_experts, torch.uint8, max_tokens,
                        combine_dtype=torch.bfloat16)
    first = _dispatched(rows, values, idx, w, split)
    scale_rows = backends.get(layout, scales.shape[1], k, num_experts, torch.float32,
                              max_tokens)
    f32 = scales if scales.dtype is torch.float32 else scales.float()
    second = _dispatched(scale_rows, f32.contiguous(), idx, w, split)
    return (lambda: (_result(first, split), _result(second, split).recv_x)), rows


def routed_fp8(core: FacadeCore, values: torch.Tensor, scales: torch.Tensor, route: Any,
               max_tokens: int) -> tuple[Any, tuple[torch.Tensor, torch.Tensor], Any]:
    """A normal FP8 dispatch (``x=(values, scales)``) along ``route`` (the facade's
    ``_Route``): the values' result with its routing on the host
    (:func:`host_bookkeeping`), the received values and scales (the engine's tensors), and
    the backend the values went through."""
    receive, backend = fp8_rows(core, "rank", values, scales, route.topk_idx,
                                route.topk_weights, route.num_experts, max_tokens, False)
    res, recv_scales = receive()
    return host_bookkeeping(res), (res.recv_x, recv_scales), backend


def _padded_pair(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                 rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    def pad(t: torch.Tensor) -> torch.Tensor:
        return t if t.shape[0] == rows else padded_rows(t, rows)

    return pad(values).view(dtype), pad(scales)


def received_pair(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                  rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A normal FP8 dispatch's ``recv_x``: the received values as ``dtype`` and their scales,
    ``rows`` rows each (zeros after the received ones)."""
    return _padded_pair(values, scales, dtype, rows)


# --------------------------------------------------------------------------- FP8 casts
def quantize_on_device(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ubep.quant.quantize`'s e4m3 cast in torch, on ``x``'s device: per token and
    128-channel block, ``scale = max(amax, 1e-4) / 448`` in float32 (with ``round_scale`` the
    power of two at or above it), ``values = x / scale`` rounded to e4m3 (never above 448 in
    magnitude, so no saturation). Returns the values (float8_e4m3fn) and the float32 scales
    ``[num_tokens, hidden // 128]``."""
    t, h = x.shape
    blocks = x.float().reshape(t, h // FP8_BLOCK, FP8_BLOCK)
    scale = blocks.abs().amax(dim=-1).clamp(min=float(AMAX_FLOOR)) / _E4M3_MAX
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    values = (blocks / scale[..., None]).to(torch.float8_e4m3fn).reshape(t, h)
    return values, scale


# --------------------------------------------------------------------------- low-latency
def packed_places(counts: torch.Tensor, rows: int, slots: int) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """Where each of ``rows`` expert-major rows (``counts[e]`` of local expert ``e``, in
    order) sits in DeepEP's packed ``[num_local_experts * slots]`` rows, and its expert: both
    ``[rows]`` int64 on ``counts``' device, computed there (no count is read back)."""
    ends = counts.cumsum(0)
    row = torch.arange(rows, dtype=torch.int64, device=counts.device)
    expert = torch.searchsorted(ends, row, right=True)
    return expert * slots + row - (ends - counts)[expert], expert


@dataclass(frozen=True, eq=False)
class DeviceHandle(LowLatencyHandle):
    """A low-latency handle of a device dispatch: ``counts`` and ``topk_idx`` are tensors of
    the engine's device, and ``places`` (set once the rows arrived) the packed place of each
    received row (:func:`packed_places`), which the combine gathers its rows from."""

    places: Any = field(default=None, repr=False)


class _Outputs:
    """The tensors a device low-latency dispatch hands out before its rows arrive, on the
    engine's device, filled in place by :meth:`fill` (as ``LowLatencyOutputs`` on the host)."""

    def __init__(self, num_local: int, slots: int, hidden: int, num_ranks: int,
                 dtype: torch.dtype, use_fp8: bool, use_ue8m0: bool,
                 device: torch.device) -> None:
        self.num_local, self.slots, self.num_ranks = num_local, slots, num_ranks
        self.rows = torch.zeros((num_local, slots, hidden), dtype=dtype, device=device)
        self.scales: torch.Tensor | None = None
        self.use_ue8m0 = use_ue8m0
        if use_fp8:
            width = hidden // FP8_BLOCK // (UE8M0_PACK if use_ue8m0 else 1)
            self.scales = torch.zeros((num_local, slots, width), device=device,
                                      dtype=torch.int32 if use_ue8m0 else torch.float32)
        self.recv_count = torch.zeros(num_local, dtype=torch.int32, device=device)
        self.src_info = torch.full((num_local, slots), -1, dtype=torch.int32, device=device)
        self.layout_range = torch.zeros((num_local, num_ranks), dtype=torch.int64,
                                        device=device)

    @property
    def recv_x(self) -> Any:
        return self.rows if self.scales is None else (self.rows, self.scales)

    def fill(self, res: Any, recv_scales: torch.Tensor | None, counts: torch.Tensor
             ) -> torch.Tensor:
        """The engine's expert-major rows (``res``) at their packed places; returns the
        places."""
        n = int(res.recv_x.shape[0])  # the tensor's size: metadata, no read of the device
        places, expert = packed_places(counts, n, self.slots)
        flat = self.rows.view(-1, self.rows.shape[2])
        bits = BITS_OF_SIZE[flat.element_size()]
        flat.view(bits).index_copy_(0, places, res.recv_x.view(bits))
        if self.scales is not None:
            assert recv_scales is not None
            width = recv_scales.shape[1]
            scales = torch.zeros((self.num_local * self.slots, width), dtype=torch.float32,
                                 device=recv_scales.device).index_copy_(0, places, recv_scales)
            if self.use_ue8m0:
                scales = pack_ue8m0(scales)
            self.scales.view(-1, self.scales.shape[2]).copy_(scales)
        self.recv_count.copy_(counts)
        self.src_info.view(-1).index_copy_(0, places, res.recv_src_token.to(torch.int32))
        per_src = torch.zeros((self.num_local, self.num_ranks), dtype=torch.int64,
                              device=counts.device)
        per_src.index_put_((expert, res.recv_src_rank.to(torch.int64)),
                           torch.ones(n, dtype=torch.int64, device=counts.device),
                           accumulate=True)
        self.layout_range.copy_(((per_src.cumsum(1) - per_src) << 32) | per_src)
        return places


class DeviceLowLatency:
    """DeepEP's low-latency pair on an engine that takes tensors (module docstring), for the
    facade's ``LowLatencyPath``: its Buffers of ``layout="expert"`` through the facade's
    core."""

    def __init__(self, core: FacadeCore) -> None:
        self.core = core
        # get_next_low_latency_combine_buffer's tensors, by (local experts, slots, hidden)
        self.staging: dict[tuple[int, int, int], torch.Tensor] = {}

    def next_combine_buffer(self, handle: DeviceHandle) -> torch.Tensor:
        """``get_next_low_latency_combine_buffer``: a BF16 tensor on the engine's device,
        one per shape, which a zero-copy combine gathers its rows from."""
        key = self._staging_key(handle)
        got = self.staging.get(key)
        if got is None:
            got = self.staging[key] = torch.zeros(key, dtype=torch.bfloat16,
                                                  device=handle.places.device)
        return got

    def _staging_key(self, handle: DeviceHandle) -> tuple[int, int, int]:
        slots = handle.num_max_dispatch_tokens_per_rank * self.core.group_size
        return len(handle.counts), slots, handle.hidden

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, max_tokens: int,
                 num_experts: int, num_local: int, stats: torch.Tensor | None, use_fp8: bool,
                 round_scale: bool, use_ue8m0: bool, async_finish: bool,
                 return_recv_hook: bool
                 ) -> tuple[Any, torch.Tensor, LowLatencyHandle, EventOverlap,
                            Callable[[], None] | None]:
        """``low_latency_dispatch`` (checked by the caller): ``x`` (or, with ``use_fp8``, its
        e4m3 values and scales cast on the device) and ``topk_idx`` go to the engine as
        tensors; the outputs are made on ``x``'s device and filled once the rows arrived."""
        if use_fp8 and x.shape[1] % (FP8_BLOCK * (UE8M0_PACK if use_ue8m0 else 1)):
            raise InvalidArgumentError("x", x.shape[1], "hidden must be a multiple of "
                                       f"{FP8_BLOCK * (UE8M0_PACK if use_ue8m0 else 1)}")
        split = async_finish or return_recv_hook
        group_size = self.core.group_size
        idx = topk_idx.to(torch.int64)
        ones = torch.ones(idx.shape, dtype=torch.float32, device=x.device)
        if use_fp8:
            values, scales = quantize_on_device(x, round_scale)
            receive, backend = fp8_rows(self.core, "expert", values, scales, idx, ones,
                                        num_experts, max_tokens, split)
        else:
            backend = self.core.backends.get("expert", x.shape[1], idx.shape[1], num_experts,
                                             x.dtype, max_tokens)
            call = _dispatched(backend, x.contiguous(), idx, ones, split)
            receive = lambda: (_result(call, split), None)  # noqa: E731
        slots = max_tokens * group_size
        out = _Outputs(num_local, slots, x.shape[1], group_size,
                       torch.float8_e4m3fn if use_fp8 else x.dtype, use_fp8, use_ue8m0,
                       x.device)
        handle = DeviceHandle(
            src_info=out.src_info, layout_range=out.layout_range,
            num_max_dispatch_tokens_per_rank=max_tokens, hidden=x.shape[1],
            num_experts=num_experts, inner=None, backend=backend,
            counts=cast(Any, torch.zeros(num_local, dtype=torch.int64, device=x.device)),
            topk_idx=cast(Any, idx))

        def finish() -> None:
            if handle.inner is not None:
                return
            res, recv_scales = receive()
            counts = res.num_recv_tokens_per_expert.to(torch.int64)
            places = out.fill(res, recv_scales, counts)
            if stats is not None:
                stats.add_(counts.to(stats.dtype))
            cast(torch.Tensor, handle.counts).copy_(counts)
            # the handle was handed out before the rows arrived: set once here (frozen to
            # its users, not to its maker)
            object.__setattr__(handle, "places", places)
            object.__setattr__(handle, "inner", res.handle)

        if not split:
            finish()
        return (out.recv_x, out.recv_count, handle, _event(async_finish, finish),
                finish if return_recv_hook else None)

    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                handle: DeviceHandle, zero_copy: bool, async_finish: bool,
                return_recv_hook: bool, out: torch.Tensor | None
                ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """``low_latency_combine`` of the expert outputs ``[num_local_experts, slots,
        hidden]`` (``x``, or with ``zero_copy`` :meth:`next_combine_buffer`'s): the received
        rows gathered at the handle's places on the device, reduced with the caller's weights
        (a -1 slot of ``topk_idx`` dropped: the engine reads no row for it)."""
        source = x
        if zero_copy:
            staged = self.staging.get(self._staging_key(handle))
            if staged is None:
                raise InvalidArgumentError(
                    "zero_copy", True, "fill get_next_low_latency_combine_buffer(handle) first")
            source = staged
        inner = handle.inner
        num_local = len(handle.counts)
        slots = handle.num_max_dispatch_tokens_per_rank * self.core.group_size
        if tuple(source.shape) != (num_local, slots, handle.hidden):
            raise InvalidArgumentError(
                "x", tuple(source.shape), f"must be [{num_local}, {slots}, {handle.hidden}]")
        cfg = handle.backend.buffer.config  # type: ignore[attr-defined]
        # the Buffer's combine dtype (its combine_dtype, else its dtype): the expert outputs'
        want = TORCH_OF.get(str(cfg.combine_dtype or cfg.dtype))
        if source.dtype != want:
            raise InvalidArgumentError("x", source.dtype, f"must be {want} (the combine dtype)")
        dispatched = cast(torch.Tensor, handle.topk_idx)
        idx = topk_idx.to(device=dispatched.device)
        if idx.shape != dispatched.shape or not bool(((idx == dispatched) | (idx == -1)).all()):
            raise InvalidArgumentError(
                "topk_idx", tuple(idx.shape), "must be the dispatch's topk_idx (-1 drops a slot)")
        w = topk_weights.to(device=dispatched.device, dtype=torch.float32)
        if w.shape != idx.shape:
            raise InvalidArgumentError("topk_weights", tuple(w.shape), f"must be {idx.shape}")
        rows = source.reshape(num_local * slots, handle.hidden).index_select(0, handle.places)
        weighted = _weighted(inner, torch.where(idx < 0, -1, inner.topk_idx),
                             torch.where(idx < 0, 0.0, w).contiguous())
        self.core.gate.combine_on(handle.backend)  # the next call: a combine there
        buffer = handle.backend.buffer  # type: ignore[attr-defined]
        split = async_finish or return_recv_hook
        if not split:
            y = buffer.combine(rows, weighted)
            if out is not None:
                out.copy_(y)
                y = out
            return y, _event(False), None
        call = buffer.combine(rows, weighted, return_recv_hook=True)
        y = out if out is not None else torch.empty((idx.shape[0], handle.hidden),
                                                     dtype=source.dtype, device=source.device)
        filled: list[bool] = []

        def finish() -> None:
            if not filled:
                y.copy_(call.hook())
                filled.append(True)

        return y, _event(async_finish, finish), (finish if return_recv_hook else None)


def _weighted(inner: Any, idx: torch.Tensor, w: torch.Tensor) -> Any:
    """A copy of the dispatch's handle ``inner`` with the combine's routing and weights (its
    other fields are the engine's own, checked when it was made)."""
    weighted = object.__new__(type(inner))
    weighted.__dict__.update(inner.__dict__)
    weighted.__dict__["topk_idx"], weighted.__dict__["topk_weights"] = idx, w
    return weighted
