"""ubep vs Open MPI's Alltoallv across namespaced hosts: the same job, the same veth links.

``python -m benchmarks.bench_multihost`` (root, Linux: it builds the hosts of
tests/mpi/netns.py) starts one ``mpiexec`` job of H hosts x P ranks (default 2 x 2: ranks on one
host share memory, hosts talk TCP over a veth pair and a bridge). In that job each rank runs,
for each shape of the peers benchmark (benchmarks/peers/workload.py, at this job's rank count),
side by side in the same processes:

* ``ubep``: a Buffer (ASP, DC: the RMA engine's no-flush mode across hosts; expert layout)
  dispatch, then combine of the expert outputs;
* ``mpi``: what an MPI application does for the same exchange: ``MPI_Alltoall`` of the counts,
  ``MPI_Alltoallv`` of the rows to the experts' ranks (packed by destination), and
  ``MPI_Alltoallv`` of the combine rows back;
* the memcpy floor: ``np.copyto`` of the bytes one rank sends.

Bytes per rank: dispatch ``rows x hidden x itemsize`` with ``rows`` = the rank's (token, pick)
pairs with an expert (expert layout: one row per pick), combine ``rows x hidden x 2`` (BF16).
Per repeat, the time of a call is the slowest rank's (barrier before each call); min / median /
max over repeats; ratios of medians. Results: benchmarks/results/multihost.{txt,json}.

What a veth link predicts: placement (what stays inside a host and what crosses), the number
of messages and round trips each design needs, and the cost of Open MPI's TCP path and of its
emulated one-sided operations (``osc/rdma`` over ``btl/tcp``), all on the host's CPUs. What it
does not: a wire's latency and bandwidth (a veth pair moves packets through kernel memory, a
few microseconds and several GB/s, bounded by the same CPUs that run the ranks), a NIC's
offload (RDMA puts complete without the target's CPU: here every remote put costs the target
CPU time in MPI's progress), congestion from other tenants, and switch hops. On a real network
the RMA engine's gap to Alltoallv changes with the transport (UCX or libfabric RMA instead of
emulated RMA over TCP); measure there with the same command and a hostfile.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "benchmarks" / "results"


def _shapes(num_ranks: int, quick: bool, tokens: list[int]) -> list[Any]:
    """The peers benchmark's shapes at ``tokens`` tokens per rank (its 512-token shapes are
    ``--tokens 128,512``: 28 MiB a rank at 7168 x 1 byte, minutes per call over emulated RMA)."""
    from benchmarks.peers.workload import Shape

    if quick:
        return [Shape(num_ranks, 128, 2048, "bf16", "uniform")]
    return [Shape(num_ranks, t, h, d, routing)
            for routing in ("uniform", "hot")
            for t in tokens
            for h, d in ((2048, "bf16"), (7168, "uint8"))]


def _timed(comm: Any, fn: Any, warmup: int, repeats: int) -> list[float]:
    """Per repeat, the slowest rank's time of ``fn()`` in ms (barrier before each call)."""
    from mpi4py import MPI

    for _ in range(warmup):
        comm.Barrier()
        fn()
    out = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        dt = np.array([(time.perf_counter() - t0) * 1e3])
        worst = np.empty(1)
        comm.Allreduce(dt, worst, op=MPI.MAX)
        out.append(float(worst[0]))
    return out


