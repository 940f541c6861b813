"""ubep vs Open MPI's Alltoallv across namespaced hosts: the same job, the same veth links.

``python -m benchmarks.bench_multihost`` (root, Linux: it builds the hosts of
tests/mpi/netns.py) starts one ``mpiexec`` job of H hosts x P ranks (default 2 x 2: ranks on one
host share memory, hosts talk TCP over a veth pair and a bridge). In that job each rank runs,
for each shape of the peers benchmark (benchmarks/peers/workload.py, at this job's rank count),
side by side in the same processes:

* ``ubep``: a Buffer (ASP, DC: the RMA engine's no-flush mode across hosts; expert layout)
  dispatch, then combine of the expert outputs: the same rows ``Alltoallv`` moves;
* ``ubep`` in the rank layout beside it (DeepEP's normal mode): a token crosses to a rank once
  however many of its top-k picks land there, and comes back once (its rows stated apart);
* ``mpi``: what an MPI application does for the same exchange: ``MPI_Alltoall`` of the counts,
  ``MPI_Alltoallv`` of the rows to the experts' ranks (packed by destination), and
  ``MPI_Alltoallv`` of the combine rows back;
* the memcpy floor: ``np.copyto`` of the bytes one rank sends.

Bytes per rank: dispatch ``rows x hidden x itemsize`` with ``rows`` = the rank's (token, pick)
pairs with an expert (expert layout: one row per pick; rank layout: its (token, destination
rank) pairs), combine ``rows x hidden x 2`` (BF16). Wire bytes (:func:`wire_bytes`: what a rank
sends to other hosts, mean over ranks) differ by system: ``Alltoallv`` sends a row per (token,
pick) on another host; ubep's expert layout a row per (token, other host) with a pick there
(ubep.mpi.hostcopy: that host's ranks copy their picks from the one copy); its rank layout a
row per (token, rank on another host). Combine sends back, in every system, a row per pick
(expert layout, ``Alltoallv``) or per (token, rank) (rank layout) that crossed: the reference
adds a token's picks in ascending ``k``, so no host may sum its picks first.
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
import os
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


def wire_bytes(inp: Any, per_host: int, system: str, op: str) -> float:
    """Bytes a rank sends to other hosts in ``op``, mean over ranks (module docstring):
    ``system`` "mpi" (``Alltoallv``, per pick), "expert" (ubep: dispatch once per (token,
    host), combine per pick) or "rank" (ubep: per (token, rank))."""
    from benchmarks.peers.workload import NUM_EXPERTS, row_bytes

    shape = inp.shape
    local = NUM_EXPERTS // shape.num_ranks
    rows = []
    for r, idx in enumerate(inp.topk_idxs):
        owner = np.where(idx >= 0, idx // local, -1)
        host = np.where(owner >= 0, owner // per_host, -1)
        away = (host >= 0) & (host != r // per_host)
        if system == "mpi" or (system == "expert" and op == "combine"):
            rows.append(int(away.sum()))
            continue
        unit = host if system == "expert" else owner  # once per (token, host) or (token, rank)
        rows.append(sum(int(((unit == u) & away).any(axis=1).sum())
                        for u in np.unique(unit[away])))
    dtype = shape.dtype if op == "dispatch" else shape.combine_dtype
    return float(np.mean(rows)) * row_bytes(dtype, shape.hidden)


def _once(comm: Any, fn: Any) -> float:
    """The slowest rank's time of one ``fn()`` in ms (barrier before the call)."""
    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    dt = np.array([(time.perf_counter() - t0) * 1e3])
    worst = np.empty(1)
    comm.Allreduce(dt, worst, op=MPI.MAX)
    return float(worst[0])


