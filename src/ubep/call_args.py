"""Argument checks of :class:`ubep.Buffer`'s calls that need nothing but the config: array
conversion (numpy, CPU torch tensors) and the shapes and dtypes of a dispatch's inputs."""

from __future__ import annotations

import sys

import numpy as np

from . import dtypes as _dt
from .config import BufferConfig
from .errors import InvalidArgumentError

__all__ = ["check_dispatch_args", "is_c", "to_array"]


def check_dispatch_args(
    cfg: BufferConfig, dtype: _dt.DType, x: object, topk_idx: object, topk_weights: object
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x`` in the Buffer's storage dtype, ``topk_idx`` an owned C-contiguous int64 copy,
    ``topk_weights`` an owned float32 copy (the handle keeps both): shapes and dtypes checked,
    each failure an ``InvalidArgumentError`` naming the argument."""
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
    return xa, idx, w


def to_array(obj: object, argument: str) -> np.ndarray:
    """``obj`` as a numpy array (a CPU torch tensor without a copy, BF16 as uint16 bits);
    anything numpy cannot convert is an ``InvalidArgumentError`` naming the argument."""
    if type(obj) is np.ndarray:
        return obj
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        from .torch._convert import to_numpy

        return to_numpy(obj, argument=argument)
    try:
        return np.asarray(obj)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidArgumentError(
            argument, type(obj).__name__, f"cannot be converted to an array: {exc}"
        ) from None


def is_c(a: np.ndarray, dtype: type) -> bool:
    return a.dtype == dtype and bool(a.flags.c_contiguous)
