"""benchmarks/bench_plan.py: its baseline Buffer (ubep.sched's numpy Plan handed to the engine on
the general path, with count cores) returns what the single-process reference returns, and the
engine's send cores follow that Plan unit for unit (no timing assertions)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

# benchmarks/ is a top-level folder, not an installed package (see test_peers.py)
from benchmarks import bench_plan
from ubep import testing
from ubep.runtime import launch

CASES = [("expert", "hierarchical", "uniform"), ("rank", "balanced", "hot"),
         ("expert", "expert_contiguous", "hot")]
TOKENS = 24


def _worker(group: Any) -> list[tuple[list[str], list[list[int]], list[list[int]]]]:
    out = []
    for i, (layout, policy, kind) in enumerate(CASES):
        cfg = dataclasses.replace(bench_plan._config(TOKENS), layout=layout, policy=policy)
        xs, idxs, ws = testing.inputs("bf16", cfg.num_experts, cfg.num_topk, cfg.hidden,
                                      [TOKENS] * group.num_ranks, 40 + i, kind)
        with bench_plan.PythonPlanBuffer(group, cfg) as buf:
            errors = testing.check_call(buf, xs, idxs, ws, 40 + i)
            plan = buf._tasks.for_idx(idxs[group.rank])
            units, _ = buf._engine.kernel.core_log()
            want = [(plan.send_token * cfg.num_topk + plan.send_k)[
                plan.core_ptr[j]:plan.core_ptr[j + 1]].tolist()
                for j in range(plan.num_send_cores)]
            out.append((errors, [list(map(int, u)) for u in units[:plan.num_send_cores]], want))
    return out


@pytest.fixture(scope="module")
def runs() -> list[Any]:
    return launch(_worker, bench_plan.RANKS, timeout_s=300)


@pytest.mark.parametrize("i", range(len(CASES)), ids=["-".join(c) for c in CASES])
def test_python_plan_buffer_is_bit_exact_and_follows_its_plan(runs: list[Any], i: int) -> None:
    for r, rank_runs in enumerate(runs):
        errors, got, want = rank_runs[i]
        assert errors == [], (r, errors[:3])
        assert got == want, r
        assert sum(map(len, want)) > 0  # the plan has units: the path under test
