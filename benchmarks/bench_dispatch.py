"""Dispatch and combine of ``ubep.Buffer`` over engine x sync x layout, against the memcpy floor.

    python -m benchmarks.bench_dispatch            # full matrix (a few minutes on 2 cores)
    python -m benchmarks.bench_dispatch --quick    # 2 ranks, 128 tokens, the main modes (~30 s)
    python -m benchmarks.bench_dispatch --json out/bench_dispatch.json --breakdown

Shapes: 2 and 4 ranks x 128 and 512 tokens/rank x (hidden 2048 BF16, hidden 7168 1-byte), top-8
of 64 experts, seeded uniform routing (``--hot``: also 50 % of picks on 4 hot experts). Each
rank count runs in one ``ubep.launch``; every case gets its own Buffer.

Timing: every iteration is a group barrier, then each rank times its own call; the time of an
iteration is the maximum over ranks; min / median / max over ``--repeats`` iterations after
warm-up. The cases of one shape are interleaved (each repeat times every case once) when their
Buffers fit in memory together, so on a shared host they all see the same background load.
Combine takes the expert outputs from ``buf.get_combine_buffer(handle)`` (where a ubep user's
experts write them; BF16 for a 1-byte dispatch). The floor is one ``np.copyto`` of the same
bytes, pre-faulted, all ranks copying at once, timed the same way in the same run.

Bytes (per rank, mean over ranks): rows actually moved x hidden x bytes per element, where rows
are (token, expert) pairs for ``layout=expert`` and (token, destination rank) pairs for
``layout=rank``, the rank's own rows included (they are copied too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from benchmarks.harness import (
    DISPATCH_PHASES,
    Stats,
    format_table,
    int_list,
    phase_medians,
    traced_call,
)

NUM_EXPERTS = 64
NUM_TOPK = 8
PHASES = DISPATCH_PHASES


@dataclass(frozen=True)
class Case:
    tokens: int
    hidden: int
    dtype: str
    layout: str
    engine: str
    sync: str
    routing: str


def cases_for(quick: bool, hot: bool) -> list[Case]:
    shapes = [(128, 2048, "bf16"), (128, 7168, "uint8")]
    if not quick:
        shapes += [(512, 2048, "bf16"), (512, 7168, "uint8")]
    from ubep.modes import LAYOUTS, supports

    # the quick run: the ASP modes and the BSP baseline; the full run: every engine x sync
    picked = [("asp", "sp"), ("asp", "sw"), ("asp", "tff"), ("asp", "dc"), ("bsp", "sw")]
    if not quick:
        picked += [("bsp", "sp"), ("bsp", "tff"), ("bsp", "dc")]
    out = []
    for tokens, hidden, dtype in shapes:
        for layout in LAYOUTS:
            for engine, sync in picked:
                if not supports(sync, dtype):
                    continue  # no free sentinel in a 1-byte type
                out.append(Case(tokens, hidden, dtype, layout, engine, sync, "uniform"))
                if hot and (engine, sync) in (("asp", "sp"), ("asp", "dc"), ("bsp", "sw")):
                    out.append(Case(tokens, hidden, dtype, layout, engine, sync, "hot"))
    return out


def inputs(case: Case, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from ubep import routing

    rng = np.random.default_rng([7, rank, case.tokens])
    if case.dtype == "bf16":
        x = (rng.standard_normal((case.tokens, case.hidden), dtype=np.float32)
             .view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    else:
        x = rng.integers(0, 256, size=(case.tokens, case.hidden), dtype=np.uint8)
    if case.routing == "hot":
        idx = routing.hot_experts_topk(case.tokens, NUM_EXPERTS, NUM_TOPK, hot_experts=4,
                                       hot_share=0.5, hot_ids=np.array([24, 59, 60, 62]),
                                       seed=100 + rank)
    else:
        idx = routing.uniform_topk(case.tokens, NUM_EXPERTS, NUM_TOPK, seed=100 + rank)
    w = rng.random((case.tokens, NUM_TOPK), dtype=np.float32)
    return x, idx, w


def _config(case: Case) -> Any:
    from ubep.buffer import BufferConfig

    return BufferConfig(
        max_tokens_per_rank=case.tokens, hidden=case.hidden, num_topk=NUM_TOPK,
        num_experts=NUM_EXPERTS, dtype=case.dtype, layout=case.layout, engine=case.engine,
        sync=case.sync,
    )


class _Running:
    """One case's Buffer, inputs and samples while a group of cases is measured."""

    def __init__(self, group: Any, case: Case) -> None:
        from ubep.buffer import Buffer

        self.case = case
        self.buf = Buffer(group, _config(case))
        self.x, self.idx, self.w = inputs(case, group.rank)
        res = self.buf.dispatch(self.x, self.idx, self.w)
        self.rows_sent = int((res.handle.send_dst_row >= 0).sum())
        self.res = res
        self.eo = self.buf.get_combine_buffer(res.handle)
        vals = np.random.default_rng(group.rank).standard_normal(self.eo.shape, dtype=np.float32)
        self.eo[...] = (vals.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
        nbytes = max(self.rows_sent * case.hidden * self.x.dtype.itemsize, 1)
        self.src = np.ones(nbytes, np.uint8)
        self.dst = np.ones_like(self.src)
        self.samples: dict[str, list[float]] = {"dispatch": [], "combine": [], "memcpy": []}
        self.trace: list[list[int]] = []

    def dispatch(self) -> None:
        self.buf.dispatch(self.x, self.idx, self.w)

    def combine(self) -> None:
        # combine needs the handle of a dispatch on this Buffer: the one made at set-up (its
        # recv_x may be stale by now, but combine reads only the expert outputs and the handle)
        self.buf.combine(self.eo, self.res.handle)

    def memcpy(self) -> None:
        np.copyto(self.dst, self.src)


def _measure_group(group: Any, cases: list[Case], warmup: int, repeats: int,
                   breakdown: bool) -> list[dict[str, Any]]:
    """Interleave the cases: every repeat times each case once, so all of them see the same
    background load (this host is shared; the load changes from second to second)."""
    running = [_Running(group, case) for case in cases]
    try:
        for i in range(warmup + repeats):
            for run_ in running:
                for op in ("dispatch", "combine", "memcpy"):
                    traced = op == "dispatch" and breakdown
                    call = traced_call(group.barrier, getattr(run_, op),
                                       run_.buf._engine.kernel.trace if traced else lambda: ())
                    if i < warmup:
                        continue
                    run_.samples[op].append((call[1] - call[0]) / 1e3)
                    if traced:
                        run_.trace.append(call)
        return [{
            "case": asdict(r.case), **r.samples, "rows_sent": r.rows_sent,
            "breakdown": phase_medians(r.trace, "dispatch") if r.trace else None,
        } for r in running]
    finally:
        for r in running:
            r.buf.close()


def shape_groups(cases: list[Case]) -> list[list[Case]]:
    """The cases of each shape (tokens, hidden, dtype), in first-seen order: the groups whose
    cases one run interleaves (bench_host_validation measures them as the same units)."""
    groups: dict[tuple[int, int, str], list[Case]] = {}
    for case in cases:
        groups.setdefault((case.tokens, case.hidden, case.dtype), []).append(case)
    return list(groups.values())


def _rank_main(group: Any, cases: list[Case], warmup: int, repeats: int,
               breakdown: bool, interleave_bytes: int) -> list[dict[str, Any]]:
    """Cases of one shape are interleaved when their Buffers fit in ``interleave_bytes`` (all
    ranks together); bigger ones run one after the other."""
    from ubep.buffer import Buffer

    out: list[dict[str, Any]] = []
    for members in shape_groups(cases):
        total = sum(Buffer.size_hint(_config(c), group.num_ranks) for c in members)
        if total * group.num_ranks <= interleave_bytes:
            out += _measure_group(group, members, warmup, repeats, breakdown)
        else:
            for case in members:
                out += _measure_group(group, [case], warmup, repeats, breakdown)
    order = {asdict(c).__repr__(): i for i, c in enumerate(cases)}
    return sorted(out, key=lambda r: order[r["case"].__repr__()])


def run(ranks: list[int], cases: list[Case], warmup: int, repeats: int, breakdown: bool,
        timeout_s: float, interleave_bytes: int = 3 << 30) -> list[dict[str, Any]]:
    from ubep.runtime import launch

    rows = []
    for num_ranks in ranks:
        per_rank = launch(_rank_main, num_ranks, cases, warmup, repeats, breakdown,
                          interleave_bytes, timeout_s=timeout_s)
        for i, case in enumerate(cases):
            mine = [r[i] for r in per_rank]
            row: dict[str, Any] = {"ranks": num_ranks, **asdict(case)}
            itemsize = 2 if case.dtype == "bf16" else 1
            row["bytes_per_rank"] = float(np.mean([m["rows_sent"] for m in mine])) * case.hidden
            row["dispatch_bytes"] = row["bytes_per_rank"] * itemsize
            row["combine_bytes"] = row["bytes_per_rank"] * 2  # expert outputs in BF16
            for op in ("dispatch", "combine", "memcpy"):
                worst = np.max(np.array([m[op] for m in mine]), axis=0)  # max over ranks
                stats = Stats.from_samples_us([float(v) for v in worst])
                row[op] = {"min_us": stats.min_us, "median_us": stats.median_us,
                           "max_us": stats.max_us}
            if breakdown and mine[0]["breakdown"] is not None:
                row["breakdown_rank0"] = dict(zip(PHASES, mine[0]["breakdown"], strict=False))
            rows.append(row)
    return rows


def print_rows(rows: list[dict[str, Any]], breakdown: bool) -> None:
    print("size_bytes = rows actually moved x hidden x bytes/elem, per rank (mean over ranks);")
    print("  rows = (token, expert) pairs (layout=expert) or (token, dst rank) pairs")
    print("  (layout=rank), own rows included; combine moves the rows back in BF16.")
    print("algbw_gbps = size / median; memcpy_us = median of one np.copyto of the same bytes")
    print("  (all ranks at once; scaled by size for a BF16 combine of a 1-byte dispatch);")
    print("  vs_memcpy = time_us / memcpy_us.")
    print("time = max over ranks per iteration; min/median/max over the repeats.")
    cols = ["ranks", "tokens", "hidden", "dtype", "layout", "engine", "sync", "routing", "op",
            "size_bytes", "min_us", "time_us", "max_us", "algbw_gbps", "memcpy_us", "vs_memcpy"]
    table = []
    for r in rows:
        for op in ("dispatch", "combine"):
            size = r["dispatch_bytes"] if op == "dispatch" else r["combine_bytes"]
            med = r[op]["median_us"]
            floor = r["memcpy"]["median_us"] * size / max(r["dispatch_bytes"], 1)
            table.append([r["ranks"], r["tokens"], r["hidden"], r["dtype"], r["layout"],
                          r["engine"], r["sync"], r["routing"], op, int(size), r[op]["min_us"],
                          med, r[op]["max_us"], size / med / 1e3, floor, med / floor])
    print(format_table(cols, table, float_digits=1))
    if breakdown:
        print("\nASP/BSP dispatch on rank 0, median microseconds per phase (engine timestamps):")
        bcols = ["ranks", "tokens", "hidden", "layout", "engine", "sync", *PHASES]
        brows = [[r["ranks"], r["tokens"], r["hidden"], r["layout"], r["engine"], r["sync"],
                  *[r["breakdown_rank0"][p] for p in PHASES]]
                 for r in rows if "breakdown_rank0" in r and r["engine"] == "asp"]
        print(format_table(bcols, brows, float_digits=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 ranks, 128 tokens, main modes")
    parser.add_argument("--ranks", default=None, help="comma-separated rank counts (2,4)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--hot", action="store_true", help="add hot-expert routing rows")
    parser.add_argument("--breakdown", action="store_true", help="per-phase dispatch times")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    ranks = int_list(args.ranks, [2] if args.quick else [2, 4])
    repeats = args.repeats or (30 if args.quick else 50)
    load = os.getloadavg()[0]
    if load > 1.0:
        print(f"[bench_dispatch] load average {load:.1f} on {os.cpu_count()} cores before the "
              "run: numbers will be noisy", file=sys.stderr)
    start = time.monotonic()
    rows = run(ranks, cases_for(args.quick, args.hot), args.warmup, repeats, args.breakdown,
               args.timeout)
    print_rows(rows, args.breakdown)
    print(f"\n({time.monotonic() - start:.0f} s, {repeats} repeats after {args.warmup} warm-up)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"machine": {"cpus": os.cpu_count(), "load_before": load},
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
