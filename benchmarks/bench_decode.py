"""Decode-sized calls, phase by phase: where a dispatch and a combine of a few tokens spend their
time, beside the floor of one flag round trip plus the copy.

Per case (2 ranks, 1-16 tokens per rank, hidden 2048 / 7168 BF16, top-8 of 64 experts, both
layouts, the default sync and SP), every call is split into:

* ``python_pre``: from the call until the native engine is entered (argument checks, the
  Plan, output allocation);
* ``native``: the engine's one C call: validation, counts, sends, waits (GIL released) and,
  on the one-call path of blocking calls (runtime/native/fastpath.c), the argument checks,
  the output allocation and the result objects too;
* ``python_post``: from the engine's return to the result (on the general path: views,
  handle, result object);

and the engine's own trace of core 0 (``Engine.trace()``, last call of each case) splits
``native`` into prepare (validate, count, publish), send and receive.

The split needs a Python proxy around the engine (to time its entry and exit), whose own calls
and clock reads fall into ``python_pre`` and ``python_post``; so the totals come from a separate
clean pass of the same calls, with nothing but the call inside each timed span (rank 0's
clock, medians over ``--repeats``).

Floor = one cross-process flag one-way latency (benchmarks/host_micro.c's ping-pong, half the
round trip) + the copy of the bytes this rank sends at the measured memcpy rate (harness
``concurrent_copy`` of the same size, two processes at once). Bytes per rank = rows sent x
hidden x 2 (rank layout: one row per (token, destination rank); expert layout: one per
(token, expert)).

    python -m benchmarks.bench_decode [--quick] [--repeats N] [--out DIR]

Writes ``decode.txt`` and ``decode.json`` (default ``benchmarks/results/``). Medians of
``--repeats`` calls per case (min and max beside), all cases in one process tree.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import concurrent_copy, format_table, save_results
from ubep import testing
from ubep.buffer import Buffer, BufferConfig
from ubep.runtime import launch
from ubep.runtime.abi import TRACE

NUM_EXPERTS, NUM_TOPK, RANKS = 64, 8, 2
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Case:
    tokens: int
    hidden: int
    layout: str
    sync: str


@dataclass(frozen=True)
class Row:
    """One case's medians (min/max of the totals) in microseconds."""

    case: Case
    bytes_per_rank: int
    dispatch_us: tuple[float, float, float]
    dispatch_pre_us: float
    dispatch_native_us: float
    dispatch_post_us: float
    combine_us: tuple[float, float, float]
    combine_pre_us: float
    combine_native_us: float
    combine_post_us: float
    dispatch_phases_us: dict[str, float]  # core 0's native phases, medians (DISPATCH_MARKS)
    combine_phases_us: dict[str, float]  # COMBINE_MARKS


