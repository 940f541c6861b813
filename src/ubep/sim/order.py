"""``lex_order``: :func:`numpy.lexsort`'s permutation, by one stable sort of one integer key.

The executors sort ~10^6 rows at EP 1024 by two or three integer keys (ranks, cores, rounded
times). ``np.lexsort`` makes one pass per key; folding the keys into one int64 (mixed radix)
and sorting that once, stably, gives the same permutation in a fraction of the time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["lex_order"]

_MAX_KEY = 1 << 62  # the folded key stays an exact int64


def lex_order(keys: Sequence[np.ndarray]) -> np.ndarray:
    """The permutation ``np.lexsort(keys)`` returns (the last key is the primary one).

    Keys must be integers or integral floats (the rounded times of ``analytic._tie``);
    otherwise, or when the folded key would not fit an int64, this is ``np.lexsort``."""
    arrays = [np.asarray(k) for k in keys]
    if not arrays or arrays[0].size == 0:
        return np.lexsort(arrays) if arrays else np.zeros(0, dtype=np.int64)
    # A strictly increasing least-significant key is the position itself: a stable sort of the
    # other keys keeps it.
    if arrays[0].size < 2 or bool(np.all(np.diff(arrays[0]) > 0)):
        arrays = arrays[1:]
        if not arrays:
            return np.arange(keys[0].size)
    folded = np.zeros(arrays[0].size, dtype=np.int64)
    scale = 1
    for k in arrays:
        if k.dtype.kind == "f" and not bool(np.all(np.isfinite(k) & (k == np.floor(k)))):
            return np.lexsort(keys)
        if k.dtype.kind not in "iuf":
            return np.lexsort(keys)
        lo, hi = k.min(), k.max()
        span = int(hi) - int(lo) + 1
        if scale * span >= _MAX_KEY or abs(float(hi)) >= 2.0**53 or abs(float(lo)) >= 2.0**53:
            return np.lexsort(keys)
        folded += (k - lo).astype(np.int64) * scale
        scale *= span
    return np.argsort(folded, kind="stable")
