"""Before/after guard: bench_growth's dispatch and combine (or a decode step, or the peers'
ubep rows), built from two git revisions.

    python -m benchmarks.compare_builds HEAD~1 HEAD                  # 3 alternations, 1 and 16 MB
    python -m benchmarks.compare_builds main mybranch --alternations 5 --repeats 20
    python -m benchmarks.compare_builds main mybranch --bench step   # bench_step --quick: decode
    python -m benchmarks.compare_builds main mybranch --bench peers  # peers --quick, ubep rows

Each revision is checked out into its own temporary ``git worktree`` and its C core is built in
place there (``python setup.py build_ext --inplace``, with this interpreter); no venv is made.
The runs then alternate A, B, B, A, A, B, ... (a slow spell of the host hits both revisions
alike), each one that checkout's ``python -m benchmarks.bench_growth`` at 2 ranks on the given
sizes, both layouts, its main modes, with ``PYTHONPATH`` at that checkout's ``src`` (ahead of
any installed ubep) and the checkout as working directory.

``--bench step`` runs ``python -m benchmarks.bench_step --quick`` instead (a decode step of
16 tokens, Qwen3-30B's shape, both engines and skews; per case the dispatch and combine span
and the whole step), ``--bench peers`` ``python -m benchmarks.peers --quick --systems ubep``
(every ubep row: engine x sync, per shape and op).

Per case (layout, mode, op, size; or the bench's own case) it prints each revision's min /
median / max over all its runs (the minimum of the runs' minima, the median of their medians,
the maximum of their maxima; bench_step's max is its p99) and ``B/A``, the ratio of the two
medians: above 1 means B is slower. A short guard, not a measurement to commit: on a 2-core
host a ratio within about 0.9-1.1 is noise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import format_table

__all__ = ["Build", "main"]

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SIZES = (1 << 20, 16 << 20)  # 1 MB and 16 MB per rank
OPS = ("dispatch", "combine")
BUILD_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Build:
    """One revision, checked out and built in place."""

    label: str  # "A" or "B"
    revision: str
    commit: str
    checkout: Path


def _size_label(size_bytes: int) -> str:
    """Bytes per rank as a case label: whole MB from 1 MB, KB below (256 KB is not "0 MB")."""
    if size_bytes >= 1 << 20 and size_bytes % (1 << 20) == 0:
        return f"{size_bytes >> 20} MB"
    return f"{size_bytes / 1024:g} KB"


@dataclass(frozen=True)
class CaseKey:
    layout: str
    mode: str
    op: str
    size: int


def _git(*args: str, cwd: Path = REPO_ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def _checkout(label: str, revision: str, root: Path) -> Build:
    """``git worktree add`` the revision (detached) under ``root``."""
    commit = _git("rev-parse", "--verify", f"{revision}^{{commit}}")
    checkout = root / label
    _git("worktree", "add", "--detach", str(checkout), commit)
    return Build(label, revision, commit, checkout)


def _compile(build: Build) -> None:
    """Build the checkout's C core in place, with this interpreter."""
    print(f"[compare] {build.label} = {build.revision} ({build.commit[:10]}): building in "
          f"{build.checkout}", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                          cwd=build.checkout, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{build.label}: build failed:\n{proc.stderr[-3000:]}")


def _remove(build: Build) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(build.checkout)], cwd=REPO_ROOT,
                   check=False, capture_output=True)


def _env(build: Build) -> dict[str, str]:
    env = dict(os.environ)
    # The checkout's src before the installed (editable) ubep; its repo root for `benchmarks`.
    env["PYTHONPATH"] = os.pathsep.join([str(build.checkout / "src"), str(build.checkout)])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _check_import(build: Build) -> None:
    """Fail early when the checkout's ubep is not the one a run would import."""
    got = subprocess.run([sys.executable, "-c", "import ubep; print(ubep.__file__)"],
                         cwd=build.checkout, env=_env(build), check=True, capture_output=True,
                         text=True).stdout.strip()
    if not Path(got).resolve().is_relative_to(build.checkout.resolve()):
        raise SystemExit(f"{build.label}: ubep imports from {got}, not from {build.checkout}")


def _run_growth(build: Build, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """One bench_growth run of ``build``; returns its rows."""
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "benchmarks.bench_growth", "--ranks", "2",
           "--sizes", ",".join(str(s) for s in args.sizes), "--repeats", str(args.repeats),
           "--rounds", "1", "--warmup", str(args.warmup), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=build.checkout, env=_env(build), capture_output=True,
                          text=True, timeout=args.timeout, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{build.label}: bench_growth exited {proc.returncode}:\n"
                         f"{proc.stderr[-3000:]}")
    rows: list[dict[str, Any]] = json.loads((out / "growth.json").read_text())["rows"]
    return rows


def _run_step(build: Build, args: argparse.Namespace, out: Path) -> list[tuple[tuple, dict]]:
    """One ``bench_step --quick`` run: per case, the dispatch and combine spans and the step."""
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "benchmarks.bench_step", "--quick", "--steps",
           str(args.steps), "--out", str(out)]
    _call(build, cmd, args)
    rows = json.loads((out / "step.json").read_text())["rows"]
    got = []
    for row in rows:
        c = row["case"]
        case = (c["model"], c["tokens"], c["routing"], c["skew"], c["engine"])
        for what in ("dispatch_span", "combine_span", "step"):
            sp = row[what]
            got.append(((*case, what), {"min_us": sp["min_us"], "median_us": sp["median_us"],
                                        "max_us": sp["p99_us"]}))
    return got


