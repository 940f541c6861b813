"""A single-process reference for DeepEP V2's dispatch and combine (``ubep.deep_ep.ElasticBuffer``
/ ``EPBuffer``), written from DeepEP's documented semantics (its ``deep_ep/utils/refs.py`` and
tests), on the global inputs every rank rebuilds from seeds. It shares no code with the facade.

* dispatch (compact): rank ``r`` receives, for every source rank ``p`` in order and every token
  ``t`` of ``p`` in order that has an expert on ``r``, the token's row; ``recv_topk_idx`` holds
  the local expert ids of ``r``'s slots (-1 elsewhere), ``src_token_global_idx = p *
  num_max_tokens_per_rank + t``.
* expanded: local expert ``e``'s rows in the same order, one per (row, slot) holding ``e``, in a
  block starting at the sum of the earlier experts' counts rounded up to ``expert_alignment``.
* combine: DeepEP's reference ``combine`` with ``reduce_in_local`` (a rank's rows of one token
  reduced first, FP32 from +0.0 in slot order, cast to BF16, placed at the rank's last slot) or
  without it (every (token, slot) row on its own); then ``bias_0 + bias_1`` in FP32 plus every
  slot in order, cast once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ubep.torch.fp8 import quantize_fp8


@dataclass(frozen=True)
class Case:
    """One configuration of a V2 flow (every field a switch of the matrix)."""

    expert_alignment: int = 1
    fp8: bool = False
    num_bias: int = 0
    deferred: bool = False
    do_cpu_sync: bool = True
    skewed: bool = False
    seed: int = 0


@dataclass(frozen=True)
class Shape:
    num_ranks: int
    num_experts: int = 8
    hidden: int = 256
    num_topk: int = 3
    num_max_tokens_per_rank: int = 7

    @property
    def local(self) -> int:
        return self.num_experts // self.num_ranks


def num_tokens(shape: Shape, rank: int) -> int:
    """Uneven token counts: ``num_max_tokens_per_rank - rank % 3`` (at least 1)."""
    return max(1, shape.num_max_tokens_per_rank - rank % 3)


def inputs(shape: Shape, case: Case, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s ``x`` (BF16, or the FP8 pair), ``topk_idx`` (distinct experts, about a
    fifth masked; ``skewed``: most picks on rank 0's experts), ``topk_weights`` and biases."""
    g = torch.Generator().manual_seed(1000 * case.seed + rank)
    n, E, K, H = num_tokens(shape, rank), shape.num_experts, shape.num_topk, shape.hidden
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    prefs = torch.ones(E)
    if case.skewed:
        prefs[: shape.local] = 30.0
    idx = torch.stack([torch.multinomial(prefs, K, replacement=False, generator=g)
                       for _ in range(n)]).to(torch.int64)
    idx[torch.rand(n, K, generator=g) < 0.2] = -1
    w = torch.rand(n, K, generator=g, dtype=torch.float32).masked_fill(idx < 0, 0.0)
    bias = tuple(torch.randn(n, H, generator=g).to(torch.bfloat16) for _ in range(case.num_bias))
    out: dict[str, Any] = {"x": x, "topk_idx": idx, "topk_weights": w, "bias": bias}
    if case.fp8:
        out["x_fp8"] = quantize_fp8(x, round_scale=False)
    return out


def expert_rows(src_global: torch.Tensor, k: int, hidden: int) -> torch.Tensor:
    """What an "expert" returns for (token, slot k): a closed form of the token's global index
    (BF16 rows, distinct per token and slot). Slots after the first are scaled by ``2 ** 20``:
    large rows of either sign next to small ones (and the bias), so FP32 partial sums round and
    a different reduction order changes bits."""
    seed = (src_global.to(torch.float64) * 7 + k + 1)[:, None]
    cols = torch.arange(1, hidden + 1, dtype=torch.float64)[None, :]
    return (torch.sin(seed * cols * 0.37) * 2.0 ** (20 * min(k, 1))).to(torch.bfloat16)


