"""The native scheduler (``schedule.c``) builds the Plan ``ubep.sched.schedule`` builds, unit for
unit: same units, same order, same cores, for every policy and layout, on topologies of one to
three hop classes (including one whose latencies are not ascending, so the issue order is not
the hop order), skewed and masked routings, and more send cores than units; and a Buffer whose
engine plans refuses bad routing on every rank before it plans."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from ubep import testing
from ubep.buffer import Buffer, BufferConfig
from ubep.errors import InvalidArgumentError, RemoteError
from ubep.modes import LAYOUTS, POLICIES
from ubep.runtime import _native, launch
from ubep.sched import Plan, ScheduleSpec, core_split, schedule, schedule_spec
from ubep.topology import Topology, cm384, host, nvl72

FIELDS = ("send_token", "send_k", "send_expert", "send_dst_rank", "send_hop", "send_slot")


def native_plan(idx: np.ndarray, spec: ScheduleSpec, layout: str, num_ranks: int,
                num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """``([6, U] unit columns in FIELDS order, core_ptr)`` from the native scheduler alone."""
    tokens, topk = idx.shape
    units = np.full((6, max(1, tokens * topk)), -7, dtype=np.int64)
    core_ptr = np.full(spec.num_send_cores + 1, -7, dtype=np.int64)
    n = _native.schedule(
        np.ascontiguousarray(idx, dtype=np.int32),
        (spec.policy_code, int(layout == "expert"), num_ranks, num_experts, topk,
         spec.num_send_cores, spec.hop_of_rank, spec.hop_issue_rank, spec.remapped_expert),
        units, core_ptr)
    cap = max(1, tokens * topk)
    return units.reshape(6, cap)[:, :n], core_ptr


def routing(rng: np.random.Generator, tokens: int, topk: int, num_experts: int,
            kind: str) -> np.ndarray:
    """Distinct experts per row; ``hot``: half the picks on four experts; ``masked``: a third of
    the slots -1."""
    if kind == "hot":
        hot = rng.choice(num_experts, size=min(4, num_experts), replace=False)
        p = np.full(num_experts, 0.5 / max(1, num_experts - hot.size))
        p[hot] = 0.5 / hot.size
        p /= p.sum()
    else:
        p = None
    idx = np.stack([rng.choice(num_experts, size=topk, replace=False, p=p)
                    for _ in range(tokens)]) if tokens else np.empty((0, topk), np.int64)
    if kind == "masked":
        idx = np.where(rng.random(idx.shape) < 1 / 3, -1, idx)
    return idx.astype(np.int64)


def unequal_latency(num_ranks: int) -> Topology:
    """Three hop classes whose latencies are not ascending (class 1 the slowest)."""
    return Topology(num_ranks=num_ranks, ranks_per_node=4, cores_per_rank=8,
                    latency_ns=(100.0, 3000.0, 900.0), bandwidth_gbps=(10.0, 10.0, 10.0))


TOPOLOGIES = {
    "host4": host(4, 8),
    "nvl72_8": dataclasses.replace(nvl72(8), cores_per_rank=12),
    "cm384_32": cm384(32, ranks_per_node=8, cores_per_rank=24),
    "unequal_8": unequal_latency(8),
}


@pytest.mark.parametrize("topo_name", sorted(TOPOLOGIES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_native_scheduler_builds_ubep_sched_plan(topo_name: str, layout: str) -> None:
    topo = TOPOLOGIES[topo_name]
    rng = np.random.default_rng(len(topo_name) * 7 + len(layout))
    num_experts = topo.num_ranks * 4
    checked = 0
    for policy in POLICIES:
        for tokens, topk, kind in ((37, 6, "uniform"), (64, 8, "hot"), (19, 5, "masked"),
                                   (1, 3, "uniform"), (0, 4, "uniform")):
            idx = routing(rng, tokens, topk, num_experts, kind)
            rank = int(rng.integers(topo.num_ranks))
            for n_send in (2, 5, topo.cores_per_rank):
                plan = schedule(idx, topo, rank=rank, num_experts=num_experts, policy=policy,
                                layout=layout, num_send_cores=n_send, num_count_cores=1)
                split = dataclasses.replace(core_split(1, num_experts, topk, 1),
                                            num_send_cores=n_send)
                spec = schedule_spec(split, topo, rank=rank, num_experts=num_experts,
                                     policy=policy)
                units, core_ptr = native_plan(idx, spec, layout, topo.num_ranks, num_experts)
                _assert_same(plan, units, core_ptr, (policy, tokens, kind, n_send))
                checked += plan.num_units
    assert checked > 1000  # the cases above are not all empty


def _assert_same(plan: Plan, units: np.ndarray, core_ptr: np.ndarray, case: object) -> None:
    assert core_ptr.tolist() == plan.core_ptr.tolist(), case
    for row, name in enumerate(FIELDS):
        assert units[row].tolist() == getattr(plan, name).tolist(), (case, name)


def test_native_scheduler_refuses_a_bad_spec() -> None:
    topo = host(2, 4)
    split = dataclasses.replace(core_split(1, 8, 2, 1), num_send_cores=2)
    spec = schedule_spec(split, topo, rank=0, num_experts=8, policy="hierarchical")
    idx = np.array([[0, 5]], dtype=np.int64)
    native_plan(idx, spec, "expert", 2, 8)  # the good spec is taken
    bad_issue = dataclasses.replace(spec, hop_issue_rank=np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match="permutation"):
        native_plan(idx, bad_issue, "expert", 2, 8)
    bad_hop = dataclasses.replace(spec, hop_of_rank=np.array([0, 2], dtype=np.int64))
    with pytest.raises(ValueError, match="hop class"):
        native_plan(idx, bad_hop, "expert", 2, 8)


def _worker_bad_routing(group: Any) -> list[Any]:
    """Four cores per rank (the native scheduler plans): rank 1 sends an id out of range, then
    a row naming one expert twice; every rank must refuse each call cleanly, then serve."""
    cfg = BufferConfig(max_tokens_per_rank=24, hidden=64, num_topk=4, num_experts=16,
                       dtype="bf16", layout="rank", engine="asp", sync="sw", num_cores=4,
                       threads=False, policy="hierarchical", timeout_s=60.0)
    out: list[Any] = []
    with Buffer(group, cfg) as buf:
        for case in ("range", "duplicate", "good"):
            xs, idxs, ws = testing.inputs("bf16", 16, 4, 64, [24, 24], 3, "uniform")
            if case == "range":
                idxs[1][5, 2] = 16
            elif case == "duplicate":
                idxs[1][7, 3] = idxs[1][7, 0]
            try:
                out.append((case, testing.check_call(buf, xs, idxs, ws, 1)))
            except InvalidArgumentError as exc:
                out.append((case, ("InvalidArgumentError", exc.argument)))
            except RemoteError as exc:
                out.append((case, ("RemoteError", exc.clean)))
    return out


def test_bad_routing_is_refused_on_every_rank_before_the_native_plan() -> None:
    got = launch(_worker_bad_routing, 2, timeout_s=120)
    for r, calls in enumerate(got):
        bad = ("InvalidArgumentError", "topk_idx") if r == 1 else ("RemoteError", True)
        assert calls == [("range", bad), ("duplicate", bad), ("good", [])], (r, calls)