def _run_peers(build: Build, args: argparse.Namespace, out: Path) -> list[tuple[tuple, dict]]:
    """One ``peers --quick --systems ubep`` run: every ubep row."""
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "benchmarks.peers", "--quick", "--systems", "ubep",
           "--no-check", "--json", str(out / "peers.json")]
    _call(build, cmd, args)
    rows = json.loads((out / "peers.json").read_text())["rows"]
    return [((r["system"], r["layout"], r["ranks"], r["tokens_per_rank"], r["hidden"],
              r["payload"], r["op"]), {k: r[k] for k in ("min_us", "median_us", "max_us")})
            for r in rows if r["system"].startswith("ubep")]


def _call(build: Build, cmd: list[str], args: argparse.Namespace) -> None:
    proc = subprocess.run(cmd, cwd=build.checkout, env=_env(build), capture_output=True,
                          text=True, timeout=args.timeout, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{build.label}: {' '.join(cmd[1:4])} exited {proc.returncode}:\n"
                         f"{proc.stderr[-3000:]}")


# --bench -> (runner, the case columns)
BENCHES: dict[str, tuple[Any, list[str]]] = {
    "step": (_run_step, ["model", "tokens", "routing", "skew", "engine", "what"]),
    "peers": (_run_peers, ["system", "layout", "ranks", "tokens", "hidden", "payload", "op"]),
}


def case_table(builds: Sequence[Build], stats: Sequence[dict[tuple, list[dict[str, float]]]],
               columns: list[str]) -> str:
    """As :func:`table`, for a bench's own cases."""
    cells: list[list[object]] = []
    for key in sorted(set(stats[0]) & set(stats[1]), key=str):
        a, b = _summary(stats[0][key]), _summary(stats[1][key])
        cells.append([*key, *a, *b, b[1] / a[1]])
    cols = [*columns, "A_min_us", "A_med_us", "A_max_us", "B_min_us", "B_med_us", "B_max_us",
            "B/A"]
    head = "\n".join(f"{b.label} = {b.revision} ({b.commit[:10]})" for b in builds)
    return head + "\n" + format_table(cols, cells, float_digits=2)


def _order(alternations: int) -> list[int]:
    """Indices into (A, B): A B, B A, A B, ... so neither always runs first."""
    order: list[int] = []
    for i in range(alternations):
        order += [0, 1] if i % 2 == 0 else [1, 0]
    return order


def _collect(stats: dict[CaseKey, list[dict[str, float]]], rows: list[dict[str, Any]]) -> None:
    for row in rows:
        for op in OPS:
            key = CaseKey(row["layout"], row["mode"], op, int(row["target_bytes"]))
            stats.setdefault(key, []).append(row[op])


def _summary(runs: list[dict[str, float]]) -> tuple[float, float, float]:
    return (min(r["min_us"] for r in runs), statistics.median(r["median_us"] for r in runs),
            max(r["max_us"] for r in runs))


def table(builds: Sequence[Build], stats: Sequence[dict[CaseKey, list[dict[str, float]]]]) -> str:
    """The per-case table: each revision's min / median / max (us) and B/A of the medians."""
    cells: list[list[object]] = []
    for key in sorted(set(stats[0]) & set(stats[1]),
                      key=lambda k: (k.layout, k.mode, OPS.index(k.op), k.size)):
        a, b = _summary(stats[0][key]), _summary(stats[1][key])
        cells.append([key.layout, key.mode, key.op, _size_label(key.size), *a, *b, b[1] / a[1]])
    cols = ["layout", "mode", "op", "size", "A_min_us", "A_med_us", "A_max_us",
            "B_min_us", "B_med_us", "B_max_us", "B/A"]
    head = "\n".join(f"{b.label} = {b.revision} ({b.commit[:10]})" for b in builds)
    return head + "\n" + format_table(cols, cells, float_digits=2)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare_builds",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("rev_a", help="the baseline revision (A)")
    p.add_argument("rev_b", help="the revision compared with it (B)")
    p.add_argument("--alternations", type=int, default=3,
                   help="pairs of runs, alternating which revision goes first (default 3)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per case and run")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per case and run")
    p.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")],
                   default=list(DEFAULT_SIZES), help="bytes per rank, comma-separated")
    p.add_argument("--timeout", type=float, default=600.0, help="per bench_growth run, seconds")
    p.add_argument("--keep", action="store_true", help="leave the checkouts (printed) behind")
    p.add_argument("--bench", choices=("growth", *BENCHES), default="growth",
                   help="what each run measures (default growth: bench_growth)")
    p.add_argument("--steps", type=int, default=200, help="--bench step: timed steps per case")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="ubep-compare-"))
    builds: list[Build] = []
    try:
        for label, rev in (("A", args.rev_a), ("B", args.rev_b)):
            builds.append(_checkout(label, rev, root))  # listed first: removed if its build fails
            _compile(builds[-1])
            _check_import(builds[-1])
        if args.bench != "growth":
            runner, columns = BENCHES[args.bench]
            cases: list[dict[tuple, list[dict[str, float]]]] = [{}, {}]
            for n, i in enumerate(_order(args.alternations)):
                print(f"[compare] run {n + 1}: {builds[i].label}", file=sys.stderr, flush=True)
                for key, spread in runner(builds[i], args, root / f"run{n}"):
                    cases[i].setdefault(key, []).append(spread)
            print(case_table(builds, cases, columns))
            return 0
        stats: list[dict[CaseKey, list[dict[str, float]]]] = [{}, {}]
        for n, i in enumerate(_order(args.alternations)):
            print(f"[compare] run {n + 1}: {builds[i].label}", file=sys.stderr, flush=True)
            _collect(stats[i], _run_growth(builds[i], args, root / f"run{n}"))
        print(table(builds, stats))
    finally:
        if not args.keep:
            for build in builds:
                _remove(build)
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
