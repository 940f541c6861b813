"""ubep's side of the peers benchmark: ``ubep.Buffer`` on ranks started by ``ubep.launch``.

One launch per rank count runs every (shape, layout, engine x sync) case in sequence, each with
its own Buffer. Every rank rebuilds the seeded inputs itself (workload.make_inputs), so
nothing but shapes crosses the process boundary, and takes its own rank's tensors: the same
bytes the peers move.

Timing mirrors the peer workers: barrier, each rank times its own call; the parent takes the
maximum over ranks per iteration. Combine reads the expert outputs from
``buf.get_combine_buffer(handle)``, where a ubep user's experts write them (filled before the
timed loop): the peers likewise send straight from the array the experts produced.

An FP8 shape (workload.Shape.dtype "fp8") runs a quantising Buffer (``dtype="bf16",
quant="e4m3"``) and times two dispatches on it: the caller's rows quantised beforehand
(``x_scales=``, the bytes the peers move) and BF16 x quantised by the engine (the whole FP8
dispatch); one combine, BF16, for both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["UbepCase", "run_ubep_cases"]

_SETTLE_S = 0.3
_LARGE_BYTES = 64 << 20


@dataclass(frozen=True)
class UbepCase:
    """One ubep measurement: a shape (workload.Shape), a layout and an engine x sync."""

    shape: Any
    layout: str
    engine: str
    sync: str


def _time(group: Any, fn: Callable[[], object], warmup: int, repeats: int) -> list[float]:
    from benchmarks.harness import time_collective

    return time_collective(group.barrier, fn, warmup, repeats).tolist()


def _measure(
    group: Any, buf: Any, x: np.ndarray, idx: np.ndarray, w: np.ndarray, warmup: int, repeats: int
) -> dict[str, Any]:
    got: dict[str, Any] = {}
    if buf.config.quant is not None:
        from ubep.quant import quantize

        # The caller's quantised rows (outside the timed region): the bytes the peers move.
        values, scales = quantize(x, buf.config.quant)
        got["dispatch"] = _time(
            group, lambda: buf.dispatch(values, idx, w, x_scales=scales), warmup, repeats)
        # The whole FP8 dispatch: BF16 x in, the engine quantises each token once.
        got["dispatch_q"] = _time(group, lambda: buf.dispatch(x, idx, w), warmup, repeats)
    else:
        got["dispatch"] = _time(group, lambda: buf.dispatch(x, idx, w), warmup, repeats)
    res = buf.dispatch(x, idx, w)
    send_dst_row = np.asarray(res.handle.send_dst_row)
    out = buf.get_combine_buffer(res.handle)
    vals = np.random.default_rng(group.rank).standard_normal(out.shape, dtype=np.float32)
    out[...] = (vals.view(np.uint32) >> np.uint32(16)).astype(np.uint16)  # BF16 expert outputs
    got["combine"] = _time(group, lambda: buf.combine(out, res.handle), warmup, repeats)
    return got | {"rows_sent": int((send_dst_row >= 0).sum())}


def _rank_main(
    group: Any, cases: Sequence[UbepCase], warmup: int, repeats: int, rounds: int
) -> list[dict[str, Any]]:
    from benchmarks.harness import round_repeats
    from benchmarks.peers.workload import NUM_EXPERTS, QUANT, make_inputs
    from ubep.buffer import Buffer, BufferConfig

    r = group.rank
    results: list[dict[str, Any]] = [{} for _ in cases]
    inputs: dict[Any, Any] = {}
    large = False
    for per_round in round_repeats(repeats, rounds):
        for case, result in zip(cases, results, strict=True):
            if case.shape not in inputs:
                inputs = {case.shape: make_inputs(case.shape)}  # one shape's tensors at a time
            inp = inputs[case.shape]
            fp8 = case.shape.dtype == "fp8"  # BF16 x, quantised rows on the wire
            cfg = BufferConfig(
                max_tokens_per_rank=case.shape.tokens_per_rank, hidden=case.shape.hidden,
                num_topk=inp.topk_idxs[r].shape[1], num_experts=NUM_EXPERTS,
                dtype="bf16" if fp8 else case.shape.dtype, quant=QUANT if fp8 else None,
                layout=case.layout, engine=case.engine, sync=case.sync,
            )
            if large:
                # The last Buffer's segments (up to ~0.5 GB a rank) are still being freed by
                # the kernel: without a pause the next case ran up to 2x slow throughout.
                time.sleep(_SETTLE_S)
            large = Buffer.size_hint(cfg, group.num_ranks) > _LARGE_BYTES
            with Buffer(group, cfg) as buf:
                got = _measure(group, buf, inp.xs[r], inp.topk_idxs[r], inp.topk_weights[r],
                               warmup, per_round)
            for key, samples in got.items():
                if key != "rows_sent":
                    result[key] = result.get(key, []) + samples
            result["rows_sent"] = got["rows_sent"]
    return results


def run_ubep_cases(
    cases: Sequence[UbepCase], num_ranks: int, *, warmup: int, repeats: int, timeout_s: float,
    rounds: int = 1,
) -> list[dict[str, Any]]:
    """Per case: ``dispatch``/``combine`` per-iteration ns (max over ranks), for an FP8 shape
    also ``dispatch_q`` (``dispatch`` sends the caller's quantised rows, ``x_scales=``;
    ``dispatch_q`` BF16 x that the engine quantises), ``rows_sent``; the
    repeats are split over ``rounds`` passes through all cases (harness.round_repeats)."""
    from ubep.runtime import launch

    per_rank = launch(_rank_main, num_ranks, list(cases), warmup, repeats, rounds,
                      timeout_s=timeout_s)
    merged = []
    for i in range(len(cases)):
        ranks = [per_rank[r][i] for r in range(num_ranks)]
        timed = [k for k in ranks[0] if k != "rows_sent"]
        merged.append({k: np.max([rk[k] for rk in ranks], axis=0) for k in timed} | {
            "rows_sent": np.array([rk["rows_sent"] for rk in ranks], dtype=np.int64),
        })
    return merged