class _Alltoallv:
    """Dispatch and combine of one shape as an MPI application writes them."""

    def __init__(self, comm: Any, x: np.ndarray, idx: np.ndarray, num_experts: int) -> None:
        from mpi4py import MPI

        R = comm.Get_size()
        self.comm, self.MPI = comm, MPI
        local = num_experts // R
        tok, k = np.nonzero(idx >= 0)
        dst = idx[tok, k] // local
        order = np.argsort(dst, kind="stable")
        self.src_rows = tok[order]  # the token of each row sent, grouped by destination
        self.x = x
        self.send_counts = np.bincount(dst, minlength=R).astype(np.int64)
        self.row = MPI.BYTE.Create_contiguous(x.shape[1] * x.itemsize).Commit()
        self.crow = MPI.BYTE.Create_contiguous(x.shape[1] * 2).Commit()
        self.hidden = x.shape[1]

    def dispatch(self) -> tuple[np.ndarray, np.ndarray]:
        sc = self.send_counts
        rc = np.empty_like(sc)
        self.comm.Alltoall(sc, rc)
        send = self.x[self.src_rows]  # pack by destination
        recv = np.empty((int(rc.sum()), self.hidden), dtype=self.x.dtype)
        sd = np.concatenate(([0], np.cumsum(sc)[:-1]))
        rd = np.concatenate(([0], np.cumsum(rc)[:-1]))
        self.comm.Alltoallv([send, (sc, sd), self.row], [recv, (rc, rd), self.row])
        return recv, rc

    def combine(self, expert_out: np.ndarray, rc: np.ndarray) -> np.ndarray:
        sc = self.send_counts
        back = np.empty((int(sc.sum()), self.hidden), dtype=np.uint16)
        rd = np.concatenate(([0], np.cumsum(rc)[:-1]))
        sd = np.concatenate(([0], np.cumsum(sc)[:-1]))
        self.comm.Alltoallv([expert_out, (rc, rd), self.crow], [back, (sc, sd), self.crow])
        return back

    def free(self) -> None:
        self.row.Free()
        self.crow.Free()


def _measure_shape(group: Any, comm: Any, shape: Any, warmup: int,
                   repeats: int) -> dict[str, Any]:
    """Every timing of one shape on this rank (collective)."""
    from benchmarks.peers.workload import NUM_EXPERTS, bytes_per_rank, make_inputs
    from ubep.buffer import Buffer, BufferConfig

    r = group.rank
    inp = make_inputs(shape)
    x, idx, w = inp.xs[r], inp.topk_idxs[r], inp.topk_weights[r]
    cfg = BufferConfig(max_tokens_per_rank=shape.tokens_per_rank, hidden=shape.hidden,
                       num_topk=idx.shape[1], num_experts=NUM_EXPERTS, dtype=shape.dtype,
                       layout="expert", engine="asp", sync="dc", timeout_s=120.0)
    got: dict[str, Any] = {"shape": shape.label, "hosts": group.num_hosts,
                           "ranks_per_host": group.ranks_per_host,
                           "dispatch_bytes": bytes_per_rank(inp, "expert", "dispatch"),
                           "combine_bytes": bytes_per_rank(inp, "expert", "combine")}
    with Buffer(group, cfg) as buf:
        res = buf.dispatch(x, idx, w)
        eo = buf.get_combine_buffer(res.handle)
        eo[...] = 0x3F80  # BF16 1.0: the experts' outputs
        got["ubep_dispatch_ms"] = _timed(comm, lambda: buf.dispatch(x, idx, w), warmup,
                                         repeats)
        got["ubep_combine_ms"] = _timed(comm, lambda: buf.combine(eo, res.handle), warmup,
                                        repeats)
    a2a = _Alltoallv(comm, x, idx, NUM_EXPERTS)
    recv, rc = a2a.dispatch()
    expert_out = np.full((recv.shape[0], shape.hidden), 0x3F80, dtype=np.uint16)
    got["mpi_dispatch_ms"] = _timed(comm, a2a.dispatch, warmup, repeats)
    got["mpi_combine_ms"] = _timed(comm, lambda: a2a.combine(expert_out, rc), warmup, repeats)
    a2a.free()
    src = np.ones(int(got["dispatch_bytes"] + got["combine_bytes"]), dtype=np.uint8)
    dst = np.empty_like(src)
    got["memcpy_ms"] = _timed(comm, lambda: np.copyto(dst, src), warmup, repeats)
    return got


def worker(out: str, quick: bool, warmup: int, repeats: int, tokens: list[int]) -> None:
    """One rank of the job (under mpiexec)."""
    from mpi4py import MPI

    import ubep.mpi

    group = ubep.mpi.init()
    comm = MPI.COMM_WORLD
    rows = []
    t0 = time.monotonic()
    for shape in _shapes(group.num_ranks, quick, tokens):
        rows.append(_measure_shape(group, comm, shape, warmup, repeats))
        if group.rank == 0:
            print(f"  {shape.label}: done at {time.monotonic() - t0:.0f} s", flush=True)
    if group.rank == 0:
        Path(out).write_text(json.dumps(rows))
    group.close()


