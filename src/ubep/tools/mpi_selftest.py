"""``python -m ubep.tools.mpi_selftest``: check ubep on an MPI job against ``ubep.reference``.

Run it the way the application will run (same hosts, same ``mpiexec`` options)::

    mpiexec -n 4 python -m ubep.tools.mpi_selftest               # every engine x sync x layout
    mpiexec -n 4 python -m ubep.tools.mpi_selftest --modes asp:dc:expert:bf16 --json out.json

Every rank builds the inputs of all ranks from one seed, runs ``dispatch`` and ``combine`` on a
:class:`ubep.Buffer` over :func:`ubep.mpi.init`, and compares its own results with the
single-process reference bit for bit (every field of the dispatch result and the combined
output). Steps per mode: uniform routing with masked slots, hot-expert routing, a rank with no
tokens, and a zero-copy combine. ``--faults`` adds a bad call (an expert id out of range on the
last rank) that must fail on every rank and leave the Buffer usable. Exit status 0 when every
rank passed; ``--json`` writes the per-rank findings (rank 0 writes the file).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from ..buffer import Buffer
from ..config import BufferConfig
from ..errors import InvalidArgumentError, RemoteError, UbepError
from ..modes import SYNCS, DTypeName, Mode, enumerate_modes
from ..testing import check_call, inputs

__all__ = ["Mode", "all_modes", "check_mode", "main"]

# dtypes in turn, floats and 1-byte types alternating, so every sync sees both kinds
_DTYPE_TURNS: tuple[DTypeName, ...] = ("bf16", "uint8", "fp32", "int8", "fp16")


def all_modes(sp: bool = True) -> list[Mode]:
    """Every engine x sync x layout (``sp=False``: without SP, which cannot run across hosts),
    one dtype each (:func:`ubep.modes.enumerate_modes` with ``rotate_dtypes``)."""
    syncs = SYNCS if sp else tuple(s for s in SYNCS if s != "sp")
    return enumerate_modes(syncs=syncs, dtypes=_DTYPE_TURNS, rotate_dtypes=True)


def check_mode(group: Any, mode: Mode, *, max_tokens: int = 24, hidden: int = 256,
               num_topk: int = 4, seed: int = 1, faults: bool = False,
               timeout_s: float = 60.0) -> list[str]:
    """Run the steps of one mode on ``group``; return this rank's mismatches (empty = pass)."""
    R, r = group.num_ranks, group.rank
    cfg = BufferConfig(
        max_tokens_per_rank=max_tokens, hidden=hidden, num_topk=num_topk, num_experts=4 * R,
        dtype=mode.dtype, layout=mode.layout, engine=mode.engine, sync=mode.sync,
        timeout_s=timeout_s,
    )
    full = [max_tokens] * R
    steps: list[tuple[list[int], str, bool]] = [
        (full, "uniform", False),
        ([max_tokens // 2 + q for q in range(R)], "hot", False),
        ([0 if q == R - 1 else max_tokens - q for q in range(R)], "uniform", True),
    ]
    errors: list[str] = []
    with Buffer(group, cfg) as buf:
        for i, (tokens, kind, zero_copy) in enumerate(steps):
            s = seed * 100 + i
            xs, idxs, ws = inputs(mode.dtype, cfg.num_experts, num_topk, hidden, tokens, s, kind)
            errors += [f"{mode} step {i}: {e}"
                       for e in check_call(buf, xs, idxs, ws, s, zero_copy=zero_copy)]
            if faults and i == 0:
                errors += _bad_call(buf, xs[r], idxs[r], ws[r], r, R, cfg.num_experts)
    return errors


def _bad_call(buf: Buffer, x: np.ndarray, idx: np.ndarray, w: np.ndarray, r: int, R: int,
              num_experts: int) -> list[str]:
    bad = idx.copy()
    if r == R - 1 and bad.size:
        bad[0, 0] = num_experts + 3
    try:
        buf.dispatch(x, bad, w)
        outcome = "ok"
    except InvalidArgumentError as exc:
        outcome = f"InvalidArgumentError:{exc.argument}"
    except RemoteError:
        outcome = "RemoteError"  # names whichever failed rank's notice it saw first
    want = "InvalidArgumentError:topk_idx" if r == R - 1 else "RemoteError"
    return [] if outcome == want else [f"bad call: got {outcome}, expected {want}"]


def main(argv: list[str] | None = None) -> int:
    from ..mpi import init

    parser = argparse.ArgumentParser(prog="python -m ubep.tools.mpi_selftest",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="all",
                        help="comma-separated engine:sync:layout:dtype, or 'all' (default)")
    parser.add_argument("--tokens", type=int, default=24, help="max tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", action="store_true", help="add a rejected call per mode")
    parser.add_argument("--ranks-per-host", type=int, default=None)
    parser.add_argument("--json", default=None, help="write per-rank findings here (rank 0)")
    args = parser.parse_args(argv)
    group = init(ranks_per_host=args.ranks_per_host)
    remote = group.num_hosts > 1
    if args.modes == "all":
        modes = all_modes(sp=not remote)
    else:
        modes = [Mode.parse(m) for m in args.modes.split(",")]
    findings: dict[str, Any] = {"modes": [], "errors": [], "seconds": 0.0,
                                "hosts": group.num_hosts, "ranks_per_host": group.ranks_per_host}
    t0 = time.monotonic()
    for mode in modes:
        try:
            errs = check_mode(group, mode, max_tokens=args.tokens, hidden=args.hidden,
                              seed=args.seed, faults=args.faults)
        except UbepError as exc:
            errs = [f"{mode}: {type(exc).__name__}: {exc}"]
        findings["modes"].append(str(mode))
        findings["errors"] += errs
    findings["seconds"] = time.monotonic() - t0
    every = group.allgather(findings)
    if group.rank == 0:
        status = "PASS" if not any(f["errors"] for f in every) else "FAIL"
        print(f"ubep.tools.mpi_selftest: {status}: {len(modes)} modes on {group.num_ranks} ranks "
              f"({group.num_hosts} host(s) x {group.ranks_per_host}), "
              f"{max(f['seconds'] for f in every):.1f} s", flush=True)
        for r, f in enumerate(every):
            for e in f["errors"]:
                print(f"  rank {r}: {e}", flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(every, fh, indent=1)
    ok = not any(f["errors"] for f in every)
    group.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
