"""CLI commands whose logic is a benchmark of the source tree's ``benchmarks/`` (today:
``ubep decode``, benchmarks/torch_decode.py).

Benchmarks are not part of the installed package: in a source checkout (the editable install
``make venv`` makes) the command is the benchmark's own parser; elsewhere it is listed, and
running it says where the benchmark lives.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["register"]

# src/ubep/benchmarks_cli.py -> the checkout's root, which holds benchmarks/
_ROOT = Path(__file__).resolve().parents[2]


def _benchmark(name: str) -> ModuleType | None:
    """``benchmarks.<name>`` of the source checkout this ubep was installed from, if any."""
    if not (_ROOT / "benchmarks" / f"{name}.py").is_file():
        return None
    if str(_ROOT) not in sys.path:
        sys.path.append(str(_ROOT))
    return importlib.import_module(f"benchmarks.{name}")


def register(subparsers: Any) -> None:
    """Add ``ubep decode``."""
    decode = _benchmark("torch_decode")
    if decode is not None:
        decode.register(subparsers)
        return
    p = subparsers.add_parser(
        "decode", help="decode TPOT of a Qwen3-MoE-shaped model on 2 ranks: ubep vs gloo "
                       "(benchmarks/torch_decode.py of a source checkout)")
    p.set_defaults(func=_no_checkout)


def _no_checkout(args: argparse.Namespace) -> int:
    print(f"ubep decode runs benchmarks/torch_decode.py of ubep's source tree, which is not "
          f"next to this installation ({_ROOT}): run it from a checkout (make venv)",
          file=sys.stderr)
    return 2
