"""``ubep sim ...``: experiments, calibration and single runs of the simulator."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..modes import ENGINES, LAYOUTS, POLICIES, SYNCS
from .experiments import ALIASES, EXPERIMENTS
from .fabric import FAMILIES, FITTED_FAMILIES
from .workload import ROUTINGS

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add ``sim`` and its subcommands to the ``ubep`` command line."""
    sim = subparsers.add_parser("sim", help="superpod simulator: paper experiments and what-ifs",
                                description="Time ubep's plans on modelled fabrics.")
    sub = sim.add_subparsers(dest="sim_command", required=True, metavar="SIM_COMMAND")
    for name, fn in EXPERIMENTS.items():
        aliases = [old for old, new in ALIASES.items() if new == name]
        p = sub.add_parser(name, aliases=aliases,
                           help=(fn.__doc__ or "").strip().splitlines()[0])
        _common(p)
        p.add_argument("--plot", metavar="PATH", help="write the figure as a PNG")
        p.add_argument("--json", metavar="PATH", help="write the results as JSON")
        p.set_defaults(func=_experiment, experiment=name)
    p = sub.add_parser("all", help="run every experiment and write DIR/report.md")
    _common(p)
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--no-plot", action="store_true", help="tables and JSON only")
    p.set_defaults(func=_all)
    p = sub.add_parser("calibrate", help="print the calibration residuals (optionally refit)")
    p.add_argument("--family", choices=FITTED_FAMILIES, default=None,
                   help="one fabric family (default: all)")
    p.add_argument("--refit", action="store_true",
                   help="rerun the least-squares fit (minutes) before printing")
    p.add_argument("--write", action="store_true", help="with --refit: save calib.json")
    p.set_defaults(func=_calibrate)
    p = sub.add_parser("run", help="simulate one dispatch/combine call and print its timeline")
    _common(p)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--cores", type=int, default=None, help="cores per rank (preset default)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--itemsize", type=int, default=1)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts-per-rank", type=int, default=1)
    p.add_argument("--routing", choices=ROUTINGS, default="uniform")
    p.add_argument("--engine", choices=ENGINES, default="asp")
    p.add_argument("--policy", choices=POLICIES, default="hierarchical")
    p.add_argument("--sync", choices=SYNCS, default="sp")
    p.add_argument("--layout", choices=LAYOUTS, default="expert")
    p.add_argument("--op", choices=("dispatch", "combine"), default="dispatch")
    p.add_argument("--mode", choices=("analytic", "events"), default="analytic")
    p.add_argument("--json", metavar="PATH", help="write the per-task spans as JSON")
    p.set_defaults(func=_run)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", choices=FAMILIES, default="cm384",
                   help="fabric preset (nvl576 is an extrapolation)")


def _experiment(args: argparse.Namespace) -> int:
    from .experiments import run_experiment

    result = run_experiment(args.experiment, args.family)
    print(result.table())
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=1) + "\n",
                                   encoding="utf-8")
    if args.plot:
        from .plots import plot

        plot(result, args.plot)
    return 0


def _all(args: argparse.Namespace) -> int:
    from .report import run_all

    report = run_all(args.out, family=args.family, plot=not args.no_plot,
                     progress=True)
    print(f"wrote {report}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    import tempfile

    from .calib import CALIB_PATH, calibrate, load_fabric, residuals

    if args.write and not args.refit:
        print("--write needs --refit", file=sys.stderr)
        return 2
    families = [args.family] if args.family else list(FITTED_FAMILIES)
    path = CALIB_PATH
    with tempfile.TemporaryDirectory() as tmp:
        if args.refit:
            path = CALIB_PATH if args.write else Path(tmp) / "calib.json"
            calibrate(path=path, progress=lambda msg: print(msg, file=sys.stderr))
        for family in families:
            fabric = load_fabric(family, path)
            print(f"# {family} ({path.name}): target, measured, model, relative error, role")
            for r in residuals(family, fabric):
                role = "fit" if r.fitted else "validation"
                print(f"{r.name:36s} {r.measured:9.3f} {r.model:9.3f} {r.unit:5s} "
                      f"{r.rel_error:+7.1%}  {role}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from .calib import load_fabric, topology_for
    from .workload import System, Workload, run_case

    fabric = load_fabric(args.family)
    topo = topology_for(args.family, args.ranks, args.cores)
    w = Workload(tokens_per_rank=args.tokens, hidden=args.hidden, itemsize=args.itemsize,
                 num_topk=args.topk, experts_per_rank=args.experts_per_rank,
                 routing=args.routing)
    cores: Any = "all" if args.engine == "bsp" else None
    system = System("cli", args.engine, args.policy, args.sync, layout=args.layout,
                    num_send_cores=cores, num_count_cores=cores)
    res = run_case(w, system, topo, fabric, op=args.op, mode=args.mode)
    print(f"{args.op} on {topo.name}: {res.latency_ns / 1e3:.2f} us ({args.engine}, "
          f"{args.policy}, {args.sync}, {args.mode}); slowest rank {res.slowest_rank}")
    for task, span in res.task_span_ns().items():
        print(f"  {task:8s} {span / 1e3:9.2f} us (first start to last end, slowest rank)")
    if args.json:
        tl = res.timeline
        payload = {"latency_us": res.latency_ns / 1e3, "spans": [
            {"rank": int(tl.rank[i]), "core": int(tl.core[i]), "task": s.task,
             "start_us": s.start_ns / 1e3, "end_us": s.end_ns / 1e3}
            for i, s in enumerate(tl.spans())]}
        Path(args.json).write_text(json.dumps(payload) + "\n", encoding="utf-8")
    return 0
