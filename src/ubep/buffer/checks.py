"""Argument checks of a Buffer's calls, all before any peer memory is touched: array conversion
(numpy, CPU torch tensors), the shapes and dtypes of a dispatch's inputs, and whether a combine's
handle and expert outputs belong to this Buffer and dispatch. Each failure is an
``InvalidArgumentError`` naming the argument."""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import dtypes as _dt
from ..config import BufferConfig
from ..errors import InvalidArgumentError
from ..handle import DispatchHandle
from ..plane.protocol import Engine
from ..torch_bridge import Unviewable, is_torch_tensor, tensor_to_numpy
from .state import BufferState

__all__ = ["ArgChecks", "check_dispatch_args", "is_c", "pack_quantized", "to_array"]


def check_dispatch_args(
    cfg: BufferConfig, dtype: _dt.DType, x: object, topk_idx: object, topk_weights: object,
    x_scales: object = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x`` in the Buffer's storage dtype (with ``x_scales``: :func:`pack_quantized`'s rows),
    ``topk_idx`` an owned C-contiguous int64 copy, ``topk_weights`` an owned float32 copy (the
    handle keeps both): shapes and dtypes checked, each failure an ``InvalidArgumentError``
    naming the argument."""
    if x_scales is not None:
        xa = pack_quantized(cfg, x, x_scales)
        return (xa, *_check_routing(cfg, xa.shape[0], topk_idx, topk_weights))
    storage = dtype.storage
    xa = to_array(x, "x")
    if xa.dtype != storage:
        xa, dt = _dt.as_storage(xa, argument="x")
        if dt != dtype:
            raise InvalidArgumentError("x", dt.name, f"must have the Buffer's dtype "
                                                     f"({dtype.name})")
    if xa.ndim != 2 or xa.shape[1] != cfg.hidden:
        raise InvalidArgumentError("x", xa.shape, f"must be [num_tokens, {cfg.hidden}]")
    ntok = xa.shape[0]
    if ntok > cfg.max_tokens_per_rank:
        raise InvalidArgumentError(
            "x", xa.shape, f"has more tokens than max_tokens_per_rank="
                           f"{cfg.max_tokens_per_rank}"
        )
    if not xa.flags.c_contiguous:
        xa = np.ascontiguousarray(xa)
    return (xa, *_check_routing(cfg, ntok, topk_idx, topk_weights))


def _check_routing(cfg: BufferConfig, ntok: int, topk_idx: object,
                   topk_weights: object) -> tuple[np.ndarray, np.ndarray]:
    idx = to_array(topk_idx, "topk_idx")
    if idx.shape != (ntok, cfg.num_topk):
        raise InvalidArgumentError(
            "topk_idx", idx.shape, f"must be [num_tokens={ntok}, num_topk={cfg.num_topk}]"
        )
    if idx.dtype != np.int64 or not idx.flags.c_contiguous:
        if idx.dtype.kind not in "iu":
            raise InvalidArgumentError("topk_idx", idx.dtype, "must be an integer array")
        if idx.dtype.kind == "u" and idx.size and int(idx.max()) >= cfg.num_experts:
            # would wrap to a negative id (2**64 - 1 -> -1, a masked slot) as int64
            bad = int(idx.max())
            raise InvalidArgumentError(
                "topk_idx", bad, f"expert id out of range [-1, {cfg.num_experts}) "
                "(num_experts)")
        idx = np.ascontiguousarray(idx, dtype=np.int64)
    else:
        idx = idx.copy()  # the handle keeps it: the caller may reuse its array
    w = to_array(topk_weights, "topk_weights")
    if w.dtype != np.float32:
        raise InvalidArgumentError("topk_weights", w.dtype, "must be float32")
    if w.shape != idx.shape:
        raise InvalidArgumentError("topk_weights", w.shape, f"must match topk_idx {idx.shape}")
    w = np.array(w, order="C")  # owned: the handle keeps it
    return idx, w


def pack_quantized(cfg: BufferConfig, x: object, x_scales: object) -> np.ndarray:
    """Rows already quantised by the caller (DeepEP's normal-mode FP8 ``x``): 1-byte values
    ``[num_tokens, hidden]`` and float32 ``x_scales [num_tokens, hidden // 128]`` packed into
    the rows a quantised Buffer sends (``[num_tokens, ubep.quant.row_bytes(hidden)]`` bytes)."""
    if cfg.quant is None:
        raise InvalidArgumentError("x_scales", "given", "needs a Buffer with BufferConfig.quant")
    values = to_array(x, "x")
    if values.dtype.itemsize != 1 or values.ndim != 2 or values.shape[1] != cfg.hidden:
        raise InvalidArgumentError(
            "x", f"{values.dtype}{values.shape}", f"with x_scales must be 1-byte values "
            f"[num_tokens, {cfg.hidden}]")
    scales = to_array(x_scales, "x_scales")
    blocks = cfg.hidden // 128
    if scales.dtype != np.float32 or scales.shape != (values.shape[0], blocks):
        raise InvalidArgumentError(
            "x_scales", f"{scales.dtype}{scales.shape}",
            f"must be float32 [{values.shape[0]}, {blocks}]")
    return np.ascontiguousarray(np.concatenate(
        [values.view(np.uint8), scales.view(np.uint8)], axis=1))


def to_array(obj: object, argument: str) -> np.ndarray:
    """``obj`` as a numpy array (a CPU torch tensor without a copy, BF16 as uint16 bits);
    anything numpy cannot convert is an ``InvalidArgumentError`` naming the argument."""
    if type(obj) is np.ndarray:
        return obj
    if is_torch_tensor(obj):
        return tensor_to_numpy(obj, argument)
    if type(obj) is Unviewable:  # a tensor the torch door could not view (its device, say)
        raise obj.error
    try:
        return np.asarray(obj)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidArgumentError(
            argument, type(obj).__name__, f"cannot be converted to an array: {exc}"
        ) from None


def is_c(a: np.ndarray, dtype: type) -> bool:
    return a.dtype == dtype and bool(a.flags.c_contiguous)


class ArgChecks:
    """The checks that need the state of the Buffer ``buf`` (its generation and layout; held as
    ``buf._checks``), its ``engine`` (which knows its memory) and the ``uid`` its ranks agreed
    on (both handed in)."""

    __slots__ = ("_engine", "_uid", "buf")

    def __init__(self, buf: BufferState, engine: Engine, uid: int) -> None:
        self.buf = buf
        self._engine = engine
        self._uid = uid

    def dispatch_args(
        self, x: object, topk_idx: object, topk_weights: object, x_scales: object = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        b = self.buf
        return check_dispatch_args(b._cfg, b._dtype, x, topk_idx, topk_weights,
                                   x_scales)

    def handle(self, handle: object) -> DispatchHandle:
        b = self.buf
        if not isinstance(handle, DispatchHandle):
            raise InvalidArgumentError("handle", type(handle).__name__, "must be a dispatch handle")
        cfg = b._cfg
        if (handle.rank, handle.num_ranks, handle.layout, handle.num_experts, handle.hidden) != (
            b.rank, b.num_ranks, cfg.layout, cfg.num_experts, cfg.hidden
        ) or handle.topk_idx.shape[1:] != (cfg.num_topk,):
            raise InvalidArgumentError(
                "handle", (handle.rank, handle.layout, handle.hidden),
                "comes from a dispatch of another rank or Buffer shape",
            )
        if handle.num_tokens > cfg.max_tokens_per_rank or (
            handle.num_recv_rows > b.layout.cap_rows
        ):
            raise InvalidArgumentError("handle", handle.num_tokens, "exceeds this Buffer's size")
        if getattr(handle, "buffer_uid", None) != self._uid:
            raise InvalidArgumentError(
                "handle", type(handle).__name__, "does not come from a dispatch of this Buffer"
            )
        if getattr(handle, "generation", None) != b._generation or not (
            0 <= getattr(handle, "dispatch_index", -1) < b._num_dispatches
        ):
            raise InvalidArgumentError(
                "handle", f"dispatch {getattr(handle, 'dispatch_index', -1)}",
                "comes from before this Buffer's last resync()",
            )
        return handle

    def recv_x_valid(self, handle: DispatchHandle) -> bool:
        """Whether ``recv_x`` of the dispatch that returned ``handle`` still holds that
        dispatch's rows (the engine knows its memory: a receive region of the native engine is
        reused by the second dispatch after the one that filled it; ``dispatch(copy=True)``
        gives rows that stay). Local, not collective."""
        b = self.buf
        index = getattr(handle, "dispatch_index", -1)
        return (getattr(handle, "buffer_uid", None) == self._uid
                and getattr(handle, "generation", None) == b._generation
                and index >= 0 and bool(self._engine.recv_valid(index, b._num_dispatches)))

    def combine_args(
        self, expert_out: object, handle: DispatchHandle
    ) -> tuple[DispatchHandle, np.ndarray]:
        b = self.buf
        h = self.handle(handle)
        eo = to_array(expert_out, "expert_out")
        # a stale recv_x view (its region filled again by a later dispatch): the engine knows
        # its memory, the Buffer asks
        stale = self._engine.stale_view(eo, int(getattr(h, "dispatch_index", -1)),
                                     b._num_dispatches)
        if stale is not None:
            raise InvalidArgumentError("expert_out", *stale)
        if eo.dtype != b._cdtype.storage:
            eo, dt = _dt.as_storage(eo, argument="expert_out")
            if dt != b._cdtype:
                raise InvalidArgumentError(
                    "expert_out", dt.name, f"must have combine_dtype ({b._cdtype.name})"
                )
        if eo.shape != (h.num_recv_rows, b._cfg.hidden):
            raise InvalidArgumentError(
                "expert_out", eo.shape,
                f"must be ({h.num_recv_rows}, {b._cfg.hidden}): one row per received row",
            )
        if not eo.flags.c_contiguous:
            eo = np.ascontiguousarray(eo)
        if h.send_dst_row is None:
            raise InvalidArgumentError(
                "handle", "send_dst_row=None", "needs send_dst_row (a handle of Buffer.dispatch)"
            )
        if not (
            is_c(h.topk_idx, np.int64) and is_c(h.topk_weights, np.float32)
            and is_c(h.send_dst_row, np.int64)
        ):
            h = dataclasses.replace(
                h,
                topk_idx=np.ascontiguousarray(h.topk_idx, dtype=np.int64),
                topk_weights=np.ascontiguousarray(h.topk_weights, dtype=np.float32),
                send_dst_row=np.ascontiguousarray(h.send_dst_row, dtype=np.int64),
            )
        return h, eo
