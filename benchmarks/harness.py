"""Shared timing helper for every benchmark: repeat a callable, report min/median/max.

Usage::

    from benchmarks.harness import time_repeats, format_table
    stats = time_repeats(lambda: work(), repeats=50, warmup=5)
    print(format_table(["case", "min_us", "median_us", "max_us"],
                       [["small", stats.min_us, stats.median_us, stats.max_us]]))

Timing uses ``time.perf_counter_ns`` around each call (one call per sample, so very short
callables include the ~100 ns clock overhead; batch them inside ``fn`` if that matters).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "COMBINE_PHASES",
    "DISPATCH_PHASES",
    "Stats",
    "collective_spans",
    "concurrent_copy",
    "dispatch_combine",
    "format_table",
    "int_list",
    "machine_since",
    "phase_medians",
    "print_table",
    "round_repeats",
    "save_results",
    "time_collective",
    "time_repeats",
    "trace_marks",
    "traced_call",
]


@dataclass(frozen=True)
class Stats:
    """Wall-clock statistics of ``repeats`` timed calls, in microseconds."""

    min_us: float
    median_us: float
    max_us: float
    repeats: int

    @classmethod
    def from_samples_us(cls, samples_us: Sequence[float]) -> Stats:
        if not samples_us:
            raise ValueError("samples_us: need at least one sample")
        return cls(
            min_us=float(min(samples_us)),
            median_us=float(statistics.median(samples_us)),
            max_us=float(max(samples_us)),
            repeats=len(samples_us),
        )


def dispatch_combine(buf: Any, x: Any, topk_idx: Any, topk_weights: Any) -> None:
    """One dispatch and the combine of its rows as they came (identity experts): the pair the
    call benchmarks time."""
    res = buf.dispatch(x, topk_idx, topk_weights)
    buf.combine(res.recv_x, res.handle)


def time_repeats(fn: Callable[[], object], repeats: int = 20, warmup: int = 3) -> Stats:
    """Call ``fn`` ``warmup`` times untimed, then ``repeats`` times timed; return the stats."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: must be >= 1")
    if warmup < 0:
        raise ValueError(f"warmup={warmup}: must be >= 0")
    for _ in range(warmup):
        fn()
    samples_us = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        samples_us.append((time.perf_counter_ns() - start) / 1e3)
    return Stats.from_samples_us(samples_us)


def collective_spans(barrier: Callable[[], object], fn: Callable[[], object], warmup: int,
                     repeats: int) -> np.ndarray:
    """The timing loop of a collective, as every benchmark of one: ``warmup + repeats`` times,
    ``barrier()`` (so every rank starts together), then this rank times its own ``fn()``;
    returns the ``[repeats, 2]`` int64 ``(start_ns, end_ns)`` of the timed calls.

    The clock is ``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux: one clock for every process
    of a host, and the one the native engine's trace uses). A caller that wants the maximum over
    ranks gathers the samples once at the end: a reduction inside the loop would add its own
    latency to the next iteration's skew.
    """
    spans = np.empty((repeats, 2), dtype=np.int64)
    for i in range(warmup + repeats):
        barrier()
        start = time.perf_counter_ns()
        fn()
        end = time.perf_counter_ns()
        if i >= warmup:
            spans[i - warmup] = (start, end)
    return spans


def time_collective(barrier: Callable[[], object], fn: Callable[[], object], warmup: int,
                    repeats: int) -> np.ndarray:
    """:func:`collective_spans` as ``[repeats]`` float64 durations in ns (this rank's calls)."""
    spans = collective_spans(barrier, fn, warmup, repeats)
    return (spans[:, 1] - spans[:, 0]).astype(np.float64)


# The phases between the native engine's core-0 trace points (``Engine.trace()``, the clock of
# collective_spans; the points are abi.h's TRACE_* enum, ``ubep.runtime.abi.TRACE``), framed by
# the Python entry and exit: ``py_in`` is Python up to the native call, ``args`` the native
# call's reading and checking of its arguments (and the result's blocks), up to the task graph;
# ``py_out`` from the last phase to the return in Python (the call's end, the result built).
DISPATCH_PHASES = ("py_in", "args", "wait_prev", "validate", "publish", "send", "counts_in",
                   "metadata", "data_wait", "py_out")
