"""A DeepEP-shaped facade over ubep: port DeepEP code by changing the import and constructor.

::

    # before                                   # after
    from deep_ep import Buffer                 from ubep.deep_ep import Buffer
    buf = Buffer(group, num_nvl_bytes, ...)    buf = Buffer(ubep_group, num_nvl_bytes, ...,
                                                            max_tokens_per_rank=4096)

Method names, argument names and order, defaults and the order of returned tuples follow
``deep_ep/buffer.py`` (DeepEP v1 API). Normal-mode ``dispatch``/``combine`` run on a ubep buffer
with ``layout="rank"`` (one row per (token, destination rank), DeepEP's normal mode); the
low-latency pair on ``layout="expert"`` (one row per (token, expert), packed per local expert).
Everything is synchronous on CPU tensors, so events are no-ops and hooks return immediately.
docs/PORTING.md lists every difference.

The group is a ubep process group (``ubep.launch`` gives one to each rank) or, for tests, a
:class:`ubep.torch.LocalBackend` (threads as ranks). ubep buffers are created on first use per
(mode, hidden, top-k, experts, dtype); that first call is collective, as every call is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import InvalidArgumentError
from .routing import get_dispatch_layout as _layout
from .torch._convert import from_numpy, to_numpy
from .torch.backend import EPBackend, LocalBackend

__all__ = ["Buffer", "Config", "EventOverlap", "LowLatencyHandle", "NormalHandle"]

_FP8_BLOCK = 128  # channels per FP8 scale, as DeepEP
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


class EventOverlap:
    """DeepEP's event wrapper. ubep calls complete before they return, so it is a no-op."""

    def __init__(self, event: Any = None, extra_tensors: Any = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Nothing to wait for."""

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@dataclass(frozen=True)
class Config:
    """DeepEP's performance-tuning config: accepted for compatibility, ignored by ubep."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 128


@dataclass(frozen=True)
class NormalHandle:
    """Normal-mode handle (DeepEP: a positional tuple; here a frozen dataclass, opaque)."""

    inner: Any  # the ubep handle
    backend: Any  # the ubep buffer the rows went through (combine goes back through it)
    topk_idx: np.ndarray  # [num_tokens, num_topk] this rank's routing
    num_recv_rows: int  # rows actually received
    num_out_rows: int  # rows handed out (>= num_recv_rows with num_worst_tokens)
    recv_src_rank: np.ndarray
    recv_src_token: np.ndarray
    num_tokens: int
    num_experts: int
    x_dtype: torch.dtype


@dataclass(frozen=True)
class LowLatencyHandle:
    """Low-latency handle: where each packed row came from, and how to pack and unpack."""

    inner: Any
    backend: Any
    counts: np.ndarray  # [num_local_experts] rows per local expert
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_tokens: int


def _quantize_fp8(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-channel FP8 (e4m3) quantisation, as DeepEP's low-latency dispatch:
    ``scale = amax / 448`` (rounded up to a power of two with ``round_scale``). Returns the values
    ``[num_tokens, hidden]`` float8_e4m3fn and the scales ``[num_tokens, hidden // 128]``
    float32."""
    num_tokens, hidden = x.shape
    blocks = x.to(torch.float32).reshape(num_tokens, hidden // _FP8_BLOCK, _FP8_BLOCK)
    scale = blocks.abs().amax(dim=-1).clamp(min=1e-4) / _FP8_MAX
    if round_scale:  # UE8M0-style: scales are powers of two
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale[..., None]).to(torch.float8_e4m3fn).reshape(num_tokens, hidden)
    return q, scale.contiguous()


class Buffer:
    """DeepEP's ``Buffer`` on ubep (see the module docstring and docs/PORTING.md).

    Arguments as DeepEP's; ``num_nvl_bytes``/``num_rdma_bytes``/``num_qps_per_rank``/
    ``allow_*`` are accepted and ignored (ubep sizes its shared memory from the shapes). ubep's
    own keyword-only options: ``max_tokens_per_rank`` (normal-mode capacity per rank; the
    low-latency pair uses its ``num_max_dispatch_tokens_per_rank``) and any ``ubep.BufferConfig``
    field (``engine``, ``sync``, ...).
    """

    num_sms: int = 20

    def __init__(
        self,
        group: Any,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        comm: Any = None,
        *,
        max_tokens_per_rank: int = 4096,
        **ubep_options: Any,
    ) -> None:
        if group is None:
            group = comm
        if group is None:
            raise InvalidArgumentError("group", None, "a ubep group (or LocalBackend) is needed")
        self.group = group
        self.rank = int(group.rank)
        self.group_size = int(group.num_ranks)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.max_tokens_per_rank = max_tokens_per_rank
        self.ubep_options = ubep_options
        self._backends: dict[tuple[Any, ...], EPBackend] = {}
        self._destroyed = False

    # ------------------------------------------------------------------ static helpers
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Kept for compatibility (ubep's cores are threads; see ``BufferConfig``)."""
        if new_num_sms % 2:
            raise InvalidArgumentError("new_num_sms", new_num_sms, "must be even")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Bytes of receive rows a rank may need in low-latency mode (BF16, all tokens to it)."""
        return int(num_max_dispatch_tokens_per_rank * num_ranks * hidden * 2 * 2)

    def destroy(self) -> None:
        if not self.explicitly_destroy:
            raise InvalidArgumentError("explicitly_destroy", False, "must be set to call destroy()")
        for backend in self._backends.values():
            close = getattr(backend, "close", None)
            if close is not None:
                close()
        self._backends.clear()
        self._destroyed = True

    def clean_low_latency_buffer(
        self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int
    ) -> None:
        """No-op: every ubep flag carries the call's epoch, so buffers never need cleaning."""

    def get_local_buffer_tensor(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("ubep does not expose its raw buffer (see docs/PORTING.md)")

    # ------------------------------------------------------------------ internals
    def _backend(
        self,
        layout: str,
        hidden: int,
        num_topk: int,
        num_experts: int,
        dtype: torch.dtype,
        max_tokens: int,
        combine_dtype: torch.dtype | None = None,
    ) -> EPBackend:
        if self._destroyed:
            raise InvalidArgumentError("self", "destroyed", "this Buffer was destroyed")
        if isinstance(self.group, LocalBackend):
            return self.group.with_layout(layout)
        key = (layout, hidden, num_topk, num_experts, dtype, max_tokens, combine_dtype)
        if key not in self._backends:
            from .torch._runtime import make_backend, ubep_dtype_name

            options = dict(self.ubep_options)
            if combine_dtype is not None:
                options["combine_dtype"] = ubep_dtype_name(combine_dtype)
            if dtype in (torch.uint8, torch.int8) and options.get("sync", "sp") == "sp":
                # FP8 rows have no free bit pattern for SP's sentinel: use token-flag fusion.
                options["sync"] = "tff"

            self._backends[key] = make_backend(
                self.group,
                hidden=hidden,
                num_topk=num_topk,
                num_experts=num_experts,
                dtype=dtype,
                max_tokens_per_rank=max_tokens,
                layout=layout,
                **options,
            )
        return self._backends[key]

    def _send(
        self,
        layout: str,
        x: torch.Tensor,
        scales: torch.Tensor | None,
        idx: np.ndarray,
        w: np.ndarray,
        num_experts: int,
        max_tokens: int,
    ) -> tuple[Any, EPBackend, np.ndarray | None]:
        """Dispatch ``x`` (and FP8 ``scales``); returns the result of the rows' dispatch, the
        backend they went through and the received scales (or None).

        FP8 values travel as bytes on a buffer whose combine takes BF16 (DeepEP's FP8 dispatch /
        BF16 combine); the scales take a second, narrow dispatch along the same routing, which
        delivers them in the same row order (dispatch is deterministic).
        """
        if scales is None:
            backend = self._backend(
                layout, x.shape[1], idx.shape[1], num_experts, x.dtype, max_tokens
            )
            return backend.dispatch(to_numpy(x), idx, w), backend, None
        values = x.contiguous().view(torch.uint8)
        backend = self._backend(
            layout,
            x.shape[1],
            idx.shape[1],
            num_experts,
            torch.uint8,
            max_tokens,
            combine_dtype=torch.bfloat16,
        )
        res = backend.dispatch(to_numpy(values), idx, w)
        sb = self._backend(
            layout, scales.shape[1], idx.shape[1], num_experts, torch.float32, max_tokens
        )
        res_s = sb.dispatch(to_numpy(scales.to(torch.float32).contiguous()), idx, w)
        return res, backend, np.array(res_s.recv_x)

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, EventOverlap]:
        """``(num_tokens_per_rank, num_tokens_per_rdma_rank=None, num_tokens_per_expert,
        is_token_in_rank, event)``; counts are int32 like DeepEP's."""
        lay = _layout(to_numpy(topk_idx, argument="topk_idx"), num_experts, self.group_size)
        return (
            torch.from_numpy(lay.num_tokens_per_rank.astype(np.int32)),
            None,
            torch.from_numpy(lay.num_tokens_per_expert.astype(np.int32)),
            torch.from_numpy(lay.is_token_in_rank),
            EventOverlap(),
        )

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: NormalHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, list[int] | None, Any, EventOverlap]:
        """Normal-mode dispatch: ``(recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event)``; with ``handle`` given (cached mode,
        e.g. the backward of combine) only ``recv_x`` is returned, the rest is None."""
        scales: torch.Tensor | None = None
        if isinstance(x, tuple):
            x, scales = x
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise InvalidArgumentError("handle", "given", "cached dispatch takes no topk_idx")
            idx_np = handle.topk_idx
            w_np = np.zeros(idx_np.shape, dtype=np.float32)
        else:
            if topk_idx is None or topk_weights is None:
                raise InvalidArgumentError(
                    "topk_idx", None, "needed (with topk_weights) unless handle is given"
                )
            idx_np = np.ascontiguousarray(to_numpy(topk_idx, argument="topk_idx"), dtype=np.int64)
            w_np = np.ascontiguousarray(to_numpy(topk_weights.float(), argument="topk_weights"))
            self._check_layout(idx_np, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert)
        num_experts = self._num_experts(num_tokens_per_expert, handle)
        res, backend, recv_scales = self._send(
            "rank", x, scales, idx_np, w_np, num_experts, self.max_tokens_per_rank
        )
        rows = len(res.recv_src_rank)
        out_rows = max(rows, num_worst_tokens)
        recv_rows = _padded(
            from_numpy(res.recv_x, torch.uint8 if scales is not None else x.dtype), out_rows
        )
        recv: Any = recv_rows
        if scales is not None:
            assert recv_scales is not None
            recv = (recv_rows.view(x.dtype), _padded(torch.from_numpy(recv_scales), out_rows))
        if handle is not None:
            return recv, None, None, None, None, EventOverlap()
        recv_idx = np.full((out_rows, idx_np.shape[1]), -1, dtype=np.int64)
        recv_idx[:rows] = res.recv_topk_idx
        recv_w = np.zeros((out_rows, idx_np.shape[1]), dtype=np.float32)
        recv_w[:rows] = res.recv_topk_weights
        counts = [int(c) for c in np.asarray(res.num_recv_tokens_per_expert)]
        if expert_alignment > 1:
            counts = [math.ceil(c / expert_alignment) * expert_alignment for c in counts]
        new_handle = NormalHandle(
            inner=res.handle,
            backend=backend,
            topk_idx=idx_np,
            num_recv_rows=rows,
            num_out_rows=out_rows,
            recv_src_rank=np.asarray(res.recv_src_rank),
            recv_src_token=np.asarray(res.recv_src_token),
            num_tokens=idx_np.shape[0],
            num_experts=num_experts,
            x_dtype=x.dtype,
        )
        return (
            recv,
            torch.from_numpy(recv_idx),
            torch.from_numpy(recv_w),
            counts,
            new_handle,
            EventOverlap(),
        )

    def combine(
        self,
        x: torch.Tensor,
        handle: NormalHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Normal-mode combine (sum without weights): ``(combined_x, combined_topk_weights,
        event)``; ``topk_weights [rows, num_topk]`` are summed the same way (float32)."""
        if not isinstance(handle, NormalHandle):
            raise InvalidArgumentError("handle", type(handle).__name__, "must come from dispatch")
        if x.shape[0] != handle.num_out_rows:
            raise InvalidArgumentError("x", tuple(x.shape), f"needs {handle.num_out_rows} rows")
        rows = x[: handle.num_recv_rows].contiguous()
        backend = handle.backend
        y = from_numpy(np.array(backend.combine(to_numpy(rows), handle.inner)), x.dtype)
        combined_w = None
        if topk_weights is not None:
            combined_w = self._combine_small(backend, topk_weights[: handle.num_recv_rows], handle)
        if bias is not None:
            for b in bias if isinstance(bias, tuple) else (bias,):
                y = (y.float() + b.float()).to(x.dtype)
        return y, combined_w, EventOverlap()

    def _combine_small(
        self, backend: EPBackend, values: torch.Tensor, handle: NormalHandle
    ) -> torch.Tensor:
        # Per-row metadata ([rows, num_topk] float32) is tiny: gather it everywhere and let each
        # source add up the rows that came from it, in ascending destination rank (float32).
        gather: Callable[[Any], list[Any]] = backend.allgather  # type: ignore[attr-defined]
        # Plain lists: the runtime group's allgather carries JSON. float32 -> float (double) ->
        # float32 is exact, so the sum below sees the very values the receivers held.
        everyone = gather(
            [
                handle.recv_src_rank.tolist(),
                handle.recv_src_token.tolist(),
                values.detach().float().tolist(),
            ]
        )
        acc = np.zeros((handle.num_tokens, values.shape[1]), dtype=np.float32)
        for src_rank, src_token, vals in everyone:
            mine = np.asarray(src_rank, dtype=np.int64) == self.rank
            rows = np.asarray(vals, dtype=np.float32).reshape(-1, values.shape[1])
            np.add.at(acc, np.asarray(src_token, dtype=np.int64)[mine], rows[mine])
        return torch.from_numpy(acc)

    # ------------------------------------------------------------------ low-latency mode
    def low_latency_dispatch(
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
    ) -> tuple[Any, torch.Tensor, LowLatencyHandle, EventOverlap, Callable[[], None]]:
        """``(recv_x, recv_count, handle, event, hook)``. ``recv_x`` is
        ``[num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks, hidden]`` BF16, or
        with ``use_fp8`` a tuple (FP8 e4m3 values, ``[..., hidden // 128]`` float32 scales);
        only the first ``recv_count[e]`` rows of expert ``e`` are valid."""
        num_tokens, hidden = x.shape
        if num_tokens > num_max_dispatch_tokens_per_rank:
            raise InvalidArgumentError(
                "x",
                num_tokens,
                f"exceeds num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}",
            )
        idx_np = np.ascontiguousarray(to_numpy(topk_idx, argument="topk_idx"), dtype=np.int64)
        values: torch.Tensor = x.contiguous()
        scales: torch.Tensor | None = None
        if use_fp8:
            if hidden % _FP8_BLOCK:
                raise InvalidArgumentError(
                    "x", hidden, f"hidden must be a multiple of {_FP8_BLOCK}"
                )
            values, scales = _quantize_fp8(x, round_scale or use_ue8m0)
        # Unit weights travel with the rows; low_latency_combine gets the real ones.
        res, backend, recv_scales = self._send(
            "expert",
            values,
            scales,
            idx_np,
            np.ones(idx_np.shape, np.float32),
            num_experts,
            num_max_dispatch_tokens_per_rank,
        )
        counts = np.asarray(res.num_recv_tokens_per_expert, dtype=np.int64)
        per_rank = num_experts // self.group_size
        slots = num_max_dispatch_tokens_per_rank * self.group_size
        row_dtype = torch.uint8 if use_fp8 else x.dtype
        packed = _pack_per_expert(from_numpy(res.recv_x, row_dtype), counts, slots)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += torch.from_numpy(counts).to(
                cumulative_local_expert_recv_stats.dtype
            )
        recv_x: Any = packed
        if use_fp8:
            assert recv_scales is not None
            packed_scales = _pack_per_expert(torch.from_numpy(recv_scales), counts, slots)
            recv_x = (packed.view(torch.float8_e4m3fn), packed_scales)
        assert packed.shape[0] == per_rank
        handle = LowLatencyHandle(
            res.handle,
            backend,
            counts,
            num_max_dispatch_tokens_per_rank,
            hidden,
            num_experts,
            num_tokens,
        )
        return (
            recv_x,
            torch.from_numpy(counts.astype(np.int32)),
            handle,
            EventOverlap(),
            _noop_hook,
        )

    def low_latency_combine(
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
    ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None]]:
        """Reduce **with weights**: ``(combined_x [num_tokens, hidden], event, hook)``;
        ``x`` is the packed ``[num_local_experts, slots, hidden]`` expert output."""
        if not isinstance(handle, LowLatencyHandle):
            raise InvalidArgumentError("handle", type(handle).__name__, "must come from dispatch")
        rows = torch.cat([x[e, :n] for e, n in enumerate(handle.counts.tolist())]).contiguous()
        backend = handle.backend
        w = np.ascontiguousarray(to_numpy(topk_weights.float(), argument="topk_weights"))
        y = from_numpy(np.array(backend.combine(to_numpy(rows), handle.inner, w)), x.dtype)
        if out is not None:
            out.copy_(y)
            y = out
        return y, EventOverlap(), _noop_hook

    # ------------------------------------------------------------------ helpers
    def _check_layout(
        self,
        idx: np.ndarray,
        num_tokens_per_rank: torch.Tensor | None,
        is_token_in_rank: torch.Tensor | None,
        num_tokens_per_expert: torch.Tensor | None,
    ) -> None:
        if num_tokens_per_expert is None:
            raise InvalidArgumentError(
                "num_tokens_per_expert",
                None,
                "pass get_dispatch_layout()'s output (DeepEP needs it)",
            )
        lay = _layout(idx, int(num_tokens_per_expert.numel()), self.group_size)
        given = (
            ("num_tokens_per_rank", num_tokens_per_rank, lay.num_tokens_per_rank),
            ("is_token_in_rank", is_token_in_rank, lay.is_token_in_rank),
            ("num_tokens_per_expert", num_tokens_per_expert, lay.num_tokens_per_expert),
        )
        for name, value, expected in given:
            if value is not None and not np.array_equal(value.numpy(), expected):
                raise InvalidArgumentError(name, "mismatch", "does not match topk_idx's layout")

    @staticmethod
    def _num_experts(num_tokens_per_expert: torch.Tensor | None, handle: Any) -> int:
        if handle is not None:
            return Buffer._num_experts_of(handle)
        assert num_tokens_per_expert is not None
        return int(num_tokens_per_expert.numel())

    @staticmethod
    def _num_experts_of(handle: NormalHandle) -> int:
        return handle.num_experts


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (an owned tensor either way)."""
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def _pack_per_expert(rows: torch.Tensor, counts: np.ndarray, slots: int) -> torch.Tensor:
    """Expert-major rows -> ``[num_local_experts, slots, ...]``, zeros after each count."""
    packed = torch.zeros((len(counts), slots, *rows.shape[1:]), dtype=rows.dtype)
    start = 0
    for e, n in enumerate(counts.tolist()):
        packed[e, :n] = rows[start : start + n]
        start += n
    return packed


def _noop_hook() -> None:
    """Receive hook: data has already arrived (calls are synchronous)."""
