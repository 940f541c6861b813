"""Data-as-Flag vs stop-and-wait, paired: ASP dispatch in every sync mode, call for call.

    python -m benchmarks.bench_sync --quick                # 2 ranks, 3 sizes (~10 s)
    python -m benchmarks.bench_sync --out benchmarks/results   # full run (~1 min, 2 cores)
    python -m benchmarks.bench_sync --replot results/sync.json --out DIR   # re-draw

The target is asp+sp within 1.1x of asp+sw at every size. bench_growth times each case in
blocks of calls, in a fixed order, so two modes' medians come from different seconds of a host
whose speed drifts within seconds; their ratio moved 0.85-1.6x between runs. Here the modes of
one case (bench_growth's sizes and routing: ``bench_growth.cases_for``) have a Buffer each and
take turns call by call, in an order shuffled every iteration (none is always first after the
barrier or always after the same mode), so every iteration holds one call of each mode made
within a few milliseconds:

* time of a call: from the barrier, each rank times its own dispatch; an iteration's time is
  the maximum over ranks (``harness.time_collective``'s convention);
* per mode: min / median / max over the iterations;
* ``x_sw``: per round, the median over iterations of the paired ratio mode / asp+sw (same
  iteration); then the median over ``--rounds`` rounds, each with freshly mapped Buffers
  (``x_sw_rounds``: every round's; the table shows their range). One run of a single set of
  Buffers read SP / SW 1.49 with a tight interval where another read 1.08: where a Buffer's
  pages lie moves all of its calls;
* ``x_floor``: median / the memcpy floor (``harness.concurrent_copy``: as many processes as
  ranks each copying bytes_per_rank at once, same run, before the calls). Pessimistic here:
  four Buffers' receive regions take turns, four times one Buffer's working set, so from a few
  MB the calls miss the L3 where the floor's one destination does not; bench_growth is the
  floor comparison.

Bytes one rank sends = rows x hidden x 2 (BF16), as bench_growth. Only dispatch is timed: an
ASP combine runs the same code in every sync mode.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from benchmarks import bench_growth as growth
from benchmarks.harness import (
    Stats,
    collective_spans,
    concurrent_copy,
    format_table,
    int_list,
    machine_since,
    round_repeats,
    save_figure,
    save_results,
)

MODES = ("sw", "sp", "tff", "dc")
FULL_SIZES = tuple(16384 << (2 * i) for i in range(6))  # 16 KB .. 16 MB
QUICK_SIZES = (16384, 262144, 4194304)


def call_order(iteration: int, modes: Sequence[str]) -> list[str]:
    """The order of iteration ``iteration``: every mode once, shuffled by a generator seeded
    with the iteration (so every rank makes the same calls in the same order). A rotation
    would put the same mode before each mode every time (DC's big reads before SW, SW before
    SP); shuffled, every mode follows every other about equally often."""
    order = np.random.default_rng([29, iteration]).permutation(len(modes))
    return [modes[int(j)] for j in order]


def paired_ratio(times: dict[str, np.ndarray], mode: str, base: str = "sw") -> float:
    """Median over iterations of ``times[mode][i] / times[base][i]``."""
    return float(np.median(times[mode] / times[base]))


def round_ratios(rounds: list[dict[str, np.ndarray]], mode: str,
                 base: str = "sw") -> list[float]:
    """:func:`paired_ratio` of each round (each round has its own, freshly mapped Buffers)."""
    return [paired_ratio(times, mode, base) for times in rounds]


def _rank_main(group: Any, cases: list[growth.Case], warmup: int, per_round: list[int],
               ) -> list[list[dict[str, list[int]]]]:
    """Per case (one per layout and size: its ``sync`` is ignored) and round, every mode's call
    times (ns) on this rank, iteration by iteration. Each round maps fresh Buffers, created in
    a shuffled order: on this VM the same calls run up to 1.5x slower on one process's or one
    segment's pages than on another's, for as long as they live, which pairing within one set
    of Buffers cannot cancel."""
    from ubep.buffer import Buffer

    out = []
    for case in cases:
        x, idx, w = growth.inputs(case, group.rank)
        per: list[dict[str, list[int]]] = []
        for rnd, iterations in enumerate(per_round):
            bufs = {}
            try:
                for sync in call_order(rnd, MODES):
                    cfg = growth._config(growth.Case(case.target_bytes, case.tokens,
                                                     case.hidden, case.layout, "asp", sync))
                    bufs[sync] = Buffer(group, cfg)
                times: dict[str, list[int]] = {m: [] for m in MODES}
                for i in range(warmup + iterations):
                    for sync in call_order(i, MODES):
                        call = functools.partial(bufs[sync].dispatch, x, idx, w)
                        span = collective_spans(group.barrier, call, 0, 1)[0]
                        if i >= warmup:
                            times[sync].append(int(span[1] - span[0]))
                per.append(times)
            finally:
                for buf in bufs.values():
                    buf.close()
        out.append(per)
    return out


def run(ranks: Sequence[int], sizes: Sequence[int], warmup: int, iterations: int,
        rounds: int = 5, timeout_s: float = 1800.0) -> list[dict[str, Any]]:
    from ubep.runtime import launch

    per_round = round_repeats(iterations, rounds)
    rows: list[dict[str, Any]] = []
    for num_ranks in ranks:
        cases = growth.cases_for(sizes, num_ranks, [("asp", "sw")])
        nbytes = [growth.bytes_per_rank(c, num_ranks) for c in cases]
        distinct = sorted({int(b) for b in nbytes})
        floors = dict(zip(distinct, concurrent_copy(num_ranks, distinct, repeats=iterations,
                                                    warmup=warmup, timeout_s=timeout_s),
                          strict=True))
        per_rank = launch(_rank_main, num_ranks, cases, warmup, per_round,
                          timeout_s=timeout_s)
        for i, case in enumerate(cases):
            # per round and iteration, the slowest rank
            worst = [{m: np.max(np.array([r[i][k][m] for r in per_rank], dtype=np.float64),
                                axis=0) for m in MODES} for k in range(len(per_round))]
            floor = floors[int(nbytes[i])]
            for m in MODES:
                st = Stats.from_samples_us(
                    (np.concatenate([w[m] for w in worst]) / 1e3).tolist())
                by_round = round_ratios(worst, m)
                rows.append({"ranks": num_ranks, "layout": case.layout, "tokens": case.tokens,
                             "hidden": case.hidden, "bytes_per_rank": nbytes[i],
                             "mode": f"asp+{m}", **asdict(st),
                             "x_sw": float(np.median(by_round)), "x_sw_rounds": by_round,
                             "floor_median_us": floor.median_us,
                             "x_floor": st.median_us / floor.median_us})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    cols = ["ranks", "layout", "tokens", "hidden", "bytes", "mode", "min_us", "median_us",
            "max_us", "x_sw", "x_sw_rounds", "floor_us", "x_floor"]
    body = [[r["ranks"], r["layout"], r["tokens"], r["hidden"], int(r["bytes_per_rank"]),
             r["mode"], r["min_us"], r["median_us"], r["max_us"], r["x_sw"],
             f"{min(r['x_sw_rounds']):.2f}-{max(r['x_sw_rounds']):.2f}",
             r["floor_median_us"], r["x_floor"]] for r in rows]
    worst = {m: max((r["x_sw"] for r in rows if r["mode"] == f"asp+{m}"), default=float("nan"))
             for m in MODES[1:]}
    head = ("ASP dispatch per sync mode, paired call by call (shuffled order); x_sw = median over "
            "iterations of mode / asp+sw in the same iteration, median over rounds of fresh "
            "Buffers (x_sw_rounds: the rounds' range); time = max over ranks per "
            "iteration; bytes = rows x hidden x 2 per rank; floor = concurrent memcpy of those "
            "bytes by every rank at once")
    tail = "worst x_sw over sizes: " + ", ".join(f"asp+{m} {v:.2f}" for m, v in worst.items())
    return f"{head}\n{format_table(cols, body, float_digits=2)}\n{tail}"


def plot(result: dict[str, Any], path: str) -> None:
    """x_sw against bytes per rank, a panel per rank count, the 1.1 target drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    ranks = sorted({r["ranks"] for r in rows})
    fig, axes = plt.subplots(1, len(ranks), figsize=(6 * len(ranks) + 2, 4.5), squeeze=False)
    styles = {"rank": "-", "expert": "--"}
    for ax, nr in zip(axes[0], ranks, strict=True):
        for i, mode in enumerate(MODES[1:]):
            for layout in ("rank", "expert"):
                pts = sorted((r["bytes_per_rank"], r["x_sw"]) for r in rows
                             if r["ranks"] == nr and r["layout"] == layout
                             and r["mode"] == f"asp+{mode}")
                if pts:
                    ax.plot(*zip(*pts, strict=True), styles[layout], marker="o", ms=3,
                            color=f"C{i}", label=f"asp+{mode} {layout}")
        ax.axhline(1.0, color="black", lw=1)
        ax.axhline(1.1, color="red", lw=1, ls=":", label="1.1 (the SP target)")
        ax.set(xscale="log", title=f"ASP dispatch / asp+sw, paired, {nr} ranks",
               xlabel="bytes per rank", ylabel="median paired ratio to asp+sw")
        ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, axes, path, legend_width_in=2.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 ranks, 3 sizes")
    parser.add_argument("--ranks", default=None, help="comma-separated rank counts (2,4)")
    parser.add_argument("--sizes", default=None, help="comma-separated target bytes per rank")
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=None, help="sets of fresh Buffers (5)")
    parser.add_argument("--out", default=None, help="write sync.{txt,json,png} here")
    parser.add_argument("--replot", default=None,
                        help="re-render a sync.json (to --out, else stdout only)")
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            old = json.load(f)
        save_results(args.out, "sync", table(old["rows"]), old, plot)
        return 0
    ranks = int_list(args.ranks, [2] if args.quick else [2, 4])
    sizes = int_list(args.sizes, QUICK_SIZES if args.quick else FULL_SIZES)
    iterations = args.iterations or (30 if args.quick else 200)
    load, start = os.getloadavg()[0], time.monotonic()
    rounds = args.rounds or (2 if args.quick else 5)
    rows = run(ranks, sizes, args.warmup, iterations, rounds)
    result = {"rows": rows, "settings": {"ranks": ranks, "sizes": list(sizes),
                                         "iterations": iterations, "rounds": rounds,
                                         "warmup": args.warmup},
              "machine": machine_since(load, start)}
    save_results(args.out, "sync", table(rows), result, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
