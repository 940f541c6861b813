"""A mixture-of-experts layer that runs its experts expert-parallel through ubep.

``MoELayer`` = router (softmax top-k, renormalised) -> :func:`~ubep.torch.dispatch` -> SwiGLU FFN
of each local expert over its rows (one batched matmul per expert, never a loop over tokens) ->
:func:`~ubep.torch.combine`.

Weights come from the seed alone: the router from one generator, expert ``e`` from its own
generator seeded with ``(seed, e)``. Every rank therefore holds exactly the experts a dense copy
would hold for the same ids, and generates only its own (rank ``r`` owns experts
``[r*E/R, (r+1)*E/R)``). ``MoELayer(..., buffer=None)`` is the dense single-process layer with all
experts; :meth:`MoELayer.forward_dense` computes what N ranks compute, from their N inputs.

Accuracy contract (tested): for the ``"expert"`` layout the distributed output equals
``forward_dense`` bit for bit, because both run each expert's FFN on the same rows in the same
order (every rank's rows in ascending rank, then token) and reduce ``w * out`` over ``k`` in
ascending order in float32, provided both run their matmuls on the same number of intra-op
threads (``torch.set_num_threads``): MKL's sgemm splits its reductions by thread count, so 1 and
2 threads differ in the last bits of the same product. The ``"rank"`` layout adds a token's
experts per rank first and then across ranks, a different association of the same float32
sum: equal within ``rtol=1e-5, atol=1e-6`` in float32 (BF16: the per-rank partial sum is rounded
to BF16 once more, ``rtol=atol=2e-2``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import InvalidArgumentError
from .backend import EPBackend, as_backend
from .ops import combine, dispatch

__all__ = ["MoELayer", "expert_seed", "route", "swiglu"]


def expert_seed(seed: int, expert: int) -> int:
    """Generator seed of expert ``expert`` (``-1`` = the router) under layer seed ``seed``."""
    return (int(seed) * 1_000_003 + int(expert) + 1) % (2**63)


def route(
    x: torch.Tensor, router_weight: torch.Tensor, top_k: int, *, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing (Qwen3-MoE style) in float32 (float64 for float64 inputs).

    Returns ``topk_idx [num_tokens, top_k]`` int64 (descending probability) and
    ``topk_weights [num_tokens, top_k]`` float32 (float64 for float64 inputs), renormalised to
    sum to 1 when ``normalize``.
    """
    acc = _acc_dtype(x.dtype)
    logits = x.to(acc) @ router_weight.to(acc).t()
    probs = torch.softmax(logits, dim=-1)
    topk_weights, topk_idx = torch.topk(probs, top_k, dim=-1)
    if normalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_idx, topk_weights


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 accumulation for every payload type, as combine does; float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down @ (silu(gate @ x) * (up @ x))`` for rows ``x [n, hidden]``; ``gate_up [2F, hidden]``
    stacks the gate rows over the up rows (the Hugging Face layout), ``down [hidden, F]``."""
    gate, up = nn.functional.linear(x, gate_up).chunk(2, dim=-1)
    return nn.functional.linear(nn.functional.silu(gate) * up, down)


class MoELayer(nn.Module):
    """Router + top-k SwiGLU experts, expert-parallel over ``buffer`` (dense when it is None).

    Args:
        hidden: model width.
        ffn_hidden: each expert's intermediate width.
        num_experts: experts in total (a multiple of the number of ranks).
        top_k: experts per token.
        buffer: a ``ubep.Buffer`` (or any :class:`~ubep.torch.backend.EPBackend`); None = dense.
        seed: weight seed, the same on every rank.
        dtype: parameter and activation dtype (the router always computes in float32).
        normalize: renormalise the top-k weights to sum to 1.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        top_k: int,
        buffer: Any = None,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        normalize: bool = True,
    ) -> None:
        super().__init__()
        for name, value in (
            ("hidden", hidden),
            ("ffn_hidden", ffn_hidden),
            ("num_experts", num_experts),
        ):
            if value < 1:
                raise InvalidArgumentError(name, value, "must be >= 1")
        if not 1 <= top_k <= num_experts:
            raise InvalidArgumentError("top_k", top_k, f"must be in [1, num_experts={num_experts}]")
        self.backend: EPBackend | None = None if buffer is None else as_backend(buffer)
        rank, num_ranks = (
            (0, 1) if self.backend is None else (self.backend.rank, self.backend.num_ranks)
        )
        if self.backend is not None and self.backend.num_experts != num_experts:
            raise InvalidArgumentError(
                "num_experts", num_experts, f"buffer was built for {self.backend.num_experts}"
            )
        if num_experts % num_ranks:
            raise InvalidArgumentError(
                "num_experts", num_experts, f"must be divisible by num_ranks={num_ranks}"
            )
        self.hidden, self.ffn_hidden = hidden, ffn_hidden
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize
        self.num_local_experts = num_experts // num_ranks
        self.first_expert = rank * self.num_local_experts
        self.router = nn.Parameter(self._randn((num_experts, hidden), seed, -1, hidden, dtype))
        gate_up, down = [], []
        for e in range(self.first_expert, self.first_expert + self.num_local_experts):
            gate_up.append(self._randn((2 * ffn_hidden, hidden), seed, e, hidden, dtype))
            down.append(self._randn((hidden, ffn_hidden), seed, e, ffn_hidden, dtype, offset=1))
        self.gate_up_proj = nn.Parameter(torch.stack(gate_up))
        self.down_proj = nn.Parameter(torch.stack(down))

    @staticmethod
    def _randn(
        shape: tuple[int, int],
        seed: int,
        expert: int,
        fan_in: int,
        dtype: torch.dtype,
        offset: int = 0,
    ) -> torch.Tensor:
        gen = torch.Generator().manual_seed(expert_seed(seed, expert) * 2 + offset)
        w = torch.randn(shape, generator=gen, dtype=torch.float32) / fan_in**0.5
        return w.to(dtype)

    # ------------------------------------------------------------------ experts
    def _expert_rows(self, local: int, rows: torch.Tensor) -> torch.Tensor:
        return swiglu(rows, self.gate_up_proj[local], self.down_proj[local])

    def _experts_expert_layout(self, recv_x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        # Rows arrive grouped by local expert: one matmul per expert over its contiguous segment.
        pieces, start = [], 0
        for local, n in enumerate(counts):
            if n:
                pieces.append(self._expert_rows(local, recv_x[start : start + n]))
            start += n
        if not pieces:
            return recv_x.new_zeros((0, self.hidden))
        return torch.cat(pieces)

    def _experts_rank_layout(
        self, recv_x: torch.Tensor, recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor
    ) -> torch.Tensor:
        # One row per (token, this rank): add w * expert(x) over the token's local experts in
        # ascending expert order, in float32, then round once to the payload dtype.
        acc_dtype = _acc_dtype(recv_x.dtype)
        acc = torch.zeros((recv_x.shape[0], self.hidden), dtype=acc_dtype)
        for local in range(self.num_local_experts):
            rows, slot = torch.nonzero(recv_topk_idx == local, as_tuple=True)
            if rows.numel():
                h = self._expert_rows(local, recv_x[rows]).to(acc_dtype)
                acc = acc.index_add(0, rows, h * recv_topk_weights[rows, slot, None])
        return acc.to(recv_x.dtype)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [num_tokens, hidden]`` -> ``[num_tokens, hidden]`` (this rank's tokens)."""
        if x.ndim != 2 or x.shape[1] != self.hidden:
            raise InvalidArgumentError("x", tuple(x.shape), f"must be [num_tokens, {self.hidden}]")
        if self.backend is None:
            return self.forward_dense([x])[0]
        topk_idx, topk_weights = route(x, self.router, self.top_k, normalize=self.normalize)
        res = dispatch(self.backend, x, topk_idx, topk_weights)
        if self.backend.layout == "expert":
            out = self._experts_expert_layout(res.recv_x, res.num_recv_tokens_per_expert)
        else:
            out = self._experts_rank_layout(res.recv_x, res.recv_topk_idx, res.recv_topk_weights)
        return combine(out, res.handle)

    def forward_dense(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What ranks ``0..N-1`` compute for inputs ``xs``, in one process (all experts needed).

        Each input is routed on its own (as its rank would); each expert runs once over the rows
        routed to it from every input in input order, then token order; ``w * out`` is added over
        ``k`` in ascending order in float32 and rounded once to the input dtype.
        """
        if self.num_local_experts != self.num_experts:
            raise InvalidArgumentError(
                "self", "expert-parallel layer", "forward_dense needs a dense layer (buffer=None)"
            )
        routed = [route(x, self.router, self.top_k, normalize=self.normalize) for x in xs]
        x_all = torch.cat(list(xs))
        idx_all = torch.cat([r[0] for r in routed])
        w_all = torch.cat([r[1] for r in routed])
        num_tokens = x_all.shape[0]
        acc = _acc_dtype(x_all.dtype)
        per_slot = torch.zeros((num_tokens, self.top_k, self.hidden), dtype=acc)
        for e in range(self.num_experts):
            rows, slot = torch.nonzero(idx_all == e, as_tuple=True)
            if rows.numel():
                h = self._expert_rows(e, x_all[rows]).to(acc)
                per_slot = per_slot.index_put((rows, slot), h)
        y = torch.zeros((num_tokens, self.hidden), dtype=acc)
        for k in range(self.top_k):
            y = y + w_all[:, k, None] * per_slot[:, k]
        return list(y.to(x_all.dtype).split([x.shape[0] for x in xs]))
