"""``ubep trace``: look at per-core task timelines.

    ubep trace run --ranks 4 --tokens 128 --hidden 7168 --routing zipf --engine asp \
        --sync tff -o t.json                        one measured call on this host
    ubep trace plot t.json [more.json ...] -o t.png   per-core bars, one panel per trace
    ubep trace merge rank0.json rank1.json -o all.json   one file for Perfetto
"""

from __future__ import annotations

import argparse

from ..errors import InvalidArgumentError

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("trace", help="per-core task timelines: record, plot, merge")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    run = verbs.add_parser("run", help="trace one measured dispatch (and combine) on this host")
    run.add_argument("--ranks", type=int, default=4)
    run.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    run.add_argument("--hidden", type=int, default=7168)
    run.add_argument("--experts", type=int, default=64)
    run.add_argument("--topk", type=int, default=8)
    run.add_argument("--routing", choices=("uniform", "zipf", "hot"), default="zipf")
    run.add_argument("--engine", choices=("asp", "bsp"), default="asp")
    run.add_argument("--sync", choices=("sw", "tff", "dc", "sp"), default="tff")
    run.add_argument("--layout", choices=("expert", "rank"), default="expert")
    run.add_argument("--cores", type=int, default=None,
                     help="cores per rank (default: the host's; with --predicted at least 2, "
                          "the simulator's ASP model's send and count core, for both runs)")
    run.add_argument("--iters", type=int, default=1, help="traced calls after the warm-up")
    run.add_argument("--no-combine", action="store_true", help="dispatch only")
    run.add_argument("-o", "--out", required=True, help="trace event JSON to write")
    run.add_argument("--predicted", default=None, metavar="PATH",
                     help="also write the simulator's trace of the same Plans (CM384 fabric)")
    run.set_defaults(func=_run)
    plot = verbs.add_parser("plot", help="draw per-core bars of trace files (one panel a trace)")
    plot.add_argument("files", nargs="+", help="trace event JSON files ubep wrote")
    plot.add_argument("-o", "--out", required=True, help="PNG to write")
    plot.add_argument("--ranks", type=int, nargs="*", default=None, help="ranks to show")
    plot.set_defaults(func=_plot)
    merge = verbs.add_parser("merge", help="merge trace files (ranks, runs) into one")
    merge.add_argument("files", nargs="+")
    merge.add_argument("-o", "--out", required=True)
    merge.set_defaults(func=_merge)


def _run(args: argparse.Namespace) -> int:
    from .trace_run import RunCase, predict, run_traced

    case = RunCase(num_ranks=args.ranks, num_tokens=args.tokens, hidden=args.hidden,
                   num_experts=args.experts, num_topk=args.topk, routing=args.routing,
                   engine=args.engine, sync=args.sync, layout=args.layout,
                   num_cores=_cores(args), iters=args.iters, combine=not args.no_combine)
    # the prediction first: a case the simulator refuses (BSP with a sync mode other than SW)
    # is refused before any rank starts
    predicted = predict(case) if args.predicted else None
    print(run_traced(case, args.out))
    if predicted is not None:
        from ..trace.chrome import write

        print(write([predicted], args.predicted))
    return 0


def _cores(args: argparse.Namespace) -> int | None:
    """``--cores``, or with ``--predicted`` on a host whose share is one core a rank, the two
    the simulator's ASP model needs, measured and predicted alike (the same Plans)."""
    if not args.predicted or args.engine != "asp":
        return args.cores
    from ..sim.spec import ASP_MIN_CORES
    from ..topology import host

    if args.cores is None:
        return max(ASP_MIN_CORES, host(args.ranks).cores_per_rank)
    if args.cores < ASP_MIN_CORES:
        raise InvalidArgumentError("--cores", args.cores, f"--predicted times ASP on the "
                                   f"simulator, which needs at least {ASP_MIN_CORES} cores a "
                                   f"rank (a send and a count core)")
    return int(args.cores)


def _plot(args: argparse.Namespace) -> int:
    from ..trace.chrome import load
    from ..trace.plot import plot_traces

    traces = [t for path in args.files for t in load(path)]
    print(plot_traces(traces, args.out, ranks=args.ranks))
    return 0


def _merge(args: argparse.Namespace) -> int:
    from ..trace.chrome import merge

    print(merge(args.files, args.out))
    return 0
