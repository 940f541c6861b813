"""Soak: thousands of dispatch/combine calls with random shapes, skews and modes, every one
checked bit for bit against ``ubep.reference``.

    python -m benchmarks.soak                      # 10,000 iterations (2, 3 and 4 ranks)
    python -m benchmarks.soak --quick              # 500 iterations, < 60 s on 2 cores
    python -m benchmarks.soak --iterations 2000 --seed 7 --ranks 2,3

The run is a list of *blocks*, all drawn from ``--seed``: one Buffer per block (engine x sync x
layout x dtype, hidden, top-k, experts, max tokens per rank, cores per rank, zero-copy
combine or not), then a series of calls on it, each with its own tokens per rank (0 to the
maximum, sometimes 0 on a rank), routing (uniform with masked slots, Zipf, hot experts, every
token to one expert) and payload seed. Consecutive calls on one Buffer are the point: reused
receive regions, epochs, parity slots and SP resets are what a long run exercises.

Every rank rebuilds all ranks' inputs from the seed, runs the call and compares its own result
with the reference (every dispatch field and the combined output, bit for bit: a NaN result is
the canonical quiet NaN on both sides, ``ubep.dtypes.CANONICAL_NAN``); a progress bar runs on
rank 0. The exit status is 0 only if every call matched. ``--json`` writes the findings.

``--faults`` runs the fault soak instead (benchmarks/soak/faults.py): random faults between and
during checked calls, and no wrong answer.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.soak.calls import run_soak
from benchmarks.soak.faults import FAULT_KINDS, FaultSettings, format_fault_summary, run_fault_soak

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=None,
                        help="calls (--faults: dispatch+combine pairs); default 10,000 (2,000)")
    parser.add_argument("--quick", action="store_true", help="500 iterations (--faults: 200)")
    parser.add_argument("--ranks", default=None,
                        help="rank counts, comma-separated (default 2,3,4; --faults: 3,2)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", action="store_true", help="inject faults (see above)")
    parser.add_argument("--fault-rate", type=float, default=FaultSettings.rate)
    parser.add_argument("--fault-timeout-s", type=float, default=FaultSettings.timeout_s,
                        help="the Buffers' timeout_s in the fault soak")
    parser.add_argument("--fault-kinds", default=",".join(FAULT_KINDS),
                        help="the fault kinds to inject, comma-separated")
    parser.add_argument("--json", default=None, help="write the findings here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.faults:
        return _main_faults(args)
    iterations = 500 if args.quick else args.iterations or 10_000
    ranks = [int(v) for v in (args.ranks or "2,3,4").split(",")]
    result = run_soak(iterations, ranks, args.seed, progress=not args.no_progress)
    for num_ranks, found in result["ranks"].items():
        bad = sum(f["num_errors"] for f in found)
        print(f"{num_ranks} ranks: {found[0]['calls']} calls in {result['blocks'][num_ranks]} "
              f"buffers, {result['seconds'][num_ranks]:.1f} s, mismatches: {bad}")
        for f in found:
            for e in f["errors"][:10]:
                print(f"  rank {f['rank']}: {e}")
    print("soak:", "PASS" if result["ok"] else "FAIL", f"({result['calls']} calls, seed "
          f"{args.seed})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result | {"settings": vars(args)}, fh, indent=1, default=str)
    return 0 if result["ok"] else 1


def _main_faults(args: argparse.Namespace) -> int:
    iterations = 200 if args.quick else args.iterations or 2_000
    ranks = [int(v) for v in (args.ranks or "3,2").split(",")]
    kinds = tuple(args.fault_kinds.split(","))
    unknown = set(kinds) - set(FAULT_KINDS)
    if unknown:
        parser_error = f"--fault-kinds: unknown {sorted(unknown)} (known: {FAULT_KINDS})"
        print(parser_error, file=sys.stderr)
        return 2
    settings = FaultSettings(seed=args.seed, timeout_s=args.fault_timeout_s,
                             rate=args.fault_rate, kinds=kinds)
    result = run_fault_soak(iterations, ranks, settings, progress=not args.no_progress)
    print(format_fault_summary(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result | {"argv": vars(args)}, fh, indent=1, default=str)
    return 0 if result["ok"] else 1

