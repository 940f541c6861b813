"""ubep's side of the peers benchmark: ``ubep.Buffer`` on ranks started by ``ubep.launch``.

One launch per rank count runs every (shape, layout, engine x sync) case in sequence, each with
its own Buffer. Every rank rebuilds the seeded inputs itself (benchmarks.peers.make_inputs), so
nothing but shapes crosses the process boundary, and takes its own rank's tensors: the same
bytes the peers move.

Timing mirrors the peer workers: barrier, each rank times its own call; the parent takes the
maximum over ranks per iteration. A case marked ``floor`` also times the memcpy floor in the same
processes, interleaved with its calls so that both see the same machine: every rank copies the
op's bytes per rank at once (one ``np.copyto``), and an iteration lasts from the first copy's
start to the last copy's end (benchmarks.harness.concurrent_copy's rule).

Combine reads the expert outputs from ``buf.get_combine_buffer(handle)``, where a ubep user's
experts write them (filled before the timed loop): the peers likewise send straight from the
array the experts produced.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["UbepCase", "run_ubep_cases"]


@dataclass(frozen=True)
class UbepCase:
    """One ubep measurement: a shape (benchmarks.peers.Shape), a layout and an engine x sync."""

    shape: Any
    layout: str
    engine: str
    sync: str
    floor: bool = False  # also time the memcpy floor of this (shape, layout)


def _time(
    group: Any, fn: Callable[[], object], warmup: int, repeats: int, floor_bytes: int = 0
) -> tuple[list[float], list[tuple[int, int]]]:
    """Per timed iteration: ``fn``'s ns; with ``floor_bytes``, first (start, end) of one copy of
    that many bytes, behind its own barrier (CLOCK_MONOTONIC: comparable across ranks)."""
    if floor_bytes:
        src = np.ones(floor_bytes + 64, dtype=np.uint8)
        dst = np.empty_like(src)
        dst.fill(1)  # pre-faulted
    out, spans = [], []
    for i in range(warmup + repeats):
        if floor_bytes:
            group.barrier()
            t0 = time.perf_counter_ns()
            np.copyto(dst[:floor_bytes], src[:floor_bytes])
            t1 = time.perf_counter_ns()
            if i >= warmup:
                spans.append((t0, t1))
        group.barrier()
        start = time.perf_counter_ns()
        fn()
        if i >= warmup:
            out.append(float(time.perf_counter_ns() - start))
    return out, spans


def _measure(
    group: Any, buf: Any, x: np.ndarray, idx: np.ndarray, w: np.ndarray, warmup: int, repeats: int,
    floor_bytes: tuple[int, int] = (0, 0),
) -> dict[str, Any]:
    dispatch_ns, dispatch_floor = _time(group, lambda: buf.dispatch(x, idx, w), warmup, repeats,
                                        floor_bytes[0])
    res = buf.dispatch(x, idx, w)
    send_dst_row = np.asarray(res.handle.send_dst_row)
    out = buf.get_combine_buffer(res.handle)
    vals = np.random.default_rng(group.rank).standard_normal(out.shape, dtype=np.float32)
    out[...] = (vals.view(np.uint32) >> np.uint32(16)).astype(np.uint16)  # BF16 expert outputs
    combine_ns, combine_floor = _time(group, lambda: buf.combine(out, res.handle), warmup,
                                      repeats, floor_bytes[1])
    return {
        "dispatch": dispatch_ns, "combine": combine_ns, "rows_sent": int((send_dst_row >= 0).sum()),
        "memcpy_dispatch": dispatch_floor, "memcpy_combine": combine_floor,
    }


def _rank_main(
    group: Any, cases: Sequence[UbepCase], warmup: int, repeats: int
) -> list[dict[str, Any]]:
    from benchmarks.peers import NUM_EXPERTS, bytes_per_rank, make_inputs

    from ubep.buffer import Buffer, BufferConfig

    r = group.rank
    results: list[dict[str, Any]] = []
    inputs: dict[Any, Any] = {}
    for case in cases:
        if case.shape not in inputs:
            inputs = {case.shape: make_inputs(case.shape)}  # keep one shape's tensors at a time
        inp = inputs[case.shape]
        cfg = BufferConfig(
            max_tokens_per_rank=case.shape.tokens_per_rank, hidden=case.shape.hidden,
            num_topk=inp.topk_idxs[r].shape[1], num_experts=NUM_EXPERTS, dtype=case.shape.dtype,
            layout=case.layout, engine=case.engine, sync=case.sync,
        )
        floor = (
            (int(bytes_per_rank(inp, case.layout, "dispatch")),
             int(bytes_per_rank(inp, case.layout, "combine")))
            if case.floor else (0, 0)
        )
        with Buffer(group, cfg) as buf:
            results.append(
                _measure(group, buf, inp.xs[r], inp.topk_idxs[r], inp.topk_weights[r], warmup,
                         repeats, floor)
            )
    return results


def run_ubep_cases(
    cases: Sequence[UbepCase], num_ranks: int, *, warmup: int, repeats: int, timeout_s: float
) -> list[dict[str, Any]]:
    """Per case: ``dispatch``/``combine`` per-iteration ns (max over ranks), ``rows_sent``, and
    for a ``floor`` case ``memcpy_dispatch``/``memcpy_combine`` per-iteration span ns."""
    from ubep.runtime import launch

    per_rank = launch(_rank_main, num_ranks, list(cases), warmup, repeats, timeout_s=timeout_s)
    merged = []
    for i in range(len(cases)):
        ranks = [per_rank[r][i] for r in range(num_ranks)]
        got = {
            "dispatch": np.max([rk["dispatch"] for rk in ranks], axis=0),
            "combine": np.max([rk["combine"] for rk in ranks], axis=0),
            "rows_sent": np.array([rk["rows_sent"] for rk in ranks], dtype=np.int64),
        }
        for key in ("memcpy_dispatch", "memcpy_combine"):
            if ranks[0][key]:
                spans = np.array([rk[key] for rk in ranks], dtype=np.int64)  # [rank, rep, 2]
                got[key] = (spans[..., 1].max(axis=0) - spans[..., 0].min(axis=0)).astype(float)
        merged.append(got)
    return merged
