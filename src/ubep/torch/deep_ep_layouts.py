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

from ..routing import DispatchLayout

__all__ = ["LayoutMemo"]


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
        is_token_in_rank``); none of its arrays share memory with ``outputs``."""
        self._idx = np.array(idx, dtype=np.int64, copy=True)
        self._layout = layout
        self._outputs = outputs
        self._versions = tuple(-1 if t is None else int(t._version) for t in outputs)

    def recall(self, idx: np.ndarray, given: tuple[Any, ...]) -> DispatchLayout | None:
        """The remembered layout if ``idx`` is the routing it was made from and every tensor of
        ``given`` (as :meth:`remember`'s ``outputs``; None: not given) is its own output,
        unmodified; else None (check the long way)."""
        mine = self._idx
        if mine is None or idx.shape != mine.shape or not np.array_equal(idx, mine):
            return None
        for tensor, out, version in zip(given, self._outputs, self._versions, strict=True):
            if tensor is not None and (tensor is not out or int(tensor._version) != version):
                return None
        return self._layout
