"""``ubep sim ...``: experiments, calibration and single runs of the simulator."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from ..modes import ENGINES, LAYOUTS, POLICIES, SYNCS
from .experiments import ALIASES, EXPERIMENTS
from .presets import FAMILIES, FITTED_FAMILIES
from .spec import ASP_MIN_CORES
from .syncs import SP
from .whatif import WHATIFS
from .workload import ROUTINGS

__all__ = ["register"]


def summary(doc: str | None) -> str:
    """A docstring's first paragraph on one line: a subcommand's whole first sentence, where
    its first line alone would stop mid-sentence."""
    return " ".join((doc or "").strip().split("\n\n", 1)[0].split())


def register(subparsers: Any) -> None:
    """Add ``sim`` and its subcommands to the ``ubep`` command line."""
    sim = subparsers.add_parser("sim", help="superpod simulator: paper experiments and what-ifs",
                                description="Time ubep's plans on modelled fabrics.")
    sub = sim.add_subparsers(dest="sim_command", required=True, metavar="SIM_COMMAND")
    for name, fn in {**EXPERIMENTS, **WHATIFS}.items():
        aliases = [old for old, new in ALIASES.items() if new == name]
        p = sub.add_parser(name, aliases=aliases,
                           help=summary(fn.__doc__))
        _common(p)
        p.add_argument("--plot", metavar="PATH", help="write the figure as a PNG")
        p.add_argument("--json", metavar="PATH", help="write the results as JSON")
        _trace_option(p)
        p.set_defaults(func=_experiment, experiment=name)
    p = sub.add_parser("all", help="run every experiment and write DIR/report.md")
    _common(p)
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--no-plot", action="store_true", help="tables and JSON only")
    p.add_argument("--no-fit", action="store_true",
                   help="first-principles values of the assumed constants, not the fitted ones")
    p.set_defaults(func=_all)
    p = sub.add_parser("calibrate", help="fit UBEP's assumed constants to the training set "
                       "(writes calib.json), print residuals and leave-one-out errors")
    p.add_argument("--family", choices=FITTED_FAMILIES, default=None,
                   help="baseline residuals of one fabric family (default: all)")
    for flag, text in _CALIBRATE_SWITCHES:
        p.add_argument(flag, action="store_true", help=text)
    p.add_argument("--loo-max-nfev", type=int, default=None,
                   help="residual evaluations of each leave-one-out refit (default 12; "
                        "quick: 4)")
    p.add_argument("--workers", type=int, default=2,
                   help="processes that evaluate the finite differences and the leave-one-out "
                        "refits (1: this process only)")
    p.add_argument("--max-nfev", type=int, default=12,
                   help="residual evaluations of the fit (default 12)")
    p.set_defaults(func=_calibrate)
    p = sub.add_parser("report", help="the fit: residuals, leave-one-out errors, moved "
                       "constants, and a predicted-vs-paper plot of the training points")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write DIR/fit.md and DIR/fit_training.png")
    p.set_defaults(func=_report)
    p = sub.add_parser("run", help="simulate one dispatch/combine call and print its timeline")
    _common(p)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--cores", type=int, default=None,
                   help="cores per rank (preset default; ASP: at least 2, a send and a count "
                        "core, where the preset's share of a small host is 1)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--itemsize", type=int, default=1)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts-per-rank", type=int, default=1)
    p.add_argument("--routing", choices=ROUTINGS, default="uniform")
    p.add_argument("--engine", choices=ENGINES, default="asp")
    p.add_argument("--policy", choices=POLICIES, default="hierarchical")
    p.add_argument("--sync", choices=SYNCS, default=SP)
    p.add_argument("--layout", choices=LAYOUTS, default="expert")
    p.add_argument("--op", choices=("dispatch", "combine"), default="dispatch")
    p.add_argument("--mode", choices=("analytic", "events"), default="analytic")
    p.add_argument("--expert-map", metavar="PATH", default=None,
                   help="redundant experts: a JSON list, logical expert -> its physical slots "
                        "(slots: ranks x experts-per-rank; topk picks logical experts)")
    p.add_argument("--masked-ranks", metavar="R,R,...", default="",
                   help="ranks out of service: they send nothing, their experts' picks go to "
                        "replicas")
    p.add_argument("--json", metavar="PATH", help="write the per-task spans as JSON")
    _trace_option(p)
    p.set_defaults(func=_run)


# ``ubep sim calibrate``'s on/off options
_CALIBRATE_SWITCHES = (
    ("--dry-run", "fit into a temporary copy; leave calib.json as it is"),
    ("--no-loo", "skip the leave-one-out refits"),
    ("--quick-loo", "leave-one-out as Gauss-Newton steps on the full fit's Jacobian instead of "
                    "a full refit per point (about a minute instead of ~10)"),
    ("--cold-loo", "start each leave-one-out refit from the first-principles values, as the "
                   "fit itself starts, not from the full fit"),
    ("--warm", "start from the fit stored in calib.json, not from the first-principles values"),
    ("--refit-baseline", "first rerun the baseline fit of every family's fabric constants from "
                         "their starting values (minutes)"),
)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", choices=FAMILIES, default="cm384",
                   help="fabric preset (nvl576 is an extrapolation)")


def _trace_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", metavar="PATH",
                   help="write the per-core timelines of the calls it timed (the first of each "
                        "system, at most 8) as a Chrome trace event file (Perfetto; ubep trace "
                        "plot)")


_TRACE_CALLS = 8  # calls a --trace file keeps: an experiment times hundreds
# a kept call of more units keeps one send and one receive span per core: a span and a flow per
# row of the larger calls (EP64 at 128 tokens, top-8, and up) would make a file of gigabytes
_TRACE_UNITS = 1 << 15


def _traced(args: argparse.Namespace, run: Any) -> Any:
    """``run()``, and with ``--trace`` the calls it timed written to ``args.trace``."""
    if not getattr(args, "trace", None):
        return run()
    from ..trace import from_sim, write
    from .workload import recording

    with recording() as calls:
        out = run()
    first: dict[str, Any] = {}
    for label, res in calls:
        if label not in first and len(first) < _TRACE_CALLS:
            first[label] = res
    small = {label: res.unit_end_ns.size <= _TRACE_UNITS for label, res in first.items()}
    path = write([from_sim(res, label, units=small[label]) for label, res in first.items()],
                 args.trace)
    large = len(small) - sum(small.values())
    print(f"wrote {path}: {len(first)} of the {len(calls)} calls timed (the first of each system)"
          + (f"; {large} of over {_TRACE_UNITS} units with a send and a receive span per core"
             if large else ""))
    return out


def _experiment(args: argparse.Namespace) -> int:
    from .experiments import run_experiment

    if args.experiment in WHATIFS:
        result = _traced(args, lambda: WHATIFS[args.experiment](args.family))
    else:
        result = _traced(args, lambda: run_experiment(args.experiment, args.family))
    print(result.table())
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=1) + "\n",
                                   encoding="utf-8")
    if args.plot:
        from .plots import plot

        plot(result, args.plot)
    return 0


def _all(args: argparse.Namespace) -> int:
    from .calib import use_fit
    from .report import run_all

    use_fit(not args.no_fit)
    report = run_all(args.out, family=args.family, plot=not args.no_plot,
                     progress=True)
    print(f"wrote {report}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    from .calib import CALIB_PATH, calibrate, load_fabric, residuals
    from .fit import calibrate as fit_assumed
    from .report import fit_markdown

    families = [args.family] if args.family else list(FITTED_FAMILIES)
    with tempfile.TemporaryDirectory() as tmp:
        path = CALIB_PATH
        if args.dry_run:
            path = Path(tmp) / "calib.json"
            shutil.copy(CALIB_PATH, path)
        if args.refit_baseline:
            calibrate(path=path, progress=lambda msg: print(msg, file=sys.stderr))
        fit_assumed(path, loo=not args.no_loo, max_nfev=args.max_nfev, warm=args.warm,
                    loo_refit=not args.quick_loo, loo_max_nfev=args.loo_max_nfev,
                    loo_cold=args.cold_loo, workers=args.workers,
                    progress=lambda msg: print(msg, file=sys.stderr))
        print(fit_markdown(path))
        for family in families:
            fabric = load_fabric(family, path)
            print(f"# {family} baseline rows ({path.name}): target, measured, model, error, role")
            for r in residuals(family, fabric):
                role = "fit" if r.fitted else "validation"
                print(f"{r.name:36s} {r.measured:9.3f} {r.model:9.3f} {r.unit:5s} "
                      f"{r.rel_error:+7.1%}  {role}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from .report import fit_markdown, plot_training

    text = fit_markdown()
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fit.md").write_text(text + "\n![training](fit_training.png)\n",
                                    encoding="utf-8")
        plot_training(out / "fit_training.png")
        print(f"wrote {out / 'fit.md'} and {out / 'fit_training.png'}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from .calib import load_fabric, topology_for
    from .workload import System, Workload, run_case

    fabric = load_fabric(args.family)
    topo = topology_for(args.family, args.ranks, args.cores)
    if args.engine == "asp" and topo.cores_per_rank < ASP_MIN_CORES:
        if args.cores is not None:
            raise InvalidArgumentError("--cores", args.cores, f"the ASP model needs a send and "
                                       f"a count core per rank: at least {ASP_MIN_CORES}")
        topo = topology_for(args.family, args.ranks, ASP_MIN_CORES)  # e.g. host, 64 ranks
    from ..expert_map import ExpertMap

    emap = None
    if args.expert_map:
        emap = ExpertMap(json.loads(Path(args.expert_map).read_text(encoding="utf-8")))
    masked = tuple(int(r) for r in args.masked_ranks.split(",") if r.strip())
    w = Workload(tokens_per_rank=args.tokens, hidden=args.hidden, itemsize=args.itemsize,
                 num_topk=args.topk, experts_per_rank=args.experts_per_rank,
                 routing=args.routing, expert_map=emap, masked_ranks=masked)
    cores: Any = "all" if args.engine == "bsp" else None
    system = System("cli", args.engine, args.policy, args.sync, layout=args.layout,
                    num_send_cores=cores, num_count_cores=cores)
    res = _traced(args, lambda: run_case(w, system, topo, fabric, op=args.op, mode=args.mode))
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
