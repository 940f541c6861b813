"""Elastic EP: what masking costs when nothing fails, and how long a loss and a rejoin take.

    python -m benchmarks.bench_elastic                      # all three parts, default sizes
    python -m benchmarks.bench_elastic --repeats 5 --out benchmarks/results

1. **Steady state** (2 ranks). Timed side by side in one process tree: a plain Buffer, a
   masking Buffer (``on_peer_loss="mask"``), a Buffer with an expert map (``expert_map``:
   the same physical slots, ``REPLICATED`` experts of each rank with a replica on the other,
   the caller routing in logical ids), a masking Buffer with that map, and the memcpy floor.
   The Buffers' calls alternate in rounds. One sample is a dispatch plus its combine, from a
   barrier to the slowest rank's end.
   - Byte formula: a dispatch moves ``T * K * H * 2`` B per rank (BF16 rows, expert
     layout). Its combine reads the same bytes and writes ``K`` times fewer. The floor is one
     copy of ``T * K * H * 2`` B by every rank at once (``harness.concurrent_copy``): a lower
     bound of the dispatch alone, not of the pair.
2. **Loss** (3 ranks, rank 2 the victim, deadlines 0.1 / 0.5 / 2 s). The victim stamps the
   clock and then either SIGKILLs itself (``kill``) or SIGSTOPs itself (``stop``) before its
   dispatch. The time reported runs from that stamp to the end of the survivors' call that saw
   the loss: detection, agreement, rebuild and the call again. It is timed on the clock every
   process of a host shares.
   A run in which a healthy rank was masked before the fault (one of its calls outlasted the
   deadline on the loaded host) is counted, not timed, and another run replaces it (at most
   ``3 * --repeats`` runs): the count is the other side of the deadline's trade.
3. **Rejoin** (3 ranks, deadline 0.5 s). The victim is killed, and a new process asks to
   replace it. Two times are reported: ``admit()`` on the members, which includes starting
   the newcomer's interpreter (rank 0 launches it just before) and building its Buffer, and
   the first dispatch plus combine after it. The same call in steady state is
   printed beside them.

Every row gives min / median / max over ``--repeats`` (each repeat of parts 2 and 3 is a
fresh group). Only ratios within one run mean anything on a shared host.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (
    Stats,
    collective_spans,
    concurrent_copy,
    dispatch_combine,
    save_results,
)
from ubep import testing
from ubep.buffer import Buffer, BufferConfig
from ubep.expert_map import ExpertMap
from ubep.runtime import launch

__all__ = ["Shape", "main"]

REPO_ROOT = Path(__file__).resolve().parent.parent
LOSS_AT = 5  # the victim's fault strikes before this call
DEADLINES_S = (0.1, 0.5, 2.0)
REPLICATED = 2  # steady state: experts of each rank with a replica on the other rank


@dataclass(frozen=True)
class Shape:
    tokens: int = 128
    hidden: int = 2048
    num_topk: int = 8
    experts_per_rank: int = 8

    def config(self, num_ranks: int, timeout_s: float, on_peer_loss: str,
               expert_map: ExpertMap | None = None) -> BufferConfig:
        return BufferConfig(max_tokens_per_rank=self.tokens, hidden=self.hidden,
                            num_topk=self.num_topk, num_experts=self.experts_per_rank * num_ranks,
                            dtype="bf16", timeout_s=timeout_s, expert_map=expert_map,
                            on_peer_loss=on_peer_loss)  # type: ignore[arg-type]

    def inputs(self, num_ranks: int, call: int, num_experts: int | None = None) -> Any:
        experts = self.experts_per_rank * num_ranks if num_experts is None else num_experts
        return testing.inputs("bf16", experts, self.num_topk, self.hidden,
                              [self.tokens] * num_ranks, call, "uniform")

    def expert_map(self, num_ranks: int) -> ExpertMap:
        """The physical slots of the plain shape: ``experts_per_rank - REPLICATED`` logical
        experts per rank, and the last REPLICATED slots of each rank holding replicas of the
        first REPLICATED experts of the next rank."""
        L, own = self.experts_per_rank, self.experts_per_rank - REPLICATED
        replicas = [[r * L + j] for r in range(num_ranks) for j in range(own)]
        for r in range(num_ranks):
            nxt = (r + 1) % num_ranks
            for j in range(REPLICATED):
                replicas[nxt * own + j].append(r * L + own + j)
        return ExpertMap(replicas)

    @property
    def dispatch_bytes(self) -> int:
        """Bytes a dispatch moves per rank: T * K * H * 2."""
        return self.tokens * self.num_topk * self.hidden * 2


# --- 1. steady state --------------------------------------------------------------------


STEADY = ("plain", "mask", "map", "mask+map")


def _steady(group: Any, shape: Shape, repeats: int, rounds: int) -> dict[str, list[int]]:
    r, n = group.rank, group.num_ranks
    emap = shape.expert_map(n)
    physical = shape.inputs(n, 0)
    logical = shape.inputs(n, 0, emap.num_logical)  # the map's callers route in logical ids
    spans: dict[str, list[int]] = {name: [] for name in STEADY}
    with Buffer(group, shape.config(n, 30.0, "raise")) as plain, \
            Buffer(group, shape.config(n, 30.0, "mask")) as masking, \
            Buffer(group, shape.config(n, 30.0, "raise", emap)) as mapped, \
            Buffer(group, shape.config(n, 30.0, "mask", emap)) as both:
        bufs = {"plain": (plain, physical), "mask": (masking, physical),
                "map": (mapped, logical), "mask+map": (both, logical)}
        for _ in range(rounds):
            for name in STEADY:
                buf, (xs, idxs, ws) = bufs[name]
                got = collective_spans(
                    group.barrier,
                    lambda b=buf, x=xs[r], i=idxs[r], w=ws[r]: dispatch_combine(b, x, i, w),
                    3, max(1, repeats // rounds))
                spans[name] += got.ravel().tolist()
    return spans


def _slowest(per_rank: list[dict[str, list[int]]], name: str) -> Stats:
    spans = np.array([p[name] for p in per_rank], dtype=np.int64).reshape(len(per_rank), -1, 2)
    return Stats.from_samples_us(((spans[..., 1].max(0) - spans[..., 0].min(0)) / 1e3).tolist())


# --- 2. loss and 3. rejoin ----------------------------------------------------------------


def _lose(group: Any, shape: Shape, deadline_s: float, fault: str, stamp: str) -> Any:
    """Calls until LOSS_AT + 3; the victim (last rank) strikes before call LOSS_AT. Survivors
    return (end of the call that saw the loss, its start, a steady call's duration) in ns;
    with fault "rejoin", the admit's and the first call's durations after it too."""
    r, n = group.rank, group.num_ranks
    victim = n - 1
    out: dict[str, int] = {}
    with Buffer(group, shape.config(n, deadline_s, "mask")) as buf:
        for i in range(LOSS_AT + 3):
            xs, idxs, ws = shape.inputs(n, i)
            if r == victim and i == LOSS_AT:
                Path(stamp).write_text(str(time.perf_counter_ns()))
                os.kill(os.getpid(), signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
                return "woke"  # a stopped victim raises RankMaskedError on its next call
            if fault == "rejoin" and i == LOSS_AT + 2:
                newcomer = _start_newcomer(group, shape, deadline_s, i) if r == 0 else None
                start = time.perf_counter_ns()
                buf.admit([victim], timeout_s=60.0)
                out["admit_ns"] = time.perf_counter_ns() - start
            start = time.perf_counter_ns()
            dispatch_combine(buf, xs[r], idxs[r], ws[r])
            end = time.perf_counter_ns()
            if i == LOSS_AT:
                out["lost_end_ns"] = end
            elif i == LOSS_AT - 1:
                out["steady_ns"] = end - start
            elif fault == "rejoin" and i == LOSS_AT + 2:
                out["rejoined_ns"] = end - start
    if fault == "stop" and r == 0:
        os.kill(group.peers[victim].pid, signal.SIGCONT)
    if fault == "rejoin" and newcomer is not None:
        newcomer.wait(120)
    return out


def _start_newcomer(group: Any, shape: Shape, deadline_s: float,
                    call: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "benchmarks.bench_elastic", "--join", group.rendezvous,
            str(group.num_ranks - 1), str(group.num_ranks), str(deadline_s),
            json.dumps(shape.__dict__), str(call)]
    return subprocess.Popen(argv, cwd=REPO_ROOT)


def _join(rendezvous: str, rank: int, num_ranks: int, deadline_s: float, shape: Shape,
          call: int) -> None:
    """The newcomer: rejoin as ``rank`` and make the calls from ``call`` on with the others."""
    with Buffer.rejoin(rendezvous, rank, shape.config(num_ranks, deadline_s, "mask"),
                       timeout_s=60.0) as buf:
        for i in range(call, LOSS_AT + 3):
            xs, idxs, ws = shape.inputs(num_ranks, i)
            dispatch_combine(buf, xs[rank], idxs[rank], ws[rank])


def _loss_run(shape: Shape, deadline_s: float, fault: str, tmp: str) -> dict[str, float] | None:
    """One run; None when a healthy rank was masked before the fault (a call of it took longer
    than the deadline: what a short deadline risks on a loaded host)."""
    stamp = os.path.join(tmp, f"stamp.{os.getpid()}.{time.monotonic_ns()}")
    results = launch(_lose, 3, shape, deadline_s, fault, stamp, timeout_s=300,
                     keep_survivors=True)
    survivors = results[:2]
    if not os.path.exists(stamp) or not all(isinstance(s, dict) for s in survivors):
        return None
    killed = int(Path(stamp).read_text())
    os.unlink(stamp)
    row = {"recovery_us": (max(s["lost_end_ns"] for s in survivors) - killed) / 1e3,
           "steady_us": max(s["steady_ns"] for s in survivors) / 1e3}
    if fault == "rejoin":
        row["admit_us"] = max(s["admit_ns"] for s in survivors) / 1e3
        row["rejoined_us"] = max(s["rejoined_ns"] for s in survivors) / 1e3
    return row


def _runs(shape: Shape, deadline_s: float, fault: str, tmp: str,
          repeats: int) -> tuple[list[dict[str, float]], int]:
    """``repeats`` good runs (at most 3 * repeats tries) and how many runs masked a healthy
    rank instead."""
    rows: list[dict[str, float]] = []
    spurious = 0
    for _ in range(3 * repeats):
        row = _loss_run(shape, deadline_s, fault, tmp)
        if row is None:
            spurious += 1
        else:
            rows.append(row)
        if len(rows) == repeats:
            break
    return rows, spurious


def _stats(rows: list[dict[str, float]], key: str) -> Stats:
    return Stats.from_samples_us([row[key] for row in rows])


def _fmt(s: Stats) -> str:
    return f"{s.min_us:10.1f} {s.median_us:10.1f} {s.max_us:10.1f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="repeats of each loss / rejoin")
    ap.add_argument("--steady-repeats", type=int, default=60)
    ap.add_argument("--out", default=None, help="write bench_elastic.{txt,json} here")
    ap.add_argument("--join", nargs=6, metavar="ARG", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.join:
        rdv, rank, n, deadline, shape_json, call = args.join
        _join(rdv, int(rank), int(n), float(deadline), Shape(**json.loads(shape_json)),
              int(call))
        return
    shape = Shape()
    lines = [f"shape: {shape}; byte formula: dispatch = T * K * H * 2 = {shape.dispatch_bytes} B"
             " per rank; floor: one copy of that by each rank at once; expert map: "
             f"{shape.experts_per_rank - REPLICATED} logical experts per rank, {REPLICATED} of "
             "each with a replica on the next rank", "",
             "1. steady state, 2 ranks (us per dispatch + combine)",
             f"{'':14s} {'min':>10s} {'median':>10s} {'max':>10s}  ratio to plain  to floor"]
    per_rank = launch(_steady, 2, shape, args.steady_repeats, 4, timeout_s=600)
    steady = {name: _slowest(per_rank, name) for name in STEADY}
    plain = steady["plain"]
    floor = concurrent_copy(2, [shape.dispatch_bytes], repeats=args.steady_repeats)[0]
    result: dict[str, Any] = {"shape": shape.__dict__, "replicated_per_rank": REPLICATED,
                              "steady": {name: s.__dict__ for name, s in steady.items()}
                              | {"floor": floor.__dict__}}
    names = {"plain": "plain Buffer", "mask": "masking Buffer", "map": "expert map",
             "mask+map": "masking + map"}
    for name, s in [*((names[k], v) for k, v in steady.items()), ("memcpy floor", floor)]:
        lines.append(f"{name:14s} {_fmt(s)}  {s.median_us / plain.median_us:14.2f}"
                     f"  {s.median_us / floor.median_us:8.2f}")
    lines += ["", "2. loss, 3 ranks: victim's fault -> the survivors' call that saw it ends (us)",
              f"{'fault':6s} {'deadline':>8s} {'min':>10s} {'median':>10s} {'max':>10s}"
              "  x deadline  healthy rank masked (runs)"]
    tmp = os.environ.get("TMPDIR", "/tmp")
    result["loss"] = []
    for fault in ("kill", "stop"):
        for deadline in DEADLINES_S:
            rows, spurious = _runs(shape, deadline, fault, tmp, args.repeats)
            if not rows:
                lines.append(f"{fault:6s} {deadline:8.1f} {'every run masked a healthy rank':>32s}"
                             f"  {'':10s}  {spurious}")
                result["loss"].append({"fault": fault, "deadline_s": deadline,
                                       "spurious_runs": spurious})
                continue
            s = _stats(rows, "recovery_us")
            ratio = s.median_us / 1e6 / deadline
            lines.append(f"{fault:6s} {deadline:8.1f} {_fmt(s)}  {ratio:10.2f}  {spurious}")
            result["loss"].append({"fault": fault, "deadline_s": deadline, **s.__dict__,
                                   "spurious_runs": spurious})
    rows, _ = _runs(shape, 0.5, "rejoin", tmp, args.repeats)
    lines += ["", "3. rejoin, 3 ranks, deadline 0.5 s (us)",
              f"{'':26s} {'min':>10s} {'median':>10s} {'max':>10s}"]
    result["rejoin"] = {}
    for key, name in (("admit_us", "admit()"), ("rejoined_us", "first call after admit"),
                      ("steady_us", "a steady call (same run)")):
        s = _stats(rows, key)
        result["rejoin"][key] = s.__dict__
        lines.append(f"{name:26s} {_fmt(s)}")
    save_results(args.out, "bench_elastic", "\n".join(lines), result)


if __name__ == "__main__":
    main()
