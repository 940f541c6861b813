"""The ``ubep`` command line. Subcommands are registered by the modules that own them."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ubep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="schedule a skewed CM384-64 routing with every policy")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
