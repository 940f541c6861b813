"""One engine call per blocking ``Buffer.dispatch`` and ``Buffer.combine``, whatever arrays the
caller passes: arrays the native door takes as they are, arrays it copies into its layout
(non-contiguous ``x``, ``expert_out`` or handle arrays) and arrays the Buffer's checks convert
first (``int32`` ``topk_idx``, a ``bf16`` array of another storage view) each reach the
engine exactly once; bad input reaches it not at all. The engine object is wrapped to count
its calls; every result is compared bit for bit with ``ubep.reference``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

import ubep
from tests._engine_spy import EngineSpy
from ubep import reference, testing
from ubep.errors import InvalidArgumentError

E, K, H = 16, 4, 256
TOKENS = [6, 5]

def _strided(a: np.ndarray) -> np.ndarray:
    """``a``'s values in a non-contiguous array (every other column of a wider one)."""
    wide = np.zeros((a.shape[0], 2 * a.shape[1]), a.dtype)
    wide[:, ::2] = a
    out = wide[:, ::2]
    assert not out.flags.c_contiguous and np.array_equal(out, a)
    return out


# how each case passes the rank's x, topk_idx, topk_weights (dispatch)
DISPATCH_CASES: dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[Any, ...]]] = {
    "exact": lambda x, i, w: (x, i, w),
    "x not contiguous": lambda x, i, w: (_strided(x), i, w),
    "weights in Fortran order": lambda x, i, w: (x, i, np.asfortranarray(w)),
    "topk_idx int32": lambda x, i, w: (x, i.astype(np.int32), w),
    "topk_idx a list": lambda x, i, w: (x, i.tolist(), w),
}
# how each case passes the rank's expert outputs and the dispatch's handle (combine)
COMBINE_CASES: dict[str, Callable[[np.ndarray, Any], tuple[Any, Any]]] = {
    "exact": lambda eo, h: (eo, h),
    "expert_out in Fortran order": lambda eo, h: (np.asfortranarray(eo), h),
    "handle weights not contiguous": lambda eo, h: (
        eo, dataclasses.replace(h, topk_weights=_strided(np.array(h.topk_weights)))),
    "handle topk_idx int32": lambda eo, h: (
        eo, dataclasses.replace(h, topk_idx=h.topk_idx.astype(np.int32))),
}


def _worker(group: Any, layout: str) -> dict[str, Any]:
    cfg = ubep.BufferConfig(max_tokens_per_rank=8, hidden=H, num_topk=K, num_experts=E,
                            dtype="bf16", layout=layout, num_cores=1)
    r, errors = group.rank, []
    calls: dict[str, list[int]] = {}  # case -> the engine calls of each time it ran
    xs, idxs, ws = testing.inputs("bf16", E, K, H, TOKENS, 3, "uniform")
    refs = reference.dispatch(xs, idxs, ws, E, layout=layout)
    outs = [testing.payload(np.random.default_rng(10 + q), "bf16", len(ref.recv_x), H)
            for q, ref in enumerate(refs)]
    y_ref = reference.combine(outs, refs)[r]
    with ubep.Buffer(group, cfg) as buf:
        engine = EngineSpy(buf._engine)
        buf._engine = buf._fast = engine  # type: ignore[assignment]
        for name, passed in DISPATCH_CASES.items():
            engine.calls["dispatch"] = 0
            res = buf.dispatch(*passed(xs[r], idxs[r], ws[r]))
            calls.setdefault(f"dispatch: {name}", []).append(engine.calls["dispatch"])
            errors += [f"dispatch {name}: {e}" for e in testing.compare(res, refs[r])]
            for cname, cpassed in COMBINE_CASES.items():
                engine.calls["combine"] = 0
                y = buf.combine(*cpassed(outs[r], res.handle))
                calls.setdefault(f"combine: {cname}", []).append(engine.calls["combine"])
                if not np.array_equal(testing.bits(y), testing.bits(y_ref)):
                    errors.append(f"combine {cname} after dispatch {name}: y differs")
        # bad input: rejected by the checks, the door never offered it
        engine.calls["dispatch"] = 0
        try:
            buf.dispatch(xs[r], idxs[r], ws[r].astype(np.float64))
            errors.append("float64 topk_weights accepted")
        except InvalidArgumentError as exc:
            calls["bad input"] = [engine.calls["dispatch"]]
            if exc.argument != "topk_weights":
                errors.append(f"float64 topk_weights: the error names {exc.argument}")
        res = buf.dispatch(xs[r], idxs[r], ws[r])  # and the next call is exact
        errors += [f"after the reject: {e}" for e in testing.compare(res, refs[r])]
    return {"errors": errors, "calls": calls}


def test_every_blocking_call_makes_one_engine_call() -> None:
    for layout in ("expert", "rank"):
        for r, got in enumerate(ubep.launch(_worker, len(TOKENS), layout)):
            assert got["errors"] == [], (layout, r)
            calls = got["calls"]
            assert calls.pop("bad input") == [0], (layout, r)
            assert len(calls) == len(DISPATCH_CASES) + len(COMBINE_CASES)
            assert all(set(n) == {1} for n in calls.values()), (layout, r, calls)
