"""What planning a multi-core ASP dispatch costs: ``ubep.sched``'s numpy Plan built per call
against the native scheduler the runtime now runs (``runtime/native/schedule.c``), which builds
the same Plan unit for unit.

Two parts, side by side in one process tree:

1. **The scheduler alone** (one process): ``ubep.sched.schedule`` (send units, validation and the
   policy, in numpy) against ``_native.schedule`` (the C scheduler behind a module function: its
   argument parsing and the int32 copy of the routing are inside the timed call) on the same
   routing, CM384 fabrics of 16-256 ranks, 8-256 tokens x top-8, 48 send cores, every policy.
2. **In the runtime** (2 ranks, ``num_cores`` 4, cores run on the calling thread: this host has
   2 CPUs, so threads would only take turns): dispatch + combine of ``tokens x 2048`` BF16,
   top-8 of 64 experts, expert layout, ASP/SW, hierarchical policy. ``native``: the Buffer as
   it is (a cached ``ScheduleSpec``, the engine plans). ``python``: the same Buffer made to build
   ``ubep.sched.schedule``'s Plan per call and pass it whole (the runtime's path before the
   native scheduler). The two alternate block by block in one loop, so a slow spell of the host
   lands on both. Floor: the copy of the bytes one rank sends (``tokens x top-8 x 2048 x 2``
   B, rows to itself included), two processes copying at once (harness ``concurrent_copy``).

    python -m benchmarks.bench_plan [--quick] [--repeats N] [--out DIR]

Writes ``plan.txt`` and ``plan.json`` with ``--out`` (e.g. ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from functools import partial
from typing import Any

import numpy as np

from benchmarks.harness import (
    Stats,
    collective_spans,
    concurrent_copy,
    dispatch_combine,
    format_table,
    machine_since,
    save_results,
    time_repeats,
)
from ubep import testing
from ubep.buffer import Buffer, BufferConfig
from ubep.buffer.tasks import NO_SPLIT, CoreTasks
from ubep.modes import POLICIES
from ubep.routing import uniform_topk
from ubep.runtime import _native, launch
from ubep.sched import CoreSplit, Plan, ScheduleSpec, schedule, schedule_spec
from ubep.topology import cm384

NUM_TOPK, SEND_CORES = 8, 48
HIDDEN, EXPERTS, CORES, RANKS = 2048, 64, 4, 2


def native_call(idx: np.ndarray, spec: ScheduleSpec, num_ranks: int, num_experts: int,
                units: np.ndarray, core_ptr: np.ndarray) -> int:
    """The native scheduler as a caller outside the engine reaches it (the routing as int32)."""
    return _native.schedule(
        idx.astype(np.int32), (spec.policy_code, 1, num_ranks, num_experts, idx.shape[1],
                               spec.num_send_cores, spec.hop_of_rank, spec.hop_issue_rank,
                               spec.remapped_expert), units, core_ptr)


def scheduler_alone(quick: bool, repeats: int) -> tuple[list[list[object]], list[dict]]:
    cases = [(16, 16, 128), (64, 256, 128), (256, 256, 128)]
    if not quick:
        cases += [(256, 256, 8), (256, 256, 256)]
    rows, records = [], []
    for num_ranks, num_experts, tokens in cases:
        topo = cm384(num_ranks)
        idx = uniform_topk(tokens, num_experts, NUM_TOPK, seed=11)
        rank = num_ranks // 2
        split = CoreSplit(num_send_cores=SEND_CORES, num_count_cores=1,
                          count_expert_ptr=np.array([0, num_experts], dtype=np.int64))
        units = np.empty((6, tokens * NUM_TOPK), dtype=np.int64)
        core_ptr = np.empty(SEND_CORES + 1, dtype=np.int64)
        for policy in POLICIES:
            spec = schedule_spec(split, topo, rank=rank, num_experts=num_experts, policy=policy)
            py = time_repeats(partial(schedule, idx, topo, rank=rank, num_experts=num_experts,
                                      policy=policy, num_send_cores=SEND_CORES,
                                      num_count_cores=1), repeats=repeats, warmup=5)
            nat = time_repeats(partial(native_call, idx, spec, num_ranks, num_experts, units,
                                       core_ptr), repeats=repeats, warmup=5)
            rows.append([policy, num_ranks, num_experts, tokens, int((idx >= 0).sum()),
                         py.min_us, py.median_us, py.max_us, nat.min_us, nat.median_us,
                         nat.max_us, py.median_us / nat.median_us])
            records.append({"policy": policy, "ranks": num_ranks, "experts": num_experts,
                            "tokens": tokens, "python": py.__dict__, "native": nat.__dict__})
    return rows, records


class PythonPlanTasks(CoreTasks):
    """The cores' tasks as the runtime planned before its native scheduler: ubep.sched's whole
    Plan, built in numpy on every call, through the Buffer's general path."""

    def for_x(self, x: object) -> object:
        return NO_SPLIT

    def for_idx(self, idx: np.ndarray) -> Plan | CoreSplit | ScheduleSpec | None:
        split = self.split(idx.shape[0])
        if not isinstance(split, ScheduleSpec):
            return split
        cfg = self.config
        topo = dataclasses.replace(self.topology, cores_per_rank=self.num_cores)
        return schedule(idx, topo, rank=self.rank, num_experts=cfg.num_experts,
                        policy=cfg.policy, layout=cfg.layout,
                        num_send_cores=split.num_send_cores,
                        num_count_cores=split.num_count_cores)


