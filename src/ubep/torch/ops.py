"""Dispatch and combine on torch tensors, as ``torch.autograd.Function`` s.

Forward passes hand the tensors' memory to the backend as numpy arrays (no copy; BF16 as uint16
bits) and wrap what comes back the same way. Backward passes are the adjoint collectives:

* dispatch copies rows, so its adjoint adds rows back: ``grad_x = combine(grad_recv_x)`` with
  unit weights (expert layout) or as is (rank layout, which never weights);
* combine adds rows, so its adjoint copies: ``grad_expert_out = dispatch(grad_y)`` (times the row's
  weight in the expert layout, where combine weighted);
* routing weights: in the ``"expert"`` layout combine applies them, so ``d/dw[t, k] =
  <grad_y[t], out(t, k)>``; each receiver computes that dot product for its rows and sends the
  scalars back in one more unit-weight combine (row ``j`` carries its scalar in column
  ``k_j``, so the sum over ``k`` leaves each in its own column). In the ``"rank"`` layout the caller
  applies ``recv_topk_weights`` to its rows, so their gradient ``[rows, num_topk]`` goes back the
  same way (a combine of those columns, zero-padded to ``hidden``). Both need
  ``hidden >= num_topk``.

Every rank must make the same sequence of collective calls. The backward decisions depend only on
``needs_input_grad`` (the same model code on every rank gives the same answer), never on whether a
gradient happens to be all zeros on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ._convert import PAYLOAD_DTYPES, from_numpy, to_numpy
from .backend import EPBackend, PendingOp, as_backend, issue_combine, issue_dispatch

__all__ = ["DispatchResult", "Handle", "PendingOp", "combine", "dispatch"]


@dataclass(frozen=True)
class Handle:
    """Everything combine (and the backward passes) need about one dispatch.

    Attributes:
        backend: the communicator the dispatch ran on.
        inner: the backend's own handle.
        topk_idx: ``[num_tokens, num_topk]`` int64 numpy, this rank's routing.
        topk_weights: ``[num_tokens, num_topk]`` float32 tensor given to dispatch (autograd
            tracks it; the expert layout's combine applies it).
        recv_src_k: ``[rows]`` int64, top-k slot of each received row (expert layout), else None.
        num_recv_rows: rows this rank received.
        hidden: row width.
        dtype: payload dtype.
    """

    backend: EPBackend
    inner: Any
    topk_idx: np.ndarray
    topk_weights: torch.Tensor
    recv_src_k: np.ndarray | None
    num_recv_rows: int
    hidden: int
    dtype: torch.dtype


@dataclass(frozen=True)
class DispatchResult:
    """What :func:`dispatch` returns (torch tensors, DeepEP names).

    Attributes:
        recv_x: ``[rows, hidden]`` received rows, ``x``'s dtype; row order as in ``ubep.reference``
            (expert layout: grouped by local expert, then source rank, then token; rank layout:
            by source rank, then token).
        recv_topk_idx: expert layout ``[rows]`` int64 global expert id of each row; rank layout
            ``[rows, num_topk]`` int64 local expert ids, ``-1`` where the expert lives elsewhere.
        recv_topk_weights: expert layout ``[rows]`` float32 (informational: combine applies the
            weights, and their gradient flows there); rank layout ``[rows, num_topk]`` float32,
            0 where ``recv_topk_idx`` is -1, differentiable (the caller applies them).
        num_recv_tokens_per_expert: ``[num_local_experts]`` Python ints (rows per local expert;
            contiguous segments of ``recv_x`` in the expert layout).
        recv_src_rank: ``[rows]`` int64 source rank of each row.
        recv_src_token: ``[rows]`` int64 token index on the source rank.
        handle: pass to :func:`combine`.
    """

    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor
    num_recv_tokens_per_expert: list[int]
    recv_src_rank: torch.Tensor
    recv_src_token: torch.Tensor
    handle: Handle


def _payload(t: torch.Tensor, argument: str) -> np.ndarray:
    if t.dtype not in PAYLOAD_DTYPES:
        raise InvalidArgumentError(argument, t.dtype, f"must be one of {list(PAYLOAD_DTYPES)}")
    return to_numpy(t, argument=argument)


def _weights(w: torch.Tensor) -> torch.Tensor:
    # Routing weights travel as float32 (DeepEP's contract); float64 ones stay float64 so the
    # in-process fake can check gradients in float64 end to end (the runtime casts to float32).
    return w if w.dtype == torch.float64 else w.to(torch.float32)


def _owned(a: np.ndarray) -> np.ndarray:
    # The runtime may return views of its receive buffer that the call after next overwrites;
    # tensors autograd saves for backward must own their memory.
    return a if a.flags.owndata and a.flags.writeable else np.array(a, copy=True)


def _padded_columns(
    values: np.ndarray, cols: np.ndarray | None, hidden: int, dtype: torch.dtype
) -> np.ndarray:
    """``[rows, hidden]`` payload with ``values[j]`` in column ``cols[j]`` (or ``values`` 2-D in the
    leading columns when ``cols`` is None), zeros elsewhere, in ``dtype``'s storage."""
    rows = values.shape[0]
    buf = torch.zeros((rows, hidden), dtype=dtype)
    v = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64)).to(dtype)
    if values.ndim == 1:
        buf[torch.arange(rows), torch.tensor(cols, dtype=torch.int64)] = v
    else:
        buf[:, : values.shape[1]] = v
    return to_numpy(buf)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        backend: EPBackend,
        topk_idx: np.ndarray,
        keep: bool,
        box: list[Any],
        issued: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # issued: the split-phase call dispatch(return_recv_hook=True) started; else a call now
        res = issued.hook() if issued is not None else backend.dispatch(
            _payload(x, "x"),
            topk_idx,
            to_numpy(_weights(topk_weights), argument="topk_weights"),
        )
        # ``keep``: grad mode was on at the call (it is always off inside forward), so autograd may
        # save recv_x for backward and it must not alias the runtime's receive buffer.
        recv_x_np = _owned(res.recv_x) if keep else res.recv_x
        recv_x = from_numpy(recv_x_np, x.dtype)
        # In the dtype of the weights given (float32 values; float64 keeps float64 gradients).
        recv_w = from_numpy(_owned(np.asarray(res.recv_topk_weights)))
        recv_w = recv_w.to(topk_weights.dtype)
        box.append(res)
        ctx.backend = backend
        ctx.handle = res.handle
        ctx.layout = backend.layout
        ctx.num_tokens, ctx.hidden = x.shape
        ctx.num_topk = topk_idx.shape[1]
        ctx.x_dtype = x.dtype
        ctx.w_dtype = topk_weights.dtype
        ctx.recv_topk_idx = np.asarray(res.recv_topk_idx)
        if backend.layout == "expert":
            ctx.mark_non_differentiable(recv_w)
        ctx.set_materialize_grads(False)
        return recv_x, recv_w

    @staticmethod
    def backward(
        ctx: Any, grad_recv_x: torch.Tensor | None, grad_recv_w: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None, None]:
        backend: EPBackend = ctx.backend
        expert = ctx.layout == "expert"
        rows = ctx.recv_topk_idx.shape[0]
        grad_x = grad_w = None
        ones = np.ones((ctx.num_tokens, ctx.num_topk), dtype=np.float32) if expert else None
        if ctx.needs_input_grad[0]:
            g = (
                grad_recv_x
                if grad_recv_x is not None
                else torch.zeros((rows, ctx.hidden), dtype=ctx.x_dtype)
            )
            g_np = _payload(g.to(ctx.x_dtype), "grad_recv_x")
            grad_x = from_numpy(_owned(backend.combine(g_np, ctx.handle, ones)), ctx.x_dtype)
        if ctx.needs_input_grad[1] and not expert:
            g = grad_recv_w if grad_recv_w is not None else torch.zeros((rows, ctx.num_topk))
            # Entries for experts on other ranks are constant zeros in the forward pass.
            g = g.masked_fill(torch.from_numpy(ctx.recv_topk_idx < 0), 0.0)
            _check_width(ctx.hidden, ctx.num_topk)
            payload = _padded_columns(g.detach().double().numpy(), None, ctx.hidden, ctx.x_dtype)
            back = from_numpy(backend.combine(payload, ctx.handle, None), ctx.x_dtype)
            grad_w = back[:, : ctx.num_topk].to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, expert_out: torch.Tensor, topk_weights: torch.Tensor, handle: Handle,
        issued: Any,
    ) -> torch.Tensor:
        backend = handle.backend
        expert = backend.layout == "expert"
        w_np = _combine_weights(backend, topk_weights)
        y = issued.hook() if issued is not None else backend.combine(
            _payload(expert_out, "expert_out"), handle.inner, w_np)
        ctx.handle = handle
        ctx.expert = expert
        ctx.w_np = w_np
        ctx.w_dtype = topk_weights.dtype
        if expert and topk_weights.requires_grad:
            ctx.save_for_backward(expert_out)
        return from_numpy(_owned(y), expert_out.dtype)

    @staticmethod
    def backward(
        ctx: Any, grad_y: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        h: Handle = ctx.handle
        backend = h.backend
        dtype = h.dtype
        needs_out, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and ctx.expert
        if not (needs_out or needs_w):
            return None, None, None, None
        # The adjoint of the sum is a copy: dispatch grad_y along the same routing. Same inputs
        # give the same row order, so row j here is row j of the forward dispatch.
        weights = ctx.w_np if ctx.expert else np.zeros(h.topk_idx.shape, dtype=np.float32)
        res = backend.dispatch(
            _payload(grad_y.contiguous().to(dtype), "grad_y"), h.topk_idx, weights
        )
        g_rows = from_numpy(_owned(res.recv_x), dtype)
        grad_out = grad_w = None
        if needs_out:
            if ctx.expert:
                # float32 like combine's own accumulation (float64 stays float64 on the fake)
                acc = torch.float64 if dtype == torch.float64 else torch.float32
                w_rows = torch.from_numpy(np.array(res.recv_topk_weights))
                grad_out = (g_rows.to(acc) * w_rows[:, None].to(acc)).to(dtype)
            else:
                grad_out = g_rows
        if needs_w:
            (expert_out,) = ctx.saved_tensors
            dots = (g_rows.double() * expert_out.detach().double()).sum(dim=1).numpy()
            _check_width(h.hidden, h.topk_idx.shape[1])
            assert h.recv_src_k is not None
            payload = _padded_columns(dots, h.recv_src_k, h.hidden, dtype)
            ones = np.ones(h.topk_idx.shape, dtype=np.float32)
            back = from_numpy(backend.combine(payload, h.inner, ones), dtype)
            grad_w = back[:, : h.topk_idx.shape[1]].to(ctx.w_dtype)
        return grad_out, grad_w, None, None


def _combine_weights(backend: EPBackend, topk_weights: torch.Tensor) -> np.ndarray | None:
    if backend.layout != "expert":
        return None
    return to_numpy(_weights(topk_weights.detach()), argument="topk_weights")


def _check_width(hidden: int, num_topk: int) -> None:
    if hidden < num_topk:
        raise InvalidArgumentError(
            "hidden",
            hidden,
            f"routing-weight gradients travel in a row; need hidden >= num_topk={num_topk}",
        )


def dispatch(
    buffer: Any, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
    return_recv_hook: bool = False,
) -> Any:
    """Send each token of ``x`` to the ranks of its experts (differentiable in ``x`` and weights).
    Returns a :class:`DispatchResult`, or with ``return_recv_hook`` a :class:`PendingOp` whose
    ``hook()`` returns it (this rank's rows are sent; the receive runs in the hook).

    Args:
        buffer: a ``ubep.Buffer`` or any :class:`~ubep.torch.backend.EPBackend`.
        x: ``[num_tokens, hidden]`` CPU tensor, bf16/fp16/fp32 (float64 on the in-process fake).
        topk_idx: ``[num_tokens, num_topk]`` int64, ``-1`` = masked slot.
        topk_weights: ``[num_tokens, num_topk]`` float32.
    """
    backend = as_backend(buffer)
    if backend.layout not in ("expert", "rank"):  # the padded places are DeepEP's facade's
        raise InvalidArgumentError("layout", backend.layout,
                                   "the autograd ops take layout='expert' or 'rank'")
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype != torch.int64:
        raise InvalidArgumentError(
            "topk_idx", getattr(topk_idx, "dtype", type(topk_idx)), "must be an int64 tensor"
        )
    if not isinstance(topk_weights, torch.Tensor) or not topk_weights.is_floating_point():
        raise InvalidArgumentError(
            "topk_weights",
            getattr(topk_weights, "dtype", type(topk_weights)),
            "must be a float tensor",
        )
    if x.ndim != 2:
        raise InvalidArgumentError("x", tuple(x.shape), "must be 2-D [num_tokens, hidden]")
    idx_np = np.ascontiguousarray(to_numpy(topk_idx, argument="topk_idx"))
    grad = torch.is_grad_enabled()
    if not return_recv_hook:
        return _dispatch_result(x, topk_weights, backend, idx_np, grad, None)
    issued = issue_dispatch(backend, _payload(x, "x"), idx_np,
                            to_numpy(_weights(topk_weights), argument="topk_weights"))

    def finish() -> DispatchResult:
        with torch.set_grad_enabled(grad):
            return _dispatch_result(x, topk_weights, backend, idx_np, grad, issued)

    return PendingOp(finish)


def _dispatch_result(x: torch.Tensor, topk_weights: torch.Tensor, backend: EPBackend,
                     idx_np: np.ndarray, grad: bool, issued: Any) -> DispatchResult:
    box: list[Any] = []
    recv_x, recv_w = _Dispatch.apply(x, topk_weights, backend, idx_np, grad, box, issued)
    res = box[0]
    src_k = getattr(res, "recv_src_k", None)
    handle = Handle(
        backend=backend,
        inner=res.handle,
        topk_idx=idx_np,
        topk_weights=topk_weights,
        recv_src_k=None if src_k is None else np.asarray(src_k, dtype=np.int64),
        num_recv_rows=int(recv_x.shape[0]),
        hidden=int(x.shape[1]),
        dtype=x.dtype,
    )
    return DispatchResult(
        recv_x=recv_x,
        recv_topk_idx=torch.from_numpy(np.array(res.recv_topk_idx, dtype=np.int64)),
        recv_topk_weights=recv_w,
        num_recv_tokens_per_expert=[int(n) for n in np.asarray(res.num_recv_tokens_per_expert)],
        recv_src_rank=torch.from_numpy(np.array(res.recv_src_rank, dtype=np.int64)),
        recv_src_token=torch.from_numpy(np.array(res.recv_src_token, dtype=np.int64)),
        handle=handle,
    )


def combine(
    expert_out: torch.Tensor, handle: Handle, topk_weights: torch.Tensor | None = None,
    return_recv_hook: bool = False,
) -> Any:
    """Bring expert outputs back to their source tokens and reduce them (differentiable).
    Returns ``y``, or with ``return_recv_hook`` a :class:`PendingOp` whose ``hook()`` does.

    Expert layout: ``y[t] = sum_k w[t, k] * expert_out(t, k)`` with ``w = topk_weights`` if given,
    else the weights given to :func:`dispatch` (their gradient flows back to that tensor).
    Rank layout: ``y[t] = sum over ranks of the row sent back`` (no weights; ``topk_weights``
    must be None).

    Args:
        expert_out: ``[rows, hidden]`` one row per received row, in ``recv_x``'s order and dtype.
        handle: ``DispatchResult.handle``.
    """
    if not isinstance(handle, Handle):
        raise InvalidArgumentError("handle", type(handle).__name__, "must be DispatchResult.handle")
    if expert_out.shape != (handle.num_recv_rows, handle.hidden):
        raise InvalidArgumentError(
            "expert_out",
            tuple(expert_out.shape),
            f"must be [{handle.num_recv_rows}, {handle.hidden}]",
        )
    if expert_out.dtype != handle.dtype:
        raise InvalidArgumentError("expert_out", expert_out.dtype, f"must be {handle.dtype} like x")
    if handle.backend.layout == "rank":
        if topk_weights is not None:
            raise InvalidArgumentError(
                "topk_weights", "given", "the rank layout combines without weights"
            )
        w = handle.topk_weights.detach()
    else:
        w = handle.topk_weights if topk_weights is None else topk_weights
        if tuple(w.shape) != handle.topk_idx.shape:
            raise InvalidArgumentError(
                "topk_weights", tuple(w.shape), f"must be {handle.topk_idx.shape}"
            )
    if not return_recv_hook:
        y: torch.Tensor = _Combine.apply(expert_out, w, handle, None)
        return y
    issued = issue_combine(handle.backend, _payload(expert_out, "expert_out"), handle.inner,
                           _combine_weights(handle.backend, w))
    grad = torch.is_grad_enabled()

    def finish() -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            out: torch.Tensor = _Combine.apply(expert_out, w, handle, issued)
            return out

    return PendingOp(finish)
