"""Microbenchmarks that give the simulator's host model its constants (docs/SIMULATOR.md, 6).

* row passes (benchmarks/host_micro.c, built here with the system C compiler): one memory pass
  of the runtime's algorithm per row, at the working-set size of a case, with as many
  processes as ranks running at once in writer/reader pairs, alternating two copies of the
  buffers as the runtime alternates its two receive regions;
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
    cache: dict[tuple[object, ...], tuple[float, ...]] = field(default_factory=dict)

    def _run(self, args: list[str]) -> list[tuple[float, ...]]:
        got = subprocess.run([str(self.binary), *args], check=True, capture_output=True,
                             text=True, timeout=120).stdout.split("\n")
        return [tuple(float(v) for v in line.split()) for line in got if line.strip()]

    def rows(self, procs: int, row_bytes: int, rows: int, writer: str, reader: str,
             terms: int = 1, copies: int = 2) -> tuple[float, ...]:
        """``(writer / bulk, reader / bulk, bulk ns)``: the median over passes of each pass's
        time relative to a memcpy of the same bytes timed beside it (median over rounds and
        processes). Passes alternate between ``copies`` copies of their buffers: the runtime
        alternates two receive regions between calls, so a case's working set is two copies
        of its rows."""
        rows = max(1, int(rows))
        key = (procs, row_bytes, rows, writer, reader, terms, copies)
        if key not in self.cache:
            per = []
            for _ in range(self.rounds):
                got = self._run([writer, reader, str(row_bytes), str(rows), str(procs),
                                 str(self.millis), str(terms), str(copies)])
                per.append(tuple(statistics.median(g[i] for g in got) for i in range(4)))
            self.cache[key] = (statistics.median(p[0] for p in per) / 1e6,
                               statistics.median(p[1] for p in per) / 1e6,
                               statistics.median(p[2] for p in per),
                               statistics.median(p[3] for p in per) / 1e6)
        return self.cache[key]

    def scaled(self, procs: int, row_bytes: int, rows: int, writer: str, reader: str,
               terms: int, copy_ns_per_byte: float) -> tuple[float, float]:
        """ns per row of the writer and the reader pass: their cost relative to a memcpy of the
        working set (:meth:`rows`) times that memcpy as ``copy_ns_per_byte`` says it costs
        (bench_dispatch's memcpy floor, measured in the same run as the calls it is compared
        with, so under the same load, cache state and time-sharing)."""
        # A ratio holds only while its passes run uninterrupted: with more processes than CPUs
        # a multi-millisecond pass is cut by time slices, so the ratios are taken with one
        # process per CPU and the sharing is the separate oversubscription factor.
        cpus = os.cpu_count() or 1
        pairs = min(procs, max(2, cpus - cpus % 2))
        w, r = self.rows(pairs, row_bytes, rows, writer, reader, terms)[:2]
        bulk_ns = copy_ns_per_byte * max(1, int(rows)) * max(terms, 1) * row_bytes
        share = self.cpu_share(procs)
        return (w * bulk_ns * share / max(1, int(rows)), r * bulk_ns * share / max(1, int(rows)))

    def cpu_share(self, procs: int) -> float:
        """Oversubscription: the wall time per unit of uninterrupted work of ``procs``
        processes running at once over that of as many processes as there are CPUs (a 1 MB
        copy-and-check loop; the two alternate, median of the ratios, so that load from
        outside, which both see, cancels): 1 up to a process per CPU, ~2 for four processes on
        two CPUs. bench_dispatch's memcpy floor is one short copy per rank, which a time slice
        covers whole; a call, whose ranks wait for each other, pays the sharing: the row passes
        are multiplied by this."""
        key = ("share", procs)
        if key not in self.cache:
            cpus = os.cpu_count() or 1
            ratios = [1.0]
            if procs > cpus:
                base = max(2, cpus - cpus % 2)
                ratios = []
                for _ in range(max(3, self.rounds)):
                    got = [statistics.median(g[3] for g in self._run(
                        ["copy", "tail", "4096", "256", str(p), str(self.millis), "1", "2"]))
                        for p in (procs, base)]
                    ratios.append(got[0] / max(got[1], 1.0))
            self.cache[key] = (max(1.0, statistics.median(ratios)),)
        return self.cache[key][0]

    def flag_oneway_ns(self, procs: int) -> float:
        """Half the median flag round trip of ``procs`` processes ping-ponging in pairs."""
        key = ("flag", procs)
        if key not in self.cache:
            per = []
            for _ in range(self.rounds):
                got = self._run(["flag", "-", "8", "1", str(procs), str(self.millis * 2)])
                per.append(statistics.median(g[0] for g in got if g[0] > 0))
            self.cache[key] = (statistics.median(per) / 2,)
        return self.cache[key][0]
