"""``ubep trace``: look at per-core task timelines.

    ubep trace plot t.json [more.json ...] -o t.png   per-core bars, one panel per trace
    ubep trace merge rank0.json rank1.json -o all.json   one file for Perfetto
"""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("trace", help="per-core task timelines: plot and merge trace files")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    plot = verbs.add_parser("plot", help="draw per-core bars of trace files (one panel a trace)")
    plot.add_argument("files", nargs="+", help="trace event JSON files ubep wrote")
    plot.add_argument("-o", "--out", required=True, help="PNG to write")
    plot.add_argument("--ranks", type=int, nargs="*", default=None, help="ranks to show")
    plot.set_defaults(func=_plot)
    merge = verbs.add_parser("merge", help="merge trace files (ranks, runs) into one")
    merge.add_argument("files", nargs="+")
    merge.add_argument("-o", "--out", required=True)
    merge.set_defaults(func=_merge)


def _plot(args: argparse.Namespace) -> int:
    from .chrome import load
    from .plot import plot_traces

    traces = [t for path in args.files for t in load(path)]
    print(plot_traces(traces, args.out, ranks=args.ranks))
    return 0


def _merge(args: argparse.Namespace) -> int:
    from .chrome import merge

    print(merge(args.files, args.out))
    return 0
