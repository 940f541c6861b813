"""The engine's trace (``Engine.trace()``): per call, the native call's entry and core 0's stamps
of its phase ends, on the clock ``time.perf_counter_ns`` reads (CLOCK_MONOTONIC), in order and
inside the call, for both engines (what benchmarks/bench_step.py and bench_growth.py read the
phases from)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ubep import routing, testing
from ubep.buffer import Buffer, BufferConfig
from ubep.runtime import launch
from ubep.runtime.abi import TRACE


def _rank(group: object, engine: str) -> list[tuple[int, int, list[int]]]:
    cfg = BufferConfig(max_tokens_per_rank=8, hidden=64, num_topk=2, num_experts=4,
                       dtype="bf16", layout="expert", engine=engine, num_cores=1)
    rng = np.random.default_rng(group.rank)  # type: ignore[attr-defined]
    x = testing.payload(rng, "bf16", 8, 64)
    idx = routing.uniform_topk(8, 4, 2, seed=group.rank)  # type: ignore[attr-defined]
    w = rng.random((8, 2), dtype=np.float32)
    out = []
    with Buffer(group, cfg) as buf:  # type: ignore[arg-type]
        for _ in range(2):
            t0 = time.perf_counter_ns()
            res = buf.dispatch(x, idx, w)
            t1 = time.perf_counter_ns()
            d = list(buf._engine.kernel.trace())
            t2 = time.perf_counter_ns()
            buf.combine(np.asarray(res.recv_x).copy(), res.handle)
            t3 = time.perf_counter_ns()
            c = list(buf._engine.kernel.trace())
            out += [(t0, t1, [d[TRACE["d_native"]], *d[TRACE["d_enter"]:TRACE["d_data_in"] + 1]]),
                    (t2, t3, [c[TRACE["c_native"]], *c[TRACE["c_enter"]:TRACE["c_reduced"] + 1]])]
    return out


@pytest.mark.parametrize("engine", ["asp", "bsp"])
def test_every_phase_is_stamped_in_order_inside_its_call(engine: str) -> None:
    for calls in launch(_rank, 2, engine, timeout_s=120):
        for start, end, stamps in calls:
            assert start <= stamps[0], "the native part starts after the Python call"
            assert stamps == sorted(stamps), f"phases out of order: {stamps}"
            assert stamps[-1] <= end, "the last phase ends before the call returns"
