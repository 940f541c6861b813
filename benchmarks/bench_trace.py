"""The cost of task spans: the same calls with tracing off and on, alternated call by call.

    python -m benchmarks.bench_trace                 # 2 ranks, decode and prefill shapes
    python -m benchmarks.bench_trace --repeats 300 --out benchmarks/results

Every rank holds two Buffers of one config, one with ``trace=False`` and one with
``trace=True``, and times a dispatch and its combine on each in turn (a barrier before every
call), so a slow spell of the host hits both alike. Per case and op: min / median / max over
repeats of the slowest rank's call, ``on/off`` the ratio of the medians (and of the minima),
and the spans one call recorded per rank. Bytes a rank sends per dispatch:
``tokens * topk * hidden * 2`` (BF16, expert layout: one row per pick); the memcpy floor is
one process copying that many bytes (``np.copyto``), min over 50.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.harness import Stats, collective_spans, format_table, save_results
from ubep.buffer import Buffer, BufferConfig
from ubep.runtime import launch
from ubep.tools.trace_run import RunCase, topk_of
from ubep.trace import spans_of

ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    hidden: int
    num_experts: int
    num_topk: int
    engine: str

    def run_case(self) -> RunCase:
        return RunCase(num_ranks=2, num_tokens=self.tokens, hidden=self.hidden,
                       num_experts=self.num_experts, num_topk=self.num_topk, routing="uniform",
                       engine=self.engine, sync="auto", num_cores=1)

    @property
    def bytes_per_rank(self) -> int:
        return self.tokens * self.num_topk * self.hidden * 2


CASES = [Case(n, t, h, e, k, eng) for n, t, h, e, k in (("qwen3-30b decode", 16, 2048, 128, 8),
                                                        ("dsv3 prefill", 128, 7168, 256, 8))
         for eng in ("asp", "bsp")]


def _config(case: Case, trace: bool) -> BufferConfig:
    engine: Any = case.engine
    return BufferConfig(max_tokens_per_rank=case.tokens, hidden=case.hidden,
                        num_topk=case.num_topk, num_experts=case.num_experts, dtype="bf16",
                        engine=engine, num_cores=1, trace=trace)


def _rank(group: Any, cases: list[Case], warmup: int, repeats: int) -> list[dict[str, Any]]:
    return [_case(group, case, warmup, repeats) for case in cases]


def _case(group: Any, case: Case, warmup: int, repeats: int) -> dict[str, Any]:
    from ubep.testing import payload

    rng = np.random.default_rng([1, group.rank])
    x = payload(rng, "bf16", case.tokens, case.hidden)
    idx = topk_of(case.run_case(), group.rank)
    w = rng.random((case.tokens, case.num_topk), dtype=np.float32)
    held: dict[str, Any] = {}

    def dispatch(buf: Any) -> None:
        held["res"] = buf.dispatch(x, idx, w)

    def combine(buf: Any) -> None:
        res = held["res"]
        buf.combine(res.recv_x, res.handle)

    samples: dict[tuple[str, str], list[int]] = {}
    spans_per_call = 0
    with Buffer(group, _config(case, False)) as off, Buffer(group, _config(case, True)) as on:
        for i in range(warmup + repeats):
            order = (("off", off), ("on", on)) if i % 2 else (("on", on), ("off", off))
            for label, buf in order:
                for op, fn in (("dispatch", dispatch), ("combine", combine)):
                    s, e = collective_spans(lambda: group.barrier(60.0),
                                            lambda fn=fn, buf=buf: fn(buf), 0, 1)[0]
                    if i >= warmup:
                        samples.setdefault((label, op), []).append(int(e - s))
            if i == warmup:
                spans_of(on)  # empty the rings: one call's worth next
            if i == warmup + 1:
                spans_per_call = len(spans_of(on).spans)
    return {"samples": samples, "spans": spans_per_call}


def _memcpy_us(size: int) -> float:
    src, dst = np.ones(size, np.uint8), np.empty(size, np.uint8)
    best = float("inf")
    for _ in range(50):
        t0 = time.perf_counter_ns()
        np.copyto(dst, src)
        best = min(best, (time.perf_counter_ns() - t0) / 1e3)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=200, help="timed calls per case and build")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", default=None, help="write OUT.txt and OUT.json")
    args = ap.parse_args(argv)
    os.environ.update(ONE_THREAD)
    load_before = os.getloadavg()[0]
    per_rank = launch(_rank, 2, CASES, args.warmup, args.repeats, timeout_s=3600)
    head = ["case", "engine", "op", "bytes/rank", "off min/med/max us", "on min/med/max us",
            "on/off med", "on/off min", "spans/call", "off/memcpy min"]
    body, rows = [], []
    for i, case in enumerate(CASES):
        floor = _memcpy_us(case.bytes_per_rank)
        for op in ("dispatch", "combine"):
            st = {}
            for label in ("off", "on"):
                per_call = np.max([np.asarray(per_rank[r][i]["samples"][(label, op)])
                                   for r in range(2)], axis=0) / 1e3
                st[label] = Stats.from_samples_us(per_call.tolist())
            off, on = st["off"], st["on"]
            body.append([case.name, case.engine, op, case.bytes_per_rank,
                         f"{off.min_us:.1f}/{off.median_us:.1f}/{off.max_us:.1f}",
                         f"{on.min_us:.1f}/{on.median_us:.1f}/{on.max_us:.1f}",
                         f"{on.median_us / off.median_us:.3f}", f"{on.min_us / off.min_us:.3f}",
                         per_rank[0][i]["spans"] if op == "dispatch" else "",
                         f"{off.min_us / floor:.1f}"])
            rows.append({"case": case.name, "engine": case.engine, "op": op,
                         "bytes_per_rank": case.bytes_per_rank, "off": off.__dict__,
                         "on": on.__dict__, "memcpy_us": floor,
                         "spans_per_dispatch_and_combine": per_rank[0][i]["spans"]})
    text = (f"tracing off vs on, 2 ranks, 1 core each, BF16, expert layout, uniform routing, "
            f"{args.repeats} calls each after {args.warmup}, alternated; load average before "
            f"{load_before:.2f}, after {os.getloadavg()[0]:.2f}; slowest rank per call; spans/call"
            f": rank 0's spans of one dispatch and its combine\n" + format_table(head, body))
    save_results(args.out, "trace", text, {"rows": rows})


if __name__ == "__main__":
    main()
