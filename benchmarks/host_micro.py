"""Microbenchmarks that give the simulator's host model its constants (docs/SIMULATOR.md, 6).

* row passes (benchmarks/host_micro.c, built here with the system C compiler and linked with
  the runtime's own kernels.c / kernels_x86.c): one memory pass of the runtime's algorithm per
  row, at the working-set size of a case, caches flushed before every pass (bench_dispatch's
  interleaved cases evict each other), all processes starting each pass together (a call's
  ranks share the memory bandwidth), in writer/reader pairs, alternating two copies of the
  buffers as the runtime alternates its two receive regions (one for the combine's reduce);
* the CPUs a call's ranks get now (:func:`cpus_available`): the host model runs its ranks on
  them (ubep.sim.host_sched);
* the cross-process flag round trip (spin, then sched_yield), with as many processes as ranks.

The per-call fixed cost (bench_host_validation.py) is the same call with 64-element rows.

None of these runs a case of bench_dispatch's matrix; bench_host_validation.py compares the
model built from them with that matrix.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import statistics
import subprocess
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ubep.runtime.abi import llc_bytes

HERE = Path(__file__).resolve().parent
NATIVE = HERE.parent / "src" / "ubep" / "runtime" / "native"


def build(out_dir: str | None = None) -> Path:
    """Compile host_micro.c with the runtime's own kernels (kernels.c, kernels_x86.c: the same
    sources and flags as the extension, so a pass runs the engine's code) and return the
    binary's path."""
    out = Path(out_dir or tempfile.mkdtemp(prefix="ubep-host-micro-")) / "host_micro"
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    subprocess.run([*cc.split()[:1], "-O3", "-ffp-contract=off", "-fno-strict-aliasing",
                    "-std=gnu11", "-D_GNU_SOURCE", f"-I{NATIVE}", "-o", str(out),
                    str(HERE / "host_micro.c"), str(NATIVE / "kernels.c"),
                    str(NATIVE / "kernels_x86.c")], check=True)
    # host_wake.c beside it (the doorbell's ring and wake-up, Micro.wake_ns)
    subprocess.run([*cc.split()[:1], "-O3", "-std=gnu11", "-D_GNU_SOURCE", f"-I{NATIVE}", "-o",
                    str(out.parent / "host_wake"), str(HERE / "host_wake.c")], check=True)
    return out