COMBINE_PHASES = ("py_in", "args", "wait_prev", "copy", "publish", "peers", "reduce", "py_out")


def traced_call(barrier: Callable[[], object], fn: Callable[[], object],
                trace: Callable[[], Sequence[int]]) -> list[int]:
    """One collective call as :func:`collective_spans` times it, then the engine's trace of it:
    ``[start_ns, end_ns, *trace]``."""
    start, end = (int(v) for v in collective_spans(barrier, fn, 0, 1)[0])
    return [start, end, *trace()]


def trace_range(op: str) -> tuple[int, int]:
    """The first and last trace slot of ``op``'s task graph ("dispatch" or "combine"), read from
    ubep's ABI at call time: peers' environments import this module without ubep and never
    trace."""
    from ubep.runtime.abi import TRACE

    first, last = {"dispatch": ("d_enter", "d_data_in"), "combine": ("c_enter", "c_reduced")}[op]
    return TRACE[first], TRACE[last]


def trace_marks(op: str, trace: Sequence[int]) -> list[int]:
    """The stamps of ``op`` in phase order: the native call's entry, then its task graph's
    (``DISPATCH_PHASES`` / ``COMBINE_PHASES`` between a call's start, these and its end)."""
    from ubep.runtime.abi import TRACE

    first, last = trace_range(op)
    return [trace[TRACE["d_native" if op == "dispatch" else "c_native"]],
            *trace[first:last + 1]]


def phase_medians(calls: Sequence[Sequence[int]], op: str) -> list[float]:
    """Median duration (us) of each phase of ``op`` (``DISPATCH_PHASES`` / ``COMBINE_PHASES``)
    over :func:`traced_call` rows: from the call's start through the trace points of ``op`` to
    its end (``py_in`` / ``py_out``: Python and the native call's entry and exit)."""
    per = []
    for start, end, *tr in calls:
        marks = [start, *trace_marks(op, tr), end]
        per.append([(b - a) / 1e3 for a, b in itertools.pairwise(marks)])
    return [float(v) for v in np.median(np.array(per), axis=0)]


def int_list(text: str | None, default: Sequence[int]) -> list[int]:
    """A comma-separated command-line list (``--ranks 2,4``), or ``default`` without one."""
    return [int(v) for v in text.split(",")] if text else list(default)


def machine_since(load_before: float, start: float) -> dict[str, Any]:
    """The ``machine`` record of a run that began at ``start`` (``time.monotonic()``) under a
    1-minute load average of ``load_before``: CPUs, the load before and now, seconds taken."""
    return {"cpus": os.cpu_count(), "load_before": load_before,
            "load_after": os.getloadavg()[0], "seconds": time.monotonic() - start}


