"""DeepEP's normal mode, held by a :class:`ubep.torch.deep_ep.Buffer` (its ``dispatch`` and
``combine``, and the internode path, call this one's): the checks of a dispatch's arguments
and the routing they give (:meth:`NormalPath.dispatch`), cached dispatch, DeepEP's outputs of
a dispatch, the combine and its weights (:meth:`NormalPath.combine`), and a decode step's calls
recognised from their tensors' metadata (:meth:`NormalPath.decode_dispatch` after its
``get_dispatch_layout``, :meth:`NormalPath.decode_combine`), straight to their Buffer."""

from __future__ import annotations

import functools
from typing import Any, cast

import numpy as np
import torch

from ..errors import InvalidArgumentError
from . import deep_ep_checks as checks
from ._convert import (
    from_numpy,
    padded_rows,
    received_rows,
    storage_views,
    tensor_of_storage,
    to_numpy,
)
from ._runtime import RuntimeBackend
from .backend import EPBackend
from .deep_ep_agree import (
    Board,
    check_combine_rows,
    combine_weights_plan,
    exchanged_counts,
    own_weights_sum,
    post_weights_word,
)
from .deep_ep_checks import check_dispatch_x, deepep_error, own_backend
from .deep_ep_core import FacadeCore
from .deep_ep_device import cached_rows, on_device, received_pair, routed_fp8
from .deep_ep_layouts import LayoutMemo, dispatch_layout
from .deep_ep_types import (
    EventOverlap,
    NormalHandle,
    _event,
    _Layout,
    _Route,
    topk_idx_t,
)

__all__ = ["NormalPath"]

_NO_LAYOUT = _Layout()  # a cached dispatch's: the handle says where rows go


def _given(layout: _Layout) -> tuple[Any, ...]:
    """The layout tensors a dispatch was given, in ``get_dispatch_layout``'s order (what
    ``LayoutMemo.recall`` compares with its outputs)."""
    return (layout.num_tokens_per_rank, layout.num_tokens_per_rdma_rank,
            layout.num_tokens_per_expert, layout.is_token_in_rank)


