"""Row arithmetic of the RMA engine, free of MPI: a batch's routing checked and cut by
destination, the raw bytes of its rows, the contiguous runs of their positions at a
destination (one put each), and the padded layout's empty slots."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["RoutingError", "Units", "empty_slots", "route", "rows_of", "runs_of", "take_runs"]


class RoutingError(Exception):
    """Bad routing: ``what`` is wrong with argument ``arg`` (its value ``value``)."""

    def __init__(self, what: str, arg: str, value: str) -> None:
        super().__init__(what)
        self.what, self.arg, self.value = what, arg, value


@dataclass
class Units:
    """A rank's sends: per-expert counts, rows per destination and, per destination, the
    rows in batch order ``(token, k, expert or local ids, weights)``."""

    cnt: np.ndarray
    rows_to: np.ndarray
    to: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]


def route(idx: np.ndarray, w: np.ndarray, E: int, R: int, expert: bool) -> Units:
    """``idx`` (``[tokens, K]`` expert ids, -1 masked) checked and cut by destination rank:
    expert layout, one row per pick sorted by expert then token; rank layout, one row per
    (token, rank) with that rank's local ids and weights (-1 / 0 elsewhere)."""
    L, K = E // R, idx.shape[1] if idx.ndim == 2 else 0
    bad = (idx < -1) | (idx >= E)
    if bad.any():
        t, k = (int(v) for v in np.argwhere(bad)[0])
        raise RoutingError(f"expert id at [{t}, {k}] out of range [-1, {E}) (num_experts)",
                           "topk_idx", str(int(idx[t, k])))
    if K > 1 and len(idx):
        srt = np.sort(idx, axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        rows = np.nonzero(dup.any(axis=1))[0]
        if len(rows):
            t = int(rows[0])
            raise RoutingError(f"row {t} names this expert twice", "topk_idx",
                               str(int(srt[t, 1:][dup[t]][0])))
    valid = idx >= 0
    cnt = np.bincount(idx[valid], minlength=E).astype(np.int64)
    to: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    if expert:
        t_all, k_all = np.nonzero(valid)
        e_all = idx[t_all, k_all]
        order = np.lexsort((t_all, e_all))  # by expert (hence destination), then token
        t_all, k_all, e_all = t_all[order], k_all[order], e_all[order]
        rows_to = cnt.reshape(R, L).sum(axis=1)
        starts = np.concatenate([[0], np.cumsum(rows_to)])
        for d in range(R):
            sl = slice(int(starts[d]), int(starts[d + 1]))
            to.append((t_all[sl], k_all[sl], e_all[sl], w[t_all[sl], k_all[sl]]))
        return Units(cnt, rows_to, to)
    dst = np.where(valid, idx // L, -1)
    rows_to = np.zeros(R, np.int64)
    for d in range(R):
        here = dst == d
        toks = np.nonzero(here.any(axis=1))[0]
        rows_to[d] = len(toks)
        first = np.argmax(here[toks], axis=1) if len(toks) else np.zeros(0, np.int64)
        ids = np.where(here[toks], idx[toks] - d * L, -1)
        wts = np.where(here[toks], w[toks], np.float32(0))
        to.append((toks, first, ids, wts))
    return Units(cnt, rows_to, to)


def rows_of(x: np.ndarray, tokens: np.ndarray, row_bytes: int) -> np.ndarray:
    """Rows ``tokens`` of ``x`` as raw bytes ``[n, row_bytes]`` (one gather)."""
    raw = x.view(np.uint8).reshape(x.shape[0], row_bytes)
    return np.take(raw, tokens, axis=0)


def take_runs(src: np.ndarray, rows: np.ndarray, runs: list[tuple[int, int]],
              out: np.ndarray) -> None:
    """``out[p0 : p0 + m] = src[rows[at : at + m]]`` for each run ``(p0, m)``, ``at`` the rows
    taken so far: a batch's rows gathered straight to where they go (``out`` may be another
    rank's memory, strided), one pass and no temporary. ``rows`` must be in range (checked by
    the caller: ``mode="clip"`` lets numpy write into ``out`` unbuffered)."""
    at = 0
    for p0, m in runs:
        np.take(src, rows[at: at + m], axis=0, out=out[p0: p0 + m], mode="clip")
        at += m


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