def _stats(v: list[float]) -> tuple[float, float, float]:
    a = np.asarray(v)
    return float(a.min()), float(np.median(a)), float(a.max())


def report(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "",
             "times in ms (min / median / max over repeats, each the slowest rank's); "
             "d+c = dispatch + combine; ratio = ubep / MPI Alltoallv (median; < 1: ubep faster);"
             " floor = memcpy of the same bytes",
             "bytes per rank: dispatch rows x hidden x itemsize, combine rows x hidden x 2 "
             "(rows = (token, pick) pairs, expert layout)", ""]
    head = (f"{'shape':<28} {'KiB d/c':>11} {'ubep dispatch':>21} {'mpi dispatch':>21} "
            f"{'ubep combine':>21} {'mpi combine':>21} {'ratio d':>7} {'ratio c':>7} "
            f"{'ratio d+c':>9} {'x floor':>7}")
    lines.append(head)
    for g in rows:
        cells = {k: _stats(g[k]) for k in ("ubep_dispatch_ms", "mpi_dispatch_ms",
                                            "ubep_combine_ms", "mpi_combine_ms", "memcpy_ms")}
        fmt = {k: f"{v[0]:6.2f}/{v[1]:6.2f}/{v[2]:6.2f}" for k, v in cells.items()}
        ud, md = cells["ubep_dispatch_ms"][1], cells["mpi_dispatch_ms"][1]
        uc, mc = cells["ubep_combine_ms"][1], cells["mpi_combine_ms"][1]
        floor = cells["memcpy_ms"][1]
        kib = f"{g['dispatch_bytes'] / 1024:.0f}/{g['combine_bytes'] / 1024:.0f}"
        lines.append(f"{g['shape']:<28} {kib:>11} {fmt['ubep_dispatch_ms']:>21} "
                     f"{fmt['mpi_dispatch_ms']:>21} {fmt['ubep_combine_ms']:>21} "
                     f"{fmt['mpi_combine_ms']:>21} {ud / md:7.2f} {uc / mc:7.2f} "
                     f"{(ud + uc) / (md + mc):9.2f} {(ud + uc) / floor:7.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_multihost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--per-host", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one shape")
    p.add_argument("--tokens", default="128", help="tokens per rank, comma-separated")
    p.add_argument("--name", default="multihost", help="results file stem")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.quick, args.warmup, args.repeats,
               [int(t) for t in args.tokens.split(",")])
        return 0
    from tests.mpi import netns
    from tests.mpi.multihost import run_job

    reason = netns.skip_reason()
    if reason:
        print(f"bench_multihost: {reason}", file=sys.stderr)
        return 2
    netns.sweep()
    with tempfile.TemporaryDirectory(prefix="ubep-bench-mh-") as tmp, \
            netns.HostBed(args.hosts, Path(tmp)) as bed:
        out = Path(tmp) / "rows.json"
        argv2 = ["-m", "benchmarks.bench_multihost", "--worker", str(out), "--repeats",
                 str(args.repeats), "--warmup", str(args.warmup), "--tokens", args.tokens]
        argv2 += ["--quick"] * args.quick
        code, output = run_job(bed, args.per_host, argv2, timeout_s=1800)
        print(output[-4000:] if code != 0 else output.replace("\x00", ""), file=sys.stderr)
        if code != 0:
            return 1
        rows = json.loads(out.read_text())
    header = (f"bench_multihost: {args.hosts} namespaced hosts x {args.per_host} ranks "
              f"(veth + bridge; btl self,sm,tcp, osc sm,rdma), ubep ASP/DC expert layout vs "
              f"MPI_Alltoallv, {args.repeats} repeats after {args.warmup} warm-up")
    text = report(rows, header)
    print(text)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / f"{args.name}.txt").write_text(text + "\n")
    (OUT_DIR / f"{args.name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