class NormalPath:
    """The normal mode of one facade: its core (Buffers per shape, the call gate, the
    Board), the layout memo its ``get_dispatch_layout`` fills, and its rank's place."""

    def __init__(self, core: FacadeCore, layouts: LayoutMemo, rank: int, group_size: int,
                 max_tokens_per_rank: int) -> None:
        self.core = core
        self._layouts = layouts
        self.rank = rank
        self.group_size = group_size
        self.max_tokens_per_rank = max_tokens_per_rank

    def decode_dispatch(
        self, x: Any, layout: _Layout, topk_idx: Any, topk_weights: Any, expert_alignment: int,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, list[int] | None, Any,
               EventOverlap] | None:
        """A decode step's dispatch after its ``get_dispatch_layout``, recognised from the
        tensors' metadata: CPU ``x`` of a dispatch dtype within the capacity, the routing
        that layout was made from as contiguous int64 / float32 tensors of one shape, the
        layout's own unmodified tensors, and a Buffer made already. None for anything else,
        which the checked path takes (and names)."""
        step = self._layouts.recall_step(
            x, topk_idx, topk_weights, _given(layout), self.max_tokens_per_rank)
        if step is None:
            return None
        x_np, idx, w, lay = step
        num_experts = int(lay.num_tokens_per_expert.size)
        backend = self.core.backends.cached("rank", x_np.shape[1], idx.shape[1], num_experts,
                                            x.dtype, self.max_tokens_per_rank)
        if backend is None:  # its first call: the checked path makes the Buffer
            return None
        route = _Route(idx, w, lay.is_token_in_rank, lay.num_tokens_per_expert, num_experts,
                       True)
        # ubep's Buffer (a host engine's: numpy results) straight, else the backend's protocol
        res = (backend.buffer.dispatch(x_np, idx, w) if type(backend) is RuntimeBackend
               else backend.dispatch(x_np, idx, w))
        return self._dispatch_outputs(res, backend, route, None, None, x.dtype, False, 0, None,
                                      expert_alignment, False)

    def dispatch(
        self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], handle: NormalHandle | None,
        layout: _Layout = _NO_LAYOUT, *, topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None, expert_alignment: int = 1,
        num_worst_tokens: int = 0, async_finish: bool = False,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, list[int] | None, Any, EventOverlap]:
        self.core.roles.check_no_m2n()  # also the internode path's
        scales: torch.Tensor | None = None
        if isinstance(x, tuple):
            x, scales = x
        if handle is not None:
            return self._cached_dispatch(x, scales, handle, topk_idx, topk_weights, async_finish)
        return self._routed_dispatch(x, scales, layout, topk_idx, topk_weights, expert_alignment,
                                     num_worst_tokens, async_finish)

    @checks.gated
    def _routed_dispatch(
        self, x: torch.Tensor, scales: torch.Tensor | None, layout: _Layout,
        topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None, expert_alignment: int,
        num_worst_tokens: int, async_finish: bool,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, list[int] | None, Any, EventOverlap]:
        check = functools.partial(
            self._route, x, topk_idx, topk_weights, layout.num_tokens_per_rank,
            layout.num_tokens_per_rdma_rank, layout.is_token_in_rank,
            layout.num_tokens_per_expert, num_worst_tokens)
        per_expert: np.ndarray | None = None
        recv: Any = None  # recv_x, where the decode step's call made it a tensor already
        recv_scales: Any = None  # the received float32 scales of FP8 rows from the host
        if topk_idx is None and topk_weights is None:
            # rows follow is_token_in_rank alone: the per-expert counts DeepEP returns are the
            # callers' num_tokens_per_expert, which no routing carries: they are exchanged
            # (that exchange fails a bad argument on every rank itself: not the gate's)
            self.core.gate.entered += 1
            route, per_expert = exchanged_counts(self.core.exchange.agree, check, self.rank,
                                                 self.group_size)
        else:  # a bad argument here fails the peers' call too, through the gate (gated)
            checks.check_device(x=x, x_scales=scales)
            route = check()
        if scales is None and self.core.shrink is None and not self.core.local:
            # a decode step's call: the one blocking dispatch, straight to its Buffer
            backend = self.core.backends.get("rank", x.shape[1], route.topk_idx.shape[1],
                                    route.num_experts, x.dtype, self.max_tokens_per_rank)
            if type(backend) is RuntimeBackend:  # ubep's Buffer takes x as it is
                res, recv = backend.dispatch_tensor(x, route.topk_idx, route.topk_weights)
            else:
                res = backend.dispatch(to_numpy(x), route.topk_idx, route.topk_weights)
        elif scales is not None and on_device(self.core):  # two dispatches of tensors
            res, recv, backend = routed_fp8(self.core, x, scales, route,
                                            self.max_tokens_per_rank)
        else:
            receive, backend = self.core.backends.send(
                "rank", x, scales, route.topk_idx, route.topk_weights, route.num_experts,
                self.max_tokens_per_rank)
            res, recv_scales = receive()
        return self._dispatch_outputs(res, backend, route, recv, recv_scales, x.dtype,
                                      scales is not None, num_worst_tokens, per_expert,
                                      expert_alignment, async_finish)

    def _dispatch_outputs(
        self, res: Any, backend: EPBackend, route: _Route, recv: Any, recv_scales: Any,
        x_dtype: torch.dtype, fp8: bool, num_worst_tokens: int, per_expert: np.ndarray | None,
        expert_alignment: int, async_finish: bool,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, list[int] | None, Any, EventOverlap]:
        """DeepEP's outputs of the dispatch ``res`` (numpy fields): owned copies of the rows
        (``recv``, where the call made them a tensor already), the routing and the weights,
        the per-expert counts and the handle."""
        # every rank's tokens to every rank, from the engine's count round: the same on all
        sent = np.array(res.num_sent_rows_per_rank, dtype=np.int64)
        most = int(sent.sum(axis=0).max(initial=0)) if num_worst_tokens else 0
        if most > num_worst_tokens:  # every rank sees it: all raise
            raise InvalidArgumentError("num_worst_tokens", num_worst_tokens,
                                       f"a rank receives {most} tokens")
        rows = res.recv_src_rank.shape[0]
        out_rows = num_worst_tokens if num_worst_tokens > 0 else rows
        if recv is None:
            recv = received_rows(res.recv_x, recv_scales, x_dtype, fp8, out_rows)
        elif isinstance(recv, tuple):  # FP8 on a device: its values and scales
            recv = received_pair(recv[0], recv[1], x_dtype, out_rows)
        elif out_rows != rows:  # num_worst_tokens: zeros after the received rows
            recv = padded_rows(recv, out_rows)
        new_handle = self._normal_handle(res, backend, route, sent, out_rows)
        recv_idx = recv_w = None
        if route.with_topk and out_rows == rows:  # owned copies of the engine's arrays
            recv_idx = torch.from_numpy(np.array(res.recv_topk_idx, dtype=np.int64))
            recv_w = torch.from_numpy(np.array(res.recv_topk_weights, dtype=np.float32))
        elif route.with_topk:  # num_worst_tokens: -1 and 0 past the received rows
            recv_idx = torch.full((out_rows, route.topk_idx.shape[1]), -1, dtype=topk_idx_t)
            recv_idx[:rows] = torch.from_numpy(np.asarray(res.recv_topk_idx))
            recv_w = torch.zeros((out_rows, route.topk_idx.shape[1]), dtype=torch.float32)
            recv_w[:rows] = torch.from_numpy(np.asarray(res.recv_topk_weights))
        counts: list[int] = []
        if num_worst_tokens == 0:
            if per_expert is None:  # the engine counted every source's picks of each expert
                per_expert = np.asarray(res.num_recv_tokens_per_expert, dtype=np.int64)
            align = max(int(expert_alignment), 1)
            counts = (np.asarray(per_expert).tolist() if align == 1 else
                      (-(-np.asarray(per_expert, dtype=np.int64) // align) * align).tolist())
        return recv, recv_idx, recv_w, counts, new_handle, _event(async_finish)

    def _route(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        num_tokens_per_rank: torch.Tensor | None,
        num_tokens_per_rdma_rank: torch.Tensor | None,
        is_token_in_rank: torch.Tensor | None,
        num_tokens_per_expert: torch.Tensor | None,
        num_worst_tokens: int,
    ) -> _Route:
        """Check one rank's normal-mode arguments and build the routing its rows follow."""
        given = _given(_Layout(num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                               num_tokens_per_expert))
        step = None if num_worst_tokens else self._layouts.recall_step(
            x, topk_idx, topk_weights, given, self.max_tokens_per_rank)
        if step is not None:  # a decode step's: its get_dispatch_layout's own outputs
            _, idx, w, lay = step
            return _Route(idx, w, lay.is_token_in_rank, lay.num_tokens_per_expert,
                          lay.num_tokens_per_expert.size, True)
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise InvalidArgumentError("x", getattr(x, "shape", x), "must be [tokens, hidden]")
        check_dispatch_x(x, self.max_tokens_per_rank)
        if isinstance(num_worst_tokens, bool) or not isinstance(num_worst_tokens, int) or (
            num_worst_tokens < 0
        ):
            raise InvalidArgumentError("num_worst_tokens", num_worst_tokens, "must be an int >= 0")
        if num_tokens_per_expert is None:
            raise InvalidArgumentError(
                "num_tokens_per_expert", None, "needed (get_dispatch_layout's output, as DeepEP)"
            )
        per_expert = to_numpy(num_tokens_per_expert, argument="num_tokens_per_expert")
        num_experts = int(per_expert.size)
        if num_experts % self.group_size:
            raise InvalidArgumentError(
                "num_tokens_per_expert", num_experts,
                f"needs a multiple of num_ranks={self.group_size} experts",
            )
        R, T = self.group_size, x.shape[0]
        if (topk_idx is None) != (topk_weights is None):
            raise InvalidArgumentError(
                "topk_weights" if topk_weights is None else "topk_idx", None,
                "topk_idx and topk_weights go together",
            )
        if topk_idx is not None and topk_weights is not None:
            idx = np.ascontiguousarray(to_numpy(topk_idx, argument="topk_idx"), dtype=np.int64)
            w = np.ascontiguousarray(to_numpy(
                topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float(),
                argument="topk_weights"), dtype=np.float32)
            if idx.shape[0] != T or w.shape != idx.shape:
                raise InvalidArgumentError(
                    "topk_idx", idx.shape, f"needs [num_tokens={T}, k] like topk_weights"
                )
            known = self._layouts.recall(idx, given)
            if known is not None:  # get_dispatch_layout's own outputs for this routing
                return _Route(idx, w, known.is_token_in_rank, per_expert, num_experts, True)
            lay = dispatch_layout(idx, num_experts, R)
            self._check_given("num_tokens_per_expert", per_expert, lay.num_tokens_per_expert)
            self._check_given("is_token_in_rank", is_token_in_rank, lay.is_token_in_rank)
            self._check_given("num_tokens_per_rank", num_tokens_per_rank, lay.num_tokens_per_rank)
            self._check_given("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank,
                              self.core.tokens_per_host(lay.is_token_in_rank).sum(axis=0))
            return _Route(idx, w, lay.is_token_in_rank, per_expert, num_experts, True)
        if is_token_in_rank is None:
            raise InvalidArgumentError(
                "is_token_in_rank", None, "needed when dispatching without topk_idx (as DeepEP)"
            )
        in_rank = np.asarray(to_numpy(is_token_in_rank, argument="is_token_in_rank"), dtype=bool)
        if in_rank.shape != (T, R):
            raise InvalidArgumentError(
                "is_token_in_rank", in_rank.shape, f"must be [num_tokens={T}, num_ranks={R}]"
            )
        self._check_given("num_tokens_per_rank", num_tokens_per_rank, in_rank.sum(axis=0))
        self._check_given("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank,
                          self.core.tokens_per_host(in_rank).sum(axis=0))
        # One column per rank holding that rank's first expert: ubep's rank layout then sends
        # exactly one row per marked (token, rank), as DeepEP does from is_token_in_rank.
        first = np.arange(R, dtype=np.int64) * (num_experts // R)
        idx = np.where(in_rank, first[None, :], -1)
        return _Route(idx, np.zeros(idx.shape, np.float32), in_rank, per_expert, num_experts, False)

    @staticmethod
    def _check_given(name: str, given: Any, expected: np.ndarray) -> None:
        if given is None:
            return
        value = given if isinstance(given, np.ndarray) else to_numpy(given, argument=name)
        if value.shape != expected.shape or not np.array_equal(value, expected):
            raise InvalidArgumentError(name, "mismatch", "does not match the routing (topk_idx)")

    def _normal_handle(
        self, res: Any, backend: EPBackend, route: _Route, sent: np.ndarray, out_rows: int
    ) -> NormalHandle:
        topk = route.with_topk  # what a combine given back the received weights sums (its word)
        return NormalHandle.built(
            inner=res.handle, backend=backend, topk_idx=route.topk_idx,
            num_experts=route.num_experts, num_recv_rows=res.recv_src_rank.shape[0],
            num_out_rows=out_rows, sent=sent, in_rank=route.is_token_in_rank,
            src_token=np.array(res.recv_src_token), rank=self.rank,  # the engine's may be refilled
            recv_weights=np.array(res.recv_topk_weights, dtype=np.float32) if topk else None,
            sent_routing=(np.array(route.topk_idx), np.array(route.topk_weights)) if topk else None)

    @checks.gated
    def _cached_dispatch(
        self,
        x: torch.Tensor,
        scales: torch.Tensor | None,
        handle: NormalHandle,
        topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        async_finish: bool,
    ) -> tuple[Any, None, None, None, None, EventOverlap]:
        if not isinstance(handle, NormalHandle):
            raise InvalidArgumentError(
                "handle", type(handle).__name__, "must be the handle a normal dispatch returned"
            )
        if topk_idx is not None or topk_weights is not None:
            raise InvalidArgumentError("handle", "given", "cached dispatch takes no topk_idx")
        checks.check_device(x=x, x_scales=scales)
        if on_device(self.core):  # the tensors as they are, and the engine's rows
            recv = cached_rows(self.core, x, scales, handle, self.max_tokens_per_rank)
            return recv, None, None, None, None, _event(async_finish)
        idx = handle.topk_idx
        receive, _ = self.core.backends.send(
            "rank", x, scales, idx, np.zeros(idx.shape, np.float32), handle.num_experts,
            self.max_tokens_per_rank,
        )
        res, recv_scales = receive()
        out_rows = handle.num_out_rows
        recv = received_rows(res.recv_x, recv_scales, x.dtype, scales is not None, out_rows)
        return recv, None, None, None, None, _event(async_finish)

    def decode_combine(self, x: Any, handle: Any, topk_weights: Any,
                       ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap] | None:
        """A decode step's blocking combine without ``bias``, recognised from the tensors'
        metadata: a handle of this facade's Buffer, the Board open (the first combine opened
        it), ``x`` a CPU ``[rows, hidden]`` tensor of the dispatch's rows and float32
        ``topk_weights`` of its rows (or none). Nothing before the Buffer's call raises (its
        errors reach every rank). None for anything else, which :meth:`combine` takes after
        the facade's checks (and names)."""
        board = self.core.exchange.board
        if not (type(handle) is NormalHandle and type(board) is Board
                and type(x) is torch.Tensor and type(handle.backend) is RuntimeBackend
                and (topk_weights is None or (type(topk_weights) is torch.Tensor
                                              and topk_weights.dtype is torch.float32))):
            return None
        backend = handle.backend
        if backend not in self.core.backends.table.values():  # by identity (no __eq__)
            return None  # another Buffer's handle: the checked path names it
        x_np, w_np = storage_views(x, topk_weights)  # CPU tensors only
        n = handle.num_recv_rows
        if type(x_np) is not np.ndarray or x_np.ndim != 2 or (
                x_np.shape[0] not in (n, handle.num_out_rows)) or (topk_weights is not None and (
                    type(w_np) is not np.ndarray or w_np.ndim != 2
                    or w_np.shape[0] != x_np.shape[0])):
            return None
        tag = post_weights_word(board, handle, w_np)  # the weights' view: the same word
        self.core.gate.combine_on(backend)  # the next call: a combine there
        try:
            y = backend.buffer.combine(x_np if x_np.shape[0] == n else x_np[:n], handle.inner)
        except InvalidArgumentError as exc:
            raise deepep_error(exc) from None
        return (tensor_of_storage(y, x.dtype),
                self._combined_weights(combine_weights_plan(board.words(tag)), handle,
                                       topk_weights, n), EventOverlap(None))

    def combine(
        self,
        x: torch.Tensor,
        handle: NormalHandle,
        topk_weights: torch.Tensor | None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
        async_finish: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        if not isinstance(handle, NormalHandle):
            raise InvalidArgumentError(
                "handle", type(handle).__name__, "must be the handle a normal dispatch returned"
            )
        n = handle.num_recv_rows
        tag = self._post_weights_word(handle, topk_weights)  # before anything can raise
        checks.check_device(x=x, topk_weights=topk_weights, bias=bias)
        check_combine_rows(x, topk_weights, (n, handle.num_out_rows))
        core = self.core
        backend = own_backend(handle, core.backends, core.gate)
        rows = x if x.shape[0] == n else x[:n]
        try:
            # ubep's Buffer takes the tensor as it is and hands y back as one (its torch door)
            y = (backend.combine_tensor(rows, handle.inner) if type(backend) is RuntimeBackend
                 else from_numpy(backend.combine(to_numpy(rows), handle.inner), x.dtype))
        except InvalidArgumentError as exc:
            raise deepep_error(exc) from None
        # every rank's word (none, all the received weights, or others), else what was given
        plan = ("none" if topk_weights is None else "carried") if tag is None else (
            combine_weights_plan(cast(Board, self.core.exchange.opened_board()).words(tag)))
        combined_w = self._combined_weights(plan, handle, topk_weights, n)
        if bias is not None:
            # Both biases are added in float32 and rounded once, as DeepEP adds them in the
            # reduction (rounding after each would lose a bit more with two).
            total = y.float()
            for b in bias if isinstance(bias, tuple) else (bias,):
                total = total + b.float()
            y = total.to(x.dtype)
        return y, combined_w, _event(async_finish)

    def _post_weights_word(self, handle: Any, topk_weights: Any) -> int | None:
        """:func:`.post_weights_word` on the Board (opened by the first combine: collective);
        None without one (another host, shrink mode, no Buffer)."""
        core = self.core
        if core.shrink is not None or not isinstance(handle, NormalHandle) or getattr(
                handle.backend, "buffer", None) is None:
            return None
        board = core.exchange.opened_board()
        return None if board is None else post_weights_word(board, handle, topk_weights)

    def _combined_weights(self, plan: str, handle: NormalHandle, topk_weights: Any,
                          n: int) -> torch.Tensor | None:
        """``combined_topk_weights`` by every rank's ``plan`` (``combine_weights_plan``)."""
        if plan == "none":
            return None
        if plan == "local":  # every source sums the weights it sent, where they are
            return torch.from_numpy(own_weights_sum(*cast(tuple, handle.sent_routing)))
        return self._combine_small(cast(torch.Tensor, topk_weights)[:n], handle)

    def _combine_small(self, values: torch.Tensor, handle: NormalHandle) -> torch.Tensor:
        """The combine's ``topk_weights`` summed at their sources (``Backends.weights_back``)."""
        return self.core.backends.weights_back(handle.backend, values, handle.sent[:, self.rank],
                                               handle.in_rank,
                                               int(handle.sent.sum(axis=0).max()),
                                               self.group_size * self.max_tokens_per_rank)