def _alternated(comm: Any, systems: dict[str, Any], warmup: int,
                repeats: int) -> dict[str, list[float]]:
    """Per system, the slowest rank's time of each repeat in ms: every repeat runs every
    system once, in turn, the order reversed every other repeat (load that comes and goes on
    a shared host falls on all of them alike)."""
    names = list(systems)
    out: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + repeats):
        for name in (names if i % 2 == 0 else names[::-1]):
            dt = _once(comm, systems[name])
            if i >= warmup:
                out[name].append(dt)
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
    """Every timing of one shape on this rank (collective): ubep in the expert layout (the
    rows Alltoallv moves) and in the rank layout (a token once per destination rank), both
    Buffers open side by side so that every system runs in every repeat."""
    from benchmarks.peers.workload import NUM_EXPERTS, bytes_per_rank, make_inputs
    from ubep.buffer import Buffer, BufferConfig

    r = group.rank
    inp = make_inputs(shape)
    x, idx, w = inp.xs[r], inp.topk_idxs[r], inp.topk_weights[r]

    def config(layout: str) -> BufferConfig:
        return BufferConfig(max_tokens_per_rank=shape.tokens_per_rank, hidden=shape.hidden,
                            num_topk=idx.shape[1], num_experts=NUM_EXPERTS, dtype=shape.dtype,
                            layout=layout, engine="asp", sync="dc", timeout_s=120.0)

    got: dict[str, Any] = {"shape": shape.label, "hosts": group.num_hosts,
                           "ranks_per_host": group.ranks_per_host,
                           "dispatch_bytes": bytes_per_rank(inp, "expert", "dispatch"),
                           "combine_bytes": bytes_per_rank(inp, "expert", "combine"),
                           "rank_dispatch_bytes": bytes_per_rank(inp, "rank", "dispatch"),
                           "rank_combine_bytes": bytes_per_rank(inp, "rank", "combine")}
    got |= {f"{system}_wire_{op}_bytes": wire_bytes(inp, group.ranks_per_host, system, op)
            for system in ("mpi", "expert", "rank") for op in ("dispatch", "combine")}
    a2a = _Alltoallv(comm, x, idx, NUM_EXPERTS)
    recv, rc = a2a.dispatch()
    expert_out = np.full((recv.shape[0], shape.hidden), 0x3F80, dtype=np.uint16)
    src = np.ones(int(got["dispatch_bytes"] + got["combine_bytes"]), dtype=np.uint8)
    dst = np.empty_like(src)
    with Buffer(group, config("expert")) as buf, Buffer(group, config("rank")) as rbuf:
        systems: dict[str, Any] = {}
        for name, b in (("ubep", buf), ("ubep_rank", rbuf)):
            last = [b.dispatch(x, idx, w)]  # combine takes the latest dispatch's handle
            eo = np.full((last[0].handle.num_recv_rows, shape.hidden), 0x3F80, np.uint16)  # 1.0

            def dispatch(b: Any = b, last: list[Any] = last) -> None:
                last[0] = b.dispatch(x, idx, w)

            def combine(b: Any = b, last: list[Any] = last, eo: np.ndarray = eo) -> None:
                b.combine(eo, last[0].handle)

            systems[f"{name}_dispatch_ms"] = dispatch
            systems[f"{name}_combine_ms"] = combine
        systems |= {"mpi_dispatch_ms": a2a.dispatch,
                    "mpi_combine_ms": lambda: a2a.combine(expert_out, rc),
                    "memcpy_ms": lambda: np.copyto(dst, src)}
        times = _alternated(comm, systems, warmup, repeats)
    a2a.free()
    return got | times


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


def probe_worker(out: str, repeats: int) -> None:
    """One rank of the progress probe (under mpiexec): rank 0 puts ``size`` bytes into the
    last rank (another host) while that rank computes for ``_COMPUTE_MS`` without entering MPI
    (BLAS, which releases the GIL); rank 0 times the put from its start to its completion at
    the target (request done, then ``MPI_Win_flush``). ``helper``: the target also runs a
    Python thread that calls MPI's progress (``Iprobe``) every 100 us meanwhile, as a
    progress thread of ubep's own would."""
    import threading

    from mpi4py import MPI

    import ubep.mpi

    group = ubep.mpi.init()
    comm = MPI.COMM_WORLD
    R, r = comm.Get_size(), comm.Get_rank()
    target = R - 1
    sizes = (64 << 10, 4 << 20)
    mem = group.map_global(max(sizes), "probe")
    m = np.random.default_rng(0).random((192, 192))
    rows = []
    for helper in (False, True):
        for size in sizes:
            data = np.ones(size, np.uint8)
            got = []
            for _ in range(repeats + 1):
                comm.Barrier()
                if r == target:
                    stop = threading.Event()

                    def poll(stop: threading.Event = stop) -> None:
                        while not stop.is_set():
                            group.progress()
                            time.sleep(1e-4)

                    th = threading.Thread(target=poll) if helper else None
                    if th is not None:
                        th.start()
                    end = time.perf_counter() + _COMPUTE_MS / 1e3
                    while time.perf_counter() < end:
                        m = np.tanh(m @ m)
                    if th is not None:
                        stop.set()
                        th.join()
                elif r == 0:
                    t0 = time.perf_counter()
                    mem.put(target, 0, data)
                    while not mem.done(target):
                        pass
                    mem.flush(target)
                    got.append((time.perf_counter() - t0) * 1e3)
                comm.Barrier()
            if r == 0:
                rows.append({"helper": helper, "size_bytes": size, "put_ms": got[1:]})
    mem.close()
    if r == 0:
        Path(out).write_text(json.dumps(rows))
    group.close()


