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

import functools
from typing import Any

import numpy as np

from ..errors import UbepError
from ..routing import DispatchLayout, experts_per_rank, get_dispatch_layout, validate_topk_idx

__all__ = ["LayoutMemo", "dispatch_layout"]


def dispatch_layout(idx: np.ndarray, num_experts: int, num_ranks: int) -> DispatchLayout:
    """:func:`ubep.routing.get_dispatch_layout` of ``idx``, its counts int32 (DeepEP's dtype),
    checked and counted in one native pass where ``idx`` is a C-contiguous int64 matrix (a
    decode step's dozen numpy operations on a few hundred ids cost more than its dispatch);
    the same errors, raised by the routing module's own check."""
    native = _native()
    if native is None or idx.dtype != np.int64 or idx.ndim != 2 or not idx.flags.c_contiguous:
        lay = get_dispatch_layout(idx, num_experts, num_ranks)
        return DispatchLayout(lay.num_tokens_per_rank.astype(np.int32),
                              lay.num_tokens_per_expert.astype(np.int32), lay.is_token_in_rank)
    experts_per_rank(num_experts, num_ranks)  # its argument errors
    per_rank = np.empty(num_ranks, dtype=np.int32)
    per_expert = np.empty(num_experts, dtype=np.int32)
    in_rank = np.empty((idx.shape[0], num_ranks), dtype=bool)
    if native.dispatch_layout(idx, num_experts, num_ranks, per_rank, per_expert, in_rank):
        validate_topk_idx(idx, num_experts)  # names what is wrong
        raise UbepError("dispatch_layout refused a routing its check accepts")
    return DispatchLayout(per_rank, per_expert, in_rank)


@functools.cache
def _native() -> Any:
    try:
        from ..runtime.abi import load_native

        return load_native()
    except ImportError:  # no native build: numpy's layout
        return None


class LayoutMemo:
    """One facade's last layout (:meth:`remember`) and the check it answers (:meth:`recall`)."""

    __slots__ = ("_idx", "_layout", "_outputs", "_versions")

    def __init__(self) -> None:
        self._idx: np.ndarray | None = None
        self._layout: DispatchLayout | None = None
        self._outputs: tuple[Any, ...] = ()
        self._versions: tuple[int, ...] = ()

    def remember(self, idx: np.ndarray, layout: DispatchLayout, outputs: tuple[Any, ...]) -> None:
        """``layout`` was made from ``idx`` and returned as ``outputs`` (tensors or None:
        ``num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
        is_token_in_rank``); its ``is_token_in_rank`` (what :meth:`recall` answers with) shares
        no memory with ``outputs``."""
        self._idx = np.array(idx, dtype=np.int64, copy=True)
        self._layout = layout
        self._outputs = outputs
        self._versions = tuple(-1 if t is None else int(t._version) for t in outputs)

    def recall(self, idx: np.ndarray, given: tuple[Any, ...]) -> DispatchLayout | None:
        """The remembered layout if ``idx`` is the routing it was made from and every tensor of
        ``given`` (as :meth:`remember`'s ``outputs``; None: not given) is its own output,
        unmodified; else None (check the long way)."""
        mine = self._idx
        # the same ids: their bytes (the remembered copy is int64, C order; idx is as given)
        if mine is None or idx.shape != mine.shape or idx.dtype != mine.dtype or (
                idx.tobytes() != mine.tobytes()):
            return None
        for tensor, out, version in zip(given, self._outputs, self._versions, strict=True):
            if tensor is not None and (tensor is not out or int(tensor._version) != version):
                return None
        return self._layout
