"""The runtime executes the Plan the simulator times: per core, the units each core sent and
the count records each count core published, against ``ubep.sim``'s OpSpec of the same inputs.
With several send cores the engine builds that Plan itself (the native scheduler), so this is
also its test end to end, for every policy.

Each rank runs one dispatch and combine (checked bit for bit against ``ubep.reference``) and
returns its engine's per-core log. The oracle is independent of the engine: ``ubep.sched`` plans
every rank's ``topk_idx`` with the split the Buffer used, and ``ubep.sim.spec.build_spec`` turns
those plans into the units and count chunks the simulator times on each physical core.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np
import pytest

from ubep import testing
from ubep.buffer import Buffer, BufferConfig
from ubep.runtime import launch
from ubep.sched import core_split, schedule
from ubep.sim.calib import load_fabric
from ubep.sim.spec import build_spec
from ubep.topology import host

HIDDEN, TOPK = 256, 4


@dataclasses.dataclass(frozen=True)
class PlanCase:
    layout: str
    sync: str
    num_cores: int
    threads: bool
    tokens: int
    num_experts: int
    policy: str = "hierarchical"

    def config(self) -> BufferConfig:
        return BufferConfig(
            max_tokens_per_rank=32, hidden=HIDDEN, num_topk=TOPK, num_experts=self.num_experts,
            dtype="bf16", layout=self.layout, engine="asp", sync=self.sync,
            num_cores=self.num_cores, threads=self.threads, policy=self.policy,
            timeout_s=60.0,
        )


# Splits (Appendix A's partition; small batches get more count cores): 4 cores at 24 tokens = 3
# send + 1 count (the Plan's units); 3 cores at 1 token = 1 send (the engine's buckets) + 2
# count (one destination each); 4 cores at 1 token = 2 + 2; 2 cores = 1 + 1.
CASES = [
    PlanCase("expert", "sw", 4, True, 24, 16),
    PlanCase("rank", "dc", 4, False, 24, 16),
    PlanCase("rank", "tff", 3, True, 1, 16),
    PlanCase("expert", "sp", 4, True, 1, 16),
    PlanCase("rank", "sw", 2, True, 16, 8),
    PlanCase("rank", "sw", 4, False, 24, 16, "balanced"),
    PlanCase("expert", "dc", 4, True, 24, 16, "expert_contiguous"),
]


def _inputs(case: PlanCase, seed: int) -> tuple[list[Any], list[np.ndarray], list[Any]]:
    return testing.inputs("bf16", case.num_experts, TOPK, HIDDEN, [case.tokens] * 2, seed,
                          "uniform")


def _worker(group: Any, cases: list[PlanCase]) -> list[tuple[list[str], Any]]:
    out = []
    for i, case in enumerate(cases):
        xs, idxs, ws = _inputs(case, i)
        with Buffer(group, case.config()) as buf:
            errors = testing.check_call(buf, xs, idxs, ws, i)
            out.append((errors, buf._engine.kernel.core_log()))
    return out


def _oracle(case: PlanCase, idxs: list[np.ndarray]) -> Any:
    topo = dataclasses.replace(host(2), cores_per_rank=case.num_cores)
    split = core_split(case.num_cores, case.num_experts, TOPK, case.tokens)
    plans = [schedule(idx, topo, rank=r, num_experts=case.num_experts, policy=case.policy,
                      layout=case.layout, num_send_cores=split.num_send_cores,
                      num_count_cores=split.num_count_cores) for r, idx in enumerate(idxs)]
    spec = build_spec(plans, topo, load_fabric("cm384"), engine="asp", sync=case.sync,
                      row_bytes=HIDDEN * 2)
    return plans, spec


@pytest.fixture(scope="module")
def runs() -> list[list[tuple[list[str], Any]]]:
    return launch(_worker, 2, CASES, timeout_s=300)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_runtime_cores_do_what_the_simulator_times(
    runs: list[list[tuple[list[str], Any]]], i: int
) -> None:
    case = CASES[i]
    _, idxs, _ = _inputs(case, i)
    plans, spec = _oracle(case, idxs)
    n_s, epr = spec.num_send_cores, case.num_experts // 2
    for r in range(2):
        errors, (units, dsts) = runs[r][i]
        assert not errors, errors[:5]
        plan = plans[r]
        key = plan.send_token * TOPK + plan.send_k  # a unit as the engine logs it
        for j in range(case.num_cores):
            sim_dst = spec.unit_dst[spec.unit_src == r][spec.unit_core[spec.unit_src == r] == j]
            got = np.asarray(units[j], dtype=np.int64)
            got_dst = idxs[r].reshape(-1)[got] // epr if got.size else got
            if n_s > 1:  # the Plan's units, in the Plan's order
                want = key[plan.core_ptr[j]:plan.core_ptr[j + 1]] if j < n_s else key[:0]
                assert got.tolist() == want.tolist(), (r, j)
                assert got_dst.tolist() == sim_dst.tolist(), (r, j)
            else:  # one send core: its units, destinations in the order their counts arrive
                want = key if j == 0 else key[:0]
                assert sorted(got.tolist()) == sorted(want.tolist()), (r, j)
                assert Counter(got_dst.tolist()) == Counter(sim_dst.tolist()), (r, j)
        # count records: a destination is counted whole by the count core that owns its first
        # expert (one checksummed record per destination); the simulator's chunks of that core
        # start with it
        for d in range(2):
            cores = spec.chunk_core[spec.chunk_dst == d]
            counted_by = [c for c in range(case.num_cores) if d in dsts[c]]
            assert counted_by == [int(cores.min())], (r, d, dsts)
        assert sum(len(x) for x in dsts) == 2
