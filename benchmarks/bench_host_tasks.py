"""The host model against the runtime's own traces, task by task, over a grid.

    python -m benchmarks.bench_host_tasks --out benchmarks/results/host_tasks

For 2 and 4 ranks, uniform and hot-expert routing, UBEP's ASP/TFF and the BSP/SW baseline, both
layouts (128 tokens x 2048 BF16): each case's traced dispatches (``BufferConfig(trace=True)``,
one core a rank) after its 64-element calls (the fixed cost) in the same launch, the CPUs the
ranks get on both sides, then its microbenchmarks (benchmarks/host_micro.py: row passes at the
runtime's own positions, the per-row bookkeeping, the flag latency), then the host model's spans
of the same call (``ubep.sim.host.predict_host_tasks``): per rank and call, busy, send and wait
time, measured beside predicted, and a plot of one call's spans, the model's over the runtime's.
Nothing the model is given is read from the traces it is compared with.

The ranks and the microbenchmarks run at real-time priority (``host_micro.held_cpus``;
``--no-hold``: at their own): on this shared host a span measured at normal priority holds
other processes' time slices (a rank that yields in a wait hands its CPU over for a whole
slice, milliseconds), which the model, predicting the machine to itself, leaves out. Each
rank's run delay over its calls (``/proc/self/task/*/schedstat``) says what the host gave it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from benchmarks.host_model import rank_scale, recv_meta_kernel

# The grid: 128 tokens x 2048 BF16, uniform and hot-expert
# routing, UBEP's ASP/TFF and the BSP/SW baseline, both layouts, 2 and 4 ranks.
GRID_MODES = (("asp", "tff"), ("bsp", "sw"))
GRID_ROUTINGS = ("uniform", "hot")
# the traced dispatches run back to back (no barrier between them): the model's call is the
# last of this many, each rank's call starting where it ended its last
# (ubep.sim.host_sched.back_to_back)
BACK_TO_BACK = 4
# (ranks, engine) whose task times the host model does not have a mechanism for: BSP on 4 ranks
# over 2 CPUs, whose sends to a rank on the other CPU cost 10x those within one, switching
# over minutes (docs/SIMULATOR.md 6); the summary gives the bounds over the rest and over all
UNMODELLED = ((4, "bsp"),)


def grid_cases(ranks: list[int]) -> list[tuple[int, Any]]:
    from benchmarks import bench_dispatch as bd
    from ubep.modes import LAYOUTS

    return [(r, bd.Case(128, 2048, "bf16", layout, engine, sync, routing))
            for r in ranks for routing in GRID_ROUTINGS for engine, sync in GRID_MODES
            for layout in LAYOUTS]


def rank_main(group: Any, case: Any, warmup: int, calls: int, repeats: int = 0,
              hold: bool = False) -> Any:
    """One rank's side of a case, one core a rank: with ``hold``, the rank first takes the
    real-time priority (``host_micro.hold_cpus``: no other process's time slice lands inside
    its calls, the machine to itself as the model predicts it); ``warmup + repeats``
    64-element dispatches, each after a barrier (the fixed cost's call, timed as bench_dispatch
    times it); then ``warmup + calls`` traced dispatches of ``case`` back to back, the
    warm-up's spans dropped, each call's CPU time and run delay read around it. Returns the
    spans, the 64-element calls' ``(start, end)`` ns, per traced call ``(wall, CPU time,
    run delay)`` ns, and the loop's own work between two calls (:func:`loop_gap_ns`, timed
    after the warm-up, without a call)."""
    from benchmarks import bench_dispatch as bd
    from benchmarks import host_model as hm
    from benchmarks.harness import collective_spans
    from benchmarks.host_micro import hold_cpus, run_delay_ns
    from ubep.buffer import Buffer
    from ubep.trace import spans_of

    if hold:
        hold_cpus()
    tiny_calls: list[tuple[int, int]] = []
    if repeats:
        tiny = hm.tiny_case(case)
        tx, tidx, tw = bd.inputs(tiny, group.rank)
        with Buffer(group, bd._config(tiny)) as buf:
            got = collective_spans(group.barrier, lambda: buf.dispatch(tx, tidx, tw), warmup,
                                   repeats)
        tiny_calls = [(int(a), int(b)) for a, b in got]
    cfg = bd._config(case)
    cfg = cfg.__class__(**{**cfg.__dict__, "trace": True, "num_cores": 1})
    x, idx, w = bd.inputs(case, group.rank)
    per_call: list[tuple[int, int, int]] = []
    gap = 0.0
    with Buffer(group, cfg) as buf:
        for i in range(warmup + calls):
            if i == warmup:
                gap = loop_gap_ns()
                spans_of(buf)  # the warm-up's spans dropped
            got = timed_call(lambda: buf.dispatch(x, idx, w), run_delay_ns)
            if i >= warmup:
                per_call.append(got)
        return spans_of(buf), tiny_calls, per_call, gap


def timed_call(call: Any, run_delay_ns: Any) -> tuple[int, int, int]:
    """``call()`` with its wall time, CPU time and run delay read around it (ns): the traced
    loop's body."""
    cpu0, delay0 = run_delay_ns()
    t0 = time.monotonic_ns()
    call()
    wall = time.monotonic_ns() - t0
    cpu1, delay1 = run_delay_ns()
    return wall, cpu1 - cpu0, delay1 - delay0


