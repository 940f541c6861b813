"""Routing: DeepEP's dispatch layout and seeded top-k generators.

``topk_idx`` is ``[num_tokens, num_topk]`` int64; ``-1`` marks a masked slot (no expert). Experts
are placed contiguously: rank ``r`` owns experts ``[r*E/R, (r+1)*E/R)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InvalidArgumentError

__all__ = [
    "DispatchLayout",
    "experts_per_rank",
    "get_dispatch_layout",
    "hot_experts_topk",
    "uniform_topk",
    "validate_topk_idx",
    "zipf_topk",
]


@dataclass(frozen=True)
class DispatchLayout:
    """What DeepEP's ``get_dispatch_layout`` returns.

    Attributes:
        num_tokens_per_rank: ``[num_ranks]`` int64, tokens with at least one expert on that rank.
        num_tokens_per_expert: ``[num_experts]`` int64, valid (token, k) picks of each expert.
        is_token_in_rank: ``[num_tokens, num_ranks]`` bool.
    """

    num_tokens_per_rank: np.ndarray
    num_tokens_per_expert: np.ndarray
    is_token_in_rank: np.ndarray


def experts_per_rank(num_experts: int, num_ranks: int) -> int:
    """Experts each rank owns; raises if ``num_experts`` is not a multiple of ``num_ranks``."""
    if not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
        raise InvalidArgumentError("num_ranks", num_ranks, "must be a positive integer")
    if not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
        raise InvalidArgumentError("num_experts", num_experts, "must be a positive integer")
    if num_experts % num_ranks:
        raise InvalidArgumentError(
            "num_experts", num_experts, f"must be divisible by num_ranks={num_ranks}"
        )
    return int(num_experts // num_ranks)


def validate_topk_idx(
    topk_idx: object, num_experts: int, *, argument: str = "topk_idx", num_tokens: int | None = None
) -> np.ndarray:
    """Check ``topk_idx`` and return it as a C-contiguous int64 array.

    Rejects: not 2-D, non-integer dtype, ids outside ``[-1, num_experts)``, the same expert twice
    in one row, and (when ``num_tokens`` is given) a row count that differs from it.
    """
    arr = np.asarray(topk_idx)
    if arr.ndim != 2:
        raise InvalidArgumentError(argument, arr.shape, "must be 2-D [num_tokens, num_topk]")
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(argument, arr.dtype, "must be an integer array (int64)")
    if num_tokens is not None and arr.shape[0] != num_tokens:
        raise InvalidArgumentError(
            argument, arr.shape, f"has {arr.shape[0]} rows but x has {num_tokens} tokens"
        )
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if arr.size:
        # sorted rows give the range (first and last columns) and the repeats (neighbours)
        srt = np.sort(arr, axis=1)
        lo, hi = int(srt[:, 0].min()), int(srt[:, -1].max())
        if lo < -1 or hi >= num_experts:
            bad = lo if lo < -1 else hi
            raise InvalidArgumentError(
                argument, bad, f"expert id out of range [-1, {num_experts}) (num_experts)"
            )
        dup = srt[:, 1:] == srt[:, :-1]
        dup &= srt[:, 1:] >= 0
        if dup.any():
            row = int(np.nonzero(dup.any(axis=1))[0][0])
            raise InvalidArgumentError(
                argument, arr[row].tolist(), f"row {row} names the same expert twice"
            )
    return arr


def get_dispatch_layout(topk_idx: object, num_experts: int, num_ranks: int) -> DispatchLayout:
    """DeepEP's ``get_dispatch_layout`` for one rank's ``topk_idx``."""
    per_rank = experts_per_rank(num_experts, num_ranks)
    idx = validate_topk_idx(topk_idx, num_experts)
    valid = idx >= 0
    num_tokens_per_expert = np.asarray(np.bincount(idx[valid], minlength=num_experts),
                                       dtype=np.int64)
    # each pick marks its rank's column of its token's row; a masked one the spare column past
    # the last rank (one scatter into the flat rows)
    width = num_ranks + 1
    owner = idx // per_rank
    owner[~valid] = num_ranks
    owner += np.arange(0, idx.shape[0] * width, width)[:, None]
    hit = np.zeros(idx.shape[0] * width, dtype=bool)
    hit[owner] = True
    is_token_in_rank = hit.reshape(idx.shape[0], width)[:, :num_ranks].copy()
    num_tokens_per_rank = is_token_in_rank.sum(axis=0, dtype=np.int64)
    return DispatchLayout(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)


def _check_shape(num_tokens: int, num_experts: int, num_topk: int) -> None:
    for name, value in (("num_tokens", num_tokens), ("num_experts", num_experts),
                        ("num_topk", num_topk)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise InvalidArgumentError(name, value, "must be an integer")
    if num_tokens < 0:
        raise InvalidArgumentError("num_tokens", num_tokens, "must be >= 0")
    if num_experts < 1:
        raise InvalidArgumentError("num_experts", num_experts, "must be >= 1")
    if num_topk < 1 or num_topk > num_experts:
        raise InvalidArgumentError(
            "num_topk", num_topk, f"must be in [1, num_experts={num_experts}]"
        )


def _top_k_of_keys(keys: np.ndarray, num_topk: int) -> np.ndarray:
    # argpartition picks the k largest keys per row; the order inside a row is then by key, so a
    # row's first slot is its strongest pick (like a router's sorted top-k).
    part = np.argpartition(-keys, num_topk - 1, axis=1)[:, :num_topk]
    order = np.argsort(-np.take_along_axis(keys, part, axis=1), axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1).astype(np.int64)


def _mask(idx: np.ndarray, mask_prob: float, rng: np.random.Generator) -> np.ndarray:
    if not 0.0 <= mask_prob <= 1.0:
        raise InvalidArgumentError("mask_prob", mask_prob, "must be in [0, 1]")
    if mask_prob > 0:
        idx = idx.copy()
        idx[rng.random(idx.shape) < mask_prob] = -1
    return idx


def uniform_topk(
    num_tokens: int, num_experts: int, num_topk: int, *, seed: int = 0, mask_prob: float = 0.0
) -> np.ndarray:
    """Every token picks ``num_topk`` distinct experts uniformly at random."""
    _check_shape(num_tokens, num_experts, num_topk)
    rng = np.random.default_rng(seed)
    idx = _top_k_of_keys(rng.random((num_tokens, num_experts)), num_topk)
    return _mask(idx, mask_prob, rng)


def zipf_topk(
    num_tokens: int,
    num_experts: int,
    num_topk: int,
    *,
    alpha: float = 1.0,
    seed: int = 0,
    mask_prob: float = 0.0,
) -> np.ndarray:
    """Experts drawn without replacement with weights ``p_e ~ 1/(rank_e+1)^alpha``.

    The popularity ranking is a seeded permutation of the experts. Sampling without replacement
    uses the Gumbel-top-k trick, which is exactly successive weighted sampling.
    """
    _check_shape(num_tokens, num_experts, num_topk)
    if alpha < 0:
        raise InvalidArgumentError("alpha", alpha, "must be >= 0")
    rng = np.random.default_rng(seed)
    popularity = rng.permutation(num_experts)
    weights = 1.0 / (popularity + 1.0) ** alpha
    gumbel = -np.log(-np.log(rng.random((num_tokens, num_experts)) + 1e-300) + 1e-300)
    idx = _top_k_of_keys(np.log(weights)[None, :] + gumbel, num_topk)
    return _mask(idx, mask_prob, rng)


def hot_experts_topk(
    num_tokens: int,
    num_experts: int,
    num_topk: int,
    *,
    hot_experts: int,
    hot_share: float = 0.5,
    hot_ids: np.ndarray | None = None,
    seed: int = 0,
    mask_prob: float = 0.0,
) -> np.ndarray:
    """A share ``hot_share`` of all picks goes to ``hot_experts`` hot experts.

    Each of a token's ``num_topk`` slots is hot with probability ``hot_share``; the number of hot
    slots is capped by ``hot_experts`` (no repeats), so the realised share is exactly
    ``E[min(Binomial(k, s), N)] / k``, equal to ``s`` whenever ``N >= k``. Hot and cold experts
    are then drawn uniformly without repeats. ``hot_ids`` defaults to a seeded random choice.
    """
    _check_shape(num_tokens, num_experts, num_topk)
    if not 0 < hot_experts < num_experts:
        raise InvalidArgumentError("hot_experts", hot_experts, f"must be in [1, {num_experts})")
    if not 0.0 <= hot_share <= 1.0:
        raise InvalidArgumentError("hot_share", hot_share, "must be in [0, 1]")
    rng = np.random.default_rng(seed)
    if hot_ids is None:
        hot_ids = np.sort(rng.choice(num_experts, hot_experts, replace=False))
    raw_ids = np.asarray(hot_ids)
    if raw_ids.dtype.kind not in "iu":
        raise InvalidArgumentError("hot_ids", raw_ids, "must be integer expert ids")
    hot_ids = raw_ids.astype(np.int64)
    if hot_ids.shape != (hot_experts,) or len(np.unique(hot_ids)) != hot_experts:
        raise InvalidArgumentError("hot_ids", hot_ids, f"must be {hot_experts} distinct expert ids")
    if hot_ids.min() < 0 or hot_ids.max() >= num_experts:
        raise InvalidArgumentError("hot_ids", hot_ids, f"ids must lie in [0, {num_experts})")
    cold_ids = np.setdiff1d(np.arange(num_experts), hot_ids)
    num_hot = np.minimum(rng.binomial(num_topk, hot_share, size=num_tokens), hot_experts)
    num_hot = np.maximum(num_hot, num_topk - len(cold_ids))  # enough cold experts must remain
    hot_pick = _top_k_of_keys(rng.random((num_tokens, hot_experts)), min(num_topk, hot_experts))
    cold_pick = _top_k_of_keys(
        rng.random((num_tokens, len(cold_ids))), min(num_topk, len(cold_ids))
    )
    out = np.empty((num_tokens, num_topk), dtype=np.int64)
    for h in np.unique(num_hot):
        rows = num_hot == h
        out[rows, :h] = hot_ids[hot_pick[rows, :h]]
        out[rows, h:] = cold_ids[cold_pick[rows, : num_topk - h]]
    # Shuffle slot order per row so hot picks are not always in the leading slots.
    perm = np.argsort(rng.random((num_tokens, num_topk)), axis=1)
    out = np.take_along_axis(out, perm, axis=1)
    return _mask(out, mask_prob, rng)
