"""ubep.mpi next to the shared-memory runtime and plain MPI ``Alltoallv``, same shapes, same run.

    python -m benchmarks.bench_dist                 # 2 ranks, 128 and 512 tokens, both payloads
    python -m benchmarks.bench_dist --quick         # 2 ranks, 128 tokens, BF16 only
    python -m benchmarks.bench_dist --json out/dist.json

Systems (rows of the table):

* ``shm``: ``ubep.Buffer`` on ranks from ``ubep.launch`` (POSIX shared memory, native engine).
* ``dist-shm``: ``ubep.Buffer`` on ``ubep.mpi.init()`` under mpiexec, one host: the native engine
  on ``MPI_Win_allocate_shared`` memory.
* ``dist-rma-tcp``: the same with ``UBEP_MPI_FORCE_RMA=1`` and ``--mca btl self,tcp``: every rank
  its own host, every row through ``MPI_Put``/``MPI_Get`` (Open MPI ``osc/rdma`` over TCP
  loopback), the Python RMA engine (``ubep.mpi.engine``).
* ``mpi-a2av`` / ``mpi-a2av-tcp``: what a user writes with MPI today (benchmarks/peers/kernels.py:
  counts ``Alltoall``, pack, payload and metadata ``Alltoallv``, reorder) on Open MPI's default
  transports and on TCP.

ubep rows use ``engine=asp``: ``sync=dc`` (the mode that needs no flush over RMA) and ``sw``.
Shapes as the peers benchmark: top-8 of 64 experts, uniform routing, hidden 2048 BF16 and 7168
1-byte, expert and rank layouts; dispatch and combine (combine moves BF16).

Timing (benchmarks/harness.py): every iteration is a barrier, then each rank times its own call;
the iteration's time is the maximum over ranks; min/median/max over ``--repeats`` after
``--warmup``.

    size_bytes = rows this rank sends x hidden x bytes per element (mean over ranks)
        rows: valid (token, expert) pairs (layout=expert) or (token, destination rank) pairs
        (layout=rank); combine: the same rows in BF16
    algbw_gbps = size_bytes / median time
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import Stats, format_table, time_collective

__all__ = ["Case", "main"]

REPO_ROOT = Path(__file__).resolve().parent.parent  # the mpiexec ranks run -m from here

_MODES = (("asp", "dc"), ("asp", "sw"))
_TCP = ["--mca", "btl", "self,tcp", "--mca", "osc", "sm,rdma"]
_QUIET = ["--mca", "osc", "^ucx"]


@dataclass(frozen=True)
class Case:
    tokens: int
    hidden: int
    dtype: str  # bf16 or uint8
    layout: str


def _cases(quick: bool) -> list[Case]:
    shapes = [(128, 2048, "bf16")] if quick else [
        (128, 2048, "bf16"), (512, 2048, "bf16"), (128, 7168, "uint8"), (512, 7168, "uint8")]
    from ubep.modes import LAYOUTS

    return [Case(t, h, d, lay) for t, h, d in shapes for lay in LAYOUTS]


def _inputs(case: Case, num_ranks: int) -> Any:
    from benchmarks.peers.workload import Shape, make_inputs

    return make_inputs(Shape(num_ranks, case.tokens, case.hidden, case.dtype, "uniform"))


def _timed(barrier: Callable[[], object], fn: Callable[[], object], warmup: int,
           repeats: int) -> list[float]:
    """Per-iteration microseconds of this rank (harness.time_collective)."""
    return (time_collective(barrier, fn, warmup, repeats) / 1e3).tolist()


# --- ubep on any group (ubep.launch or ubep.mpi) -------------------------------------------


def ubep_rank(group: Any, cases: list[Case], warmup: int, repeats: int) -> list[dict[str, Any]]:
    """Per (case, engine x sync): this rank's per-iteration microseconds and rows sent."""
    from benchmarks.peers.workload import NUM_EXPERTS, NUM_TOPK
    from ubep.buffer import Buffer, BufferConfig

    r = group.rank
    out = []
    for case in cases:
        inp = _inputs(case, group.num_ranks)
        for engine, sync in _MODES:
            cfg = BufferConfig(max_tokens_per_rank=case.tokens, hidden=case.hidden,
                               num_topk=NUM_TOPK, num_experts=NUM_EXPERTS, dtype=case.dtype,
                               layout=case.layout, engine=engine, sync=sync, timeout_s=120.0)
            x, idx, w = inp.xs[r], inp.topk_idxs[r], inp.topk_weights[r]
            with Buffer(group, cfg) as buf:
                disp = _timed(group.barrier, functools.partial(buf.dispatch, x, idx, w), warmup,
                              repeats)
                res = buf.dispatch(x, idx, w)
                eo = buf.get_combine_buffer(res.handle)
                eo[...] = np.random.default_rng(r).integers(0x3000, 0x4000, eo.shape,
                                                            dtype=np.uint16)
                comb = _timed(group.barrier, functools.partial(buf.combine, eo, res.handle),
                              warmup, repeats)
                rows = int((np.asarray(res.handle.send_dst_row) >= 0).sum())
            out.append({"case": asdict(case), "system": f"{engine}-{sync}", "dispatch": disp,
                        "combine": comb, "rows": rows})
    return out


# --- plain MPI Alltoallv (benchmarks/peers/kernels.py) -------------------------------------------