def loop_gap_ns(n: int = 30) -> float:
    """The traced loop's own work around a call (:func:`timed_call` of nothing: the run-delay
    reads of ``/proc``, the clock), median over ``n``, in the calling process: between two
    traced calls a rank runs it on its CPU, and where ranks share a CPU it is the others'
    turn (``ubep.sim.host_sched.back_to_back``'s ``loop_gap_ns``)."""
    from benchmarks.host_micro import run_delay_ns

    got = []
    for _ in range(n):
        t0 = time.monotonic_ns()
        timed_call(lambda: None, run_delay_ns)
        got.append(time.monotonic_ns() - t0)
    return float(statistics.median(got))


def measured_calls(case: Any, ranks: int, warmup: int = 20, calls: int = 20, repeats: int = 0,
                   hold: bool = False) -> tuple[list[list[tuple[int, str, float, float]]],
                                                float, dict[str, float]]:
    """The runtime's traced dispatches of ``case`` (:func:`rank_main`): per call, every span
    ``(rank, kind, start, end)`` in ns from that rank's call start (calls matched by their
    order on each rank); the 64-element call's median latency in us (per call the slowest
    rank's, as bench_dispatch reports it; 0 without ``repeats``); and what the host gave the
    ranks over the traced calls, summed over ranks and calls: ``wall_ns``, ``cpu_ns``,
    ``run_delay_ns`` per rank and call, ``run_delay_share`` (run delay / wall), and the
    loop's own work between two calls, ``loop_gap_ns`` (:func:`loop_gap_ns`, median over
    ranks)."""
    from ubep.runtime import launch

    per_rank = launch(rank_main, ranks, case, warmup, calls, repeats, hold, timeout_s=600)
    out: list[list[tuple[int, str, float, float]]] = [[] for _ in range(calls)]
    for t, _, _, _ in per_rank:
        calls_r = sorted((c for c in t.calls if c.name == "dispatch"), key=lambda c: c.start_ns)
        for i, c in enumerate(calls_r[-calls:]):
            out[i] += [(s.rank, s.task, s.start_ns - c.start_ns, s.end_ns - c.start_ns)
                       for s in t.spans if s.rank == c.rank and c.start_ns <= s.start_ns
                       and s.end_ns <= c.end_ns]
    tiny_us = 0.0
    if repeats:
        worst = [max(e - s for s, e in per) for per in zip(*(tc for _, tc, _, _ in per_rank),
                                                          strict=True)]
        tiny_us = statistics.median(worst) / 1e3
    n = max(1, ranks * calls)
    wall, cpu, delay = (sum(c[k] for _, _, pc, _ in per_rank for c in pc) for k in range(3))
    host = {"wall_ns": wall / n, "cpu_ns": cpu / n, "run_delay_ns": delay / n,
            "run_delay_share": delay / wall if wall > 0 else 0.0,
            "loop_gap_ns": statistics.median(g for _, _, _, g in per_rank)}
    return out, tiny_us, host


