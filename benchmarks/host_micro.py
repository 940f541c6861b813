"""Microbenchmarks that give the simulator's host model its constants (docs/SIMULATOR.md, 6).

* row passes (benchmarks/host_micro.c, built here with the system C compiler): one memory pass
  of the runtime's algorithm per row, at the working-set size of a case, with as many
  processes as ranks running at once in writer/reader pairs, starting from cold caches (the
  matrix interleaves its cases, so each call finds its data evicted);
* the cross-process flag round trip (spin, then sched_yield), with as many processes as ranks;
* the per-call fixed cost of the Python layer and the native engine: a tiny call (1 token,
  hidden 64) of ``ubep.Buffer`` per engine, sync mode, layout and rank count, timed as
  bench_dispatch times every call.

None of these runs a case of bench_dispatch's matrix; bench_host_validation.py compares the
model built from them with that matrix.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(out_dir: str | None = None) -> Path:
    """Compile host_micro.c (-O3 -march=native) and return the binary's path."""
    out = Path(out_dir or tempfile.mkdtemp(prefix="ubep-host-micro-")) / "host_micro"
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    subprocess.run([*cc.split()[:1], "-O3", "-march=native", "-ffp-contract=off", "-std=gnu11",
                    "-o", str(out), str(HERE / "host_micro.c")], check=True)
    return out


@dataclass
class Micro:
    """Runs and caches microbenchmarks; every result is a median over ``rounds`` runs."""

    binary: Path
    millis: int = 60
    rounds: int = 3
    cache: dict[tuple[object, ...], tuple[float, float]] = field(default_factory=dict)

    def _run(self, args: list[str]) -> list[tuple[float, float]]:
        got = subprocess.run([str(self.binary), *args], check=True, capture_output=True,
                             text=True, timeout=120).stdout.split("\n")
        return [(float(a), float(b)) for a, b in (line.split() for line in got if line.strip())]

    def rows(self, procs: int, row_bytes: int, rows: int, writer: str, reader: str,
             terms: int = 1, footprint_mb: int = 0) -> tuple[float, float]:
        """Mean ns per row of one writer pass and one reader pass (median over rounds, mean
        over the processes). ``footprint_mb``: passes cycle through copies of their buffers
        spanning this many MB, so that they find their data evicted as often as a call of an
        interleaved benchmark does (0: one copy, warm)."""
        rows = max(1, int(rows))
        key = (procs, row_bytes, rows, writer, reader, terms, footprint_mb)
        if key not in self.cache:
            per = []
            for _ in range(self.rounds):
                got = self._run([writer, reader, str(row_bytes), str(rows), str(procs),
                                 str(self.millis), str(terms), str(footprint_mb)])
                per.append((statistics.mean(w for w, _ in got), statistics.mean(r for _, r in got)))
            self.cache[key] = (statistics.median(w for w, _ in per) / rows,
                               statistics.median(r for _, r in per) / rows)
        return self.cache[key]

    def flag_oneway_ns(self, procs: int) -> float:
        """Half the median flag round trip of ``procs`` processes ping-ponging in pairs."""
        key = ("flag", procs)
        if key not in self.cache:
            per = []
            for _ in range(self.rounds):
                got = self._run(["flag", "-", "8", "1", str(procs), str(self.millis * 2)])
                per.append(statistics.median(w for w, _ in got if w > 0))
            self.cache[key] = (statistics.median(per) / 2, 0.0)
        return self.cache[key][0]
