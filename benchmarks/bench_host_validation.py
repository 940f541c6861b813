"""Host validation: the simulator, given microbenchmark constants only, predicts bench_dispatch.

    python -m benchmarks.bench_host_validation                 # full matrix (several minutes)
    python -m benchmarks.bench_host_validation --quick         # 2 ranks, 128 tokens (debugging)
    python -m benchmarks.bench_host_validation --out benchmarks/results/host_validation
    python -m benchmarks.bench_host_validation --quick --tasks # and each dispatch task by task
                                                               # (bench_host_tasks' comparison)

One run: per unit (a rank count x one shape's cases, which bench_dispatch interleaves), (1) the
microbenchmarks of benchmarks/host_micro.py (row passes at each case's working set, the
tiny-call fixed cost per engine x sync x layout; the flag round trip once per run), then (2)
bench_dispatch's matrix measured as bench_dispatch measures it (same cases, inputs, timing), a
unit's (2) right after its (1) because this host's speed drifts within minutes; and (3)
``ubep.sim.host.predict_host`` for every case from (1) alone, printed beside (2) with the
relative error, the median and the worst |error|. Nothing in (3) reads (2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import bench_dispatch as bd
from benchmarks.harness import format_table, int_list
from benchmarks.host_micro import Micro, build, cpus_available
from benchmarks.host_model import (
    TINY_HIDDEN,
    case_of,
    case_timer,
    dispatch_terms,
    doorbells,
    error_lines,
    error_stats,
    fixed_cost,
    host_case,
    routing_of,
    tiny_case,
)
from ubep.sim.host import combine_terms, kernel_passes, predict_host
from ubep.sim.host_sched import Doorbells, cpus_for


def _copy_ns_per_byte(row: dict[str, Any]) -> float:
    """bench_dispatch's memcpy floor of this row: one np.copyto of the dispatch's bytes by every
    rank at once, interleaved with the calls (so under the same load and cache state)."""
    return float(row["memcpy"]["median_us"]) * 1e3 / max(float(row["dispatch_bytes"]), 1.0)


def _units(ranks: list[int], cases: list[bd.Case]) -> list[tuple[int, list[bd.Case]]]:
    """The run's units: per rank count, the cases of one shape (bench_dispatch interleaves
    them), in the matrix's order."""
    return [(r, members) for r in ranks for members in bd.shape_groups(cases)]


