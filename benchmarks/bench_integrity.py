"""Integrity: dispatch and combine with ``integrity="off"`` vs ``"checksum"``, beside the floor.

    python -m benchmarks.bench_integrity --quick                 # 1 MB only, few repeats
    python -m benchmarks.bench_integrity --out benchmarks/results   # 1 MB and 16 MB per rank

Cases: bench_growth's (BF16 rows of hidden 2048 at 1 MB, 7168 at 16 MB, top-8 of 64 experts,
seeded uniform routing, tokens per rank so one rank sends about the target), 2 ranks, both
layouts, the modes asp+sw, asp+tff and bsp+sw, each with integrity off and on: two Buffers
side by side in one launch, timed in alternation (``harness.round_repeats``: every round times
every Buffer), so a burst of outside load lands on both.

Bytes one rank sends = rows x hidden x 2 (bench_growth.bytes_per_rank); combine reduces the same
rows. What the checksum adds: the sender reads each row once more to sum it (8-byte words, four
Fletcher lanes, AVX2 where the CPU has it), every receiver reads each row it got once more to
check it, and every rank waits for every other rank's check before it returns.

Timing: barrier, each rank times its own call, an iteration's time is the maximum over ranks;
min / median / max over the repeats. Ratios: checksum / off (medians) and each / the floor
(``harness.concurrent_copy``: 2 processes each copying the same bytes at once, same run).
The checksum alone: one process summing the bytes of a size (``_native.row_sums``, rows of the
case's hidden) against the data plane's copy of the same bytes (``_native.copy``), GB/s.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import Any

import numpy as np

from benchmarks.bench_growth import Case, bytes_per_rank, cases_for, inputs
from benchmarks.harness import (
    Stats,
    concurrent_copy,
    format_table,
    measured,
    round_repeats,
    rounds_parser,
    save_results,
    time_collective,
    time_repeats,
)

SIZES = (1 << 20, 16 << 20)
MODES = (("asp", "sw"), ("asp", "tff"), ("bsp", "sw"))
INTEGRITY = ("off", "checksum")
OPS = ("dispatch", "combine")
RANKS = 2


class _Running:
    """One Buffer of a case with one integrity setting, its inputs and a dispatch handle."""

    def __init__(self, group: Any, case: Case, integrity: str) -> None:
        from ubep.buffer import Buffer, BufferConfig

        cfg = BufferConfig(
            max_tokens_per_rank=case.tokens, hidden=case.hidden, num_topk=8, num_experts=64,
            dtype="bf16", layout=case.layout, engine=case.engine, sync=case.sync,
            integrity=integrity)
        self.buf = Buffer(group, cfg)
        self.x, self.idx, self.w = inputs(case, group.rank)
        self.res = self.buf.dispatch(self.x, self.idx, self.w)
        self.eo = self.buf.get_combine_buffer(self.res.handle)
        vals = np.random.default_rng(group.rank).standard_normal(self.eo.shape, dtype=np.float32)
        self.eo[...] = (vals.view(np.uint32) >> np.uint32(16)).astype(np.uint16)

    def dispatch(self) -> None:
        self.buf.dispatch(self.x, self.idx, self.w)

    def combine(self) -> None:
        self.buf.combine(self.eo, self.res.handle)


def _rank_main(group: Any, cases: list[Case], warmup: int,
               per_round: list[int]) -> list[dict[str, list[float]]]:
    """Samples (us) per (case, integrity), in the order of ``_keys``; one case's two Buffers
    live together, timed in alternation round by round."""
    out: list[dict[str, list[float]]] = []
    for case in cases:
        runs = [_Running(group, case, integ) for integ in INTEGRITY]
        try:
            samples: list[dict[str, list[float]]] = [{op: [] for op in OPS} for _ in runs]
            for repeats in per_round:
                for run_, s in zip(runs, samples, strict=True):
                    for op in OPS:
                        ns = time_collective(group.barrier, getattr(run_, op), warmup, repeats)
                        s[op] += (ns / 1e3).tolist()
            out += samples
        finally:
            for run_ in runs:
                run_.buf.close()
    return out


def kernel_speed(nbytes: int, row_bytes: int, repeats: int) -> dict[str, Any]:
    """The row checksum over ``nbytes`` (rows of ``row_bytes``) beside a copy of them."""
    from ubep.runtime.abi import load_native

    native = load_native()
    rows = nbytes // row_bytes
    src = np.random.default_rng(1).integers(0, 256, rows * row_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    out: dict[str, Any] = {"bytes": int(src.size), "row_bytes": row_bytes}
    for name, fn in (("row_sums", lambda: native.row_sums(src, row_bytes)),
                     ("copy", lambda: native.copy(dst, src))):
        st = time_repeats(fn, repeats=repeats, warmup=3)
        out[name] = {**asdict(st), "gbps": src.size / st.median_us / 1e3}
    return out


def run(sizes: tuple[int, ...], warmup: int, repeats: int, rounds: int) -> dict[str, Any]:
    from ubep.runtime import launch

    per_round = round_repeats(repeats, rounds)
    cases = cases_for(sizes, RANKS, MODES)
    nbytes = [bytes_per_rank(c, RANKS) for c in cases]
    distinct = sorted({int(b) for b in nbytes})
    floor = dict(zip(distinct, concurrent_copy(RANKS, distinct, repeats=sum(per_round),
                                               warmup=warmup, rounds=len(per_round)),
                     strict=True))
    per_rank = launch(_rank_main, RANKS, cases, warmup, per_round, timeout_s=3600)
    rows = []
    for i, case in enumerate(cases):
        for j, integ in enumerate(INTEGRITY):
            row: dict[str, Any] = {"ranks": RANKS, **asdict(case), "mode": case.mode,
                                   "integrity": integ, "bytes_per_rank": nbytes[i],
                                   "floor": asdict(floor[int(nbytes[i])])}
            for op in OPS:
                worst = np.max(np.array([r[2 * i + j][op] for r in per_rank]), axis=0)
                row[op] = asdict(Stats.from_samples_us(worst.tolist()))
            rows.append(row)
    kernels = [kernel_speed(size, next(c.hidden for c in cases if c.target_bytes == size) * 2,
                            repeats) for size in sizes]
    return {"rows": rows, "kernels": kernels}


def report(result: dict[str, Any]) -> str:
    lines = []
    by_key = {(r["target_bytes"], r["layout"], r["mode"], r["integrity"]): r
              for r in result["rows"]}
    table = []
    for (size, layout, mode, integ), r in by_key.items():
        off = by_key[(size, layout, mode, "off")]
        cells: list[object] = [f"{size >> 20} MB", layout, mode, integ,
                               f"{r['bytes_per_rank'] / 2**20:.2f}"]
        for op in OPS:
            st = r[op]
            cells += [st["min_us"], st["median_us"], st["max_us"],
                      st["median_us"] / off[op]["median_us"],
                      st["median_us"] / r["floor"]["median_us"]]
        cells.append(r["floor"]["median_us"])
        table.append(cells)
    cols = ["target", "layout", "mode", "integrity", "MB/rank"]
    for op in OPS:
        cols += [f"{op[0]}_min_us", f"{op[0]}_med_us", f"{op[0]}_max_us", f"{op[0]}/off",
                 f"{op[0]}/floor"]
    cols.append("floor_us")
    lines.append(format_table(cols, table))
    # the median over the cases of each size of the checksum's ratio to off
    for size in sorted({k[0] for k in by_key}):
        for op in OPS:
            ratios = [by_key[k][op]["median_us"] / by_key[(*k[:3], "off")][op]["median_us"]
                      for k in by_key if k[0] == size and k[3] == "checksum"]
            lines.append(f"{size >> 20} MB {op}: checksum/off median over cases "
                         f"{float(np.median(ratios)):.3f} (range {min(ratios):.3f}.."
                         f"{max(ratios):.3f})")
    for k in result.get("kernels", []):
        lines.append(f"checksum alone, {k['bytes'] / 2**20:.1f} MB in rows of {k['row_bytes']} B: "
                     f"row_sums {k['row_sums']['median_us']:.0f} us ({k['row_sums']['gbps']:.1f} "
                     f"GB/s), copy {k['copy']['median_us']:.0f} us ({k['copy']['gbps']:.1f} GB/s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = rounds_parser(__doc__ or "", "1 MB only, 10 repeats", "integrity", 40).parse_args(argv)
    sizes = SIZES[:1] if args.quick else SIZES
    repeats = 10 if args.quick else args.repeats
    result, machine = measured(lambda: run(sizes, args.warmup, repeats, args.rounds))
    head = (f"# python -m benchmarks.bench_integrity{' --quick' if args.quick else ''}; "
            f"{RANKS} ranks, {repeats} repeats in {args.rounds} rounds, {machine}")
    save_results(args.out, "integrity", head + "\n" + report(result), result)
    return 0

if __name__ == "__main__":
    sys.exit(main())