def a2av_rank(comm: Any, cases: list[Case], warmup: int, repeats: int) -> list[dict[str, Any]]:
    from benchmarks.peers.kernels import make_peer
    from benchmarks.peers.mpi_worker import MpiExchange
    from benchmarks.peers.workload import NUM_EXPERTS, NUM_TOPK

    ex = MpiExchange(comm)
    r = ex.rank
    out = []
    try:
        for case in cases:
            inp = _inputs(case, ex.num_ranks)
            x, idx, w = inp.xs[r], inp.topk_idxs[r], inp.topk_weights[r]
            peer = make_peer(case.layout, ex, num_experts=NUM_EXPERTS, num_topk=NUM_TOPK,
                             max_tokens=case.tokens, hidden=case.hidden, x_dtype=x.dtype,
                             out_dtype=np.dtype(np.uint16))
            disp = _timed(ex.barrier, functools.partial(peer.dispatch, x, idx, w), warmup,
                          repeats)
            d = peer.dispatch(x, idx, w)
            eo = np.random.default_rng(r).integers(0x3000, 0x4000, (d.num_recv_rows, case.hidden),
                                                   dtype=np.uint16)
            comb = _timed(ex.barrier, functools.partial(peer.combine, eo), warmup, repeats)
            out.append({"case": asdict(case), "system": "a2av", "dispatch": disp,
                        "combine": comb, "rows": int(d.num_sent_rows)})
    finally:
        ex.free()
    return out


def _mpi_worker(kind: str, spec: str, out: str) -> None:
    job = json.loads(Path(spec).read_text())
    cases = [Case(**c) for c in job["cases"]]
    if kind == "ubep":
        import ubep.mpi

        group = ubep.mpi.init()
        found = ubep_rank(group, cases, job["warmup"], job["repeats"])
        every = group.allgather(found)
        if group.rank == 0:
            Path(out).write_text(json.dumps(every))
        group.close()
    else:
        from mpi4py import MPI

        found = a2av_rank(MPI.COMM_WORLD, cases, job["warmup"], job["repeats"])
        every = MPI.COMM_WORLD.allgather(found)
        if MPI.COMM_WORLD.Get_rank() == 0:
            Path(out).write_text(json.dumps(every))


# --- driver -------------------------------------------------------------------------------


def _mpiexec(num_ranks: int, kind: str, job: dict[str, Any], mca: list[str],
             env: dict[str, str], timeout_s: float) -> list[list[dict[str, Any]]] | str:
    from ubep.doctor import mpi_launcher

    launcher = mpi_launcher()
    if launcher is None:
        return "no mpiexec"
    with tempfile.TemporaryDirectory(prefix="ubep-bench-dist-") as tmp:
        spec, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps(job))
        full_env = dict(os.environ) | env | {"OMP_NUM_THREADS": "1"}
        if os.geteuid() == 0:
            full_env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        cmd = [launcher, "--oversubscribe", *mca, "-n", str(num_ranks), sys.executable,
               "-m", "benchmarks.bench_dist", "--worker", kind, str(spec), str(out)]
        try:
            proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True,
                                  timeout=timeout_s, check=False, cwd=REPO_ROOT)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout_s:.0f} s"
        if proc.returncode != 0 or not out.exists():
            return f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
        result: list[list[dict[str, Any]]] = json.loads(out.read_text())
        return result


def _merge(system: str, per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for i, first in enumerate(per_rank[0]):
        ranks = [pr[i] for pr in per_rank]
        case = Case(**first["case"])
        for op in ("dispatch", "combine"):
            samples = np.max([rk[op] for rk in ranks], axis=0)  # slowest rank per iteration
            stats = Stats.from_samples_us([float(v) for v in samples])
            elem = 1 if case.dtype == "uint8" and op == "dispatch" else 2
            size = float(np.mean([rk["rows"] for rk in ranks])) * case.hidden * elem
            rows.append({"system": f"{system}:{first['system']}" if first["system"] != "a2av"
                         else system, "op": op, **asdict(case), "size_bytes": int(size),
                         "min_us": stats.min_us, "median_us": stats.median_us,
                         "max_us": stats.max_us, "algbw_gbps": size / stats.median_us / 1e3})
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _mpi_worker(argv[1], argv[2], argv[3])
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_dist", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    repeats = args.repeats or (10 if args.quick else 30)
    warmup = args.warmup or (2 if args.quick else 5)
    cases = _cases(args.quick)
    job = {"cases": [asdict(c) for c in cases], "warmup": warmup, "repeats": repeats}
    rows: list[dict[str, Any]] = []
    missing: dict[str, str] = {}

    from ubep.runtime import launch

    per_rank = launch(ubep_rank, args.ranks, cases, warmup, repeats, timeout_s=1800)
    rows += _merge("shm", per_rank)
    runs = [
        ("dist-shm", "ubep", _QUIET, {}),
        ("dist-rma-tcp", "ubep", _TCP, {"UBEP_MPI_FORCE_RMA": "1"}),
        ("mpi-a2av", "a2av", _QUIET, {}),
        ("mpi-a2av-tcp", "a2av", _TCP, {}),
    ]
    for system, kind, mca, env in runs:
        got = _mpiexec(args.ranks, kind, job, mca, env, timeout_s=1800)
        if isinstance(got, str):
            missing[system] = got
        else:
            rows += _merge(system, got)
    columns = ["system", "op", "layout", "tokens", "hidden", "dtype", "size_bytes", "min_us",
               "median_us", "max_us", "algbw_gbps"]
    print(f"{args.ranks} ranks, top-8 of 64 experts, uniform routing, {repeats} repeats after "
          f"{warmup} warm-up; size_bytes = rows sent x hidden x bytes/elem (per rank), "
          "algbw = size_bytes / median")
    print(format_table(columns, [[r[c] for c in columns] for r in rows]))
    for system, why in missing.items():
        print(f"not measured: {system}: {why}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "not_measured": missing,
                                               "settings": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