_COMPUTE_MS = 50.0


def _stats(v: list[float]) -> tuple[float, float, float]:
    a = np.asarray(v)
    return float(a.min()), float(np.median(a)), float(a.max())


def report(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "",
             "times in ms (min / median / max over repeats, each the slowest rank's); "
             "d+c = dispatch + combine; ratio = ubep / MPI Alltoallv (median; < 1: ubep faster);"
             " floor = memcpy of the expert layout's bytes",
             "bytes per rank: dispatch rows x hidden x itemsize, combine rows x hidden x 2; "
             "expert layout (and Alltoallv): rows = (token, pick) pairs; rank layout: rows = "
             "(token, destination rank) pairs, a token once per rank its picks land on",
             "wire KiB = bytes a rank sends to other hosts (mean over ranks), ubep's d/c, then "
             "Alltoallv's: Alltoallv dispatch = (token, pick) pairs on other hosts x hidden x "
             "itemsize; ubep expert layout = (token, other host) pairs x hidden x itemsize (a "
             "token crosses to a host once, its ranks copy their picks from that copy); rank "
             "layout = (token, rank on another host) pairs; combine = the rows that crossed, "
             "per pick (expert layout, Alltoallv) or per (token, rank), x hidden x 2", ""]
    head = (f"{'hosts x ranks, shape':<32} {'ubep':<6} {'KiB d/c':>11} {'wire KiB d/c':>13} "
            f"{'mpi wire':>11} {'ubep dispatch':>21} "
            f"{'mpi dispatch':>21} {'ubep combine':>21} {'mpi combine':>21} {'ratio d':>7} "
            f"{'ratio c':>7} {'ratio d+c':>9} {'x floor':>7}")
    lines.append(head)
    for g in rows:
        label = f"{g['hosts']}x{g['ranks_per_host']} {g['shape']}"
        for layout, key in (("expert", "ubep"), ("rank", "ubep_rank")):
            if f"{key}_dispatch_ms" not in g:
                continue
            cells = {k: _stats(g[k]) for k in (f"{key}_dispatch_ms", "mpi_dispatch_ms",
                                                f"{key}_combine_ms", "mpi_combine_ms",
                                                "memcpy_ms")}
            fmt = {k: f"{v[0]:6.2f}/{v[1]:6.2f}/{v[2]:6.2f}" for k, v in cells.items()}
            ud, md = cells[f"{key}_dispatch_ms"][1], cells["mpi_dispatch_ms"][1]
            uc, mc = cells[f"{key}_combine_ms"][1], cells["mpi_combine_ms"][1]
            floor = cells["memcpy_ms"][1]
            prefix = "" if layout == "expert" else "rank_"
            kib = (f"{g[prefix + 'dispatch_bytes'] / 1024:.0f}/"
                   f"{g[prefix + 'combine_bytes'] / 1024:.0f}")
            wire = _kib(g, layout)
            lines.append(f"{label:<32} {layout:<6} {kib:>11} {wire:>13} {_kib(g, 'mpi'):>11} "
                         f"{fmt[f'{key}_dispatch_ms']:>21} "
                         f"{fmt['mpi_dispatch_ms']:>21} {fmt[f'{key}_combine_ms']:>21} "
                         f"{fmt['mpi_combine_ms']:>21} {ud / md:7.2f} {uc / mc:7.2f} "
                         f"{(ud + uc) / (md + mc):9.2f} {(ud + uc) / floor:7.0f}")
    return "\n".join(lines)


def _kib(g: dict[str, Any], system: str) -> str:
    """``system``'s wire KiB d/c of row ``g`` ("-" for results from before they were kept)."""
    d, c = (g.get(f"{system}_wire_{op}_bytes") for op in ("dispatch", "combine"))
    return "-" if d is None or c is None else f"{d / 1024:.0f}/{c / 1024:.0f}"


# Open MPI's TCP progress: "none" (a put moves while its target is in MPI) or "thread" (the
# TCP component's own progress thread moves it while the target computes; docs/MULTIHOST.md)
PROGRESS = {"none": ("--mca", "btl_tcp_progress_thread", "0"),
            "thread": ("--mca", "btl_tcp_progress_thread", "1")}
_BASE = ("--mca", "btl", "self,sm,tcp", "--mca", "osc", "sm,rdma")


