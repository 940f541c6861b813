"""Dispatch results recycled per receive region (runtime/native/fastpath.c, ``keep``/``refill``):
a blocking dispatch refills the last result built for its region, in place, only when nothing
but that result's own objects refers to any of them. Checked against ``ubep.reference`` call by
call, against snapshots of what a caller kept, and by the memory a call allocates."""

from __future__ import annotations

import copy
import dataclasses
import tracemalloc
from typing import Any

import numpy as np
import pytest

from ubep import reference, testing
from ubep.buffer import Buffer, BufferConfig
from ubep.runtime import launch

E, K, H, T = 8, 4, 64, 64


def _call(buf: Buffer, step: int, rank: int) -> tuple[Any, list[str]]:
    """Dispatch of step ``step``'s inputs (new routing every step, same token count), checked
    against the reference of every rank's inputs of that step."""
    xs, idxs, ws = testing.inputs("bf16", E, K, H, [T, T], 100 + step, "uniform")
    res = buf.dispatch(xs[rank], idxs[rank], ws[rank])
    ref = reference.dispatch(xs, idxs, ws, E, layout=buf.config.layout)[rank]
    return res, [f"step {step}: {e}" for e in testing.compare(res, ref)]


def _snapshot(obj: Any) -> dict[str, Any]:
    """Every array field of a result or handle, copied (and the handle's, for a result)."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, np.ndarray) and f.name != "recv_x":  # recv_x: the region, by design
            out[f.name] = v.copy()
        elif dataclasses.is_dataclass(v):
            out |= {f"handle.{k}": a for k, a in _snapshot(v).items()}
        elif not isinstance(v, np.ndarray):
            out[f.name] = copy.deepcopy(v)
    return out


def _unchanged(obj: Any, snap: dict[str, Any], what: str) -> list[str]:
    now = _snapshot(obj)
    bad = [k for k in snap if not np.array_equal(np.asarray(now[k]), np.asarray(snap[k]))]
    return [f"{what}: {k} changed" for k in bad]


def _worker(group: Any, layout: str) -> dict[str, Any]:
    r = group.rank
    cfg = BufferConfig(max_tokens_per_rank=T, hidden=H, num_topk=K, num_experts=E,
                       dtype="bf16", layout=layout, num_cores=1)
    errors: list[str] = []
    with Buffer(group, cfg) as buf:
        # kept by the caller: the result, only its handle, only a slice of a field
        step = 0
        held, e = _call(buf, step, r)
        errors += e
        snap_held = _snapshot(held)
        handle_only, e = _call(buf, step := step + 1, r)
        errors += e
        h = handle_only.handle
        snap_h = _snapshot(h)
        del handle_only
        sliced, e = _call(buf, step := step + 1, r)
        errors += e
        part = sliced.recv_src_token[:3]
        part_before = part.copy()
        del sliced
        for _ in range(6):  # every region dispatched into again, each call right
            res, e = _call(buf, step := step + 1, r)
            errors += e
            del res
        errors += _unchanged(held, snap_held, "kept result")
        errors += _unchanged(h, snap_h, "kept handle")
        if not np.array_equal(part, part_before):
            errors.append("a kept slice of recv_src_token changed")
        # the kept handle still combines (a dispatch whose region was reused since)
        xs, idxs, ws = testing.inputs("bf16", E, K, H, [T, T], 101, "uniform")
        refs = reference.dispatch(xs, idxs, ws, E, layout=layout)
        outs = [testing.payload(np.random.default_rng(q), "bf16", len(refs[q].recv_x), H)
                for q in range(2)]
        out = outs[r]
        if not testing.same_bits(buf.combine(out, h), reference.combine(outs, refs)[r]):
            errors.append("combine of the kept handle differs from the reference")
        del held, h
        # what one dispatch allocates (numpy reports its blocks to tracemalloc): with the
        # region's last result still held, new blocks; with nothing held, none
        peaks = {"held": [], "free": []}
        tracemalloc.start()
        kept = []
        for i in range(8):
            xs, idxs, ws = testing.inputs("bf16", E, K, H, [T, T], 200 + i, "uniform")
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            res = buf.dispatch(xs[r], idxs[r], ws[r])
            peaks["held" if i % 4 >= 2 else "free"].append(
                tracemalloc.get_traced_memory()[1] - base)
            ref = reference.dispatch(xs, idxs, ws, E, layout=layout)[r]
            errors += [f"call {i}: {e}" for e in testing.compare(res, ref)]
            kept.append(res if i % 4 < 2 else None)  # calls 2, 3 find 0, 1 held; 4-7 free
            if i % 4 == 3:
                kept.clear()
            del res
        tracemalloc.stop()
        cap_rows = buf.layout.cap_rows
    return {"errors": errors, "peaks": peaks, "cap_rows": cap_rows}


@pytest.mark.parametrize("layout", ["expert", "rank"])
def test_results_are_refilled_only_when_nothing_else_holds_them(layout: str) -> None:
    for got in launch(_worker, 2, layout, timeout_s=120):
        assert got["errors"] == [], "\n".join(got["errors"])
        # a result's int64 block holds at least recv_topk_idx and three metadata ints per
        # receivable row: 4 x 8 bytes x cap_rows
        block = 32 * got["cap_rows"]
        assert min(got["peaks"]["held"]) >= block, got["peaks"]  # built anew
        assert max(got["peaks"]["free"][1:]) < block // 8, got["peaks"]  # refilled
