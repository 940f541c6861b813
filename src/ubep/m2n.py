"""M2N: attention ranks send, expert ranks hold every expert (``BufferConfig(expert_ranks=)``).

An M2N placement is an expert map: the ``num_experts`` logical experts are spread over the
ranks of ``expert_ranks`` in that order, ``S = num_experts // len(expert_ranks)`` each, and a
Buffer of ``R`` ranks gets ``S`` physical slots per rank (``S * R`` in all). Logical expert
``e`` lives on slot ``expert_ranks[e // S] * S + e % S``; the slots of the other ranks (the
senders) serve no expert, so nothing is ever routed to them. The Buffer, the oracle
(``ubep.reference.dispatch(..., expert_ranks=)``) and the scheduler all run the expert map's
physical routing (``ubep.expert_map``), so every engine, sync mode and layout, and the MPI
engine, serve M2N as they serve a map.

What a caller sees is logical: ``buf.config`` is the config it passed, and the expert layout's
``recv_topk_idx`` names logical experts (:func:`slot_shift`). The rank layout's ids are local
(``e % S``), the same in both numberings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

# the role check is the config's own (one direction: this module reads configs)
from .config import BufferConfig, check_expert_ranks
from .errors import InvalidArgumentError
from .expert_map import ExpertMap

__all__ = ["check_expert_ranks", "logical_experts", "logical_result", "m2n_expert_map",
           "physical_config", "slot_shift"]


def m2n_expert_map(num_experts: int, expert_ranks: Sequence[int], num_ranks: int) -> ExpertMap:
    """The expert map of an M2N placement: logical ``e`` -> slot ``expert_ranks[e // S] * S +
    e % S`` (``S = num_experts // len(expert_ranks)`` slots per rank over ``num_ranks``)."""
    ranks = check_expert_ranks(expert_ranks, num_experts)
    out = [r for r in ranks if r >= num_ranks]
    if out:
        raise InvalidArgumentError("expert_ranks", list(ranks), f"rank {out[0]} is out of range "
                                   f"[0, {num_ranks}) (the group's ranks)")
    per_rank = num_experts // len(ranks)
    return ExpertMap(tuple((ranks[e // per_rank] * per_rank + e % per_rank,)
                           for e in range(num_experts)))


def physical_config(config: BufferConfig, num_ranks: int) -> BufferConfig:
    """The config a Buffer of ``num_ranks`` runs for an M2N ``config``: ``num_experts`` counts
    the physical slots (``S`` per rank) and ``expert_map`` is the placement's. Any other config
    is returned as is."""
    if config.expert_ranks is None:
        return config
    emap = m2n_expert_map(config.num_experts, config.expert_ranks, num_ranks)
    per_rank = config.num_experts // len(config.expert_ranks)
    return dataclasses.replace(config, num_experts=per_rank * num_ranks, expert_ranks=None,
                               expert_map=emap)


def logical_experts(slots: np.ndarray, expert_map: ExpertMap) -> np.ndarray:
    """Logical expert of each physical slot id in ``slots`` (-1 stays -1): what a receiver's
    ``recv_topk_idx`` (slot ids) names in the caller's ids."""
    top = max(max(s) for s in expert_map.replicas)
    table = np.full(top + 2, -1, dtype=np.int64)
    for e, replicas in enumerate(expert_map.replicas):
        table[np.asarray(replicas) + 1] = e
    idx = np.asarray(slots, dtype=np.int64)
    out: np.ndarray = np.where(idx <= top, table[np.minimum(idx, top) + 1], -1)
    return out


def slot_shift(config: BufferConfig, rank: int, num_ranks: int) -> int:
    """What turns a physical slot id received by ``rank`` into its logical expert id, in the
    expert layout (0 otherwise, and on a sender, which receives nothing). Every row ``rank``
    receives names one of its own slots ``rank * S + j``, logical expert ``p * S + j`` where
    ``p`` is ``rank``'s place in ``expert_ranks``: one constant per rank."""
    ranks = config.expert_ranks
    if ranks is None or config.layout == "rank" or rank not in ranks:
        return 0
    return (ranks.index(rank) - rank) * (config.num_experts // len(ranks))


def logical_result(res: Any, sender: bool, shift: int) -> None:
    """Turn a dispatch result of an M2N Buffer's one-call path (built by the native engine on
    physical slots) into the caller's numbering, in place: ``recv_topk_idx`` shifted
    (:func:`slot_shift`), and no per-expert counts on a ``sender``."""
    if shift:
        ids = res.recv_topk_idx
        shifted = ids + shift
        if isinstance(ids, np.ndarray):  # a padded layout's empty slots (-1) stay -1
            shifted = np.where(ids >= 0, shifted, ids)
        object.__setattr__(res, "recv_topk_idx", shifted)
    if sender:
        object.__setattr__(res, "num_recv_tokens_per_expert",
                           res.num_recv_tokens_per_expert[:0])
