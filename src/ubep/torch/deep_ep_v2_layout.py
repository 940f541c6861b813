"""DeepEP V2's receive layouts and combine order, from one rank-layout dispatch (numpy, no I/O).

``ubep.torch.deep_ep_v2`` moves every row once through a ubep ``layout="rank"`` dispatch (one
row per (token, destination rank)); this module turns what a rank received into V2's outputs
and metadata, and defines the reduction the combine runs at each token's source.

Receive order: rows sorted by ``src_token_global_idx = src_rank * num_max_tokens_per_rank +
src_token`` (source rank, then token), which is the order DeepEP's ``deterministic=True``
produces; ubep always produces it.

Expanded layout (``do_expand``): local expert ``e`` owns rows ``[start[e], start[e] +
count[e])`` with ``start[e] = sum(align(count[j], expert_alignment) for j < e)``; inside a block
rows follow the receive order (then the top-k slot); the gaps up to the next aligned start are
zero rows.

Combine order (bit-exact, DeepEP's reference ``combine``): at the source, token ``t``'s result
is ``acc = float(bias_0) + float(bias_1)`` (or ``+0.0`` without bias), then for ``k = 0 ..
num_topk - 1`` in order ``acc += c[t, k]`` in FP32, then one cast to BF16. ``c[t, k]`` is the
row the rank owning ``topk_idx[t, k]`` sent back when ``k`` is that rank's last slot of the
token, else 0 (a masked slot is 0). Without ``allow_multiple_reduction`` an expanded combine
sends one row per (token, slot) and ``c[t, k]`` is that row. A rank's row of an expanded combine
with ``allow_multiple_reduction`` is ``+0.0`` plus its expanded rows in slot order, in FP32, cast
once to BF16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..runtime.abi import native_or_none

__all__ = [
    "Received", "SourceRoute", "align", "expanded_slots", "masked_weights", "received",
    "reduce_at_source",
    "reduce_local", "source_route", "worst_case_rows",
]


def align(value: int, alignment: int) -> int:
    return -(-int(value) // int(alignment)) * int(alignment)


def worst_case_rows(num_ranks: int, num_max_tokens_per_rank: int, num_topk: int,
                    num_local_experts: int, expert_alignment: int) -> tuple[int, int]:
    """Rows of the outputs without a CPU sync, as DeepEP allocates them: ``(compact,
    expanded)``."""
    compact = num_ranks * num_max_tokens_per_rank
    expanded = compact * min(num_topk, num_local_experts)
    expanded += (expert_alignment - 1) * num_local_experts
    return compact, align(expanded, expert_alignment)


@dataclass(frozen=True)
class Received:
    """One rank's received rows (in the receive order) and what V2 derives from them.

    Attributes:
        order: permutation of the engine's rows into the receive order.
        src_rank, src_token: ``[n]`` int64 origin of each row.
        local_idx: ``[n, num_topk]`` int64 local expert id of each slot, -1 elsewhere.
        counts: ``[num_local_experts]`` int64 (row, slot) pairs per local expert.
        aligned: ``counts`` rounded up to ``expert_alignment``.
        start: ``[num_local_experts]`` first expanded row of each expert.
        rows_per_rank: ``[num_ranks]`` int64 rows from each source rank.
        in_order: the engine's rows were in the receive order (``order`` is the identity).
        slots: ``[n, num_topk]`` int64 expanded row of each local slot, -1 elsewhere (made when
            first read: only an expanded layout's calls read it).
    """

    order: np.ndarray
    src_rank: np.ndarray
    src_token: np.ndarray
    local_idx: np.ndarray
    counts: np.ndarray
    aligned: np.ndarray
    start: np.ndarray
    rows_per_rank: np.ndarray
    in_order: bool = False

    @property
    def num_rows(self) -> int:
        return int(self.src_rank.shape[0])

    @functools.cached_property
    def slots(self) -> np.ndarray:
        return expanded_slots(self.local_idx, self.start)


def received(src_rank: np.ndarray, src_token: np.ndarray, local_idx: np.ndarray,
             num_ranks: int, num_local_experts: int, num_topk: int,
             expert_alignment: int) -> Received:
    """Sort a rank-layout dispatch's rows into the receive order and count them."""
    # copies: a handle keeps them, an engine may fill its own arrays again
    rank = np.array(src_rank, dtype=np.int64)
    token = np.array(src_token, dtype=np.int64)
    idx = np.array(local_idx, dtype=np.int64).reshape(rank.shape[0], num_topk)
    n = rank.shape[0]
    native = native_or_none()
    if native is not None:  # the counts and the order check in one pass
        counts = np.empty(num_local_experts, dtype=np.int64)
        aligned, start = np.empty_like(counts), np.empty_like(counts)
        per_rank = np.empty(num_ranks, dtype=np.int64)
        if native.received_counts(rank, token, idx, num_ranks, num_local_experts,
                                  expert_alignment, counts, aligned, start, per_rank):
            return Received(np.arange(n), rank, token, idx, counts, aligned, start, per_rank,
                            True)
    # the engines land each source's rows in a block of its own, sources ascending, tokens
    # ascending inside: already the receive order (one compare of the (rank, token) keys
    # instead of a sort and three gathers), else sorted
    key = (rank << 32) | token
    if n > 1 and not bool((key[1:] > key[:-1]).all()):
        order = np.lexsort((token, rank))
        rank, token, idx = rank[order], token[order], idx[order]
        in_order = False
    else:
        order, in_order = np.arange(n), True
    local = idx[(idx >= 0) & (idx < num_local_experts)]
    counts = np.bincount(local, minlength=num_local_experts).astype(np.int64)
    aligned = -(-counts // expert_alignment) * expert_alignment
    start = np.concatenate([[0], np.cumsum(aligned)[:-1]]).astype(np.int64)
    return Received(order, rank, token, idx, counts, aligned, start,
                    np.bincount(rank, minlength=num_ranks), in_order)


def expanded_slots(local_idx: np.ndarray, start: np.ndarray) -> np.ndarray:
    """``[n, num_topk]``: the expanded row of each local (row, slot), -1 elsewhere; inside an
    expert's block in row order, then slot order."""
    slots = np.full(local_idx.shape, -1, dtype=np.int64)
    flat = local_idx.reshape(-1)
    where = np.nonzero((flat >= 0) & (flat < start.size))[0]  # row-major: rows, then slots
    expert = flat[where]
    # a stable sort by expert keeps the row-major order inside each expert's block
    by_expert = np.argsort(expert, kind="stable")
    counts = np.bincount(expert, minlength=start.size)
    first_in_sorted = np.cumsum(counts) - counts  # each expert's first place in the sorted list
    sorted_expert = expert[by_expert]
    place = np.arange(by_expert.size) - first_in_sorted[sorted_expert] + start[sorted_expert]
    slots.reshape(-1)[where[by_expert]] = place
    return slots


@dataclass(frozen=True)
class SourceRoute:
    """How a source rank's tokens went out, by destination rank.

    Attributes:
        owner: ``[num_tokens, num_topk]`` int64 rank owning each slot's expert, -1 if masked.
        num_ranks: ranks of the group.
        last: ``[num_tokens, num_topk]`` bool, the slot is its rank's last slot of the token.
        tokens_to: per destination rank, the tokens sent there, ascending.

    ``last`` and ``tokens_to`` are made when first read (a combine that sums in the core and a
    handle whose slots are never read need neither).
    """

    owner: np.ndarray
    num_ranks: int

    @functools.cached_property
    def last(self) -> np.ndarray:
        owner = self.owner
        num_topk = owner.shape[1]
        # later[t, k, j]: slot j > k of token t has slot k's rank
        after = np.triu(np.ones((num_topk, num_topk), dtype=bool), k=1)
        later = (owner[:, :, None] == owner[:, None, :]) & after[None]
        last: np.ndarray = (owner >= 0) & ~later.any(axis=2)
        return last

    @functools.cached_property
    def tokens_to(self) -> list[np.ndarray]:
        return [np.nonzero((self.owner == r).any(axis=1))[0] for r in range(self.num_ranks)]


def masked_weights(topk_idx: np.ndarray, topk_weights: np.ndarray | None,
                   num_experts: int) -> np.ndarray | None:
    """A dispatch's float32 weights: ``topk_weights`` where the slot is routed, 0.0 where it is
    masked (-1), zeros without weights; None if an id is neither -1 nor in ``[0,
    num_experts)``. One native pass where the build has it (``topk_idx`` int64 C order)."""
    native = native_or_none()
    out = np.empty(topk_idx.shape, dtype=np.float32)
    if native is not None and topk_idx.dtype == np.int64 and topk_idx.flags.c_contiguous and (
            topk_weights is None or (topk_weights.dtype == np.float32
                                     and topk_weights.flags.c_contiguous)):
        return out if native.masked_weights(topk_idx, topk_weights, num_experts, out,
                                            False) else None
    if topk_idx.size and (topk_idx.min() < -1 or topk_idx.max() >= num_experts):
        return None
    out[...] = 0.0 if topk_weights is None else np.where(topk_idx >= 0, topk_weights, 0.0)
    return out


def source_route(topk_idx: np.ndarray, num_experts: int, num_ranks: int) -> SourceRoute:
    per_rank = num_experts // num_ranks
    owner = topk_idx // per_rank  # -1 // per_rank is -1: a masked slot keeps -1
    return SourceRoute(owner, num_ranks)


def reduce_local(x: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
    """An expanded combine's per-rank reduction: for each received row, ``+0.0`` plus its
    expanded rows in slot order in FP32, cast once to ``x.dtype`` (``[n, hidden]``). A slot
    that is not local adds +0.0, which leaves the sum as it is (it is never -0.0)."""
    n, num_topk = slots.shape
    padded = torch.cat([x, torch.zeros((1, x.shape[1]), dtype=x.dtype)])  # row len(x): zeros
    pick = torch.from_numpy(np.where(slots >= 0, slots, x.shape[0]).T.copy())  # [num_topk, n]
    terms = padded[pick].float()
    acc = torch.zeros((n, x.shape[1]), dtype=torch.float32)
    for k in range(num_topk):
        acc.add_(terms[k])
    return acc.to(x.dtype)


def reduce_at_source(rows: torch.Tensor, row_of: np.ndarray, use: np.ndarray,
                     bias: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    """The combine's final reduction: token ``t``'s result is the FP32 bias sum (``+0.0``
    without bias) plus, for ``k`` in order, ``c[t, k]`` = ``rows[row_of[t, k]]`` where
    ``use[t, k]`` else ``+0.0``, cast once to ``dtype`` (``[num_tokens, hidden]``).

    DeepEP adds every term, the ``+0.0`` ones too. Only the used terms are gathered and added
    here (slot by slot, one FP32 add per token and slot, as DeepEP's): adding ``+0.0`` leaves
    every sum as it is but a ``-0.0`` one, which it makes ``+0.0``, and a sum can be ``-0.0``
    only from a ``-0.0`` start and ``-0.0`` terms alone; so a token with an unused slot has
    ``+0.0`` added once at the end, which gives DeepEP's bits."""
    num_tokens, num_topk = use.shape
    if bias:
        acc = bias[0].to(torch.float32, copy=True)
        for b in bias[1:]:
            acc = acc + b.float()
    else:
        acc = torch.zeros((num_tokens, rows.shape[1]), dtype=torch.float32)
    for k in range(num_topk):  # slot order
        tokens = np.flatnonzero(use[:, k])
        if tokens.size:
            terms = rows.index_select(0, torch.from_numpy(row_of[tokens, k].astype(np.int64)))
            acc.index_add_(0, torch.from_numpy(tokens), terms.float())
    unused = torch.from_numpy(~use.all(axis=1))
    if bool(unused.any()):
        acc[unused] += 0.0
    return acc.to(dtype)