def rounds_parser(doc: str, quick_help: str, stem: str, repeats: int) -> argparse.ArgumentParser:
    """The options of a benchmark timed in rounds: ``--quick``, ``--repeats``, ``--rounds``,
    ``--warmup`` and ``--out`` (the directory for ``stem.txt`` / ``stem.json``)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", help=f"directory for {stem}.txt / {stem}.json")
    return ap


def measured(run: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """``run()``'s result with its ``machine`` record (:func:`machine_since`), and the words
    for a header: CPUs and the load before and after."""
    start, load = time.monotonic(), os.getloadavg()[0]
    result = run()
    machine = result["machine"] = machine_since(load, start)
    return result, f"{machine['cpus']} CPUs, load {load:.1f} -> {machine['load_after']:.1f}"


def round_repeats(repeats: int, rounds: int) -> list[int]:
    """``repeats`` timed iterations split over ``rounds`` passes through the cases (every pass
    times every case once, so a burst of outside load lands in one slice of each case's
    samples instead of in all of one case's)."""
    rounds = max(1, min(rounds, repeats))
    return [repeats // rounds + (1 if i < repeats % rounds else 0) for i in range(rounds)]


def _spin_barrier(slots: Any, rank: int, target: int) -> None:
    # Shared-memory barrier that spins then yields (the runtime's group barrier does the same):
    # its exit skew is a few microseconds, where a semaphore's wake-up costs tens.
    slots[rank] = target
    spins = 0
    while min(slots) < target:
        spins += 1
        if spins > 64:
            os.sched_yield()


def _copy_worker(
    slots: Any, out: Any, rank: int, sizes_bytes: Sequence[int], rounds: Sequence[int],
    warmup: int, destinations: int = 1,
) -> None:
    # Pre-faulted buffers (a first touch page-faults at a fraction of copy speed).
    src = np.ones(max(sizes_bytes) + 64, dtype=np.uint8)
    dsts = [np.ones_like(src) for _ in range(destinations)]
    spans: list[list[tuple[int, int]]] = [[] for _ in sizes_bytes]
    iteration = 0
    for repeats in rounds:
        for n, got in zip(sizes_bytes, spans, strict=True):
            for i in range(warmup + repeats):
                iteration += 1
                _spin_barrier(slots, rank, iteration)
                start = time.perf_counter_ns()  # CLOCK_MONOTONIC: one clock for all processes
                np.copyto(dsts[iteration % destinations][:n], src[:n])
                if i >= warmup:
                    got.append((start, time.perf_counter_ns()))
    out.put((rank, spans))


def concurrent_copy(
    num_procs: int, sizes_bytes: Sequence[int], repeats: int = 20, warmup: int = 3,
    timeout_s: float = 600.0, rounds: int = 1, destinations: int = 1,
) -> list[Stats]:
    """The memcpy floor of a ``num_procs``-rank operation: per size, ``num_procs`` processes each
    copy ``size`` bytes at the same time (a barrier before every iteration); an iteration lasts
    from the first copy's start to the last copy's end. The ranks of a collective share the
    memory system and, when there are more of them than cores, the cores: then the copies take
    turns, as the ranks do, and one process copying alone is not a floor they can reach.
    ``rounds``: the repeats are split over that many passes through the sizes.
    ``destinations``: each process's copies alternate between that many destination buffers,
    as a Buffer's dispatches alternate between its two receive regions (the working set a
    floor of one buffer pair keeps in the last-level cache, two may not)."""
    if num_procs < 1:
        raise ValueError(f"num_procs={num_procs}: must be >= 1")
    per_round = round_repeats(repeats, rounds)
    ctx = mp.get_context("spawn")
    slots, out = ctx.RawArray("q", num_procs), ctx.Queue()
    procs = [
        ctx.Process(target=_copy_worker, args=(slots, out, r, list(sizes_bytes), per_round,
                                               warmup, destinations), daemon=True)
        for r in range(num_procs)
    ]
    for p in procs:
        p.start()
    try:
        per_rank = dict(out.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    ns = np.array([per_rank[r] for r in range(num_procs)], dtype=np.int64)  # [rank, size, rep, 2]
    span_us = (ns[..., 1].max(axis=0) - ns[..., 0].min(axis=0)) / 1e3  # [size, repeat]
    return [Stats.from_samples_us(row.tolist()) for row in span_us]


def save_results(out: str | None, stem: str, text: str, result: dict[str, Any],
                 plot: Callable[[dict[str, Any], str], None] | None = None) -> None:
    """Print ``text``; with ``out``, write ``stem.txt``, ``stem.json`` (``result``) and, with
    ``plot``, ``stem.png`` there."""
    import json

    print(text)
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=1)
    if plot is not None:
        plot(result, os.path.join(out, f"{stem}.png"))


def save_figure(fig: Any, axes: Any, path: str, legend_width_in: float) -> None:
    """The benchmarks' figure ending: one legend for all panels (the first panel's entries) in
    a ``legend_width_in`` inch strip at the right, then the PNG at ``path``."""
    import matplotlib.pyplot as plt

    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1 - legend_width_in / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cell(value: object, float_digits: int) -> str:
    if isinstance(value, float):
        return f"{value:.{float_digits}f}"
    return str(value)


def format_table(
    columns: Sequence[str], rows: Sequence[Sequence[object]], *, float_digits: int = 2
) -> str:
    """Right-aligned plain-text table (floats with ``float_digits`` decimals)."""
    cells = [[_cell(v, float_digits) for v in row] for row in rows]
    for row in cells:
        if len(row) != len(columns):
            raise ValueError(f"row {row}: has {len(row)} cells, expected {len(columns)}")
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def print_table(
    columns: Sequence[str], rows: Sequence[Sequence[object]], *, float_digits: int = 2
) -> None:
    """Print :func:`format_table` to stdout."""
    print(format_table(columns, rows, float_digits=float_digits))
