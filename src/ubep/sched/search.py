"""Quaternary search (the paper's Algorithm 1): which expert's token range covers a target index.

The units of a rank are laid out expert after expert (in the remapped expert order); expert ``e``
owns the global unit indices ``[C(e), C(e+1))`` where ``C(e)`` is the number of units whose expert
position is below ``e``. A core that starts its slice at global index ``target`` must find the
expert ``e`` with ``C(e) <= target < C(e+1)`` and its offset ``target - C(e)`` in that expert's
token list. Empty experts (``C(e) == C(e+1)``) never cover anything, so the answer is the unique
non-empty expert, i.e. ``np.searchsorted(C, target, side="right") - 1``.

Algorithm 1 keeps a window ``[L, R]`` with the invariant ``C(L) <= target < C(R)`` and evaluates
three equidistant pivots per step with one vectorised count (``VectorCount(E < P_i)`` on the NPU;
here ``prefix[pivots]`` or ``(expert_list < pivots).sum()``). Each step shrinks the window from
``w`` to at most ``ceil(w/4)``, so it ends after at most ``ceil(log4(E))`` steps. Two fixes to the
paper's pseudo-code: pivots are clamped to ``R`` (for small windows ``L + 3*gap`` can pass ``R``),
and the loop stops at ``R - L <= 1`` (the paper's ``gap >= 1`` test never fails at width 1). The
count at ``L`` is carried along, so no final count is needed.

``target == total`` (one past the last unit, the end boundary of the last slice) is answered with
``(num_experts, 0)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError

__all__ = ["SearchResult", "prefix_from_expert_list", "quaternary_search",
           "quaternary_search_many"]

KINDS = ("prefix", "expert_list")


@dataclass(frozen=True)
class SearchResult:
    """Answer of :func:`quaternary_search`: ``target`` is unit ``local_offset`` of ``expert_id``.

    ``steps`` counts the vectorised three-pivot counts the search made.
    """

    expert_id: int
    local_offset: int
    steps: int


def _counter(values: object, kind: str, num_experts: int | None) -> tuple[np.ndarray, int]:
    """Return ``(prefix, num_experts)``; prefix[e] = units of experts below ``e``."""
    if kind not in KINDS:
        raise InvalidArgumentError("kind", kind, f"must be one of {KINDS}")
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgumentError("values", arr.shape, "must be a 1-D integer array")
    arr = arr.astype(np.int64, copy=False)
    if kind == "prefix":
        if arr.size < 2 or arr[0] != 0 or np.any(np.diff(arr) < 0):
            raise InvalidArgumentError(
                "values", arr, "prefix must have num_experts+1 >= 2 entries, start at 0 and "
                "never decrease"
            )
        if num_experts is not None and num_experts != arr.size - 1:
            raise InvalidArgumentError("num_experts", num_experts, f"prefix has {arr.size - 1}")
        return arr, arr.size - 1
    if num_experts is None or not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
        raise InvalidArgumentError("num_experts", num_experts, "expert_list needs num_experts >= 1")
    if arr.size and (arr.min() < 0 or arr.max() >= num_experts):
        raise InvalidArgumentError("values", arr, f"expert ids must be in [0, {num_experts})")
    return arr, int(num_experts)


def prefix_from_expert_list(expert_list: np.ndarray, num_experts: int) -> np.ndarray:
    """``[num_experts+1]`` prefix counts of a (not necessarily sorted) per-unit expert list."""
    arr, e = _counter(expert_list, "expert_list", num_experts)
    out = np.zeros(e + 1, dtype=np.int64)
    np.cumsum(np.bincount(arr, minlength=e), out=out[1:])
    return out


def _count(arr: np.ndarray, kind: str, pivots: np.ndarray) -> np.ndarray:
    """VectorCount: units whose expert position lies below each pivot (any pivot shape)."""
    if kind == "prefix":
        return arr[pivots]
    # One broadcast compare of every unit against every pivot: the SIMD count of Algorithm 1.
    return (arr[None, :] < pivots.reshape(-1, 1)).sum(axis=1).reshape(pivots.shape)


def quaternary_search(
    values: object, target: int, *, kind: str = "prefix", num_experts: int | None = None
) -> SearchResult:
    """Algorithm 1 for one target.

    Args:
        values: ``kind="prefix"``: ``[E+1]`` non-decreasing prefix counts starting at 0;
            ``kind="expert_list"``: ``[U]`` expert position of every unit (any order).
        target: global unit index in ``[0, total]``.
        kind: how ``values`` is given.
        num_experts: ``E``; required for ``expert_list``, checked for ``prefix``.
    """
    arr, e = _counter(values, kind, num_experts)
    total = int(arr[-1]) if kind == "prefix" else arr.size
    if not isinstance(target, (int, np.integer)) or not 0 <= target <= total:
        raise InvalidArgumentError("target", target, f"must be an integer in [0, {total}]")
    if target == total:
        return SearchResult(e, 0, 0)
    lo, hi, c_lo, steps = 0, e, 0, 0
    while hi - lo > 1:
        gap = -(-(hi - lo) // 4)
        pivots = np.minimum(lo + gap * np.arange(1, 4), hi)
        counts = _count(arr, kind, pivots)
        steps += 1
        # Smallest quadrant q whose right pivot count exceeds the target (q = 4: [P3, R]).
        above = np.nonzero(target < counts)[0]
        q = int(above[0]) + 1 if above.size else 4
        new_lo = lo if q == 1 else int(pivots[q - 2])
        c_lo = c_lo if q == 1 else int(counts[q - 2])
        hi = hi if q == 4 else int(pivots[q - 1])
        lo = new_lo
    return SearchResult(lo, int(target) - c_lo, steps)


def quaternary_search_many(
    values: object, targets: object, *, kind: str = "prefix", num_experts: int | None = None
) -> tuple[np.ndarray, np.ndarray, int]:
    """Algorithm 1 for many targets in lockstep (e.g. every slice boundary at once).

    Returns ``(expert_id [T] int64, local_offset [T] int64, steps)``; ``steps`` is the number of
    lockstep rounds, each one vectorised count of ``3*T`` pivots.
    """
    arr, e = _counter(values, kind, num_experts)
    total = int(arr[-1]) if kind == "prefix" else arr.size
    tgt = np.asarray(targets)
    if tgt.ndim != 1 or (tgt.size and tgt.dtype.kind not in "iu"):
        raise InvalidArgumentError("targets", tgt.shape, "must be a 1-D integer array")
    tgt = tgt.astype(np.int64, copy=False)
    if tgt.size and (tgt.min() < 0 or tgt.max() > total):
        raise InvalidArgumentError("targets", tgt, f"must lie in [0, {total}]")
    return _search_many(arr, kind, e, tgt)


def _search_many(
    arr: np.ndarray, kind: str, e: int, tgt: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int]:
    total = int(arr[-1]) if kind == "prefix" else arr.size
    at_end = tgt == total
    # End targets get the window [0, 1] and target -1: every count exceeds it, so each round
    # picks quadrant 1 and the window stays put (their answer is overridden below).
    goal = np.where(at_end, -1, tgt)
    num = tgt.size
    # Columns of `window`: L, P1, P2, P3, R; of `count`: C(L), C(P1), C(P2), C(P3).
    window = np.zeros((num, 5), dtype=np.int64)
    window[:, 4] = np.where(at_end, 1, e)
    count = np.zeros((num, 4), dtype=np.int64)
    flat_window = window.ravel()
    flat_count = count.ravel()
    row5 = np.arange(num, dtype=np.int64) * 5
    row4 = np.arange(num, dtype=np.int64) * 4
    mult = np.arange(1, 4, dtype=np.int64)
    steps = 0
    while num:
        lo, hi = window[:, 0], window[:, 4]
        width = hi - lo
        if width.max() <= 1:
            break
        # Finished windows (width 1) clamp every pivot to R, whose count exceeds the target, so
        # they pick quadrant 1 and keep [L, L+1]: all targets can share the same rounds.
        np.minimum(lo[:, None] + ((width + 3) >> 2)[:, None] * mult, hi[:, None],
                   out=window[:, 1:4])
        count[:, 1:] = _count(arr, kind, window[:, 1:4])
        steps += 1
        # Quadrant q (0-based) = pivots whose count is <= target: new window [P_q, P_{q+1}].
        q = np.count_nonzero(count[:, 1:] <= goal[:, None], axis=1)
        count[:, 0] = flat_count[row4 + q]
        at = row5 + q
        window[:, 0], window[:, 4] = flat_window[at], flat_window[at + 1]
    expert = np.where(at_end, e, window[:, 0])
    offset = np.where(at_end, 0, tgt - count[:, 0])
    return expert, offset, steps
