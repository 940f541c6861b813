"""A decode step as a serving engine runs it, and what ubep's two calls cost inside it.

Per step, on every rank (2 ranks, one process each, ``ubep.launch``):

1. a barrier (the step starts together, as the previous layer's combine leaves the ranks);
2. **attention stand-in**: a pass that reads ``evict_bytes`` (4 x this host's last-level cache,
   so none of the previous step's lines survive, as the attention weights and KV cache of a
   real layer evict them);
3. **arrival skew**: a spin of a delay drawn per (step, rank) from the case's distribution
   (``none``: 0; ``exp10``: exponential, mean 10 us; seeded), so the ranks reach the
   dispatch apart as they do when attention's work differs;
4. ``dispatch`` of the step's tokens (routing: uniform, Zipf alpha 1.2, or hot experts: 70 % of
   the picks on 2 experts; seeded per step);
5. a grouped expert matmul over the received rows (per local expert: ``x @ W_up``, SiLU,
   ``@ W_down``, float32, intermediate ``EXPERT_INTER``; one weight pair stands for every local
   expert: a real model's do not fit here, and the matmul's job is the time and the cache state
   between the calls);
6. ``combine`` of the expert outputs.

The tokens are BF16 roundings of standard normal activations, as a layer's hidden states are
(``testing.payload``'s wide-exponent BF16, which the correctness tests move, overflows the
stand-in FFN into infinities and subnormals whose float arithmetic is ~100x slower: a 48 ms
"expert" phase whose difference between the ranks read as a 4-9 ms combine). Each rank's BLAS
runs one thread (``OMP_NUM_THREADS=1``, torchrun's default; ``OPENBLAS_NUM_THREADS=1``): one
rank per core, as serving engines pin them.

Clocks are ``CLOCK_MONOTONIC`` (``time.perf_counter_ns`` and the engine's trace stamps), shared by
the processes of this host, so per call the parent reads

* ``span``: from the first rank's entry to the last rank's exit (what the layer waits);
* ``tail``: from the last rank's entry to the last rank's exit (the call once every rank is in:
  what ubep controls; with skew ``none`` it is close to ``span``);
* ``experts skew``: the last rank's combine entry minus the first's: how much longer one rank's
  experts ran than another's (its received rows differ). It is in the combine's ``span`` (the
  first rank in waits for the last one's outputs) but not ubep's: read the combine's ``tail``;
* the phases of the slowest rank (the one that exits last), from the engine's trace of core 0:
  dispatch ``py_in`` (Python, up to the native call), ``args`` (the native call reads and checks
  its arrays, takes the result's blocks), ``wait_prev`` (peers done with
  the region this call reuses), ``validate`` (routing checked and counted), ``publish`` (counts
  and the routing record out), ``send`` (rows copied), ``counts_in`` (every peer's counts),
  ``metadata`` (received rows' metadata), ``data_wait`` (every row in), ``py_out`` (result
  objects, exit); combine ``py_in``, ``args``, ``wait_prev``, ``copy``, ``publish``, ``peers``,
  ``reduce``, ``py_out``;

each as min / median / p99 over the steps, and the communication's share of the step (the two
calls' spans over the step, medians). Floor of a call: the copy of the bytes one rank sends
(``harness.concurrent_copy``, both ranks at once, warm caches) + one cross-process flag one-way
latency; the **cold floor** is the same copy made the way the calls make it in a step: after
the attention stand-in's eviction (source and destination cold; both ranks at once,
``COLD_COPIES`` samples per case; the flag latency from benchmarks/host_micro.c). The
**cold call** is one ``np.copyto`` of 64 bytes made the same way: the least a Python call into
native code costs in a step; each call's entry and exit (``py_in`` + ``args`` + ``py_out`` of
the slowest rank) is set against it. Bytes a rank sends = rows x hidden x 2 (BF16; one row
per (token, expert) pick: the expert-major layout of DeepEP's low-latency mode, which decode
uses).

    python -m benchmarks.bench_step [--quick] [--steps N] [--out DIR]

Writes ``step.txt`` and ``step.json`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (
    COMBINE_PHASES,
    DISPATCH_PHASES,
    concurrent_copy,
    format_table,
    save_results,
    trace_marks,
    trace_range,
)
from ubep import reference, routing, testing
from ubep.buffer import Buffer, BufferConfig
from ubep.dtypes import dtype_of
from ubep.runtime import launch

RANKS = 2
RESULTS = Path(__file__).resolve().parent / "results"
# the stand-in experts' intermediate size: small, so that a DeepSeek-V3 step of 128 tokens (1024
# received rows of 7168) stays near 50 ms on a CPU whose sgemm runs ~10 GFLOP/s a core; the
# eviction, not the matmul, sets the cache state the calls meet
EXPERT_INTER = 16
COLD_COPIES = 30  # cold-floor samples per case


@dataclass(frozen=True)
class Model:
    """The MoE shape a case takes (hidden size, routed experts, top-k)."""

    name: str
    hidden: int
    num_experts: int
    num_topk: int


MODELS = {m.name: m for m in (
    Model("qwen3-30b", 2048, 128, 8),
    Model("dsv3", 7168, 256, 8),
    Model("e896-k16", 2048, 896, 16),
    Model("e2048-k32", 2048, 2048, 32),
)}
ROUTINGS = ("uniform", "zipf1.2", "hot")
SKEWS = ("none", "exp10")


@dataclass(frozen=True)
class Case:
    model: str
    tokens: int
    routing: str
    skew: str
    engine: str


@dataclass(frozen=True)
class Spread:
    """min / median / p99 of one quantity over the steps, microseconds."""

    min_us: float
    median_us: float
    p99_us: float

    @classmethod
    def of(cls, samples_ns: list[int] | np.ndarray) -> Spread:
        a = np.asarray(samples_ns, dtype=np.float64) / 1e3
        return cls(float(a.min()), float(np.median(a)), float(np.percentile(a, 99)))


@dataclass(frozen=True)
class Row:
    case: Case
    bytes_per_rank: int
    step: Spread
    comm_share: float  # (dispatch span + combine span) / step, medians over steps
    dispatch_span: Spread
    dispatch_tail: Spread
    combine_span: Spread
    combine_tail: Spread
    experts_skew: Spread  # last rank's combine entry - first rank's
    cold_copy: Spread  # the cold floor's copy: per sample the slower rank's
    cold_call: Spread  # one np.copyto of 64 bytes after the eviction: per sample the slower rank's
    dispatch_phases: dict[str, Spread]  # of the slowest rank
    combine_phases: dict[str, Spread]
    dispatch_entry_exit: Spread | None  # py_in + args + py_out of the slowest rank, per step
    combine_entry_exit: Spread | None


def _evict_bytes() -> int:
    """4 x the last-level cache (from /sys; 32 MiB when it cannot be read)."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        llc = int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]]
    except (OSError, ValueError, KeyError):
        llc = 8 << 20
    return 4 * llc


