"""Growth: dispatch and combine time vs bytes per rank (16 KB .. 64 MB) beside the memcpy floor.

    python -m benchmarks.bench_growth --quick              # 2 ranks, 3 sizes (~5 s)
    python -m benchmarks.bench_growth --out benchmarks/results   # full run (~3 min, 2 cores)
    python -m benchmarks.bench_growth --all                # also asp+tff and asp+dc

Sweep: per target size (16 KB .. 64 MB, x4 apart), BF16 rows of hidden 1024 (< 64 KB), 2048
(<= 1 MB) or 7168 (bigger), top-8 of 64 experts, seeded uniform routing, tokens per rank chosen
so one rank sends about the target; both layouts, 2 and 4 ranks, the main modes (asp+sw, asp+sp,
bsp+sw). The large-expert shapes (896 experts top-16, 2048 experts top-32: ``SCALE_SHAPES``) run
the same modes at ``SCALE_SIZES``; their series are labelled ``e896k16`` / ``e2048k32`` after the
mode. Every case has its own Buffer.

Bytes one rank sends = rows x hidden x 2 (mean over ranks), rows = (token, expert) pairs for
layout=expert, (token, destination rank) pairs for layout=rank, the rank's own rows included.
Combine reduces the same rows (BF16 expert outputs), so its bytes are the same number.

Timing: barrier, each rank times its own call (``harness.time_collective``), an iteration's time
is the maximum over ranks; min / median / max over ``--repeats`` split over ``--rounds`` passes
through all cases (``harness.round_repeats``). The floor: ``harness.concurrent_copy``, as many
processes as ranks each copying the same bytes at once, same repeats and rounds, same run.

Fit: per (ranks, layout, mode, op) series, a Theil-Sen line through (bytes, median time): the
intercept is the fixed cost per call (us), the slope the per-byte cost (ns/KB; GB/s = 1/slope).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from benchmarks.harness import (
    COMBINE_PHASES,
    DISPATCH_PHASES,
    Stats,
    concurrent_copy,
    format_table,
    int_list,
    machine_since,
    phase_medians,
    round_repeats,
    save_figure,
    save_results,
    time_collective,
    traced_call,
)

NUM_EXPERTS = 64
NUM_TOPK = 8
ITEMSIZE = 2  # BF16
FULL_SIZES = tuple(16384 << (2 * i) for i in range(7))  # 16 KB .. 64 MB
QUICK_SIZES = (16384, 262144, 4194304)
SCALE_SHAPES = ((896, 16), (2048, 32))  # (num_experts, num_topk) beside 64 / 8
SCALE_SIZES = (262144, 1048576, 4194304)
MAIN_MODES = (("asp", "sw"), ("asp", "sp"), ("bsp", "sw"))
EXTRA_MODES = (("asp", "tff"), ("asp", "dc"))
OPS = ("dispatch", "combine")


@dataclass(frozen=True)
class Case:
    target_bytes: int
    tokens: int
    hidden: int
    layout: str
    engine: str
    sync: str
    num_experts: int = NUM_EXPERTS
    num_topk: int = NUM_TOPK

    @property
    def mode(self) -> str:
        """The series label: engine+sync, and the shape when it is not 64 experts top-8."""
        shape = ("" if (self.num_experts, self.num_topk) == (NUM_EXPERTS, NUM_TOPK)
                 else f" e{self.num_experts}k{self.num_topk}")
        return f"{self.engine}+{self.sync}{shape}"


@dataclass(frozen=True)
class Fit:
    """A line ``time_us = intercept_us + bytes * slope_us_per_byte``."""

    intercept_us: float
    slope_us_per_byte: float

    @property
    def ns_per_kb(self) -> float:
        return self.slope_us_per_byte * 1e3 * 1024

    @property
    def gbps(self) -> float:
        return 1e-3 / self.slope_us_per_byte if self.slope_us_per_byte > 0 else math.inf


def fit_line(bytes_: Sequence[float], times_us: Sequence[float]) -> Fit:
    """Theil-Sen (median of pairwise slopes, intercept = median residual): one slow outlier
    point moves neither the fixed cost nor the per-byte cost, as a least-squares fit would."""
    if len(bytes_) != len(times_us) or len(bytes_) < 2:
        raise ValueError(f"fit_line: need >= 2 paired points, got {len(bytes_)}/{len(times_us)}")
    x, y = np.asarray(bytes_, dtype=np.float64), np.asarray(times_us, dtype=np.float64)
    i, j = np.triu_indices(len(x), k=1)
    keep = x[j] != x[i]
    if not keep.any():
        raise ValueError("fit_line: all points have the same bytes")
    slope = float(np.median((y[j] - y[i])[keep] / (x[j] - x[i])[keep]))
    return Fit(intercept_us=float(np.median(y - slope * x)), slope_us_per_byte=slope)


def rows_per_token(layout: str, ranks: int, num_experts: int = NUM_EXPERTS,
                   num_topk: int = NUM_TOPK) -> float:
    """Expected rows a token sends: top-k for the expert layout; for the rank layout the
    expected number of distinct destination ranks of k distinct uniform experts."""
    if layout == "expert":
        return float(num_topk)
    local = num_experts // ranks
    miss = math.comb(num_experts - local, num_topk) / math.comb(num_experts, num_topk)
    return ranks * (1.0 - miss)


def hidden_for(target_bytes: int) -> int:
    return 1024 if target_bytes < 65536 else 2048 if target_bytes <= 1 << 20 else 7168


def cases_for(sizes: Sequence[int], ranks: int, modes: Sequence[tuple[str, str]],
              shape: tuple[int, int] = (NUM_EXPERTS, NUM_TOPK)) -> list[Case]:
    out = []
    for target in sizes:
        hidden = hidden_for(target)
        for layout in ("rank", "expert"):
            per_token = rows_per_token(layout, ranks, *shape) * hidden * ITEMSIZE
            tokens = max(1, round(target / per_token))
            out += [Case(target, tokens, hidden, layout, e, s, *shape) for e, s in modes]
    return out


def inputs(case: Case, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from ubep import routing

    rng = np.random.default_rng([17, rank, case.tokens, case.hidden])
    x = (rng.standard_normal((case.tokens, case.hidden), dtype=np.float32)
         .view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    idx = routing.uniform_topk(case.tokens, case.num_experts, case.num_topk, seed=100 + rank)
    w = rng.random((case.tokens, case.num_topk), dtype=np.float32)
    return x, idx, w


def rows_sent(case: Case, rank: int, ranks: int) -> int:
    """The byte formula's rows, from the routing alone (the ranks check it against the
    handle's own count)."""
    _, idx, _ = inputs(case, rank)
    if case.layout == "expert":
        return int((idx >= 0).sum())
    dst = np.where(idx >= 0, idx // (case.num_experts // ranks), -1)
    return int(sum(len(set(row[row >= 0].tolist())) for row in dst))


def bytes_per_rank(case: Case, ranks: int) -> float:
    rows = np.mean([rows_sent(case, r, ranks) for r in range(ranks)])
    return float(rows) * case.hidden * ITEMSIZE


def _config(case: Case) -> Any:
    from ubep.buffer import BufferConfig

    return BufferConfig(
        max_tokens_per_rank=case.tokens, hidden=case.hidden, num_topk=case.num_topk,
        num_experts=case.num_experts, dtype="bf16", layout=case.layout, engine=case.engine,
        sync=case.sync,
    )


def buffer_bytes(case: Case, ranks: int) -> int:
    """Shared memory of the case's Buffers over all ranks."""
    from ubep.buffer import Buffer

    return Buffer.size_hint(_config(case), ranks) * ranks


class _Running:
    """One case's Buffer, its inputs and a dispatch handle for combine."""

    def __init__(self, group: Any, case: Case) -> None:
        from ubep.buffer import Buffer

        self.buf = Buffer(group, _config(case))
        self.x, self.idx, self.w = inputs(case, group.rank)
        self.res = self.buf.dispatch(self.x, self.idx, self.w)
        self.rows = int((self.res.handle.send_dst_row >= 0).sum())
        expect = rows_sent(case, group.rank, group.num_ranks)
        if self.rows != expect:
            raise RuntimeError(f"{case}: rank {group.rank} sent {self.rows} rows, formula {expect}")
        self.eo = self.buf.get_combine_buffer(self.res.handle)
        vals = np.random.default_rng(group.rank).standard_normal(self.eo.shape, dtype=np.float32)
        self.eo[...] = (vals.view(np.uint32) >> np.uint32(16)).astype(np.uint16)

    def dispatch(self) -> None:
        self.buf.dispatch(self.x, self.idx, self.w)

    def combine(self) -> None:
        # combine reads only the expert outputs and the handle of the set-up dispatch
        self.buf.combine(self.eo, self.res.handle)


# Calls traced per ASP case and op after its last round's timing: the engine's phases
TRACED_CALLS = 20
PHASES = {"dispatch": DISPATCH_PHASES, "combine": COMBINE_PHASES}


def _traced_phases(group: Any, run_: _Running) -> dict[str, dict[str, float]]:
    """Median duration (us) of each phase of each op (harness.phase_medians), this rank."""
    out = {}
    for op in OPS:
        calls = [traced_call(group.barrier, getattr(run_, op), run_.buf._engine.kernel.trace)
                 for _ in range(TRACED_CALLS)]
        out[op] = dict(zip(PHASES[op], phase_medians(calls, op), strict=True))
    return out


def _slowest_phases(per_rank: list[dict[str, dict[str, float]]]
                    ) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """Per op, the phases of the rank whose traced calls took longest (the one a collective
    waits for), and which rank that is."""
    phases, rank = {}, {}
    for op in OPS:
        rank[op] = max(range(len(per_rank)), key=lambda r: sum(per_rank[r][op].values()))
        phases[op] = per_rank[rank[op]][op]
    return phases, rank


def _rank_main(group: Any, cases: list[Case], warmup: int, per_round: list[int],
               keep_bytes: int) -> list[dict[str, Any]]:
    """Every round passes through every case; a size's Buffers stay alive across rounds when
    all kept ones fit in ``keep_bytes`` (all ranks), else they are rebuilt each round. After
    the last round's timing, an ASP case's calls are traced (``phases``), apart from the timed
    ones: reading the trace is a Python call between calls."""
    samples: list[dict[str, Any]] = [{op: [] for op in OPS} for _ in cases]
    by_size: dict[int, list[int]] = {}
    for i, case in enumerate(cases):
        by_size.setdefault(case.target_bytes, []).append(i)
    kept: dict[int, _Running] = {}
    budget = keep_bytes
    try:
        for n, repeats in enumerate(per_round):
            for members in by_size.values():
                for i in members:
                    run_ = kept.get(i) or _Running(group, cases[i])
                    for op in OPS:
                        ns = time_collective(group.barrier, getattr(run_, op), warmup, repeats)
                        samples[i][op] += (ns / 1e3).tolist()
                    if n == len(per_round) - 1 and cases[i].engine == "asp":
                        samples[i]["phases"] = _traced_phases(group, run_)
                    size = buffer_bytes(cases[i], group.num_ranks)
                    if i not in kept and size <= budget and len(per_round) > 1:
                        kept[i], budget = run_, budget - size
                    elif i not in kept:
                        run_.buf.close()
    finally:
        for run_ in kept.values():
            run_.buf.close()
    return samples


def run(ranks: Sequence[int], sizes: Sequence[int], modes: Sequence[tuple[str, str]],
        warmup: int, repeats: int, rounds: int, mem_bytes: int, keep_bytes: int,
        timeout_s: float = 1800.0, scale_sizes: Sequence[int] = ()) -> dict[str, Any]:
    """Measure every rank count; returns ``{"rows", "floor", "skipped"}`` (see the module doc)."""
    from ubep.runtime import launch

    per_round = round_repeats(repeats, rounds)
    rows: list[dict[str, Any]] = []
    floors: list[dict[str, Any]] = []
    skipped: list[str] = []
    for num_ranks in ranks:
        cases = []
        every = cases_for(sizes, num_ranks, modes) + [
            c for shape in SCALE_SHAPES for c in cases_for(scale_sizes, num_ranks, modes, shape)]
        for case in every:
            need = buffer_bytes(case, num_ranks)
            if need > mem_bytes:
                skipped.append(f"{num_ranks} ranks {case.layout} {case.mode} "
                               f"{case.target_bytes} B: Buffers need {need / 2**30:.1f} GiB")
            else:
                cases.append(case)
        if not cases:
            continue
        nbytes = [bytes_per_rank(c, num_ranks) for c in cases]
        distinct = sorted({int(b) for b in nbytes})
        before = _floor(num_ranks, distinct, per_round, warmup, timeout_s)
        per_rank = launch(_rank_main, num_ranks, cases, warmup, per_round, keep_bytes,
                          timeout_s=timeout_s)
        after = _floor(num_ranks, distinct, per_round, warmup, timeout_s)
        # the floor is the best the host did in either pass: a burst of outside load in one of
        # the two passes (they are seconds apart) would otherwise skew every ratio of that size
        floor_stats = {b: min(before[b], after[b], key=lambda st: st.median_us) for b in distinct}
        # the floor again with each copy alternating between two destinations, as dispatches
        # alternate between the two receive regions: what the limits table compares with
        two = _floor(num_ranks, distinct, per_round, warmup, timeout_s, destinations=2)
        floors += [{"ranks": num_ranks, "bytes_per_rank": b, **asdict(floor_stats[b]),
                    "median_us_before": before[b].median_us,
                    "median_us_after": after[b].median_us,
                    "median_us_two_destinations": two[b].median_us} for b in distinct]
        for i, case in enumerate(cases):
            row: dict[str, Any] = {"ranks": num_ranks, **asdict(case), "mode": case.mode,
                                   "bytes_per_rank": nbytes[i]}
            for op in OPS:
                worst = np.max(np.array([r[i][op] for r in per_rank]), axis=0)  # max over ranks
                row[op] = asdict(Stats.from_samples_us(worst.tolist()))
            if "phases" in per_rank[0][i]:
                row["phases"], row["phases_rank"] = _slowest_phases([r[i]["phases"] for r in
                                                                     per_rank])
            row["floor"] = asdict(floor_stats[int(nbytes[i])])
            row["floor_two_destinations"] = asdict(two[int(nbytes[i])])
            rows.append(row)
    return {"rows": rows, "floor": floors, "skipped": skipped}


# The L3 (32 MiB here) holds a 2-rank copy's source and destination up to ~4 MB per rank:
# one line across that cliff fits neither side, so each series is also fitted per regime.
REGIMES = {"all": (0.0, math.inf), "<=4MB": (0.0, 4.5e6), ">=4MB": (4.0e6, math.inf)}


def _floor(num_ranks: int, sizes: list[int], per_round: list[int], warmup: int,
           timeout_s: float, destinations: int = 1) -> dict[int, Stats]:
    stats = concurrent_copy(num_ranks, sizes, repeats=sum(per_round), warmup=warmup,
                            rounds=len(per_round), timeout_s=timeout_s,
                            destinations=destinations)
    return dict(zip(sizes, stats, strict=True))


def series_fits(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One fit per (ranks, layout, mode, op) and per (ranks, layout) floor, per size regime
    (``REGIMES``) that holds at least two sizes."""
    groups: dict[tuple[int, str, str, str], list[tuple[float, float]]] = {}
    for r in result["rows"]:
        for op in OPS:
            key = (r["ranks"], r["layout"], r["mode"], op)
            groups.setdefault(key, []).append((r["bytes_per_rank"], r[op]["median_us"]))
        floor_key = (r["ranks"], r["layout"], "memcpy", "floor")
        if (r["bytes_per_rank"], r["floor"]["median_us"]) not in groups.get(floor_key, []):
            groups.setdefault(floor_key, []).append((r["bytes_per_rank"], r["floor"]["median_us"]))
    out = []
    for (ranks, layout, mode, op), every in groups.items():
        for regime, (lo, hi) in REGIMES.items():
            pts = [(b, t) for b, t in every if lo <= b <= hi]
            if len({b for b, _ in pts}) < 2 or (regime != "all" and len(pts) == len(every)):
                continue
            f = fit_line([b for b, _ in pts], [t for _, t in pts])
            out.append({"ranks": ranks, "layout": layout, "mode": mode, "op": op,
                        "regime": regime, "intercept_us": f.intercept_us,
                        "ns_per_kb": f.ns_per_kb, "gbps": f.gbps, "points": len(pts)})
    order = {"dispatch": 0, "combine": 1, "floor": 2}
    regimes = list(REGIMES)
    return sorted(out, key=lambda f: (f["ranks"], regimes.index(f["regime"]),
                                      f["layout"] != "rank", order[f["op"]]))


# The targets: dispatch and combine within these multiples of the floor, 256 KB .. 64 MB
TARGET_X_FLOOR = {2: 1.25, 4: 1.4}
TARGET_MIN_BYTES = 250_000


# The engine's phases (harness.DISPATCH_PHASES / COMBINE_PHASES) in four parts: Python and the
# native call's entry and exit; local per-token work (validation, the routing record, the
# received rows' metadata); waiting for peers (to leave the previous call, for their counts,
# their rows or their published outputs); this rank's own copy (dispatch: its rows out;
# combine: the rows peers pull, then the reduce).
PARTS = {
    "dispatch": {"entry": ("py_in", "args", "py_out"),
                 "local": ("validate", "publish", "metadata"),
                 "wait": ("wait_prev", "counts_in", "data_wait"), "copy": ("send",)},
    "combine": {"entry": ("py_in", "args", "py_out"), "local": (),
                "wait": ("wait_prev", "publish", "peers"), "copy": ("copy", "reduce")},
}
PART_NAMES = {"entry": "entry/exit", "local": "per-token bookkeeping", "wait": "waits on peers",
              "rest": "the slowest rank"}


def parts(phases: dict[str, float], op: str, median_us: float) -> dict[str, float]:
    """``phases`` (the slowest rank's phase medians of one op, us) summed into ``PARTS``, and
    ``rest``: the case's median (per call, the maximum over ranks) beyond that rank's median
    call: the ranks' skew, which rank is slowest changing from call to call. (A JSON written
    before ``args`` was traced has it inside ``py_in``.)"""
    out = {part: sum(phases.get(p, 0.0) for p in names) for part, names in PARTS[op].items()}
    out["rest"] = max(0.0, median_us - sum(phases.values()))
    return out


def limits(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every ASP case (BSP is the baseline) over its target (``TARGET_X_FLOOR``) and what
    limits it, measured. With the engine's phases (``phases``, of the slowest rank): its own copy
    when it alone takes more than the target (``copy_x_floor``), else the largest other part
    (entry / exit, per-token bookkeeping, waits on peers, or the slowest rank: work a copy does
    not have). Without them (an older JSON): the series' fixed cost per call (its intercept,
    ``<=4MB`` regime where fitted, beyond the floor's own intercept) or its size-proportional
    cost; ``x_floor_per_byte`` is the ratio with that fixed cost taken off."""
    fits = {(f["ranks"], f["layout"], f["mode"], f["op"], f["regime"]): f
            for f in result.get("fits") or series_fits(result)}

    def intercept(ranks: int, layout: str, mode: str, op: str) -> float:
        f = fits.get((ranks, layout, mode, op, "<=4MB")) or fits.get(
            (ranks, layout, mode, op, "all"))
        return f["intercept_us"] if f else 0.0

    out = []
    for r in result["rows"]:
        target = TARGET_X_FLOOR.get(r["ranks"])
        floor = r["floor"]["median_us"]
        if target is None or r["bytes_per_rank"] < TARGET_MIN_BYTES:
            continue
        for op in OPS:
            med = r[op]["median_us"]
            if med <= target * floor or r["mode"].startswith("bsp"):  # BSP: the baseline
                continue
            fixed = max(0.0, intercept(r["ranks"], r["layout"], r["mode"], op)
                         - max(0.0, intercept(r["ranks"], r["layout"], "memcpy", "floor")))
            per_byte = (med - fixed) / floor
            two = (r.get("floor_two_destinations") or {}).get("median_us")
            x = {"ranks": r["ranks"], "layout": r["layout"], "mode": r["mode"], "op": op,
                 "bytes": int(r["bytes_per_rank"]), "x_floor": med / floor,
                 "x_floor_two_dst": med / two if two else math.nan, "fixed_us": fixed,
                 "x_floor_per_byte": per_byte,
                 "limit": "fixed cost" if per_byte <= target else "size-proportional"}
            phases = (r.get("phases") or {}).get(op)
            if phases:
                split = parts(phases, op, med)
                x |= {f"{part}_us": us for part, us in split.items()}
                x["copy_x_floor"] = split["copy"] / floor
                x["limit"] = "moving the rows" if split["copy"] > target * floor else (
                    PART_NAMES[max(PART_NAMES, key=lambda p: split[p])])
            out.append(x)
    return out


def header(result: dict[str, Any], ranks: Sequence[int]) -> str:
    cpus = os.cpu_count() or 1
    lines = [
        "bytes_per_rank = rows x hidden x 2 (BF16), mean over ranks; rows = (token, expert)",
        "  pairs (layout=expert) or (token, destination rank) pairs (layout=rank), own rows",
        "  included; combine reduces the same rows (BF16), so the same bytes.",
        "time = max over ranks per iteration; min/median/max over the repeats (split over rounds).",
        "floor = harness.concurrent_copy: as many processes as ranks each copying bytes_per_rank",
        "  at once (first start to last end), same run, once before and once after the ranks'",
        "  cases: the pass with the lower median; x_floor = median / floor median.",
        "fit: Theil-Sen line of median time vs bytes: intercept = fixed cost per call (us),",
        "  slope = per-byte cost (ns/KB; GB/s = 1 / slope); over all sizes and per regime",
        "  (<=4MB: the copies stay in the 32 MiB L3; >=4MB: they stream from DRAM).",
    ]
    over = [r for r in ranks if r > cpus]
    if over:
        lines.append(f"NOTE: {', '.join(map(str, over))} ranks on {cpus} cores are "
                     "oversubscribed: ranks (and floor processes) take turns on the cores.")
    lines += [f"SKIPPED (memory): {s}" for s in result["skipped"]]
    return "\n".join(lines)


def tables(result: dict[str, Any]) -> str:
    cols = ["ranks", "layout", "mode", "op", "tokens", "hidden", "bytes", "min_us", "median_us",
            "max_us", "floor_us", "x_floor"]
    table = [[r["ranks"], r["layout"], r["mode"], op, r["tokens"], r["hidden"],
              int(r["bytes_per_rank"]), r[op]["min_us"], r[op]["median_us"], r[op]["max_us"],
              r["floor"]["median_us"], r[op]["median_us"] / r["floor"]["median_us"]]
             for r in result["rows"] for op in OPS]
    fcols = ["ranks", "sizes", "layout", "mode", "op", "fixed_us", "ns_per_kb", "gbps", "points"]
    ftable = [[f["ranks"], f["regime"], f["layout"], f["mode"], f["op"], f["intercept_us"],
               f["ns_per_kb"],
               f["gbps"], f["points"]] for f in result["fits"]]
    over = limits(result)
    lcols = ["ranks", "layout", "mode", "op", "bytes", "x_floor", "x_floor_two_dst",
             "fixed_us", "x_floor_per_byte", "entry_us", "local_us", "wait_us", "rest_us",
             "copy_us", "copy_x_floor", "limit"]
    ltable = [[x.get(c, math.nan) for c in lcols] for x in over]
    targets = ", ".join(f"{t}x at {r} ranks" for r, t in TARGET_X_FLOOR.items())
    return (format_table(cols, table, float_digits=1) + "\n\nFits (fixed cost per call and "
            "per-byte cost; memcpy = the floor):\n" + format_table(fcols, ftable, float_digits=2)
            + f"\n\nOver the target ({targets}, >= 256 KB) and what limits each: fixed_us = "
            "the series' fitted fixed cost beyond the floor's; x_floor_per_byte = (median - "
            "fixed_us) / floor; x_floor_two_dst = median / the floor whose copies alternate "
            "between two destinations, as dispatches alternate between two receive regions. "
            f"Measured on the slowest rank (engine trace, median of {TRACED_CALLS} calls after the "
            "timed ones): entry_us = Python and the native call's entry and exit; local_us = "
            "validation, the routing record and the received rows' metadata; wait_us = "
            "waiting for peers (to leave the previous call, for their counts, rows or "
            "outputs); rest_us = the median (the slowest rank per call) beyond that rank's; "
            "copy_us = this rank's own copy (dispatch: its rows out; combine: the rows peers "
            "pull, and the reduce); copy_x_floor = copy_us / floor. limit = moving the rows "
            "if copy_x_floor is over the target, else the largest other part:\n"
            + (format_table(lcols, ltable, float_digits=2) if ltable else "(none)"))


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({r["ranks"] for r in result["rows"]})
    fig, axes = plt.subplots(2, len(ranks), figsize=(6 * len(ranks) + 3, 9), squeeze=False)
    styles = {"rank": "-", "expert": "--"}
    modes = sorted({r["mode"] for r in result["rows"]})
    colors = {m: f"C{i}" for i, m in enumerate(modes)}
    for col, nr in enumerate(ranks):
        for row_i, op in enumerate(OPS):
            ax = axes[row_i][col]
            for layout in ("rank", "expert"):
                mine = [r for r in result["rows"] if r["ranks"] == nr and r["layout"] == layout]
                for mode in modes:
                    pts = sorted((r["bytes_per_rank"], r[op]["median_us"]) for r in mine
                                 if r["mode"] == mode)
                    if pts:
                        ax.plot(*zip(*pts, strict=True), styles[layout], marker="o", ms=3,
                                color=colors[mode], label=f"{mode} {layout}")
                floor = sorted({(r["bytes_per_rank"], r["floor"]["median_us"]) for r in mine})
                if floor:
                    ax.plot(*zip(*floor, strict=True), styles[layout], color="black", lw=2.5,
                            label=f"memcpy floor {layout}")
            ax.set(xscale="log", yscale="log", title=f"{op}, {nr} ranks",
                   xlabel="bytes per rank", ylabel="median time (us)")
            ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, axes, path, legend_width_in=2.6)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 ranks, 3 sizes (~5 s)")
    parser.add_argument("--all", action="store_true", help="also asp+tff and asp+dc")
    parser.add_argument("--no-scale", action="store_true",
                        help="leave out the 896/16 and 2048/32 expert shapes (also left out "
                             "with --sizes)")
    parser.add_argument("--ranks", default=None, help="comma-separated rank counts (2,4)")
    parser.add_argument("--sizes", default=None, help="comma-separated target bytes per rank")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--mem-gib", type=float, default=16.0,
                        help="skip a case whose Buffers (all ranks) need more shared memory")
    parser.add_argument("--keep-gib", type=float, default=6.0,
                        help="Buffers kept alive across rounds (all ranks); others are rebuilt")
    parser.add_argument("--out", default=None, help="write growth.{txt,json,png} here")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--replot", default=None,
                        help="re-fit and re-render a growth.json (to --out, else stdout only)")
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            write_outputs(json.load(f), args.out)
        return 0
    ranks = int_list(args.ranks, [2] if args.quick else [2, 4])
    sizes = int_list(args.sizes, QUICK_SIZES if args.quick else FULL_SIZES)
    repeats = args.repeats or (10 if args.quick else 30)
    rounds = args.rounds or (2 if args.quick else 3)
    modes = MAIN_MODES + (EXTRA_MODES if args.all else ())
    load = os.getloadavg()[0]
    start = time.monotonic()
    # explicit --sizes: exactly those cases (compare_builds runs an older bench_growth beside)
    scale = () if args.no_scale or args.sizes else (
        SCALE_SIZES[1:2] if args.quick else SCALE_SIZES)
    result = run(ranks, sizes, modes, args.warmup, repeats, rounds,
                 int(args.mem_gib * 2**30), int(args.keep_gib * 2**30), args.timeout, scale)
    result["settings"] = {"ranks": ranks, "sizes": list(sizes), "modes": [f"{e}+{s}" for e, s
                          in modes], "repeats": repeats, "rounds": rounds, "warmup": args.warmup}
    result["machine"] = machine_since(load, start)
    write_outputs(result, args.out)
    return 0


def write_outputs(result: dict[str, Any], out: str | None) -> None:
    """Fit, print, and (with ``out``) write growth.{txt,json,png}."""
    result["fits"] = series_fits(result)
    st, machine = result["settings"], result["machine"]
    text = (header(result, st["ranks"]) + "\n\n" + tables(result) + f"\n\n("
            f"{machine['seconds']:.0f} s, {st['repeats']} repeats in {st['rounds']} rounds after "
            f"{st['warmup']} warm-up each; load {machine['load_before']:.2f} -> "
            f"{machine['load_after']:.2f})")
    save_results(out, "growth", text, result, plot)

if __name__ == "__main__":
    sys.exit(main())
