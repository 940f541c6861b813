"""The ``ubep`` command line.

Each subsystem owns its subcommands: a module listed in ``_COMMAND_MODULES`` defines
``register(subparsers)``, which adds its parser(s) with ``set_defaults(func=...)``; ``func``
takes the parsed namespace and returns an exit code. Modules are imported lazily so that, say,
``ubep sim`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from .errors import InvalidArgumentError

_COMMAND_MODULES = (
    "ubep.demo",
    "ubep.sim.cli",
    "ubep.doctor",
    "ubep.tools.trace_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ubep", description="Expert-parallel dispatch/combine: runtime, simulator, tools."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real missing dependency inside the module: surface it
                raise
            continue
        register: Callable[[argparse._SubParsersAction], None] = module.register
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return int(func(args) or 0)
    except InvalidArgumentError as exc:  # a bad option value: one line and status 2, as argparse
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