def _topk_idx(case: Case, model: Model, step: int, rank: int) -> np.ndarray:
    seed = (step * 7919 + rank) * 31 + ROUTINGS.index(case.routing)
    if case.routing == "zipf1.2":
        return routing.zipf_topk(case.tokens, model.num_experts, model.num_topk, alpha=1.2,
                                 seed=seed)
    if case.routing == "hot":
        return routing.hot_experts_topk(case.tokens, model.num_experts, model.num_topk,
                                        hot_experts=2, hot_share=0.7, seed=seed)
    return routing.uniform_topk(case.tokens, model.num_experts, model.num_topk, seed=seed)


def _skew_ns(skew: str, step: int, rank: int) -> int:
    if skew == "none":
        return 0
    return int(np.random.default_rng([step, rank, 17]).exponential(10_000.0))


def _spin_until(t_ns: int) -> None:
    while time.perf_counter_ns() < t_ns:
        pass


def _experts(recv_x: np.ndarray, counts: list[int], w_up: np.ndarray,
             w_down: np.ndarray) -> np.ndarray:
    """The grouped matmul: each local expert's rows through the stand-in FFN, BF16 out."""
    out = np.empty(recv_x.shape, dtype=recv_x.dtype)
    start = 0
    for n in counts:
        rows = recv_x[start:start + n].view(np.uint16).astype(np.uint32) << 16
        h = rows.view(np.float32) @ w_up
        with np.errstate(over="ignore"):  # exp(-h) overflows to inf for h << 0: SiLU -> 0
            h *= 1.0 / (1.0 + np.exp(-h))
        y = (h @ w_down).view(np.uint32)
        out[start:start + n] = (y >> 16).astype(np.uint16).view(out.dtype)
        start += n
    return out


