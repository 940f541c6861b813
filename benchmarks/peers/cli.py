"""``python -m benchmarks.peers``'s command line: settings and shapes from the arguments, the
run (benchmarks/peers/run.py), then the report (benchmarks/peers/report.py) on stdout and
optionally as JSON and a plot."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from benchmarks.harness import format_table
from benchmarks.peers.launch import Settings
from benchmarks.peers.report import (
    BYTE_FORMULA,
    EXCHANGE_OPS,
    LAYOUTS,
    OPS,
    PEER_SYSTEMS,
    TABLE_COLUMNS,
    exchange_report,
    floor_report,
    fp8_report,
    machine_info,
    table_rows,
    write_plot,
)
from benchmarks.peers.run import collect
from benchmarks.peers.workload import (
    HOT_SHARE,
    NUM_EXPERTS,
    NUM_TOPK,
    Shape,
    hot_ids,
    make_inputs,
)

__all__ = ["main", "parse_args"]

DESCRIPTION = (
    "ubep against the peers a user would pick instead, same routing, same tensors, one run."
)

QUIET_LOAD = 0.5  # 1-min load average under which the host counts as quiet


FULL_RUN_HELP = """\
the full run (committed results; quiet host, nothing else running):
  python -m benchmarks.peers --wait-quiet 600 --json benchmarks/results/peers.json \\
      --plot benchmarks/results/peers.png | tee benchmarks/results/peers.txt
  20 shapes (16 BF16/1-byte, 4 FP8) x 2 layouts, every ubep mode (FP8: also +q), 3 MPIs +
  gloo x torch/numpy local work (FP8: also torch+q), memcpy; 30 repeats in 3 rounds after 5
  warm-up each: expect about 30 minutes on this 2-core host (an estimate: the numpy-only full
  run of 16 shapes took 14.4 min; the torch rows, the combine exchange and the bit-exactness
  checks double the peers' share; the 4 FP8 shapes add about a quarter). The peer venvs
  (~4.3 GB with torch) are built first on a fresh checkout: ~8 minutes more.
reduced run (2 and 4 ranks, the default shapes, few repeats): add --repeats 6 --rounds 1
  --warmup 2 (17 min here under a load average of 6-12 before the FP8 shapes, which alone took
  4.7 min so; less on a quiet host)."""


def shapes_for(quick: bool) -> list[Shape]:
    if quick:
        return [Shape(r, 128, 2048, "bf16", "uniform") for r in (2, 4)]
    return [
        Shape(r, t, h, d, routing)
        for routing in ("uniform", "hot")
        for r in (2, 4)
        for t in (128, 512)
        for h, d in ((2048, "bf16"), (7168, "uint8"))
    ] + [
        # FP8 (BF16 x sent quantised): ~half of BF16's bytes; beside the 128-token BF16 shape
        # at 2048 (the fp8 report's ratio) and at DeepSeek's 7168.
        Shape(r, 128, h, "fp8", "uniform") for r in (2, 4) for h in (2048, 7168)
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.peers", description=DESCRIPTION,
        epilog=FULL_RUN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true",
                   help="2 shapes, rank layout, few repeats (~1-2 min)")
    p.add_argument("--json", type=Path, help="write the rows and machine info here")
    p.add_argument("--plot", type=Path, help="write a PNG of latency per system and shape")
    p.add_argument("--systems", default="all",
                   help="comma list of ubep,impi,openmpi,mpich,gloo,memcpy (default all)")
    p.add_argument("--repeats", type=int, help="timed iterations (default 15 quick, 30 full)")
    p.add_argument("--warmup", type=int, help="untimed iterations first (default 3 / 5)")
    p.add_argument("--rounds", type=int,
                   help="passes through all cases, repeats split among them, so that a burst of "
                        "outside load hits a slice of every case, not all of one (default 1 / 3)")
    p.add_argument("--ranks", default="", help="comma list of rank counts (default 2,4)")
    p.add_argument("--dtypes", default="",
                   help="comma list of the payload types to run, of bf16,uint8,fp8 (default all)")
    p.add_argument("--layouts", default="",
                   help="comma list of rank,expert (default both; --quick: rank)")
    p.add_argument("--timeout", type=float, default=0.0, help="per launch, seconds")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="first wait up to SECONDS for the 1-min load average to drop below 0.5")
    p.add_argument("--no-check", action="store_true",
                   help="skip the bit-exactness check of each peer variant against "
                        "ubep.reference that precedes its timing (~5 s per peer and rank count)")
    return p.parse_args(argv)


def _layouts(spec: str, quick: bool) -> tuple[str, ...]:
    if not spec:
        return ("rank",) if quick else LAYOUTS  # the floors are rank-layout ones
    chosen = tuple(s.strip() for s in spec.split(",") if s.strip())
    if not chosen or any(c not in LAYOUTS for c in chosen):
        raise SystemExit(f"--layouts: {spec!r}; choose from {LAYOUTS}")
    return chosen


def _selected(spec: str) -> list[str]:
    known = ["ubep", *PEER_SYSTEMS, "memcpy"]
    if spec == "all":
        return known
    chosen = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in chosen if s not in known]
    if bad:
        raise SystemExit(f"--systems: unknown {bad}; known: {known}")
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    settings = Settings(
        warmup=args.warmup if args.warmup is not None else (3 if args.quick else 5),
        repeats=args.repeats if args.repeats is not None else (15 if args.quick else 30),
        rounds=args.rounds if args.rounds is not None else (1 if args.quick else 3),
        timeout_s=args.timeout or (60.0 if args.quick else 900.0),
        layouts=_layouts(args.layouts, args.quick),
        check=not args.no_check,
    )
    deadline = time.monotonic() + args.wait_quiet
    while os.getloadavg()[0] >= QUIET_LOAD and time.monotonic() < deadline:
        time.sleep(5.0)
    load = os.getloadavg()[0]
    if load >= QUIET_LOAD:
        print(f"[peers] WARNING: load average {load:.2f} before the run: other processes compete "
              f"for the {os.cpu_count()} cores, expect noisy numbers", file=sys.stderr)
    shapes = shapes_for(args.quick)
    if args.ranks:
        wanted = {int(r) for r in args.ranks.split(",")}
        shapes = [s for s in shapes if s.num_ranks in wanted]
    if args.dtypes:
        kinds = {d.strip() for d in args.dtypes.split(",") if d.strip()}
        if not kinds or not kinds <= {"bf16", "uint8", "fp8"}:
            raise SystemExit(f"--dtypes: {args.dtypes!r}; choose from bf16, uint8, fp8")
        shapes = [s for s in shapes if s.dtype in kinds]
    inputs_list = [make_inputs(s) for s in shapes]
    checked: list[str] = []
    all_rows, versions, skipped = collect(_selected(args.systems), inputs_list, settings, checked)
    rows = [r for r in all_rows if r.op in OPS]
    exchange_rows = [r for r in all_rows if r.op in EXCHANGE_OPS.values()]

    print(BYTE_FORMULA)
    print(f"warmup {settings.warmup} per round, repeats {settings.repeats} in {settings.rounds} "
          f"round(s); top-{NUM_TOPK} of {NUM_EXPERTS} "
          f"experts; hot routing = {HOT_SHARE:.0%} of picks on experts {hot_ids().tolist()}; "
          f"{os.cpu_count()} cores (4 ranks oversubscribe them)")
    print(format_table(TABLE_COLUMNS, table_rows(rows), float_digits=2))
    for system, version in versions.items():
        print(f"{system}: {version}")
    for system, reason in skipped.items():
        print(f"{system}: NOT MEASURED: {reason}")
    if checked:
        print(f"bit for bit equal to ubep.reference before timing: {', '.join(checked)}")
    print(exchange_report(rows, exchange_rows))
    print(fp8_report(rows))
    print(floor_report(rows, shapes))
    from benchmarks.peers.sim import sim_report

    sim_text, sim_rows = sim_report(rows, inputs_list, NUM_EXPERTS)
    print(sim_text)
    if args.json:
        doc = {
            "machine": machine_info(versions, load),
            "settings": asdict(settings),
            "rows": [r.to_json() for r in rows],
            "payload_exchange": [r.to_json() for r in exchange_rows],
            "not_measured": skipped,
            "bit_exact_checked": checked,
            "simulator": sim_rows,
        }
        args.json.write_text(json.dumps(doc, indent=1))
    if args.plot:
        write_plot(rows, args.plot)
    print(f"total {time.monotonic() - t_start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
