"""The call soak: thousands of checked dispatch/combine calls on the random blocks of
benchmarks/soak/plan.py, every one compared bit for bit with ``ubep.reference``."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from benchmarks.soak.plan import (
    Block,
    call_inputs,
    dispatch_diffs,
    expert_outputs,
    make_blocks,
    progress_bar,
)
from ubep import reference
from ubep.buffer import Buffer
from ubep.runtime import launch
from ubep.testing import same_bits

__all__ = ["run_soak"]


def _worker(group: Any, blocks: list[Block], progress: bool) -> dict[str, Any]:
    r = group.rank
    bar = progress_bar(group, sum(len(b.calls) for b in blocks), "soak") if progress else None
    errors: list[str] = []
    calls = 0
    for bi, block in enumerate(blocks):
        with Buffer(group, block.config()) as buf:
            for ci, call in enumerate(block.calls):
                where = f"block {bi} ({block.mode()} hidden {block.hidden}) call {ci}"
                xs, idxs, ws = call_inputs(block, call)
                res = buf.dispatch(xs[r], idxs[r], ws[r])
                refs = reference.dispatch(xs, idxs, ws, block.num_experts, layout=block.layout)
                np.seterr(over="ignore", invalid="ignore")  # NaN/Inf payloads are valid data
                for f in dispatch_diffs(res, refs[r]):
                    errors.append(f"{where}: dispatch {f} differs")
                outs = expert_outputs(block, refs, call.seed)
                if block.zero_copy:
                    eo = buf.get_combine_buffer(res.handle)
                    eo[...] = outs[r]
                else:
                    eo = outs[r]
                y = buf.combine(eo, res.handle)
                if not same_bits(y, reference.combine(outs, refs)[r]):
                    errors.append(f"{where}: combine differs")
                calls += 1
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    return {"rank": r, "calls": calls, "errors": errors[:50], "num_errors": len(errors)}


def run_soak(iterations: int, ranks: list[int], seed: int, *, progress: bool = True,
             timeout_s: float = 3600.0) -> dict[str, Any]:
    """Run the soak; return ``{"ranks": {R: [per-rank findings]}, "seconds", "ok"}``."""
    share = [iterations // len(ranks) + (i < iterations % len(ranks)) for i in range(len(ranks))]
    out: dict[str, Any] = {"ranks": {}, "blocks": {}, "seconds": {}}
    for num_ranks, n in zip(ranks, share, strict=True):
        if not n:
            continue
        blocks = make_blocks(num_ranks, n, seed)
        t0 = time.monotonic()
        found = launch(_worker, num_ranks, blocks, progress, timeout_s=timeout_s)
        out["seconds"][num_ranks] = time.monotonic() - t0
        out["ranks"][num_ranks] = found
        out["blocks"][num_ranks] = len(blocks)
    out["ok"] = all(f["num_errors"] == 0 for v in out["ranks"].values() for f in v)
    out["calls"] = sum(f["calls"] for v in out["ranks"].values() for f in v[:1])
    return out

