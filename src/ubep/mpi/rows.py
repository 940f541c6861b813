"""Row arithmetic of the RMA engine, free of MPI: the raw bytes of a batch's rows, the
contiguous runs of their positions at a destination (one put each), and the padded layout's
empty slots."""

from __future__ import annotations

import numpy as np

__all__ = ["empty_slots", "rows_of", "runs_of"]


def rows_of(x: np.ndarray, tokens: np.ndarray, row_bytes: int) -> np.ndarray:
    """Rows ``tokens`` of ``x`` as raw bytes ``[n, row_bytes]`` (one gather)."""
    raw = x.view(np.uint8).reshape(x.shape[0], row_bytes)
    return np.take(raw, tokens, axis=0)


def runs_of(pos: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous runs ``(first position, length)`` of sorted-by-run positions."""
    if not len(pos):
        return []
    breaks = np.nonzero(np.diff(pos) != 1)[0] + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(pos)]])
    return [(int(pos[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]


def empty_slots(per_expert: np.ndarray, slots: int, outs: tuple[np.ndarray, ...]) -> None:
    """The metadata of the padded layout's slots past each expert's count (``slots`` a local
    expert): -1, weight 0 (their payload is left as it was)."""
    o_idx, o_w, o_rank, o_tok, o_k = outs[:5]
    for el, n in enumerate(per_expert.tolist()):
        empty = slice(el * slots + n, (el + 1) * slots)
        o_idx[empty] = o_rank[empty] = o_tok[empty] = o_k[empty] = -1
        o_w[empty] = 0