def _cold_samples(group: Any, size_bytes: int, evict: np.ndarray) -> tuple[list[int], list[int]]:
    """Right after the eviction, both ranks at once (ns per sample): the cold floor's copy
    (``size_bytes`` from a cold source to a cold destination), and the cold call (one
    ``np.copyto`` of 64 bytes: the least a Python call into native code costs in the step, the
    interpreter's and numpy's code and data coming back from memory)."""
    src = np.ones(size_bytes, np.uint8)
    dst = np.zeros(size_bytes, np.uint8)
    tiny_src, tiny_dst = np.ones(64, np.uint8), np.zeros(64, np.uint8)
    copies, calls = [], []
    for _ in range(COLD_COPIES):
        for a, b, out in ((dst, src, copies), (tiny_dst, tiny_src, calls)):
            group.barrier(60.0)
            float(evict.sum())
            t = time.perf_counter_ns()
            np.copyto(a, b)
            out.append(time.perf_counter_ns() - t)
    return copies, calls


def _run_case(group: Any, buf: Any, case: Case, model: Model, steps: int, warmup: int,
              evict: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> dict[str, Any]:
    """One case on this rank: per step its times (ns) and the engine's trace; the cold floor's
    copies and the cold calls."""
    r = group.rank
    cold, cold_call = _cold_samples(group, _bytes_per_rank(case), evict)
    x, w = _tokens(case, model, r)
    stamps, traces, errors = [], [], []
    for step in range(steps + warmup):
        idx = _topk_idx(case, model, step, r)
        group.barrier(60.0)
        t0 = time.perf_counter_ns()
        float(evict.sum())  # attention stand-in: every line of the evict buffer read
        _spin_until(time.perf_counter_ns() + _skew_ns(case.skew, step, r))
        d0 = time.perf_counter_ns()
        res = buf.dispatch(x, idx, w)
        d1 = time.perf_counter_ns()
        out = _experts(np.asarray(res.recv_x), list(res.num_recv_tokens_per_expert), w_up,
                       w_down)
        c0 = time.perf_counter_ns()
        y = buf.combine(out, res.handle)
        c1 = time.perf_counter_ns()
        if step < warmup:
            continue
        stamps.append((t0, d0, d1, c0, c1))
        traces.append(tuple(buf._engine.kernel.trace()))
        if step == warmup:  # one checked step per case: the timed calls are right
            errors += _check(case, model, step, res, y, r, w_up, w_down)
    return {"stamps": stamps, "traces": traces, "errors": errors, "cold_copy_ns": cold,
            "cold_call_ns": cold_call}


def _check(case: Case, model: Model, step: int, res: Any, y: np.ndarray, rank: int,
           w_up: np.ndarray, w_down: np.ndarray) -> list[str]:
    """This rank's dispatch and combine against ubep.reference (every rank's inputs rebuilt from
    the seeds, every rank's expert outputs from the reference's dispatch)."""
    xs, idxs, ws = [], [], []
    for r in range(RANKS):
        x, w = _tokens(case, model, r)
        xs.append(x)
        ws.append(w)
        idxs.append(_topk_idx(case, model, step, r))
    refs = reference.dispatch(xs, idxs, ws, model.num_experts, layout="expert")
    outs = [_experts(ref.recv_x, list(ref.num_recv_tokens_per_expert), w_up, w_down)
            for ref in refs]
    errors = testing.compare(res, refs[rank])
    if not testing.same_bits(y, reference.combine(outs, refs)[rank]):
        errors.append("combine: differs from the reference")
    return errors


def _tokens(case: Case, model: Model, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's ``x`` (BF16 of standard normal activations) and ``topk_weights`` (seeded;
    the same for every step)."""
    rng = np.random.default_rng([rank, 5])
    x = dtype_of("bf16").from_float32(rng.standard_normal((case.tokens, model.hidden),
                                                          dtype=np.float32))
    return x, rng.random((case.tokens, model.num_topk), dtype=np.float32)


def _rank(group: Any, cases: list[Case], steps: int, warmup: int,
          trace: bool = False) -> list[dict[str, Any]]:
    evict = np.ones(_evict_bytes() // 4, dtype=np.float32)
    out: list[dict[str, Any]] = []
    keyed = itertools.groupby(cases, key=lambda c: (c.model, c.tokens, c.engine))
    for (name, tokens, engine), group_cases in keyed:
        model = MODELS[name]
        rng = np.random.default_rng(3)
        w_up = (rng.standard_normal((model.hidden, EXPERT_INTER), dtype=np.float32)
                / np.float32(np.sqrt(model.hidden)))
        w_down = (rng.standard_normal((EXPERT_INTER, model.hidden), dtype=np.float32)
                  / np.float32(np.sqrt(EXPERT_INTER)))
        cfg = BufferConfig(max_tokens_per_rank=max(16, tokens), hidden=model.hidden,
                           num_topk=model.num_topk, num_experts=model.num_experts, dtype="bf16",
                           layout="expert", engine=engine, num_cores=1, trace=trace)
        with Buffer(group, cfg) as buf:
            out += [_run_case(group, buf, c, model, steps, warmup, evict, w_up, w_down)
                    for c in group_cases]
    return out


# the parts of a call that are Python and the native call's entry and exit, not its work
ENTRY_EXIT = ("py_in", "args", "py_out")


def _phases(per_rank: list[dict[str, Any]], slowest: np.ndarray,
            op: str) -> tuple[dict[str, Spread], Spread | None]:
    """The phases of ``op`` on the slowest rank of each step: from the call's entry through
    core 0's trace points to its exit, and their ENTRY_EXIT part summed per step; empty and None
    where the engine did not trace ``op`` (BSP's dispatch names its own phases by the same
    slots: abi.h)."""
    first, _ = trace_range(op)
    if not any(tr[first] for pr in per_rank for tr in pr["traces"]):
        return {}, None
    names = DISPATCH_PHASES if op == "dispatch" else COMBINE_PHASES
    enter, leave = (1, 2) if op == "dispatch" else (3, 4)
    per_step = []
    for s, r in enumerate(slowest):
        st, tr = per_rank[r]["stamps"][s], per_rank[r]["traces"][s]
        marks = [st[enter], *trace_marks(op, tr), st[leave]]
        per_step.append(np.diff(marks))
    cols = np.array(per_step)
    entry_exit = cols[:, [names.index(n) for n in ENTRY_EXIT]].sum(axis=1)
    return {n: Spread.of(cols[:, i]) for i, n in enumerate(names)}, Spread.of(entry_exit)


def _summarise(case: Case, per_rank: list[dict[str, Any]], bytes_per_rank: int) -> Row:
    st = np.array([pr["stamps"] for pr in per_rank])  # [rank, step, 5]
    t0, d0, d1, c0, c1 = (st[:, :, i] for i in range(5))
    d_span, c_span = d1.max(0) - d0.min(0), c1.max(0) - c0.min(0)
    step = c1.max(0) - t0.min(0)
    d_phases, d_entry_exit = _phases(per_rank, d1.argmax(0), "dispatch")
    c_phases, c_entry_exit = _phases(per_rank, c1.argmax(0), "combine")
    return Row(
        case=case, bytes_per_rank=bytes_per_rank, step=Spread.of(step),
        comm_share=float(np.median(d_span + c_span) / np.median(step)),
        dispatch_span=Spread.of(d_span), dispatch_tail=Spread.of(d1.max(0) - d0.max(0)),
        combine_span=Spread.of(c_span), combine_tail=Spread.of(c1.max(0) - c0.max(0)),
        experts_skew=Spread.of(c0.max(0) - c0.min(0)),
        cold_copy=Spread.of(np.array([pr["cold_copy_ns"] for pr in per_rank]).max(0)),
        cold_call=Spread.of(np.array([pr["cold_call_ns"] for pr in per_rank]).max(0)),
        dispatch_phases=d_phases, combine_phases=c_phases,
        dispatch_entry_exit=d_entry_exit, combine_entry_exit=c_entry_exit)


def _bytes_per_rank(case: Case) -> int:
    """The bytes rank 0 sends per step (expert layout: one BF16 row per (token, expert) pick;
    every slot of these routings is a pick)."""
    model = MODELS[case.model]
    return case.tokens * model.num_topk * model.hidden * 2


def _flag_oneway_us() -> float:
    from benchmarks.host_micro import Micro, build

    return Micro(build()).flag_oneway_ns(RANKS) / 1e3


# one BLAS thread per rank (torchrun's default): read by the ranks' numpy, which they import
# after the spawn
ONE_THREAD = {v: "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


def run(cases: list[Case], steps: int, warmup: int,
        trace: bool = False) -> tuple[list[Row], float, list[float]]:
    sizes = [_bytes_per_rank(c) for c in cases]
    os.environ.update(ONE_THREAD)
    per_rank = launch(_rank, RANKS, cases, steps, warmup, trace, timeout_s=3600)
    copies = concurrent_copy(RANKS, sorted(set(sizes)), repeats=50, rounds=2)
    copy_us = dict(zip(sorted(set(sizes)), (c.median_us for c in copies), strict=True))
    rows = []
    for i, case in enumerate(cases):
        mine = [pr[i] for pr in per_rank]
        bad = [e for m in mine for e in m["errors"]]
        if bad:
            raise RuntimeError(f"{case}: results differ from ubep.reference: {bad[:3]}")
        rows.append(_summarise(case, mine, sizes[i]))
    return rows, _flag_oneway_us(), [copy_us[s] for s in sizes]


def _fmt(s: Spread) -> str:
    return f"{s.min_us:.1f}/{s.median_us:.1f}/{s.p99_us:.1f}"


def _phase_cells(phases: dict[str, Spread], names: tuple[str, ...]) -> list[str]:
    return [f"{phases[n].median_us:.1f}/{phases[n].p99_us:.1f}" if phases else "-"
            for n in names]


def table(rows: list[Row], flag_us: float, copy_us: list[float]) -> str:
    head = ["model", "tok", "routing", "skew", "eng", "KB/rank", "step med", "comm %",
            "disp span", "disp tail", "experts skew", "comb span", "comb tail", "floor",
            "cold floor", "tail/floor d/c", "tail/cold d/c"]
    body = []
    for row, cp in zip(rows, copy_us, strict=True):
        c, floor = row.case, flag_us + cp
        cold = flag_us + row.cold_copy.median_us
        body.append([c.model, c.tokens, c.routing, c.skew, c.engine, row.bytes_per_rank / 1024,
                     row.step.median_us, 100 * row.comm_share, _fmt(row.dispatch_span),
                     _fmt(row.dispatch_tail), _fmt(row.experts_skew), _fmt(row.combine_span),
                     _fmt(row.combine_tail),
                     floor, cold, f"{row.dispatch_tail.median_us / floor:.2f}/"
                                  f"{row.combine_tail.median_us / floor:.2f}",
                     f"{row.dispatch_tail.median_us / cold:.2f}/"
                     f"{row.combine_tail.median_us / cold:.2f}"])
    phead = ["model", "tok", "routing", "skew", "eng", *("d " + p for p in DISPATCH_PHASES),
             *("c " + p for p in COMBINE_PHASES)]
    pbody = [[r.case.model, r.case.tokens, r.case.routing, r.case.skew, r.case.engine,
              *_phase_cells(r.dispatch_phases, DISPATCH_PHASES),
              *_phase_cells(r.combine_phases, COMBINE_PHASES)] for r in rows]
    return (format_table(head, body, float_digits=1)
            + "\n\nspans, tails and the experts' skew min/median/p99 us (experts skew: last "
              "combine entry - first, in the combine's span, not ubep's); floor = flag one-way "
              "+ copy of the bytes sent (warm); cold floor = flag one-way + the same copy right "
              "after the eviction; ratios: medians\n\n" + _engines_table(rows)
            + "\n\nphases of the slowest rank, median/p99 us (engine "
              "trace of core 0)\n" + format_table(phead, pbody)
            + "\n\n" + _entry_exit_table(rows))


def _entry_exit_table(rows: list[Row]) -> str:
    """Each call's entry and exit (py_in + args + py_out of the slowest rank) against the cold
    call: what of the software around the copy any Python API pays in a step, and what is
    ubep's own."""
    head = ["model", "tok", "routing", "skew", "eng", "cold call", "d entry+exit", "d x call",
            "c entry+exit", "c x call"]
    body = []
    for r in rows:
        call = r.cold_call.median_us
        cells = []
        for ee in (r.dispatch_entry_exit, r.combine_entry_exit):
            cells += ([f"{ee.median_us:.1f}/{ee.p99_us:.1f}", f"{ee.median_us / call:.2f}"]
                      if ee is not None else ["-", "-"])
        body.append([r.case.model, r.case.tokens, r.case.routing, r.case.skew, r.case.engine,
                     f"{call:.1f}/{r.cold_call.p99_us:.1f}", *cells])
    return ("entry and exit (py_in + args + py_out of the slowest rank), median/p99 us, against "
            "the cold call (one np.copyto of 64 bytes right after the eviction, both ranks at "
            "once: the least a Python call into native code costs in the step); x call: "
            "medians\n" + format_table(head, body))


def _engines_table(rows: list[Row]) -> str:
    """ASP against BSP per case, median and p99: the dispatch's span (arrival skew included)
    and the combine's tail (the experts' skew left out)."""
    by = {(r.case.model, r.case.tokens, r.case.routing, r.case.skew, r.case.engine): r
          for r in rows}
    head = ["model", "tok", "routing", "skew", "disp span med a/b", "disp span p99 a/b",
            "comb tail med a/b", "comb tail p99 a/b", "bsp/asp p99 d/c"]
    body = []
    for (m, t, ro, sk, eng), a in by.items():
        b = by.get((m, t, ro, sk, "bsp"))
        if eng != "asp" or b is None:
            continue
        body.append([m, t, ro, sk,
                     f"{a.dispatch_span.median_us:.1f}/{b.dispatch_span.median_us:.1f}",
                     f"{a.dispatch_span.p99_us:.1f}/{b.dispatch_span.p99_us:.1f}",
                     f"{a.combine_tail.median_us:.1f}/{b.combine_tail.median_us:.1f}",
                     f"{a.combine_tail.p99_us:.1f}/{b.combine_tail.p99_us:.1f}",
                     f"{b.dispatch_span.p99_us / a.dispatch_span.p99_us:.2f}/"
                     f"{b.combine_tail.p99_us / a.combine_tail.p99_us:.2f}"])
    return ("ASP (a) against BSP (b), us\n" + format_table(head, body)) if body else ""


TRACED = " task spans recorded (--trace);"


def cases_for(quick: bool) -> list[Case]:
    if quick:
        return [Case("qwen3-30b", 16, r, s, e) for e in ("asp", "bsp") for r in ("uniform",)
                for s in SKEWS]
    base = [Case(m, t, r, s, e) for m in ("qwen3-30b", "dsv3") for t in (1, 16, 128)
            for e in ("asp", "bsp") for r in ROUTINGS for s in SKEWS]
    scale = [Case(m, 16, r, "none", e) for m in ("e896-k16", "e2048-k32")
             for e in ("asp", "bsp") for r in ("uniform", "zipf1.2")]
    return base + scale


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="Qwen3-30B shape, 16 tokens, uniform, both engines and skews")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per case")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps before each case")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--trace", action="store_true",
                    help="every Buffer records its task spans (BufferConfig(trace=True)): "
                         "the cost of tracing on")
    args = ap.parse_args(argv)
    cases = cases_for(args.quick)
    rows, flag_us, copy_us = run(cases, args.steps, args.warmup, args.trace)
    text = (f"decode steps, {RANKS} ranks, BF16, expert layout, {args.steps} steps per case after "
            f"{args.warmup} untimed;{TRACED if args.trace else ''} evict "
            f"{_evict_bytes() >> 20} MiB per step; expert FFN "
            f"intermediate {EXPERT_INTER}\n" + table(rows, flag_us, copy_us))
    save_results(str(args.out), "step", text, {
        "flag_oneway_us": flag_us, "copy_us": copy_us, "evict_bytes": _evict_bytes(),
        "rows": [asdict(r) for r in rows]})


if __name__ == "__main__":
    main()
