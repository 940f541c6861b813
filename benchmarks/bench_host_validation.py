"""Host validation: the simulator, given microbenchmark constants only, predicts bench_dispatch.

    python -m benchmarks.bench_host_validation                 # full matrix (several minutes)
    python -m benchmarks.bench_host_validation --quick         # 2 ranks, 128 tokens (debugging)
    python -m benchmarks.bench_host_validation --out benchmarks/results/host_validation

One run: (1) the microbenchmarks of benchmarks/host_micro.py (row passes at each case's working
set, flag round trip, the tiny-call fixed cost per engine x sync x layout x ranks), (2)
bench_dispatch's matrix measured as bench_dispatch measures it (same cases, inputs, timing), (3)
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

import numpy as np
from benchmarks import bench_dispatch as bd
from benchmarks.harness import format_table
from benchmarks.host_micro import Micro, build

from ubep.sim.host import HostCase, predict_host

TINY_TOKENS, TINY_HIDDEN = 1, 64


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "bf16" else 1


def _routing(case: bd.Case, ranks: int) -> list[np.ndarray]:
    return [bd.inputs(case, r)[1] for r in range(ranks)]


def _rows_per_rank(idxs: list[np.ndarray], layout: str, num_experts: int) -> float:
    epr = num_experts // len(idxs)
    if layout == "expert":
        return float(np.mean([(idx >= 0).sum() for idx in idxs]))
    return float(np.mean([sum(len(set((row[row >= 0] // epr).tolist())) for row in idx)
                          for idx in idxs]))


def _host_case(case: bd.Case, ranks: int, op: str) -> HostCase:
    return HostCase(ranks=ranks, tokens=case.tokens, hidden=case.hidden,
                    itemsize=_itemsize(case.dtype), layout=case.layout, engine=case.engine,
                    sync=case.sync, op=op, num_experts=bd.NUM_EXPERTS, num_topk=bd.NUM_TOPK)


def _footprint_mb(case: bd.Case, ranks: int, idxs: list[np.ndarray], group: int) -> int:
    """The working set of one call of this case on one rank: its rows out and in, in the two
    receive regions the runtime alternates (docs/FORMATS.md), plus the combine's rows back.
    Passes cycle through that much memory, so a pass finds its data as cached as a call of the
    case finds its own. (``group``, the cases interleaved with it, would evict even that; the
    model takes the case's own working set, as the host model is specified.)"""
    del group
    rows = _rows_per_rank(idxs, case.layout, bd.NUM_EXPERTS)
    per_call = rows * case.hidden * (_itemsize(case.dtype) * 2 * 2 + 2 * 2)
    return int(min(256, per_call / 2**20))


def _timer(micro: Micro, case: bd.Case, ranks: int, op: str, idxs: list[np.ndarray],
           group: int) -> Any:
    """Per-row pass costs at this case's working set: rows per rank (send/receive passes),
    tokens (SP's scan of x, the combine's reduction), cold as in the interleaved matrix."""
    hc = _host_case(case, ranks, op)
    rows = _rows_per_rank(idxs, case.layout, bd.NUM_EXPERTS)
    foot = _footprint_mb(case, ranks, idxs, group)

    def timer(writer: str, reader: str, terms: int) -> tuple[float, float]:
        if reader == "reduce":
            return micro.rows(ranks, hc.hidden * 2, case.tokens, writer, reader, terms, foot)
        if writer == "scan":
            return micro.rows(ranks, hc.row_bytes, case.tokens, writer, reader, terms, foot)
        return micro.rows(ranks, hc.row_bytes, round(rows), writer, reader, terms, foot)

    return timer


def _tiny(case: bd.Case) -> bd.Case:
    return bd.Case(TINY_TOKENS, TINY_HIDDEN, "bf16", case.layout, case.engine, case.sync,
                   case.routing)


def fixed_costs(micro: Micro, ranks: list[int], cases: list[bd.Case], warmup: int,
                repeats: int) -> dict[tuple[int, str, str, str, str], dict[str, float]]:
    """Tiny-call latency per (ranks, engine, sync, layout, op), and the model's own share of it
    (flags, barriers, the few rows): fixed = measured - model(fixed=0), at least 0."""
    tiny = sorted({_tiny(c) for c in cases}, key=lambda c: (c.layout, c.engine, c.sync))
    rows = bd.run(ranks, tiny, warmup, repeats, False, 1800.0)
    out = {}
    for row in rows:
        case = bd.Case(**{k: row[k] for k in ("tokens", "hidden", "dtype", "layout", "engine",
                                              "sync", "routing")})
        r = row["ranks"]
        idxs = _routing(case, r)
        for op in ("dispatch", "combine"):
            measured = row[op]["median_us"] * 1e3
            model0 = predict_host(_host_case(case, r, op), idxs, fixed_ns=0.0,
                                  flag_oneway_ns=micro.flag_oneway_ns(r),
                                  timer=_timer(micro, case, r, op, idxs, len(tiny)))
            out[(r, case.engine, case.sync, case.layout, op)] = {
                "tiny_measured_ns": measured, "tiny_model_ns": model0,
                "fixed_ns": max(0.0, measured - model0)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 ranks, 128 tokens, main modes")
    parser.add_argument("--ranks", default=None, help="comma-separated rank counts (2,4)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--millis", type=int, default=60, help="per microbenchmark round")
    parser.add_argument("--out", default=None, help="write OUT.txt and OUT.json")
    args = parser.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else (
        [2] if args.quick else [2, 4])
    repeats = args.repeats or (30 if args.quick else 50)
    cases = bd.cases_for(args.quick, False)
    load_before = os.getloadavg()
    start = time.monotonic()
    micro = Micro(build(), millis=args.millis)
    flags = {r: micro.flag_oneway_ns(r) for r in ranks}
    fixed = fixed_costs(micro, ranks, cases, args.warmup, repeats)
    # every row pass the predictions need, measured before the matrix runs
    timers = {}
    group = {(c.tokens, c.hidden, c.dtype): sum(1 for d in cases if (d.tokens, d.hidden, d.dtype)
                                                == (c.tokens, c.hidden, c.dtype)) for c in cases}
    for r in ranks:
        for case in cases:
            idxs = _routing(case, r)
            for op in ("dispatch", "combine"):
                timers[(r, case, op)] = (idxs, _timer(micro, case, r, op, idxs,
                                                      group[(case.tokens, case.hidden,
                                                             case.dtype)]))
                predict_host(_host_case(case, r, op), idxs, fixed_ns=0.0,
                             flag_oneway_ns=flags[r], timer=timers[(r, case, op)][1])
    micro_s = time.monotonic() - start
    load_mid = os.getloadavg()
    rows = bd.run(ranks, cases, args.warmup, repeats, False, 1800.0)
    load_after = os.getloadavg()
    table, out_rows = [], []
    for row in rows:
        case = bd.Case(**{k: row[k] for k in ("tokens", "hidden", "dtype", "layout", "engine",
                                              "sync", "routing")})
        r = row["ranks"]
        for op in ("dispatch", "combine"):
            idxs, timer = timers[(r, case, op)]
            f = fixed[(r, case.engine, case.sync, case.layout, op)]
            pred = predict_host(_host_case(case, r, op), idxs, fixed_ns=f["fixed_ns"],
                                flag_oneway_ns=flags[r], timer=timer) / 1e3
            meas = row[op]["median_us"]
            err = 100.0 * (pred - meas) / meas
            table.append([r, case.tokens, case.hidden, case.dtype, case.layout, case.engine,
                          case.sync, op, meas, pred, err, f["fixed_ns"] / 1e3])
            out_rows.append({**asdict(case), "ranks": r, "op": op, "measured_us": meas,
                             "measured_min_us": row[op]["min_us"],
                             "measured_max_us": row[op]["max_us"], "predicted_us": pred,
                             "error_pct": err, "fixed_us": f["fixed_ns"] / 1e3,
                             "tiny_measured_us": f["tiny_measured_ns"] / 1e3})
    summary = _summary(out_rows)
    lines = [
        "# Host validation: ubep.sim host model (microbenchmark constants only) vs bench_dispatch",
        f"# {os.cpu_count()} CPUs; load average before {load_before[0]:.2f}, after the "
        f"microbenchmarks {load_mid[0]:.2f}, after the matrix {load_after[0]:.2f} (1-min)",
        "# flag one-way latency (ns) by ranks: "
        + ", ".join(f"{r}: {v:.0f}" for r, v in flags.items()),
        "# time = median over repeats of the max over ranks (bench_dispatch); pred = "
        "ubep.sim.host.predict_host; fixed = tiny-call latency minus the model's share of it",
    ]
    cols = ["ranks", "tokens", "hidden", "dtype", "layout", "engine", "sync", "op",
            "measured_us", "predicted_us", "error_pct", "fixed_us"]
    lines.append(format_table(cols, table, float_digits=1))
    lines += ["", "| rows | n | median abs error % | worst abs error % |", "|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['n']} | {s['median_abs_error_pct']:.1f} | "
                     f"{s['worst_abs_error_pct']:.1f} |")
    lines.append(f"\n({time.monotonic() - start:.0f} s; microbenchmarks {micro_s:.0f} s; "
                 f"{repeats} repeats after {args.warmup} warm-up)")
    text = "\n".join(lines)
    print(text)
    if args.out:
        base = Path(args.out)
        base.parent.mkdir(parents=True, exist_ok=True)
        base.with_suffix(".txt").write_text(text + "\n", encoding="utf-8")
        payload = {"machine": {"cpus": os.cpu_count(), "load_before": load_before,
                               "load_after_micro": load_mid, "load_after": load_after},
                   "flag_oneway_ns": {str(k): v for k, v in flags.items()},
                   "fixed": [{"ranks": k[0], "engine": k[1], "sync": k[2], "layout": k[3],
                              "op": k[4], **v} for k, v in fixed.items()],
                   "micro_row_ns": [{"key": list(map(str, k)), "writer_ns": v[0],
                                     "reader_ns": v[1]} for k, v in micro.cache.items()],
                   "summary": summary, "rows": out_rows}
        base.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n",
                                             encoding="utf-8")
    return 0


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
        errs = np.abs([m["error_pct"] for m in members])
        out[name] = {"n": len(members), "median_abs_error_pct": float(np.median(errs)),
                     "worst_abs_error_pct": float(np.max(errs))}
    return out


if __name__ == "__main__":
    sys.exit(main())