class _Timed:
    """The Buffer's engine with its dispatch/combine entry and exit times recorded."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.spans: dict[str, list[tuple[int, int]]] = {"dispatch": [], "combine": []}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def _call(self, kind: str, *args: Any) -> Any:
        return self._call_as(kind, kind, *args)

    # the engine's one door (ubep.plane.Engine): on a blocking call of exact arrays the native
    # span also builds the result objects
    def dispatch(self, *args: Any) -> Any:
        return self._call("dispatch", *args)

    def combine(self, *args: Any) -> Any:
        return self._call("combine", *args)

    def _call_as(self, kind: str, method: str, *args: Any) -> Any:
        t0 = time.perf_counter_ns()
        got = getattr(self._engine, method)(*args)
        if got is not None:  # None: not the fast path's case, the general path follows
            self.spans[kind].append((t0, time.perf_counter_ns()))
        return got


def _timed_calls(group: Any, buf: Any, x: Any, idx: Any, w: Any, repeats: int,
                 ) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, ...]]]:
    """``repeats`` dispatch + combine pairs after 20 untimed ones (a barrier every 25), nothing
    but the call inside each timed span: each call's (start, end) and the engine's trace after
    the pair (both calls' trace points: combine writes 8..13)."""
    res = buf.dispatch(x, idx, w)
    eo = np.array(res.recv_x)
    disp, comb, traces = [], [], []
    for rep in range(repeats + 20):
        if rep % 25 == 0:
            group.barrier(30.0)
        t0 = time.perf_counter_ns()
        res = buf.dispatch(x, idx, w)
        t1 = time.perf_counter_ns()
        mine = eo[: len(res.recv_x)]
        t2 = time.perf_counter_ns()
        buf.combine(mine, res.handle)
        t3 = time.perf_counter_ns()
        disp.append((t0, t1))
        comb.append((t2, t3))
        traces.append(buf._engine.kernel.trace())
    return disp[20:], comb[20:], traces[20:]  # the first calls warm caches and wake-ups


def _split(outer: list[tuple[int, int]], inner: list[tuple[int, int]],
           clean: list[tuple[int, int]]) -> tuple[float, ...]:
    """Medians (us) of pre, native and post (the proxied pass), and min/median/max of the
    total (the clean pass)."""
    pre = [b[0] - a[0] for a, b in zip(outer, inner, strict=True)]
    nat = [b[1] - b[0] for b in inner]
    post = [a[1] - b[1] for a, b in zip(outer, inner, strict=True)]
    tot = [b - a for a, b in clean]
    med = statistics.median
    return (med(pre) / 1e3, med(nat) / 1e3, med(post) / 1e3,
            min(tot) / 1e3, med(tot) / 1e3, max(tot) / 1e3)


# the engine's trace points (core 0; Engine.trace(), abi.h's TRACE_* enum) that bound each
# native phase, coarser than harness.DISPATCH_PHASES / COMBINE_PHASES
DISPATCH_MARKS = {"prepare": (TRACE["d_enter"], TRACE["d_published"]),
                  "send": (TRACE["d_published"], TRACE["d_sent"]),
                  "receive": (TRACE["d_sent"], TRACE["d_data_in"])}
COMBINE_MARKS = {"wait": (TRACE["c_enter"], TRACE["c_prev_done"]),
                 "copy": (TRACE["c_prev_done"], TRACE["c_copied"]),
                 "peers": (TRACE["c_copied"], TRACE["c_peers"]),
                 "reduce": (TRACE["c_peers"], TRACE["c_reduced"])}


def _phases(traces: list[tuple[int, ...]], marks: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Median duration (us) of each phase over the calls."""
    return {name: statistics.median(t[b] - t[a] for t in traces) / 1e3
            for name, (a, b) in marks.items()}


def _rank(group: Any, cases: list[Case], repeats: int) -> list[dict[str, Any]]:
    out = []
    for i, case in enumerate(cases):
        cfg = BufferConfig(max_tokens_per_rank=max(16, case.tokens), hidden=case.hidden,
                           num_topk=NUM_TOPK, num_experts=NUM_EXPERTS, dtype="bf16",
                           layout=case.layout, sync=case.sync, num_cores=1)
        xs, idxs, ws = testing.inputs("bf16", NUM_EXPERTS, NUM_TOPK, case.hidden,
                                      [case.tokens] * RANKS, i, "uniform")
        r = group.rank
        with Buffer(group, cfg) as buf:
            errors = testing.check_call(buf, xs, idxs, ws, i)  # the timed calls are right
            clean_d, clean_c, _ = _timed_calls(group, buf, xs[r], idxs[r], ws[r], repeats)
            timed = _Timed(buf._engine)
            buf._engine = buf._fast = timed  # the one-call path too
            outer_d, outer_c, traces = _timed_calls(group, buf, xs[r], idxs[r], ws[r], repeats)
            buf._engine = buf._fast = timed._engine
        out.append({
            "errors": errors,
            "dispatch": _split(outer_d, timed.spans["dispatch"][-repeats:], clean_d),
            "combine": _split(outer_c, timed.spans["combine"][-repeats:], clean_c),
            "dispatch_phases": _phases(traces, DISPATCH_MARKS),
            "combine_phases": _phases(traces, COMBINE_MARKS),
        })
    return out


def _bytes_per_rank(case: Case, seed: int) -> int:
    _, idxs, _ = testing.inputs("bf16", NUM_EXPERTS, NUM_TOPK, 8, [case.tokens] * RANKS, seed,
                                "uniform")
    idx = idxs[0]
    if case.layout == "expert":
        rows = int((idx >= 0).sum())
    else:
        owner = np.where(idx >= 0, idx // (NUM_EXPERTS // RANKS), -1)
        rows = sum(len(set(row[row >= 0].tolist())) for row in owner)
    return rows * case.hidden * 2


def _flag_oneway_us() -> float:
    from benchmarks.host_micro import Micro, build

    return Micro(build()).flag_oneway_ns(RANKS) / 1e3


def run(cases: list[Case], repeats: int) -> tuple[list[Row], float, list[float]]:
    sizes = [_bytes_per_rank(c, i) for i, c in enumerate(cases)]
    # the floor once before and once after the ranks' calls, the lower median of the two (as
    # bench_growth): a burst of outside load inflates one pass, and an inflated floor flatters
    floor_repeats = max(20, repeats // 10)
    before = concurrent_copy(RANKS, sizes, repeats=floor_repeats, rounds=2)
    per_rank = launch(_rank, RANKS, cases, repeats, timeout_s=1800)
    after = concurrent_copy(RANKS, sizes, repeats=floor_repeats, rounds=2)
    copies = [min(a, b, key=lambda s: s.median_us) for a, b in zip(before, after, strict=True)]
    flag_us = _flag_oneway_us()
    rows = []
    for i, case in enumerate(cases):
        mine = [pr[i] for pr in per_rank]
        bad = [e for m in mine for e in m["errors"]]
        if bad:
            raise RuntimeError(f"{case}: results differ from ubep.reference: {bad[:3]}")
        d, c = mine[0]["dispatch"], mine[0]["combine"]
        rows.append(Row(case=case, bytes_per_rank=sizes[i],
                        dispatch_us=(d[3], d[4], d[5]), dispatch_pre_us=d[0],
                        dispatch_native_us=d[1], dispatch_post_us=d[2],
                        combine_us=(c[3], c[4], c[5]), combine_pre_us=c[0],
                        combine_native_us=c[1], combine_post_us=c[2],
                        dispatch_phases_us=mine[0]["dispatch_phases"],
                        combine_phases_us=mine[0]["combine_phases"]))
    return rows, flag_us, [s.median_us for s in copies]


def table(rows: list[Row], flag_us: float, copy_us: list[float]) -> str:
    head = ["tokens", "hidden", "layout", "sync", "KB/rank", "disp med", "pre", "native", "post",
            "comb med", "pre", "native", "post", "floor", "disp/floor", "comb/floor"]
    body = []
    for row, cp in zip(rows, copy_us, strict=True):
        floor = flag_us + cp
        c = row.case
        body.append([c.tokens, c.hidden, c.layout, c.sync, row.bytes_per_rank / 1024,
                     row.dispatch_us[1], row.dispatch_pre_us, row.dispatch_native_us,
                     row.dispatch_post_us, row.combine_us[1], row.combine_pre_us,
                     row.combine_native_us, row.combine_post_us, floor,
                     row.dispatch_us[1] / floor, row.combine_us[1] / floor])
    phead = ["tokens", "hidden", "layout", "sync", *("disp " + k for k in DISPATCH_MARKS),
             *("comb " + k for k in COMBINE_MARKS)]
    pbody = [[r.case.tokens, r.case.hidden, r.case.layout, r.case.sync,
              *r.dispatch_phases_us.values(), *r.combine_phases_us.values()] for r in rows]
    return (format_table(head, body) + "\n\nnative phases of core 0 (engine trace points, "
            "medians, us): dispatch prepare (validate, count, publish) / send / receive; "
            "combine wait (peers one call behind) / copy (the rows peers pull) / peers (their "
            "outputs published) / reduce\n" + format_table(phead, pbody))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 tokens x 2048 only, 200 calls")
    ap.add_argument("--repeats", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        cases = [Case(16, 2048, lay, "auto") for lay in ("rank", "expert")]
        repeats = 200
    else:
        cases = [Case(t, h, lay, s) for t in (1, 4, 16) for h in (2048, 7168)
                 for lay in ("rank", "expert") for s in ("auto", "sp")]
        repeats = args.repeats
    rows, flag_us, copy_us = run(cases, repeats)
    text = (f"decode-sized calls, {RANKS} ranks, top-{NUM_TOPK} of {NUM_EXPERTS}, BF16, "
            f"{repeats} calls per case (medians, us); floor = flag one-way {flag_us:.2f} us + "
            "copy of the bytes sent\n" + table(rows, flag_us, copy_us))
    save_results(str(args.out), "decode", text, {
        "flag_oneway_us": flag_us, "copy_us": copy_us, "rows": [asdict(r) for r in rows]})


if __name__ == "__main__":
    main()