@dataclass
class Micro:
    """Runs and caches microbenchmarks; every result is a median over ``rounds`` runs."""

    binary: Path
    millis: int = 60
    rounds: int = 3
    cache: dict[tuple[object, ...], tuple[float, ...]] = field(default_factory=dict)

    def _run(self, env: dict[str, str] | None, args: list[str]) -> list[tuple[float, ...]]:
        got = subprocess.run([str(self.binary), *args], check=True, capture_output=True,
                             text=True, timeout=120, env=env).stdout.split("\n")
        return [tuple(float(v) for v in line.split()) for line in got if line.strip()]

    def rows(self, procs: int, row_bytes: int, rows: int, writer: str, reader: str,
             terms: int = 1, copies: int = 2, cold: bool = True,
             rowmap: np.ndarray | None = None,
             positions: tuple[int, np.ndarray, np.ndarray] | None = None,
             turns: bool = False, dst: str = "warm", gap_us: int = 0,
             local_experts: int = 0) -> tuple[float, ...]:
        """``(writer / bulk, reader / bulk, bulk ns, CPU share, call latency ns, writer ns,
        reader ns, reader rows)``, each the median over rounds of the median over processes,
        then the processes' writer times over their median, slowest first (:func:`_spread`;
        per order, the median over rounds).
        Ratios are per pass relative to a memcpy of the same bytes timed beside it; the
        ``ns`` values are the passes' own times. Passes alternate between ``copies`` copies of
        their buffers: the runtime alternates two receive regions between calls, so a case's
        working set is two copies of its rows. ``cold``: every pass starts with its buffers
        flushed from the caches (bench_dispatch interleaves its cases, whose buffers evict
        each other's), all processes together, and the per-process values are first quartiles
        over passes (passes cut by other processes' time slices left out). ``rowmap``
        (reduce readers): ``[R, T, M, 2]`` (rank, row) per token
        (:func:`ubep.sim.host.combine_row_map`): the reduce reads the rows where the runtime's
        combine reads them, process ``p`` as rank ``p``. ``positions`` (writers):
        ``(slots, [rows] slot of each row, [rows] source row of each)``: each row is read from
        that source row (a token's row, read once per destination) and lands in that slot of
        a region of ``slots`` slots, in send order (:func:`ubep.sim.host.writer_positions`);
        without it row ``r`` is read from row ``r`` and lands in slot ``r``. ``turns`` (warm
        passes): the processes share one CPU and take turns, 40 passes each, so that every
        pass follows the others' on its CPU, as ranks that share a CPU run
        (``ubep.sim.host_sched``): each finds what the others' passes left in the caches.
        ``dst`` (warm passes): the writer's destination lines as the previous pass left them
        (``"warm"``), flushed before each pass (``"evict"``: they come from memory) or last
        written by a process on another CPU (``"remote"``); the source rows stay warm.
        ``gap_us`` (warm passes): each process sleeps that long before each pass, so that
        whatever else runs on the host runs between its passes, as between two writes of a
        receive slot a call or two apart. ``local_experts`` (``recvmeta``): the rank's experts
        of 64 whose picks the receive metadata writes out (0: the kernel's default, 32)."""
        if dst not in ("warm", "evict", "remote"):
            raise ValueError(f"dst must be 'warm', 'evict' or 'remote', not {dst!r}")
        rows = max(1, int(rows))
        digest = hashlib.sha1(rowmap.tobytes()).hexdigest()[:16] if rowmap is not None else "-"
        wpos = "-"
        if positions is not None:
            slots, dst_pos, src_rows = positions
            pos = np.concatenate([np.resize(np.asarray(dst_pos, dtype=np.int64), rows),
                                  np.resize(np.asarray(src_rows, dtype=np.int64), rows)])
            wpos = hashlib.sha1(pos.tobytes() + str(slots).encode()).hexdigest()[:16]
        key = (procs, row_bytes, rows, writer, reader, terms, copies, cold, digest, wpos, turns,
               dst, gap_us, local_experts)
        if key not in self.cache:
            path, wpath = "-", "-"
            if rowmap is not None:
                path = str(self._map_file(rowmap, digest))
            if positions is not None:
                wpath = str(self.binary.parent / f"wpos-{wpos}.bin")
                with open(wpath, "wb") as f:
                    np.asarray([positions[0]], dtype=np.int64).tofile(f)
                    pos.tofile(f)
            per = []
            env = {**os.environ, "HOST_MICRO_DST": dst, "HOST_MICRO_GAP_US": str(int(gap_us))}
            if local_experts:
                env["HOST_MICRO_LOCAL"] = str(int(local_experts))
            if turns:
                env["HOST_MICRO_TURNS"] = "40"
            for _ in range(self.rounds):
                got = self._run(env, [writer, reader, str(row_bytes), str(rows), str(procs),
                                 str(self.millis), str(terms), str(copies), str(int(cold)),
                                 path, str(llc_bytes()), wpath])
                per.append(tuple(statistics.median(g[i] for g in got) for i in range(8))
                           + _spread(g[5] for g in got))
            med = [statistics.median(p[i] for p in per) for i in range(len(per[0]))]
            self.cache[key] = (med[0] / 1e6, med[1] / 1e6, med[2], med[3] / 1e6, med[4],
                               med[5], med[6], med[7], *med[8:])
        return self.cache[key]

    def _map_file(self, rowmap: np.ndarray, digest: str) -> Path:
        """host_micro.c's MAP file: int32 R, T, M, then the ``[R, T, M, 2]`` map."""
        path = self.binary.parent / f"rowmap-{digest}.bin"
        if not path.exists():
            with open(path, "wb") as f:
                np.asarray(rowmap.shape[:3], dtype=np.int32).tofile(f)
                np.ascontiguousarray(rowmap, dtype=np.int32).tofile(f)
        return path

    def per_row_ns(self, procs: int, row_bytes: int, rows: int, writer: str, reader: str,
                   terms: int, rowmap: np.ndarray | None = None,
                   positions: tuple[int, np.ndarray, np.ndarray] | None = None,
                   cold: bool = True, turns: bool = False, dst: str = "warm",
                   copies: int | None = None, gap_us: int = 0,
                   local_experts: int = 0) -> tuple[float, float]:
        """ns per row of the writer and the reader pass, cold (:meth:`rows`): a pass's own
        time (ranks that share CPUs are the host model's schedule, ubep.sim.host_sched, not a
        factor on the passes). Absolute times (the first quartile of
        each pass's own time): most passes are not memory-bound (the reduce converts and
        adds, SP and DC compare and sum), so rescaling them by a memcpy rate measured
        elsewhere would charge them a slowdown they do not have. With ``rowmap`` the reader's
        rows are the rows the map names (the reduce's: ns per row reduced). ``cold=False``:
        buffers left in the caches between passes, as one case's calls back to back have
        them (benchmarks/bench_host_tasks.py); the median pass; ``dst``, ``gap_us``:
        :meth:`rows`; ``local_experts``: :meth:`rows`.
        ``copies``: the receive regions the runtime alternates (default: 1 for the reduce's
        expert outputs, 2 for the rest: ASP's two receive regions)."""
        got = self._pass(procs, row_bytes, rows, writer, reader, terms, rowmap=rowmap,
                         positions=positions, cold=cold, turns=turns, dst=dst, copies=copies,
                         gap_us=gap_us, local_experts=local_experts)
        w_ns, r_ns, r_rows = got[5], got[6], got[7]
        return w_ns / max(1, int(rows)), r_ns / max(1.0, r_rows)

    def _pass(self, procs: int, row_bytes: int, rows: int, writer: str, reader: str,
              terms: int, rowmap: np.ndarray | None = None,
              positions: tuple[int, np.ndarray, np.ndarray] | None = None,
              cold: bool = True, turns: bool = False, dst: str = "warm",
              copies: int | None = None, gap_us: int = 0,
              local_experts: int = 0) -> tuple[float, ...]:
        """:meth:`rows` of the pass :meth:`per_row_ns` prices."""
        # A pass is timed uninterrupted only with one process per CPU: with more, a
        # multi-millisecond pass is cut by time slices (the sharing is the schedule's). With
        # ``turns`` the processes take turns on one CPU, so every rank's process runs: each
        # pass follows all the others' buffers through the caches, as the ranks' calls do
        # (4 ranks' receive regions overflow what 2 ranks' fit in).
        cpus = os.cpu_count() or 1
        pairs = procs if turns else min(procs, max(2, cpus - cpus % 2))
        # the reduce reads the expert outputs, one buffer where the experts left them (no
        # alternating receive regions): one copy
        if copies is None:
            copies = 1 if reader.startswith("reduce") else 2
        return self.rows(pairs, row_bytes, rows, writer, reader, terms, copies, cold=cold,
                         rowmap=rowmap, positions=positions, turns=turns, dst=dst,
                         gap_us=gap_us, local_experts=local_experts)

    def process_ratios(self, procs: int, row_bytes: int, rows: int, writer: str, reader: str,
                       terms: int, **kw: Any) -> tuple[float, ...]:
        """The writer pass's time in each of its processes over their median, slowest first
        (the median over rounds of each order): what two processes running the same pass on
        this host differ by (where a process's memory lies, docs/SIMULATOR.md 6), for the
        pass :meth:`per_row_ns` prices with the same arguments."""
        return tuple(self._pass(procs, row_bytes, rows, writer, reader, terms, **kw)[8:])

    def flag_oneway_ns(self, procs: int) -> float:
        """Half the median flag round trip of ``procs`` processes ping-ponging in pairs."""
        key = ("flag", procs)
        if key not in self.cache:
            per = []
            for _ in range(self.rounds):
                got = self._run(None, ["flag", "-", "8", "1", str(procs), str(self.millis * 2)])
                per.append(statistics.median(g[0] for g in got if g[0] > 0))
            self.cache[key] = (statistics.median(per) / 2,)
        return self.cache[key][0]

    def wake_ns(self, delay_us: int = 200) -> tuple[float, float, float]:
        """A wait that outlasts its yield window (host_wake.c): ``(ring_sleep_ns,
        wake_ns, ring_armed_ns)``, each the median over rounds of the median over rings: the
        waker's doorbell ring while its peer sleeps on it (the bell, then the futex wake
        system call), the sleeper's wake-up from the publication to its running again, and
        the ring while the peer is registered as a sleeper but awake (a rank that slept once
        in a call stays registered until the call ends). ``delay_us``: how long the sleeper
        sleeps before the ring."""
        key = ("wake", delay_us)
        if key not in self.cache:
            binary = str(self.binary.parent / "host_wake")
            per = []
            for _ in range(self.rounds):
                got = subprocess.run([binary, str(self.millis * 2), str(int(delay_us))],
                                     check=True, capture_output=True, text=True, timeout=120)
                per.append(tuple(float(v) for v in got.stdout.split()[:3]))
            self.cache[key] = tuple(statistics.median(p[i] for p in per) for i in range(3))
        ring_sleep, wake, ring_armed = self.cache[key]
        return ring_sleep, wake, ring_armed