def _premeasure(micro: Micro, ranks: int, cases: list[bd.Case], bells: Doorbells) -> None:
    """Every microbenchmark the predictions of ``cases`` at ``ranks`` will need, before their
    matrix runs (the receive metadata's with a CPU a rank where the host has them: with
    fewer, the prediction measures its own after the matrix)."""
    for case in cases:
        idxs = routing_of(case, ranks)
        dispatch_terms(micro, case, ranks, min(ranks, os.cpu_count() or 1), bells)
        for op in ("dispatch", "combine"):
            hc = host_case(case, ranks, op)
            timer = case_timer(micro, case, ranks, op, idxs)
            for w, rd, t in kernel_passes(hc, combine_terms(idxs, hc)).values():
                timer(w, rd, t)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 ranks, 128 tokens, main modes")
    parser.add_argument("--ranks", default=None, help="comma-separated rank counts (2,4)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--millis", type=int, default=60, help="per microbenchmark round")
    parser.add_argument("--rounds", type=int, default=5, help="microbenchmark rounds (median)")
    parser.add_argument("--out", default=None, help="write OUT.txt and OUT.json")
    parser.add_argument("--tasks", action="store_true",
                        help="also each dispatch task by task: measured spans (trace=True) "
                             "beside the host model's (benchmarks/bench_host_tasks.py)")
    args = parser.parse_args(argv)
    ranks = int_list(args.ranks, [2] if args.quick else [2, 4])
    repeats = args.repeats or (30 if args.quick else 50)
    cases = bd.cases_for(args.quick, False)
    load_before = os.getloadavg()
    start = time.monotonic()
    micro = Micro(build(), millis=args.millis, rounds=args.rounds)
    flags = {r: micro.flag_oneway_ns(r) for r in ranks}
    bells = doorbells(micro)  # a wait past its yield window: the wake-up and the rings
    cpus_by: dict[tuple[int, bd.Case], tuple[float, int]] = {}
    tiny_rows: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    micro_s, load_units = 0.0, []
    for r, members in _units(ranks, cases):
        # a unit's microbenchmarks right before its matrix: this host's speed drifts up to 2x
        # within minutes, so a pass measured minutes away prices another machine
        tiny = sorted({tiny_case(c) for c in members},
                      key=lambda c: (c.tokens, c.dtype, c.layout, c.engine, c.sync))
        t0 = time.monotonic()
        _premeasure(micro, r, members + tiny, bells)
        micro_s += time.monotonic() - t0
        # the CPUs the unit's ranks get, on both sides of its calls (the load moves)
        before = cpus_available(r)
        tiny_rows += bd.run([r], tiny, args.warmup, repeats, False, 1800.0)
        rows += bd.run([r], members, args.warmup, repeats, False, 1800.0)
        avail = (before + cpus_available(r)) / 2
        for c in members + tiny:
            cpus_by[(r, c)] = (avail, cpus_for(avail, r))
        load_units.append(os.getloadavg()[0])
    load_after = os.getloadavg()
    tiny_by = {(t["ranks"], t["tokens"], t["dtype"], t["engine"], t["sync"], t["layout"]): t
               for t in tiny_rows}
    fixed: dict[tuple[Any, ...], dict[str, float]] = {}
    table, out_rows, task_table = [], [], []
    for row in rows:
        case, r = case_of(row), row["ranks"]
        idxs = routing_of(case, r)
        avail, cpus = cpus_by[(r, case)]
        for op in ("dispatch", "combine"):
            key = (r, case.tokens, case.dtype, case.engine, case.sync, case.layout)
            # the task model's terms (bench_host_tasks'): one model gives a call's spans and
            # its latency; a combine sends nothing and waits for no peer's rows
            terms: dict[str, Any] = (dispatch_terms(micro, case, r, cpus, bells)
                                     if op == "dispatch" else {})
            small = {k: v for k, v in terms.items() if k != "rank_scale"}
            f = fixed_cost(micro, flags, tiny_by[key], op, cpus_by[(r, tiny_case(case))][1],
                           **small)
            fixed[(*key, op)] = f
            timer = case_timer(micro, case, r, op, idxs)
            pred = predict_host(host_case(case, r, op), idxs, fixed_ns=f["fixed_ns"],
                                flag_oneway_ns=flags[r], timer=timer, cpus=cpus,
                                **terms) / 1e3
            meas = row[op]["median_us"]
            err = 100.0 * (pred - meas) / meas
            table.append([r, case.tokens, case.hidden, case.dtype, case.layout, case.engine,
                          case.sync, op, cpus, meas, pred, err, f["fixed_ns"] / 1e3,
                          1.0 / _copy_ns_per_byte(row)])
            out_rows.append({**asdict(case), "ranks": r, "op": op, "measured_us": meas,
                             "measured_min_us": row[op]["min_us"],
                             "measured_max_us": row[op]["max_us"], "predicted_us": pred,
                             "error_pct": err, "fixed_us": f["fixed_ns"] / 1e3,
                             "cpus_available": avail, "cpus": cpus,
                             "tiny_measured_us": f["tiny_measured_ns"] / 1e3,
                             "memcpy_gbps": 1.0 / _copy_ns_per_byte(row)})
    summary = _summary(out_rows)
    if args.tasks:
        task_table = _task_table(Micro(micro.binary, millis=args.millis, rounds=args.rounds),
                                 [(row["ranks"], case_of(row)) for row in rows], args.warmup,
                                 repeats)
    lines = [
        "# Host validation: ubep.sim host model (microbenchmark constants only) vs bench_dispatch",
        f"# {os.cpu_count()} CPUs; load average before {load_before[0]:.2f}, after each unit "
        f"(ranks x shape: its microbenchmarks, then its matrix) "
        + " ".join(f"{v:.2f}" for v in load_units) + " (1-min)",
        "# flag one-way latency (ns) by ranks: "
        + ", ".join(f"{r}: {v:.0f}" for r, v in flags.items())
        + f"; doorbells (ns): wake-up {bells.wake_ns:.0f}, ring of a sleeper "
        f"{bells.ring_sleep_ns:.0f}, of a registered rank awake {bells.ring_armed_ns:.0f}, "
        f"yield window {bells.yield_ns:.0f}",
        "# measured = median over repeats of the max over ranks (bench_dispatch); predicted = "
        "ubep.sim.host.predict_host, the task model of bench_host_tasks (a dispatch's per-row "
        "bookkeeping, receive metadata, ranks' speeds and doorbells measured as there; ranks "
        "start together after bench_dispatch's barrier): every rank's tasks run on the CPUs "
        "its ranks got "
        "(cpus: host_micro.cpus_available on both sides of the unit's calls, the nearest whole "
        "number) until each must wait (ubep.sim.host_sched), the slowest rank's call, from: "
        f"fixed = a rank's per-call cost with which the model's call with {TINY_HIDDEN}-element "
        "rows lasts what it measured; row passes = host_micro.c's passes (the runtime's "
        "kernels, caches flushed before each pass, ns per row, each pass's own time); flag "
        "latency = host_micro's round trip / 2; memcpy_gbps = bench_dispatch's memcpy floor "
        "(shown, not used)",
    ]
    cols = ["ranks", "tokens", "hidden", "dtype", "layout", "engine", "sync", "op", "cpus",
            "measured_us", "predicted_us", "error_pct", "fixed_us", "memcpy_gbps"]
    lines.append(format_table(cols, table, float_digits=1))
    if task_table:
        lines += ["", "# dispatch task by task (benchmarks/bench_host_tasks.py's comparison): "
                  "us per rank and call, median over ranks and 20 traced calls after 5; busy = "
                  "every span but waits, barriers and init (ASP's receive is a wait); the "
                  "model's spans from each case's own microbenchmarks, run right before it",
                  format_table(["ranks", "tokens", "hidden", "layout", "mode", "cpus",
                                "busy_meas", "busy_pred", "send_meas", "send_pred",
                                "wait_meas", "wait_pred"], task_table, float_digits=1)]
    lines += error_lines(summary, "rows")
    lines.append(f"\n({time.monotonic() - start:.0f} s; microbenchmarks {micro_s:.0f} s; "
                 f"{repeats} repeats after {args.warmup} warm-up)")
    text = "\n".join(lines)
    print(text)
    if args.out:
        base = Path(args.out)
        base.parent.mkdir(parents=True, exist_ok=True)
        base.with_suffix(".txt").write_text(text + "\n", encoding="utf-8")
        payload = {"machine": {"cpus": os.cpu_count(), "load_before": load_before,
                               "load_after_units": load_units, "load_after": load_after},
                   "flag_oneway_ns": {str(k): v for k, v in flags.items()},
                   "doorbells": asdict(bells),
                   "fixed": [{"ranks": k[0], "tokens": k[1], "dtype": k[2], "engine": k[3],
                              "sync": k[4], "layout": k[5], "op": k[6], **v}
                             for k, v in fixed.items()],
                   "micro": [{"key": list(map(str, k)), "values": list(v)}
                             for k, v in micro.cache.items()],
                   "summary": summary, "rows": out_rows, "tasks": task_table}
        base.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n",
                                             encoding="utf-8")
    return 0