def _run_bed(hosts: int, per_host: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One job on a fresh bed of ``hosts`` x ``per_host``; its rows."""
    from tests.mpi import netns
    from tests.mpi.multihost import run_job

    with tempfile.TemporaryDirectory(prefix="ubep-bench-mh-") as tmp, \
            netns.HostBed(hosts, Path(tmp)) as bed:
        out = Path(tmp) / "rows.json"
        argv2 = ["-m", "benchmarks.bench_multihost", "--worker", str(out), "--repeats",
                 str(args.repeats), "--warmup", str(args.warmup), "--tokens", args.tokens]
        argv2 += ["--quick"] * args.quick
        code, output = run_job(bed, per_host, argv2, transport=_BASE + PROGRESS[args.progress],
                               timeout_s=3600)
        print(output[-4000:] if code != 0 else output.replace("\x00", ""), file=sys.stderr)
        if code != 0:
            raise SystemExit(f"bench_multihost: the {hosts} x {per_host} job failed")
        return list(json.loads(out.read_text()))


def _probe(args: argparse.Namespace) -> int:
    """The progress probe on 2 hosts x 1 rank, once per TCP progress setting."""
    from tests.mpi import netns
    from tests.mpi.multihost import run_job

    lines = [f"put into a host that computes for {_COMPUTE_MS:.0f} ms outside MPI (2 namespaced "
             f"hosts x 1 rank, osc/rdma over btl/tcp): ms from the put's start to its completion"
             f" at the target (request done + MPI_Win_flush), min / median / max of "
             f"{args.repeats}", "",
             f"{'TCP progress':<14} {'helper thread':<14} {'size':>8} {'put ms':>26}"]
    found = []
    for progress, mca in PROGRESS.items():
        with tempfile.TemporaryDirectory(prefix="ubep-bench-mh-") as tmp, \
                netns.HostBed(2, Path(tmp)) as bed:
            out = Path(tmp) / "probe.json"
            code, output = run_job(bed, 1, ["-m", "benchmarks.bench_multihost", "--probe-worker",
                                            str(out), "--repeats", str(args.repeats)],
                                   transport=_BASE + mca, timeout_s=600)
            if code != 0:
                print(output[-4000:], file=sys.stderr)
                return 1
            for row in json.loads(out.read_text()):
                row["progress"] = progress
                found.append(row)
                lo, med, hi = _stats(row["put_ms"])
                lines.append(f"{progress:<14} {'yes' if row['helper'] else 'no':<14} "
                             f"{row['size_bytes'] >> 10:>6}Ki {lo:8.2f}/{med:8.2f}/{hi:8.2f}")
    text = "\n".join(lines)
    print(text)
    (OUT_DIR / f"{args.name}_progress.txt").write_text(text + "\n")
    (OUT_DIR / f"{args.name}_progress.json").write_text(json.dumps(found, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_multihost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--beds", default="2x2,4x1",
                   help="hosts x ranks per host, comma-separated (one job each)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="one shape")
    p.add_argument("--tokens", default="128,512", help="tokens per rank, comma-separated")
    p.add_argument("--progress", default="none", choices=sorted(PROGRESS),
                   help="Open MPI's TCP progress between hosts")
    p.add_argument("--name", default="multihost", help="results file stem")
    p.add_argument("--probe", action="store_true",
                   help="time a put into a host that computes, per TCP progress setting")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--probe-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe_worker:
        probe_worker(args.probe_worker, args.repeats)
        return 0
    if args.worker:
        worker(args.worker, args.quick, args.warmup, args.repeats,
               [int(t) for t in args.tokens.split(",")])
        return 0
    from tests.mpi import netns

    reason = netns.skip_reason()
    if reason:
        print(f"bench_multihost: {reason}", file=sys.stderr)
        return 2
    netns.sweep()
    if args.probe:
        return _probe(args)
    rows: list[dict[str, Any]] = []
    beds = [tuple(int(v) for v in b.split("x")) for b in args.beds.split(",")]
    for hosts, per_host in beds:
        rows += _run_bed(hosts, per_host, args)
    load = os.getloadavg()
    header = (f"bench_multihost: namespaced hosts (veth + bridge; btl self,sm,tcp, osc sm,rdma; "
              f"TCP progress: {args.progress} {' '.join(PROGRESS[args.progress])}), ubep "
              f"ASP/DC, expert and rank layouts, vs MPI_Alltoallv, {args.repeats} repeats after "
              f"{args.warmup} warm-up, every system alternated in each repeat\n"
              f"shared host: {os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f} / "
              f"{load[2]:.1f} at the end (other jobs running): compare ratios inside this run, "
              f"not times across runs")
    text = report(rows, header)
    print(text)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / f"{args.name}.txt").write_text(text + "\n")
    (OUT_DIR / f"{args.name}.json").write_text(json.dumps(
        {"progress": args.progress, "mca": list(PROGRESS[args.progress]), "rows": rows},
        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