def _spread(times: Any) -> tuple[float, ...]:
    """Each process's time over the processes' median, slowest first."""
    ts = sorted((float(t) for t in times), reverse=True)
    mid = statistics.median(ts) if ts else 0.0
    return tuple(t / mid if mid > 0 else 1.0 for t in ts)


# The real-time priority the compared ranks and their microbenchmarks run at (SCHED_FIFO, the
# lowest): every normal process waits while they run, so a span holds the ranks' own work and
# the waits their peers cause, not other processes' time slices. The kernel's real-time
# throttling (sched_rt_runtime_us, 95 % by default) still leaves the other processes a share.
HELD_PRIORITY = 1


def hold_cpus() -> bool:
    """Run this process (and every process it starts from now on) at ``HELD_PRIORITY``
    under SCHED_FIFO; False (and nothing changed) where that is not permitted."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(HELD_PRIORITY))
    except (AttributeError, OSError):
        return False
    return True


@contextmanager
def held_cpus(enabled: bool = True) -> Iterator[bool]:
    """:func:`hold_cpus` for the block, the process's own policy restored after; yields
    whether the CPUs are held."""
    if not enabled:
        yield False
        return
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    held = hold_cpus()
    try:
        yield held
    finally:
        if held:
            os.sched_setscheduler(0, policy, param)


def run_delay_ns() -> tuple[int, int]:
    """``(CPU time, run delay)`` in ns of this process's threads so far
    (``/proc/self/task/*/schedstat``): the run delay is the time a thread was runnable but
    another ran on its CPU (a peer rank, or another process); the kernel updates both at each
    switch, so over a call they are exact at its end only if it ended with a switch: used over
    many calls."""
    cpu = delay = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
                fields = f.read().split()
        except OSError:
            continue
        cpu += int(fields[0])
        delay += int(fields[1])
    return cpu, delay


def _spin(n: int) -> int:
    acc = 0
    for i in range(n):
        acc ^= i
    return acc


def _spin_worker(barrier: Any, n: int, rounds: int, out: Any) -> None:
    for _ in range(rounds):
        barrier.wait()
        t0 = time.perf_counter_ns()
        _spin(n)
        out.put((t0, time.perf_counter_ns()))


def cpus_available(procs: int, work_ms: float = 2.0, rounds: int = 15) -> float:
    """How many CPUs ``procs`` processes that start a CPU-bound pass together get, now:
    ``procs * (the pass alone) / (the wall time from the first start to the last end)``, each a
    median over ``rounds`` passes, between 1 and ``min(procs, CPUs)``. The runtime's ranks are
    such processes (a call's ranks start together and each has its rows to write); other
    processes on this shared host take CPUs from them, and when fewer CPUs than ranks are left
    the scheduler's slices (milliseconds, longer than a call's phases) run the ranks one after
    another on a CPU rather than side by side (``ubep.sim.host.serialize``). ``work_ms``: the
    pass, about a 128-token call's sends."""
    ctx = mp.get_context("fork")
    n = 20000
    while True:  # the spin count of a work_ms pass alone
        t0 = time.perf_counter_ns()
        _spin(n)
        if time.perf_counter_ns() - t0 >= work_ms * 1e6 / 4:
            n *= 4
            break
        n *= 2
    alone = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        _spin(n)
        alone.append(time.perf_counter_ns() - t0)
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_spin_worker, args=(barrier, n, rounds, out))
               for _ in range(procs)]
    for w in workers:
        w.start()
    got = [out.get(timeout=120) for _ in range(procs * rounds)]
    for w in workers:
        w.join(timeout=60)
    # pass i of every process: the i-th start of each (they start together after a barrier)
    starts = sorted(got)
    walls = [max(e for _, e in starts[i:i + procs]) - starts[i][0]
             for i in range(0, len(starts), procs)]
    cpus = os.cpu_count() or 1
    share = statistics.median(walls) / statistics.median(alone)
    return float(min(max(procs / max(share, 1e-9), 1.0), min(procs, cpus)))