def _task_table(micro: Micro, cases: list[tuple[int, bd.Case]], warmup: int,
                repeats: int) -> list[list[Any]]:
    """The dispatches of ``cases`` task by task: bench_host_tasks' comparison of each (its
    microbenchmarks, its traced calls, the model's spans on the CPUs its ranks got)."""
    from benchmarks.bench_host_tasks import compare_case

    out = []
    for r, case in cases:
        row, _, _ = compare_case(micro, case, r, warmup, repeats, 20)
        m, p = row["measured_us"], row["predicted_us"]
        out.append([r, case.tokens, case.hidden, case.layout, f"{case.engine}/{case.sync}",
                    row["cpus"], m["busy"], p["busy"], m["send"], p["send"], m["wait"],
                    p["wait"]])
    return out


def _summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    groups = {"all": rows,
              "dispatch": [r for r in rows if r["op"] == "dispatch"],
              "combine": [r for r in rows if r["op"] == "combine"]}
    for r in sorted({row["ranks"] for row in rows}):
        groups[f"dispatch, {r} ranks"] = [x for x in rows if x["op"] == "dispatch"
                                          and x["ranks"] == r]
    out = {}
    for name, members in groups.items():
        if not members:
            continue
        out[name] = error_stats(m["error_pct"] for m in members)
    return out


if __name__ == "__main__":
    sys.exit(main())
