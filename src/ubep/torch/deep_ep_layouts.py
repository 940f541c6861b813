"""The last ``get_dispatch_layout`` of a facade, remembered for the dispatch that follows.

A normal-mode decode step calls ``get_dispatch_layout(topk_idx)`` and hands its outputs to
``dispatch`` with the same ``topk_idx``. The dispatch checks that the layout it is given matches
the routing (DeepEP trusts it; ubep refuses a mismatch by name), which took a second layout
computation per step. The memo answers that check without one: the routing is compared with a
copy of the one the layout was made from (so a change through any alias is seen), and each
layout tensor given must be the very tensor ``get_dispatch_layout`` returned, unmodified since
(torch's version counter). Anything else is checked the long way.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import UbepError
from ..routing import DispatchLayout, experts_per_rank, get_dispatch_layout, validate_topk_idx
from ..runtime.abi import native_or_none
from ._convert import storage_views
from .deep_ep_checks import DISPATCH_DTYPES

__all__ = ["LayoutMemo", "dispatch_layout"]

_TENSOR, _TORCH_INT64, _TORCH_FLOAT32 = torch.Tensor, torch.int64, torch.float32
_NDARRAY = np.ndarray
_INT64 = np.dtype(np.int64)


def dispatch_layout(idx: np.ndarray, num_experts: int, num_ranks: int) -> DispatchLayout:
    """:func:`ubep.routing.get_dispatch_layout` of ``idx``, its counts int32 (DeepEP's dtype),
    checked and counted in one native pass where ``idx`` is a C-contiguous int64 matrix (a
    decode step's dozen numpy operations on a few hundred ids cost more than its dispatch);
    the same errors, raised by the routing module's own checks."""
    native = native_or_none()
    if (native is None or idx.dtype != _INT64 or idx.ndim != 2 or not idx.flags.c_contiguous
            or type(num_experts) is not int or type(num_ranks) is not int or num_experts < 1
            or num_ranks < 1 or num_experts % num_ranks):
        experts_per_rank(num_experts, num_ranks)  # its argument errors
        lay = get_dispatch_layout(idx, num_experts, num_ranks)
        return DispatchLayout(lay.num_tokens_per_rank.astype(np.int32),
                              lay.num_tokens_per_expert.astype(np.int32), lay.is_token_in_rank)
    per_rank = np.empty(num_ranks, dtype=np.int32)
    per_expert = np.empty(num_experts, dtype=np.int32)
    in_rank = np.empty((idx.shape[0], num_ranks), dtype=bool)
    if native.dispatch_layout(idx, num_experts, num_ranks, per_rank, per_expert, in_rank):
        validate_topk_idx(idx, num_experts)  # names what is wrong
        raise UbepError("dispatch_layout refused a routing its check accepts")
    return DispatchLayout(per_rank, per_expert, in_rank)


class LayoutMemo:
    """One facade's last layout (:meth:`remember`) and the check it answers (:meth:`recall`)."""

    __slots__ = ("_idx", "_layout", "_outputs", "_versions")

    def __init__(self) -> None:
        self._idx: tuple[tuple[int, ...], bytes] | None = None  # shape, int64 bytes
        self._layout: DispatchLayout | None = None
        self._outputs: tuple[Any, ...] = ()
        self._versions: tuple[int, ...] = ()

    def remember(self, idx: np.ndarray, layout: DispatchLayout, outputs: tuple[Any, ...]) -> None:
        """``layout`` was made from ``idx`` and returned as ``outputs`` (tensors or None:
        ``num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
        is_token_in_rank``); its ``is_token_in_rank`` (what :meth:`recall` answers with) shares
        no memory with ``outputs``."""
        # the ids' bytes (a copy: a change through any alias is seen), as the int64 C-order
        # array the native layout took
        self._idx = (idx.shape, np.ascontiguousarray(idx, dtype=np.int64).tobytes())
        self._layout = layout
        self._outputs = outputs
        self._versions = tuple([-1 if t is None else t._version for t in outputs])

    def recall(self, idx: np.ndarray, given: tuple[Any, ...]) -> DispatchLayout | None:
        """The remembered layout if ``idx`` is the routing it was made from and every tensor of
        ``given`` (as :meth:`remember`'s ``outputs``; None: not given) is its own output,
        unmodified; else None (check the long way)."""
        mine = self._idx
        if mine is None or idx.dtype != _INT64 or idx.shape != mine[0] or (
                idx.tobytes() != mine[1]):
            return None
        for tensor, out, version in zip(given, self._outputs, self._versions, strict=True):
            if tensor is not None and (tensor is not out or tensor._version != version):
                return None
        return self._layout

    def recall_step(self, x: Any, topk_idx: Any, topk_weights: Any, given: tuple[Any, ...],
                    max_tokens_per_rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                       DispatchLayout] | None:
        """A decode step's dispatch after its ``get_dispatch_layout``: ``(x, topk_idx,
        topk_weights, layout)``, the three as numpy views of the tensors' memory (one native
        call, ``_convert.storage_views``), when ``x`` and the routing are the plain CPU tensors
        such a step passes (``x`` 2-D of a dispatch dtype within the capacity, int64 and float32
        routing of one shape, contiguous, no autograd) and :meth:`recall` knows the layout;
        else None, and the dispatch checks everything the long way (which names what is
        wrong)."""
        if not (type(x) is _TENSOR and type(topk_idx) is _TENSOR and type(topk_weights) is _TENSOR
                and topk_idx.dtype is _TORCH_INT64 and topk_weights.dtype is _TORCH_FLOAT32
                and x.dtype in DISPATCH_DTYPES and not x.requires_grad
                and not topk_weights.requires_grad):
            return None
        x_np, idx, w = storage_views(x, topk_idx, topk_weights)  # CPU tensors only
        if not (type(x_np) is _NDARRAY and type(idx) is _NDARRAY and type(w) is _NDARRAY
                and x_np.ndim == 2 and idx.ndim == 2 and idx.shape == w.shape
                and idx.flags.c_contiguous and w.flags.c_contiguous
                and idx.shape[0] == x_np.shape[0] <= max_tokens_per_rank):
            return None
        layout = self.recall(idx, given)
        return None if layout is None else (x_np, idx, w, layout)