def categories(spans: list[tuple[int, str, float, float]], engine: str,
               ranks: int) -> dict[str, float]:
    """Per rank, median over ranks, of: ``send`` (its send spans), ``wait`` (its waits and
    barriers; ASP: and its receive, which is a wait for the peers' rows: the runtime records a
    source's receive as one span ending when its last row is in, and the rows' own check is
    tens of ns), ``busy`` (every other span but ``init``: the runtime's init is its native
    prepare, the model's a call's whole fixed cost, Python included)."""
    per = {k: [0.0] * ranks for k in ("busy", "send", "wait")}
    for rank, kind, start, end in spans:
        ns = end - start
        if kind in ("wait", "barrier") or (engine == "asp" and kind == "reorder"):
            per["wait"][rank] += ns
        elif kind != "init":
            per["busy"][rank] += ns
        if kind == "send":
            per["send"][rank] += ns
    return {k: statistics.median(v) for k, v in per.items()}


def _med_calls(calls: list[list[tuple[int, str, float, float]]], engine: str,
               ranks: int) -> dict[str, float]:
    got = [categories(c, engine, ranks) for c in calls]
    return {k: statistics.median(g[k] for g in got) for k in got[0]}


def _grid_timer(micro: Any, case: Any, ranks: int, idxs: list[np.ndarray],
                turns: bool = False, call_us: float = 0.0) -> Any:
    """host_model's timer for ``case`` with four changes for the task model: a send pass
    writes its rows where the runtime writes them (ubep.sim.host.writer_positions), into as
    many regions as the runtime alternates, each pass after as many calls' time asleep as a
    slot waits between two writes (ubep.sim.host.send_regions; ``call_us``: a call, at least
    the 64-element one measured); passes run warm, as one case's dispatches back to back
    leave their buffers in the caches (bench_dispatch interleaves cases, which evict each
    other's: its passes run cold);
    and with ``turns``, for ranks that share a CPU, the passes take turns on one CPU, each
    after the others' (``Micro.rows``)."""
    from benchmarks import host_model as hm

    hc = hm.host_case(case, ranks, "dispatch")
    rows, send_kw = _send_pass(case, ranks, idxs, turns, call_us)

    def timer(writer: str, reader: str, terms: int) -> tuple[float, float]:
        if writer in ("copy", "tffw", "spw"):  # a send pass: rows into a receive region
            return micro.per_row_ns(ranks, hc.row_bytes, rows, writer, reader, terms,
                                    **send_kw)
        n = case.tokens if writer in ("scan", "tail") else rows
        return micro.per_row_ns(ranks, hc.row_bytes, n, writer, reader, terms, cold=False,
                                turns=turns)

    return timer


def _send_pass(case: Any, ranks: int, idxs: list[np.ndarray], turns: bool,
               call_us: float) -> tuple[int, dict[str, Any]]:
    """The send pass's rows per rank and its arguments (:func:`_grid_timer`)."""
    from benchmarks import host_model as hm
    from ubep.sim.host import send_regions, writer_positions

    rows = round(hm.rows_per_rank(idxs, case.layout, bd_experts()))
    regions = send_regions(case.engine)
    return rows, {"positions": writer_positions(idxs, bd_experts(), case.layout, case.engine,
                                                rows),
                  "cold": False, "turns": turns, "copies": regions,
                  "gap_us": round(regions * call_us)}


def bd_experts() -> int:
    from benchmarks import bench_dispatch as bd

    return bd.NUM_EXPERTS


