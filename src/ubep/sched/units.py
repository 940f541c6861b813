"""Send units of one rank: what crosses the fabric, where it lands, and how far it travels.

Units are returned in *canonical order*: ``(send_expert, token)`` ascending for the expert layout
and ``(send_dst_rank, token)`` ascending for the rank layout. In that order ``send_slot`` is just
the position inside the unit's receive region, which is how the receiver lays rows out (ascending
source token inside each ``(source rank, expert)`` / ``source rank`` region).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..errors import InvalidArgumentError
from ..modes import LAYOUTS
from ..routing import experts_per_rank, validate_topk_idx
from ..topology import Topology

__all__ = ["SendUnits", "hop_row", "send_units"]


@dataclass(frozen=True)
class SendUnits:
    """All send units of one rank in canonical order (see module docstring); ``[U]`` int64 each.

    ``num_tokens_per_expert`` ``[num_experts]`` counts the units whose ``send_expert`` is that
    expert (in the rank layout: tokens whose first expert on the rank is that expert).
    ``num_tokens``, ``num_topk``: the shape of the ``topk_idx`` they came from.
    """

    token: np.ndarray
    k: np.ndarray
    expert: np.ndarray
    dst_rank: np.ndarray
    hop: np.ndarray
    slot: np.ndarray
    num_tokens_per_expert: np.ndarray
    num_tokens: int
    num_topk: int

    @property
    def num_units(self) -> int:
        return int(self.token.size)


@lru_cache(maxsize=4096)
def hop_row(topology: Topology, rank: int) -> np.ndarray:
    """``[num_ranks]`` int64 hop class from ``rank`` to every rank (cached, read-only)."""
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < topology.num_ranks:
        raise InvalidArgumentError("rank", rank, f"must be in [0, {topology.num_ranks})")
    ranks = np.arange(topology.num_ranks)
    out = np.full(topology.num_ranks, topology.num_hops - 1, dtype=np.int64)
    # Widest domain first, so the innermost domain that holds both ranks wins.
    for h in range(len(topology.domain_sizes) - 1, -1, -1):
        size = topology.domain_sizes[h]
        out[ranks // size == rank // size] = h
    out.flags.writeable = False
    return out


def send_units(
    topk_idx: object, topology: Topology, *, rank: int, num_experts: int, layout: str = "expert"
) -> SendUnits:
    """Build the send units of ``rank`` from its ``topk_idx [num_tokens, num_topk]`` (-1 = none).

    Expert ``e`` lives on rank ``e // (num_experts // num_ranks)``.
    """
    if layout not in LAYOUTS:
        raise InvalidArgumentError("layout", layout, f"must be one of {LAYOUTS}")
    if not isinstance(topology, Topology):
        raise InvalidArgumentError("topology", type(topology).__name__, "must be a Topology")
    per_rank = experts_per_rank(num_experts, topology.num_ranks)
    idx = validate_topk_idx(topk_idx, num_experts)
    hops = hop_row(topology, rank)
    if layout == "expert":
        return _expert_units(idx, num_experts, per_rank, hops)
    return _rank_units(idx, num_experts, per_rank, topology.num_ranks, hops)


def _expert_units(
    idx: np.ndarray, num_experts: int, per_rank: int, hops: np.ndarray
) -> SendUnits:
    num_topk = idx.shape[1]
    flat = idx.ravel()
    valid = np.flatnonzero(flat >= 0)
    experts = flat[valid]
    # Flat order is token-major, so a stable sort by expert gives (expert, token) order.
    order = np.argsort(experts, kind="stable")
    pos = valid[order]
    expert = experts[order]
    counts = np.bincount(expert, minlength=num_experts).astype(np.int64)
    starts = np.cumsum(counts) - counts
    slot = np.arange(expert.size, dtype=np.int64) - starts[expert]
    dst = expert // per_rank
    return SendUnits(
        token=pos // num_topk, k=pos % num_topk, expert=expert, dst_rank=dst, hop=hops[dst],
        slot=slot, num_tokens_per_expert=counts, num_tokens=idx.shape[0], num_topk=num_topk,
    )


def _rank_units(
    idx: np.ndarray, num_experts: int, per_rank: int, num_ranks: int, hops: np.ndarray
) -> SendUnits:
    num_tokens, num_topk = idx.shape
    # first_k[t, r] = lowest k whose expert lives on rank r (num_topk = none). Writing k from the
    # highest down lets the lowest k overwrite, with one vector store per k.
    first_k = np.full((num_tokens, num_ranks), num_topk, dtype=np.int64)
    tokens = np.arange(num_tokens)
    for kk in range(num_topk - 1, -1, -1):
        col = idx[:, kk]
        ok = col >= 0
        first_k[tokens[ok], col[ok] // per_rank] = kk
    # Transposed nonzero walks (rank, token) in ascending order: the receive-region order.
    has = np.transpose(first_k) != num_topk
    dst, token = np.nonzero(has)
    k = first_k[token, dst]
    expert = idx[token, k]
    per_dst = np.bincount(dst, minlength=num_ranks)
    starts = np.cumsum(per_dst) - per_dst
    slot = np.arange(dst.size, dtype=np.int64) - starts[dst]
    counts = np.bincount(expert, minlength=num_experts).astype(np.int64)
    return SendUnits(
        token=token.astype(np.int64), k=k, expert=expert, dst_rank=dst.astype(np.int64),
        hop=hops[dst], slot=slot, num_tokens_per_expert=counts, num_tokens=num_tokens,
        num_topk=num_topk,
    )