class PythonPlanBuffer(Buffer):
    """The Buffer made to plan as the runtime did before its native scheduler
    (:class:`PythonPlanTasks`)."""

    def __init__(self, group: Any, config: BufferConfig) -> None:
        super().__init__(group, config)
        self._tasks = PythonPlanTasks(self._cfg, self.num_cores, self.group.topology,
                                      self.rank)


def _config(tokens: int) -> BufferConfig:
    return BufferConfig(max_tokens_per_rank=max(tokens, 1), hidden=HIDDEN, num_topk=NUM_TOPK,
                        num_experts=EXPERTS, dtype="bf16", layout="expert", engine="asp",
                        sync="sw", num_cores=CORES, threads=False, policy="hierarchical")


def _runtime_worker(group: Any, tokens_list: list[int], blocks: int,
                    per_block: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tokens in tokens_list:
        xs, idxs, ws = testing.inputs("bf16", EXPERTS, NUM_TOPK, HIDDEN, [tokens] * RANKS, 5,
                                      "uniform")
        r = group.rank
        bufs = {"native": Buffer(group, _config(tokens)),
                "python": PythonPlanBuffer(group, _config(tokens))}
        try:
            for name, buf in bufs.items():  # both plan and move the same rows, bit for bit
                errors = testing.check_call(buf, xs, idxs, ws, 0)
                if errors:
                    raise AssertionError(f"{name}: {errors[:3]}")
            spans: dict[str, list[np.ndarray]] = {k: [] for k in bufs}
            for b in range(blocks):
                for name in (("native", "python") if b % 2 == 0 else ("python", "native")):
                    call = partial(dispatch_combine, bufs[name], xs[r], idxs[r], ws[r])
                    spans[name].append(collective_spans(group.barrier, call, 2, per_block))
            for name, got in spans.items():
                s = np.concatenate(got)
                out[f"{tokens}/{name}"] = (s[:, 1] - s[:, 0]).tolist()
        finally:
            for buf in bufs.values():
                buf.close()
    return out


def in_runtime(tokens_list: list[int], repeats: int) -> tuple[list[list[object]], list[dict]]:
    blocks = 10
    per_block = max(1, repeats // blocks)
    ranks = launch(_runtime_worker, RANKS, tokens_list, blocks, per_block, timeout_s=1200)
    sizes = [t * NUM_TOPK * HIDDEN * 2 for t in tokens_list]
    floors = concurrent_copy(RANKS, sizes, repeats=repeats, warmup=3)
    rows, records = [], []
    for tokens, size, floor in zip(tokens_list, sizes, floors, strict=True):
        stats = {}
        for name in ("native", "python"):
            # the call of the slowest rank, per iteration
            ns = np.max([ranks[r][f"{tokens}/{name}"] for r in range(RANKS)], axis=0)
            stats[name] = Stats.from_samples_us((ns / 1e3).tolist())
        nat, py = stats["native"], stats["python"]
        rows.append([tokens, size, nat.min_us, nat.median_us, nat.max_us, py.min_us,
                     py.median_us, py.max_us, py.median_us / nat.median_us,
                     floor.median_us, nat.median_us / floor.median_us])
        records.append({"tokens": tokens, "bytes_per_rank": size, "native": nat.__dict__,
                        "python": py.__dict__, "floor": floor.__dict__})
    return rows, records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer cases and repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default=None, help="directory for plan.txt / plan.json")
    args = ap.parse_args(argv)
    repeats = args.repeats or (50 if args.quick else 200)
    load, start = os.getloadavg()[0], time.monotonic()
    alone, alone_rec = scheduler_alone(args.quick, repeats)
    tokens_list = [16, 128] if args.quick else [1, 16, 128, 512]
    runtime, runtime_rec = in_runtime(tokens_list, repeats)
    text = "\n".join([
        f"# 1. one rank's Plan, CM384, top-{NUM_TOPK}, {SEND_CORES} send cores: ubep.sched "
        f"(numpy) vs the native scheduler, us over {repeats} calls",
        format_table(["policy", "EP", "experts", "tokens", "units", "py_min", "py_median",
                      "py_max", "native_min", "native_median", "native_max", "py/native"],
                     alone),
        "",
        f"# 2. dispatch + combine, {RANKS} ranks x {CORES} cores (on the calling thread), "
        f"tokens x {HIDDEN} BF16, top-{NUM_TOPK} of {EXPERTS} experts, expert layout, ASP/SW, "
        "hierarchical; slowest rank per call, us; bytes = tokens x top-k x hidden x 2; floor = "
        "that copy, both ranks at once",
        format_table(["tokens", "bytes", "native_min", "native_median", "native_max",
                      "python_min", "python_median", "python_max", "python/native",
                      "floor_median", "native/floor"], runtime),
    ])
    save_results(args.out, "plan", text, {
        "scheduler_alone": alone_rec, "runtime": runtime_rec,
        "machine": machine_since(load, start)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