def dispatch(shape: Shape, everyone: list[dict[str, Any]], rank: int, fp8: bool) -> dict[str, Any]:
    """Compact dispatch at ``rank``: rows, scales, local topk ids, weights, global source
    indices and rows per source rank."""
    L, K = shape.local, shape.num_topk
    rows, sfs, idxs, ws, srcs, per_rank = [], [], [], [], [], []
    for p, inp in enumerate(everyone):
        count = 0
        for t in range(inp["topk_idx"].shape[0]):
            experts = inp["topk_idx"][t]
            mine = (experts >= rank * L) & (experts < (rank + 1) * L)
            if not bool(mine.any()):
                continue
            count += 1
            if fp8:
                rows.append(inp["x_fp8"][0][t].view(torch.uint8))
                sfs.append(inp["x_fp8"][1][t])
            else:
                rows.append(inp["x"][t])
            idxs.append(torch.where(mine, experts - rank * L, -1))
            ws.append(inp["topk_weights"][t])
            srcs.append(p * shape.num_max_tokens_per_rank + t)
        per_rank.append(count)
    empty_row = torch.zeros(0, shape.hidden, dtype=torch.uint8 if fp8 else torch.bfloat16)
    return {
        "recv_x": torch.stack(rows) if rows else empty_row,
        "recv_sf": torch.stack(sfs) if sfs else None,
        "recv_topk_idx": torch.stack(idxs) if idxs else torch.zeros(0, K, dtype=torch.int64),
        "recv_topk_weights": torch.stack(ws) if ws else torch.zeros(0, K, dtype=torch.float32),
        "src_global": torch.tensor(srcs, dtype=torch.int64),
        "per_rank": per_rank,
    }


def expanded(ref: dict[str, Any], shape: Shape, alignment: int) -> dict[str, Any]:
    """Expanded layout of a compact reference: per expert its counts, block starts and the
    (row, slot) in each expanded row."""
    idx = ref["recv_topk_idx"]
    counts, starts, slot_of = [], [], {}
    start = 0
    for e in range(shape.local):
        starts.append(start)
        pairs = [(r, k) for r in range(idx.shape[0]) for k in range(shape.num_topk)
                 if int(idx[r, k]) == e]
        for i, pair in enumerate(pairs):
            slot_of[start + i] = pair
        counts.append(len(pairs))
        start += math.ceil(len(pairs) / alignment) * alignment
    return {"counts": counts, "starts": starts, "slot_of": slot_of, "num_rows": start}


def local_partial(src_global: torch.Tensor, local_idx: torch.Tensor, hidden: int) -> torch.Tensor:
    """What a DeepEP caller feeds a compact combine: per received row, +0.0 plus its local
    slots' expert rows in slot order, FP32, cast to BF16."""
    acc = torch.zeros(src_global.shape[0], hidden, dtype=torch.float32)
    for k in range(local_idx.shape[1]):
        ok = (local_idx[:, k] >= 0)[:, None]
        acc = acc + torch.where(ok, expert_rows(src_global, k, hidden).float(), 0.0)
    return acc.to(torch.bfloat16)


def combine(shape: Shape, inp: dict[str, Any], rank: int, reduce_in_local: bool
            ) -> torch.Tensor:
    """DeepEP's reference combine at source ``rank`` with expert rows :func:`expert_rows`."""
    idx, H, K = inp["topk_idx"], shape.hidden, shape.num_topk
    n = idx.shape[0]
    src = rank * shape.num_max_tokens_per_rank + torch.arange(n)
    y = torch.stack([expert_rows(src, k, H) for k in range(K)], dim=1)  # [n, K, H]
    y[idx < 0] = 0
    if reduce_in_local:
        owner = torch.where(idx >= 0, idx // shape.local, -1)
        reduced = torch.zeros_like(y)
        for t in range(n):
            for r in set(owner[t].tolist()):
                slots = [k for k in range(K) if int(owner[t, k]) == r]
                acc = torch.zeros(H, dtype=torch.float32)
                for k in slots:
                    acc = acc + y[t, k].float()
                reduced[t, slots[-1]] = acc.to(torch.bfloat16)
        y = reduced
    acc = torch.zeros(n, H, dtype=torch.float32)
    if inp["bias"]:
        acc = inp["bias"][0].float()
        for b in inp["bias"][1:]:
            acc = acc + b.float()
    for k in range(K):
        acc = acc + y[:, k].float()
    return acc.to(torch.bfloat16)


def bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's raw bytes (compare BF16/FP8 bit for bit)."""
    return t.detach().contiguous().view(torch.uint8).numpy().copy()