def compare_case(micro: Any, case: Any, r: int, warmup: int, repeats: int, calls: int,
                 hold: bool = True
                 ) -> tuple[dict[str, Any], list[Any], list[tuple[int, str, float, float]]]:
    """One case on ``r`` ranks: the CPUs the ranks get (before and after), one launch of its
    64-element calls (the fixed cost) and its traced dispatches, then its microbenchmarks (row
    passes at the runtime's positions, the per-row bookkeeping, the flag latency); then the
    model's spans of the same call. With ``hold`` the ranks and every microbenchmark run at
    the real-time priority (``host_micro.held_cpus``), so that both see the machine to
    themselves. Returns the table row, the measured calls' spans and the model's spans."""
    import os
    from dataclasses import asdict

    from benchmarks import bench_dispatch as bd
    from benchmarks import host_model as hm
    from benchmarks.host_micro import cpus_available, held_cpus
    from ubep.sim.host import kernel_passes, predict_host_tasks
    from ubep.sim.host_sched import cpu_share, cpus_for

    micro.cache.clear()  # this host drifts within minutes: each case measures its own
    idxs = hm.routing_of(case, r)
    hc = hm.host_case(case, r, "dispatch")
    with held_cpus(hold) as held:  # the CPUs the ranks get, on both sides of their calls
        before = cpus_available(r)
    measured, tiny_us, host = measured_calls(case, r, warmup=max(warmup, 20), calls=calls,
                                             repeats=repeats, hold=held)
    with held_cpus(hold):
        avail = (before + cpus_available(r)) / 2
        # held, each rank keeps a CPU while it runs (its run delay is its peers' turns only:
        # 0 % at 2 ranks), so the ranks run on min(ranks, CPUs) whole CPUs; at their own
        # priority, on the CPUs they measured, each given the measured share of its time
        cpus = min(r, os.cpu_count() or 1) if held else cpus_for(avail, r)
        share = 1.0 if held else cpu_share(avail, cpus)
        # held, nothing else runs between two writes of a receive slot: no gap
        call_us = 0.0 if held else tiny_us
        timers = {turns: _grid_timer(micro, case, r, idxs, turns, call_us)
                  for turns in (False, True)}
        rows = round(hm.rows_per_rank(idxs, case.layout, bd.NUM_EXPERTS))
        meta = micro.per_row_ns(r, hc.row_bytes, rows, "rowmeta", "-", 1, cold=False)[0]
        # the receive's metadata of one source (ns per token): its routing record, written by
        # the partner, read, checked and its picks to this rank's experts written out
        recv_meta = micro.per_row_ns(r, hc.row_bytes, case.tokens, "route",
                                     recv_meta_kernel(case.layout), hc.num_topk, cold=False,
                                     turns=cpus < r, local_experts=hc.num_experts // r)[1]
        flag = micro.flag_oneway_ns(r)
        # a wait past the yield window: its sleeper's wake-up and its waker's ring
        bells = hm.doorbells(micro)
        for w, rd, t in kernel_passes(hc, 1).values():
            for timer in timers.values():
                timer(w, rd, t)
        tiny = {"ranks": r, **asdict(hm.tiny_case(case)), "dispatch": {"median_us": tiny_us}}
        # the small call runs untraced: its per-row bookkeeping (without the span records
        # ``rowmeta`` prices) is in its fixed cost
        fixed = hm.fixed_cost(micro, {r: flag}, tiny, "dispatch", cpus, share,
                              recv_meta_ns=recv_meta, doorbells=bells)["fixed_ns"]
        # the ranks' own speeds: what the send pass's processes differ by
        send_w, send_r, _ = kernel_passes(hc, 1)["send"]
        send_rows, send_kw = _send_pass(case, r, idxs, cpus < r, call_us)
        scale = rank_scale(micro.process_ratios(r, hc.row_bytes, send_rows, send_w, send_r, 1,
                                                **send_kw), r)
    # ranks that share a CPU take turns on it: their passes are priced so
    spans = predict_host_tasks(hc, idxs, fixed_ns=fixed, flag_oneway_ns=flag,
                               timer=timers[cpus < r], cpus=cpus, row_meta_ns=meta,
                               cpu_share=share, calls=BACK_TO_BACK, recv_meta_ns=recv_meta,
                               rank_scale=scale, doorbells=bells,
                               loop_gap_ns=host["loop_gap_ns"])
    pred_spans = [(s.rank, s.task, s.start_ns, s.end_ns) for s in spans]
    meas = _med_calls(measured, case.engine, r)
    pred = categories(pred_spans, case.engine, r)
    row = {"ranks": r, "routing": case.routing, "engine": case.engine, "sync": case.sync,
           "layout": case.layout, "held": held, "cpus_available": avail, "cpus": cpus,
           "cpu_share": share, "run_delay_share": host["run_delay_share"],
           "run_delay_us": host["run_delay_ns"] / 1e3, "fixed_us": fixed / 1e3,
           "flag_oneway_ns": flag, "row_meta_ns": meta, "recv_meta_ns": recv_meta,
           "rank_scale": list(scale), "wake_ns": bells.wake_ns,
           "ring_sleep_ns": bells.ring_sleep_ns, "ring_armed_ns": bells.ring_armed_ns,
           "loop_gap_us": host["loop_gap_ns"] / 1e3,
           "measured_us": {k: v / 1e3 for k, v in meas.items()},
           "predicted_us": {k: v / 1e3 for k, v in pred.items()}}
    return row, measured, pred_spans


def run_grid(ranks: list[int], warmup: int, repeats: int, calls: int, micro: Any,
             hold: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every case of the grid (:func:`compare_case`), and the spans of one call per mode."""
    rows_out: list[dict[str, Any]] = []
    shown: dict[str, Any] = {}
    for r, case in grid_cases(ranks):
        row, measured, pred_spans = compare_case(micro, case, r, warmup, repeats, calls,
                                                 hold)
        rows_out.append(row)
        if r == min(ranks) and case.routing == "uniform" and case.layout == "expert":
            # the call whose native span is the median, beside the model's
            ends = [max((e for _, _, _, e in c), default=0.0) for c in measured]
            mid = sorted(range(len(ends)), key=ends.__getitem__)[len(ends) // 2]
            shown[f"{case.engine}/{case.sync}"] = {"measured": measured[mid],
                                                   "predicted": pred_spans, "ranks": r}
    return rows_out, shown


_COLORS = {"init": "#999999", "send": "#1f77b4", "wait": "#f2c14e", "barrier": "#222222",
           "reorder": "#ff7f0e", "cumsum": "#2ca02c", "flag": "#9467bd", "verify": "#8c564b"}


def plot_overlay(shown: dict[str, Any], path: str) -> None:
    """One panel per mode: each rank's measured spans (wide bars) with the model's spans of
    the same call over them (narrow bars), in us from the rank's call start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(shown), 1, figsize=(8, 1.4 + 1.1 * sum(
        v["ranks"] for v in shown.values())), squeeze=False)
    for ax, (mode, v) in zip(axes[:, 0], shown.items(), strict=True):
        # the model's init is a whole call's fixed cost (Python too), the runtime's its native
        # prepare: each rank's predicted spans are drawn from where its measured init ends
        init_end = {src: {rank: end for rank, kind, _, end in v[src] if kind == "init"}
                    for src in ("measured", "predicted")}
        for src, height in (("measured", 0.7), ("predicted", 0.25)):
            for rank, kind, start, end in v[src]:
                if kind == "init" and src == "predicted":
                    continue
                shift = 0.0 if src == "measured" else (
                    init_end["measured"].get(rank, 0.0) - init_end["predicted"].get(rank, 0.0))
                start, end = start + shift, end + shift
                ax.barh(rank, (end - start) / 1e3, left=start / 1e3, height=height,
                        color=_COLORS.get(kind, "#cccccc"),
                        edgecolor="black" if src == "predicted" else "none", linewidth=0.4)
        ax.set_yticks(range(v["ranks"]), [f"rank {r}" for r in range(v["ranks"])])
        ax.invert_yaxis()
        ax.set_title(f"{mode}: measured (wide) and the model's (narrow, outlined) spans",
                     fontsize=9)
        ax.set_xlabel("us from the rank's call start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    fig.legend(handles, list(_COLORS), loc="lower center", ncol=8, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=72)
    plt.close(fig)


def merge_passes(passes: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per case, the median over passes of every measured and predicted task time and of the
    CPUs available (this host's load moves from minute to minute: one pass is one sample);
    ``cpus`` becomes the passes' CPUs, comma-separated."""
    out = []
    for same in zip(*passes, strict=True):
        row = dict(same[0])
        for side in ("measured_us", "predicted_us"):
            row[side] = {k: statistics.median(r[side][k] for r in same) for k in row[side]}
        for key in ("cpus_available", "cpu_share", "run_delay_share", "run_delay_us",
                    "fixed_us", "flag_oneway_ns", "row_meta_ns", "recv_meta_ns", "wake_ns",
                    "ring_sleep_ns", "ring_armed_ns", "loop_gap_us"):
            if key not in row:
                continue
            row[key] = statistics.median(r[key] for r in same)
        row["cpus"] = ",".join(str(r["cpus"]) for r in same)
        row["passes"] = [{k: r[k] for k in ("cpus_available", "cpus", "measured_us",
                                             "predicted_us")} for r in same]
        out.append(row)
    return out


def _err(p: float, m: float) -> float:
    return 100.0 * (p - m) / m if m > 0 else float("nan")


def modelled(row: dict[str, Any]) -> bool:
    """Whether ``row``'s case has the host model's mechanisms (not in :data:`UNMODELLED`)."""
    return (row["ranks"], row["engine"]) not in UNMODELLED


def grid_summary(rows: list[dict[str, Any]],
                 paired: bool = False) -> dict[str, dict[str, float]]:
    """Median and worst |error| of each task time over ``rows`` (and of all together): of
    each case's median prediction against its median measurement, or with ``paired``, of the
    median over its passes of each pass's error (a pass's calls against the model from the
    microbenchmarks run right after them: this host's speed moves between passes minutes
    apart, so the medians of the two sides can come from passes that ran at different
    speeds)."""
    from benchmarks import host_model as hm

    def err(r: dict[str, Any], k: str) -> float:
        if not paired:
            return _err(r["predicted_us"][k], r["measured_us"][k])
        return statistics.median(_err(p["predicted_us"][k], p["measured_us"][k])
                                 for p in r["passes"] if p["measured_us"][k] > 0)

    out = {}
    for kind in ("busy", "send", "wait", "all"):
        kinds = ("busy", "send", "wait") if kind == "all" else (kind,)
        out[kind] = hm.error_stats(err(r, k) for r in rows for k in kinds
                                   if r["measured_us"][k] > 0)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import os
    import time
    from pathlib import Path

    from benchmarks.harness import format_table, int_list
    from benchmarks.host_micro import Micro, build
    from benchmarks.host_model import error_lines

    parser = argparse.ArgumentParser(description="the host model against the runtime's "
                                     "traces, task by task")
    parser.add_argument("--ranks", default=None, help="comma-separated rank counts (2,4)")
    parser.add_argument("--calls", type=int, default=20, help="traced dispatches per case")
    parser.add_argument("--repeats", type=int, default=30, help="64-element calls (fixed cost)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--millis", type=int, default=60, help="per microbenchmark round")
    parser.add_argument("--rounds", type=int, default=3, help="microbenchmark rounds (median)")
    parser.add_argument("--passes", type=int, default=3,
                        help="passes over the grid (each case's microbenchmarks, then its "
                             "calls); per case the median over passes")
    parser.add_argument("--no-hold", action="store_true",
                        help="run the ranks and microbenchmarks at their normal priority, "
                             "beside the other processes' time slices")
    parser.add_argument("--out", default=None, help="write OUT.txt, OUT.json and OUT.png")
    args = parser.parse_args(argv)
    ranks = int_list(args.ranks, [2, 4])
    load_before = os.getloadavg()
    start = time.monotonic()
    micro = Micro(build(), millis=args.millis, rounds=args.rounds)
    passes = [run_grid(ranks, args.warmup, args.repeats, args.calls, micro, not args.no_hold)
              for _ in range(args.passes)]
    rows = merge_passes([p[0] for p in passes])
    shown = passes[-1][1]
    load_after = os.getloadavg()
    table = []
    for r in rows:
        m, p = r["measured_us"], r["predicted_us"]
        table.append([r["ranks"], r["routing"], r["layout"], f"{r['engine']}/{r['sync']}",
                      f"{r['cpus_available']:.2f}", r["cpus"],
                      f"{100 * r.get('run_delay_share', 0.0):.1f}", m["busy"], p["busy"],
                      _err(p["busy"], m["busy"]), m["send"], p["send"], _err(p["send"], m["send"]),
                      m["wait"], p["wait"], _err(p["wait"], m["wait"])])
    summary = grid_summary(rows)
    summary_rest = grid_summary([r for r in rows if modelled(r)])
    paired = grid_summary(rows, paired=True)
    paired_rest = grid_summary([r for r in rows if modelled(r)], paired=True)
    cmd = "python -m benchmarks.bench_host_tasks" + (f" --out {args.out}" if args.out else "")
    lines = [
        "# The host model against the runtime's traces, task by task (" + cmd + ")",
        f"# {os.cpu_count()} CPUs shared with other processes; load average (1-min) before "
        f"{load_before[0]:.2f}, after {load_after[0]:.2f}",
        "# per case (median over passes; cpus: the whole CPUs the model ran the ranks on, per "
        "pass): 128 tokens x 2048 BF16, top-8 of 64 experts, one core a rank; "
        + ("the ranks and the microbenchmarks at real-time priority (SCHED_FIFO 1: no other "
           "process's time slice inside their calls; rdelay%: the ranks' run delay over their "
           "calls' wall time, from /proc schedstat: a peer rank's turn on a shared CPU)"
           if not args.no_hold else "the ranks and the microbenchmarks at their normal "
           "priority, beside the other processes (rdelay%: the ranks' run delay over their "
           "calls' wall time, from /proc schedstat)") + "; measured = "
        f"{args.calls} traced dispatches back to back after 20, per call the median over "
        "ranks of a rank's task time, median over calls, median over "
        f"{args.passes} passes over the grid; predicted = ubep.sim.host.predict_host_tasks "
        "from that case's microbenchmarks, run right after its calls (row passes at the "
        "runtime's positions, per-row bookkeeping, flag latency, a sleeping wait's wake-up "
        "and rings (host_wake), the CPUs the ranks get and the share of each they get, the "
        "fixed cost from the 64-element call of the same launch, the loop's own work between "
        "calls timed in each rank)",
        "# busy = every span but waits, barriers and init (ASP's receive is a wait); send = send "
        "spans; wait = waits and barriers (ASP: and the receive); us per call",
    ]
    cols = ["ranks", "routing", "layout", "mode", "cpus_avail", "cpus", "rdelay%", "busy_meas",
            "busy_pred", "busy_err%", "send_meas", "send_pred", "send_err%", "wait_meas",
            "wait_pred", "wait_err%"]
    lines.append(format_table(cols, table, float_digits=1))
    lines += error_lines(summary, "task time (all cases)")
    unmodelled = ", ".join(f"{r}-rank {e.upper()}" for r, e in UNMODELLED)
    lines += error_lines(summary_rest, f"task time (without {unmodelled})")
    lines.append("\nthe same, each case's error the median over passes of each pass's error "
                 "(its calls against the model from the microbenchmarks right after them)")
    lines += error_lines(paired, "paired task time (all cases)")
    lines += error_lines(paired_rest, f"paired task time (without {unmodelled})")
    lines.append(f"\n({time.monotonic() - start:.0f} s)")
    text = "\n".join(lines)
    print(text)
    if args.out:
        base = Path(args.out)
        base.parent.mkdir(parents=True, exist_ok=True)
        base.with_suffix(".txt").write_text(text + "\n", encoding="utf-8")
        payload = {"command": cmd, "machine": {"cpus": os.cpu_count(), "load_before": load_before,
                                               "load_after": load_after},
                   "summary": summary, "summary_modelled": summary_rest,
                   "summary_paired": paired, "summary_paired_modelled": paired_rest,
                   "unmodelled": [list(u) for u in UNMODELLED], "rows": rows,
                   "shown": {k: {"ranks": v["ranks"], "measured": v["measured"],
                                 "predicted": v["predicted"]} for k, v in shown.items()}}
        base.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n",
                                             encoding="utf-8")
        if shown:
            plot_overlay(shown, str(base.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
